"""Generate on a device mesh equals generate on one device, token for token, for every method.

Needs 4 devices, fixed when jax is imported: ``tests/test_sharding.py`` runs this module in processes of their own
(two at once, compiled without LLVM's optimizations) with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``; in the main test process (one CPU device) it is skipped.
Run it alone with
``XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m pytest -q tests/test_sharding_devices.py``.
"""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import random_prompts
from jkv import cli
from jkv import generate as gen
from jkv import load as load_lib
from jkv import sharding
from jkv.cache import CacheSpec, is_array_info
from jkv.evaluation.compare import compare, parse_methods
from jkv.evaluation.perplexity import WindowPlan
from jkv.methods import make_method
from jkv.sampling import Greedy

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: tests/test_sharding.py runs "
                                                               "this module with 4 forced CPU devices")

# Settings under which every method's events happen within a few tokens of short prompts: KIVI flushes its key
# ring (R = 32) as the 28- and 30-token prompts grow, ZipCache compresses its window every 8 steps, OTT quantizes
# 8-token blocks and competes for its pool in every layer, SpeCache fetches 8 rows per head from host memory.
METHODS = {
    "dense": {},
    "kivi": dict(bits=2, residual=32),
    "fakequant": dict(bits=2),
    "zipcache": dict(interval=8, key_group=16, random_probes=0.3),
    "ott": dict(group_size=32, residual=8, aux_size=8, no_pool_layers=0),
    "specache": dict(residual=32, fetch_rows=8),
}
LENGTHS = (5, 30, 17, 28)
NEW_TOKENS = 10


def _generate(model, prompts, name, mesh=None, impl="xla", **kw):
  return gen.generate(model.params, model.config, prompts, method=make_method(name, **METHODS[name]),
                      max_new_tokens=NEW_TOKENS, chunk=NEW_TOKENS, eos_ids=(), attention_impl=impl, mesh=mesh, **kw)


@pytest.mark.parametrize("name", list(METHODS))
def test_tiny_model_on_a_data_by_model_mesh_equals_one_device(tiny_llama, name):
  _, model = tiny_llama  # 6 query heads, 2 KV heads: data=2 x model=2 splits sequences and heads
  prompts = random_prompts(model.config.vocab_size, LENGTHS, seed=1)
  one = _generate(model, prompts, name)
  sharded = _generate(model, prompts, name, mesh="data=2,model=2")
  assert sharded.tokens == one.tokens
  assert sharded.stats["mesh"] == "data=2,model=2" and sharded.stats["kv_bytes"] == one.stats["kv_bytes"]
  assert sharding.make_mesh("data=2,model=2") in sharding._WARMED_MESHES  # its collectives run before the timing
  # Statistics gathered while decoding count every shard (SpeCache's hit rate over all KV heads).
  hit_rates = [r.stats["method_stats"].get("speculation_hit_rate") for r in (sharded, one)]
  assert hit_rates == [None, None] if name != "specache" else hit_rates[0] == pytest.approx(hit_rates[1], rel=1e-6)


@pytest.mark.parametrize("spec", ["data=2,model=2", "seq=4"])
def test_each_axis_total_sums_over_that_axis_alone(spec):
  """generate's compile phase runs one all-reduce over each axis of its mesh (``warm_collectives``: a GPU builds the
  communicator of a group of devices at its first collective); each runs over its axis's devices, not the mesh's."""
  mesh = sharding.make_mesh(spec)
  assert {a: int(sharding.axis_total(mesh, a)) for a in mesh.axis_names} == dict(mesh.shape)


@pytest.mark.parametrize("name", ["dense", "kivi"])
def test_chunked_prefill_on_a_mesh_equals_one_device(tiny_llama, name):
  """Chunked prefill (``extend`` per shard: each shard's held rows and chunk) gives one device's tokens. (That
  dense's chunked prefill equals its whole one on one device is tests/test_chunked_prefill.py's.)"""
  _, model = tiny_llama
  prompts = random_prompts(model.config.vocab_size, (300, 90, 200, 64), seed=3)
  one = _generate(model, prompts, name, prefill_chunk=64)
  sharded = _generate(model, prompts, name, mesh="data=2,model=2", prefill_chunk=64)
  assert sharded.stats["prefill_chunk"] == one.stats["prefill_chunk"] == 64 and sharded.tokens == one.tokens


def test_a_cache_saved_on_a_mesh_loads_on_the_mesh_and_on_one_device(tiny_llama, tmp_path):
  """SpeCache (its host copy saved shard by shard) prefilled and saved on a data x model mesh, then continued by
  questions on the mesh and on one device: the tokens of one device's save and load, each way."""
  _, model = tiny_llama
  docs = random_prompts(model.config.vocab_size, (150, 140), seed=2)
  questions = random_prompts(model.config.vocab_size, (20, 11), seed=3)
  run = lambda prompts, **kw: _generate(model, prompts, "specache", capacity=384, prefill_chunk=128, **kw).tokens
  mesh = "data=2,model=2"
  assert run(docs, mesh=mesh, save_cache=str(tmp_path / "mesh")) == run(docs, save_cache=str(tmp_path / "one"))
  want = run(questions, cache=str(tmp_path / "one"))
  assert run(questions, cache=str(tmp_path / "mesh"), mesh=mesh) == want
  assert run(questions, cache=str(tmp_path / "mesh")) == want


def test_pallas_kernels_run_per_shard(tiny_llama):
  """The fused dequant-attention and quantize-pack kernels (interpret mode), each on its shard's local arrays."""
  _, model = tiny_llama
  prompts = random_prompts(model.config.vocab_size, LENGTHS, seed=2)
  one = _generate(model, prompts, "kivi", impl="interpret")
  assert _generate(model, prompts, "kivi", mesh="data=2,model=2", impl="interpret").tokens == one.tokens


# fakequant re-quantizes the whole cache at every step, and its float16 scales round a last-bit difference of the
# sums (the tensor-parallel all-reduce adds in another order; so does a matmul of another batch size) into another
# 2-bit code often enough that SmolLM2 at 2 bits, already near ties, took another token by the third one (also
# over data=2 alone); with float32 scales (or 4 bits) the tokens are equal. The other methods quantize each token
# once and are equal as they are.
DEFAULT_MODEL_METHODS = dict(METHODS, fakequant=dict(bits=2, meta_dtype="float32"))


# The methods that quantize tokens of these prompts (5 and 7 tokens, 10 new): KIVI and SpeCache hold them all in
# their exact residual (R = 32) and OTT below its first group (32 tokens past a residual of 8), which makes their
# cases here dense's, through their own state; the tiny model's test above takes each through its events on a mesh.
@pytest.mark.parametrize("name", ["dense", "fakequant", "zipcache"])
def test_default_model_over_its_three_kv_heads_equals_one_device(default_model, name):
  mesh = sharding.make_mesh("model=3", devices=jax.devices()[:3])  # SmolLM2: 9 query heads, 3 KV heads
  tok = default_model.tokenizer
  prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    ")]
  run = lambda mesh: gen.generate(default_model.params, default_model.config, prompts, max_new_tokens=NEW_TOKENS,
                                  method=make_method(name, **DEFAULT_MODEL_METHODS[name]), chunk=NEW_TOKENS,
                                  eos_ids=(), attention_impl="xla", mesh=mesh)
  assert run(mesh).tokens == run(None).tokens


def test_every_cache_array_is_split_by_its_axes_and_keeps_its_memory_kind(tiny_llama):
  _, model = tiny_llama
  mesh = sharding.make_mesh("data=2,model=2")
  spec = CacheSpec.for_model(model.config, 4, 64)
  for name in METHODS:
    cache = sharding.create_cache(make_method(name, **METHODS[name]), spec, "xla", mesh)
    abstract = cache.abstract()
    arrays = jax.tree.leaves(cache.state)
    infos = jax.tree.leaves(abstract, is_leaf=is_array_info)
    assert len(arrays) == len(infos)
    for x, info in zip(arrays, infos):
      want = {"batch": "data", "kv_heads": "model"}
      got = dict(zip(info.axes, tuple(x.sharding.spec) + (None,) * len(info.axes)))
      assert all(got[a] == m for a, m in want.items() if a in info.axes), (name, info.axes, x.sharding.spec)
      assert x.sharding.memory_kind == info.memory_kind
      shard = x.addressable_shards[0].data.shape  # each device holds its own part only
      assert shard == tuple(n // (2 if a in want else 1) for n, a in zip(info.shape, info.axes))
    assert cache.lengths.sharding.spec == sharding.P("data")
  host = sharding.create_cache(make_method("specache", **METHODS["specache"]), spec, "xla", mesh).state.host_kv
  assert host.sharding.memory_kind == "pinned_host"


def _collective_sizes(hlo: str) -> list:
  """Element counts of the results of every cross-device op in compiled HLO text."""
  sizes = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*\b(all-gather|all-to-all|collective-permute|all-reduce|"
                  r"reduce-scatter)(-start)?\(", line)
    if m:
      sizes.append(int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1])))
  return sizes


def _decode_hlo(model, mesh_spec, compiled=True):
  """The optimized HLO of two KIVI decode steps (generate's decode chunk) of 4 sequences on ``mesh_spec`` (not
  ``compiled``: the program as lowered, before XLA partitions it), and the cache it was compiled for."""
  cfg = model.config
  mesh = sharding.make_mesh(mesh_spec)
  method, B = make_method("kivi", **METHODS["kivi"]), 4
  with sharding.use_mesh(mesh):
    params = sharding.shard_params(model.params, cfg, mesh)
    cache = sharding.create_cache(method, CacheSpec.for_model(cfg, B, 256), "xla", mesh)
    rows = lambda *xs: sharding.rows(xs, mesh)
    args = (params, cache) + rows(jnp.zeros((B,), jnp.int32), jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), bool),
                                  jnp.zeros((B,), bool), jnp.zeros((B, 2), jnp.int32), jax.random.key(0),
                                  jnp.asarray([-1], jnp.int32), jnp.int32(0))
    lowered = gen._decode_chunk.lower(*args, cfg=cfg, sampler=Greedy(), steps=2)
    return (lowered.compile().as_text() if compiled else lowered.as_text()), cache


def test_decode_moves_no_cache_array_between_devices(tiny_llama):
  """Only activations cross devices (the tensor-parallel sums, the vocabulary's argmax): the largest array any
  collective of the compiled decode step moves is smaller than the smallest shard of any cache array."""
  hlo, cache = _decode_hlo(tiny_llama[1], "data=2,model=2")
  sizes = _collective_sizes(hlo)
  assert sizes, "a tensor-parallel step must sum its partial products across the model axis"
  smallest_shard = min(x.addressable_shards[0].data.size for x in jax.tree.leaves(cache.state))
  assert max(sizes) < smallest_shard


def test_tensor_parallel_sums_cross_devices_in_the_model_dtype(tiny_llama):
  """A bf16 model's products whose contraction ``model`` splits (the attention's output product, the MLP's down
  product: two a layer) return bf16 [B, 1, E], so the partial products cross devices in bf16; on one device they
  return fp32. (The compiled CPU program promotes a bf16 all-reduce to fp32, so the program is read as lowered.)"""
  model = tiny_llama[1]
  cfg = dataclasses.replace(model.config, dtype="bfloat16")
  bf16 = types.SimpleNamespace(config=cfg, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params))
  into_residual = lambda mesh: re.findall(r"stablehlo\.dot_general[^\n]*-> tensor<4x1x%dx(\w+)>" % cfg.embed,
                                          _decode_hlo(bf16, mesh, compiled=False)[0])
  assert into_residual("data=2,model=2") == ["bf16", "bf16"]  # the layers' scan body, once
  assert into_residual("data=4") == ["f32", "f32"]


def test_data_parallel_decode_moves_nothing_between_devices(tiny_llama):
  """With the whole model on every device and the sequences split, a decode step needs no communication: its
  compiled HLO has no collective at all (a cache or parameter array that lost its sharding would add one)."""
  hlo, _ = _decode_hlo(tiny_llama[1], "data=4")
  assert not re.search(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)", hlo)


@pytest.mark.parametrize("mesh_spec", ["model=4", "data=2,model=2"])
def test_the_embedding_lookup_reads_each_shards_rows_and_sums_them(mesh_spec):
  """Under a mesh that splits the vocabulary, ``vocab_lookup`` is ``table[tokens]`` (tokens at every shard's first
  and last id, random others) and moves one [B, T, E] sum between devices, never the table."""
  mesh = sharding.make_mesh(mesh_spec)
  V, E = 64, 24
  table = jax.random.normal(jax.random.key(3), (V, E), jnp.float32)
  edges = np.array([[0, 15, 16, 31], [32, 47, 48, 63]], np.int32)
  tokens = np.concatenate([edges, np.random.default_rng(3).integers(0, V, (2, 5), dtype=np.int32)], axis=1)
  with sharding.use_mesh(mesh):
    placed = jax.device_put(table, jax.sharding.NamedSharding(mesh, P("model")))
    lookup = jax.jit(sharding.vocab_lookup)
    got = lookup(placed, jnp.asarray(tokens))
    hlo = lookup.lower(placed, jnp.asarray(tokens)).compile().as_text()
  np.testing.assert_array_equal(np.asarray(got), np.asarray(table)[tokens])
  assert _collective_sizes(hlo) and max(_collective_sizes(hlo)) <= tokens.size * E


def test_perplexity_through_compare_on_a_mesh_equals_one_device(tiny_llama):
  """``jkv compare``'s path (perplexity per method) with a mesh; 3 windows per batch are padded to 4 for data=2."""
  _, model = tiny_llama
  ids = random_prompts(model.config.vocab_size, [400], seed=4)[0]
  plan = WindowPlan(context=32, scored=8, num_windows=3, batch_size=3)
  specs = parse_methods(["kivi:bits=2,residual=32"])
  run = lambda mesh: compare(model, specs, token_ids=ids, ppl=plan, passkey=None, progress=False,
                             attention_impl="xla", mesh=mesh)[0]
  one, sharded = run(None), run("data=2,model=2")
  assert sharded["ppl"] == pytest.approx(one["ppl"], rel=1e-5)
  assert sharded["window_nll"] == pytest.approx(one["window_nll"], rel=1e-5)
  assert sharded["kv_bytes"] == one["kv_bytes"]


@pytest.fixture
def cli_loads_default_model(default_model, monkeypatch):
  """The CLI's ``open_model("default", "float32")`` (its default dtype; ``load_model`` reads through it) gives the
  model the tests above loaded, rather than loading it again (~7 s)."""
  real = load_lib.open_model
  monkeypatch.setattr(load_lib, "open_model", lambda name, dtype="float32": (
      load_lib.ModelSource(default_model.config, default_model.tokenizer, lambda: default_model.params)
      if (name, dtype) == ("default", "float32") else real(name, dtype)))


@pytest.mark.parametrize("argv, message", [
    (["generate", "--mesh", "model=4", "hi"], "the model's 3 KV heads (9 query heads) do not split over model=4"),
    (["generate", "--mesh", "data=4", "hi"], "a batch of 1 sequences does not split over data=4 (give a multiple"),
])
def test_cli_mesh_that_does_not_fit_the_model_is_one_line(cli_loads_default_model, capsys, argv, message):
  assert cli.main(argv) == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]  # after "loading model default ..."
  assert last.startswith("jkv: error: mesh ") and message in last, last
