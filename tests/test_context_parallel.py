"""Context parallelism (``jkv.context_parallel``): one sequence's cache split by tokens over a mesh's ``seq`` axis.

The tests that need 4 devices (the count is fixed when jax starts) run in a process of their own, started by
``test_on_four_cpu_devices`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (as tests/test_sharding.py
runs its sharded suite); in the main test process they are skipped.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from jkv import context_parallel
from jkv import generate as gen
from jkv import memory
from jkv import prefill as prefill_lib
from jkv import sharding
from jkv.attention import decode_attention, prompt_attention, prompt_mask
from jkv.cache import CacheSpec
from jkv.config import ModelConfig
from jkv.context_parallel import merge_across_seq
from jkv.methods import make_method
from jkv.model import forward
from jkv.params import init_random
from jkv_kernels.attention_reference import gqa_attention_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOUR_DEVICES = jax.device_count() >= 4
on_four_devices = pytest.mark.skipif(not FOUR_DEVICES, reason="runs in test_on_four_cpu_devices's process")

# 2 KV heads: model=4 cannot split them, seq=4 can split one sequence's tokens.
CFG = ModelConfig("llama", vocab_size=128, embed=96, ffw_size=160, num_layers=2, q_heads=6, kv_heads=2, head_dim=64,
                  max_position=2048)
CAPACITY = 128  # 32 token slots per device of seq=4
LENGTHS = (70, 9, 45, 100)  # prompts over 3, 1, 2 and 4 devices' ranges
NEW_TOKENS = 12  # the 100-token prompt's decode crosses from the fourth device's first slots on; the 9's stays
CHUNK = 24  # prompt chunks that straddle the ranges' boundaries (32, 64, 96)
# KIVI with a key block of 16 tokens: blocks flushed in prefill and decode, two in each range of seq=4, whose
# chunks of 3 blocks straddle the ranges' boundaries; the window (the rings) straddles them too. The kernels run (in
# interpret mode): quantization, and decode attention's partial o and log-sum-exp.
SMALL_KIVI = dict(method="kivi", settings=dict(residual=16, group_size=16), impl="interpret")
KIVI_CHUNK = 48
# OTT at its defaults (G = 16, R = 32) with a pool in both layers, small enough that tokens are evicted to the
# auxiliary pool. A range of seq is whole tiles of 64 slots (seq=4 rounds the capacity to 256) and a chunk whole
# pairs of groups: chunks of 96 straddle the ranges' ends at 64 and 128, and each chunk's store rewrites the buffer's
# rows before it, from the first not yet quantized.
SMALL_OTT = dict(method="ott", settings=dict(no_pool_layers=0, pool_size=4, aux_size=8))
OTT_CHUNK = 96
# ZipCache whose prompts and windows fill whole key groups of 16 rows (r = 1/2 of N = 32 and of every chunk of 96),
# so each pool, 160 rows at a capacity of 320 tokens, rounds to 256 rows on seq=4 and seq=2 (ranges of 64 and 128
# rows): the 270-token prompt's rows reach the third and the second range of both pools, a chunk's rows straddle a
# range's end, and the window, full after 32 decode steps, is compressed into rows of a later range.
SMALL_ZIPCACHE = dict(method="zipcache", settings=dict(salient_ratio=0.5, interval=32, key_group=16), capacity=320)
ZIP_LENGTHS = (270, 150, 45)
ZIP_NEW_TOKENS = 40
ZIP_CHUNK = 96
# SpeCache at its defaults but a key block of 32 (1-bit groups are 32) and 16 fetched rows, fewer than the candidates
# (a prompt of 180 has 160 at its first step): a capacity of 256 splits on seq=4 into ranges of 64, a block's
# multiple, which the 180-token prompt and its decode reach all of; chunks of 96 straddle the ranges' ends at 64 and
# 128, and a decode step's row lands in the range past 192.
SMALL_SPECACHE = dict(method="specache", settings=dict(residual=32, fetch_rows=16), capacity=256)
SPEC_LENGTHS = (180, 9, 70)
SPEC_NEW_TOKENS = 30
SPEC_CHUNK = 96


@pytest.fixture(autouse=True)
def _release_compiled_programs_each_test():
  """In the 4-device process, drops jax's compiled programs after each test, as conftest does after each module:
  this one module compiles a few hundred 4-device programs in one process, and XLA's CPU compiler crashed there
  (segmentation faults and an abort inside backend_compile) once enough of them were held; every subset of the
  module passes, and the whole module crashed at the same test each time."""
  yield
  if FOUR_DEVICES:
    jax.clear_caches()


# Run with LLVM's optimizations (conftest.py): OTT's MMA packing keeps fp16 scales and zero-points, and the
# one-device and seq=4 runs round their keys differently (their merges' order); on a Xeon with AVX-512 FP16 and AMX,
# unoptimized, that flipped 2-bit codes and moved logits by up to 0.18 (0.0006 optimized, the test's 1e-3 holds).
OPTIMIZED = "test_ott_logits_and_pools_over_seq_equal_one_devices and mma"


def test_on_four_cpu_devices():
  if FOUR_DEVICES:
    pytest.skip("this process is the one with 4 devices")
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  unoptimized = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  optimized = dict(unoptimized, XLA_FLAGS=flags.replace("--xla_backend_optimization_level=0", ""),
                   JKV_TESTS_OPTIMIZED="1")
  for selected, env in ((f"not test_on_four_cpu_devices and not ({OPTIMIZED})", unoptimized), (OPTIMIZED, optimized)):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k",
                           selected, os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_a_mesh_spec_names_seq_only_where_it_splits():
  assert sharding.parse_mesh("seq=4") == {"data": 1, "model": 1, "seq": 4}
  assert sharding.parse_mesh("model=2,seq=1") == {"data": 1, "model": 2}


def _abstract_seq4():
  """A seq=4 mesh without devices (the memory plans read its axis sizes only)."""
  try:
    return AbstractMesh((1, 1, 4), sharding.AXES)
  except TypeError:  # older signature: ((name, size), ...)
    return AbstractMesh((("data", 1), ("model", 1), ("seq", 4)))


def test_a_devices_bytes_count_the_largest_range_where_seq_does_not_divide_the_capacity():
  """The memory plans search capacities one block apart; seq=4 splits 130 slots as 33, 33, 33, 31."""
  mesh = _abstract_seq4()
  state = make_method("dense").abstract(CacheSpec.for_model(CFG, 3, 130))  # k and v [2, 3, 2, 130, 64] float32
  assert sharding.local_bytes(state, mesh).device == 2 * (2 * 3 * 2 * 33 * 64) * 4


def test_the_longest_context_over_seq_counts_each_devices_share_of_the_held_rows():
  """On seq=4 each device holds a quarter of the cache and dequantizes a quarter of a chunk's held rows: the
  longest context fits those, the reserve and a long prompt's chunk activations beside the weights on each device,
  and one more block does not; about 4x one device's at the Llama-3-8B shape."""
  mesh = _abstract_seq4()
  cfg = dataclasses.replace(CFG, embed=4096, ffw_size=14336, num_layers=32, q_heads=32, kv_heads=8, head_dim=128,
                            dtype="bfloat16")
  method, device, weights = make_method("dense"), 80 << 30, 4 << 30
  free = dict(device_bytes=device, weight_bytes=weights)
  n = memory.longest_context(cfg, method, mesh=mesh, **free)
  per_device = lambda t: (memory.cache_bytes(method, cfg, 1, t, mesh) + memory.held_rows_bytes(cfg, 1, t) // 4
                          + memory.RESERVE_BYTES + 2 * memory.LONG_PROMPT_CHUNK * memory.prefill_bytes_per_token(cfg)
                          + weights)
  step = method.chunk_multiple()
  assert per_device(n) <= device < per_device(n + step)
  assert 3.5 < n / memory.longest_context(cfg, method, **free) < 4.5


@on_four_devices
@pytest.mark.parametrize("name, settings", [("dense", {}), ("kivi", SMALL_KIVI["settings"]),
                                            ("ott", SMALL_OTT["settings"]), ("zipcache", SMALL_ZIPCACHE["settings"]),
                                            ("specache", SMALL_SPECACHE["settings"])])
def test_the_memory_plan_is_what_seq_allocates_on_each_device(name, settings):
  """The plans' bytes of a cache on seq=4 (``memory.cache_bytes``, ``host_cache_bytes``) are what device 0 holds of
  it as allocated, ZipCache's pools rounded to the ranges included."""
  mesh, method = sharding.make_mesh("seq=4"), make_method(name, **settings)
  capacity = context_parallel.split_capacity(300, method, mesh)
  cache = sharding.create_cache(method, CacheSpec.for_model(CFG, 2, capacity), "xla", mesh)
  device = jax.devices()[0]
  held = {"device": 0, "host": 0}
  for x in jax.tree.leaves((cache.state, cache.lengths)):
    kind = "device" if x.sharding.memory_kind in (None, "device") else "host"
    held[kind] += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
  assert held["device"] == memory.cache_bytes(method, CFG, 2, capacity, mesh)
  assert held["host"] * 4 == memory.host_cache_bytes(method, CFG, 2, capacity, mesh)  # this process's 4 devices


@pytest.fixture(scope="module")
def params():
  return init_random(CFG, jax.random.key(0), scale=0.15)  # peaked enough that tokens vary with the context


def _random_prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, CFG.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def prompts():
  return _random_prompts(7, LENGTHS)


ZIP_PROMPTS, SPEC_PROMPTS = _random_prompts(9, ZIP_LENGTHS), _random_prompts(10, SPEC_LENGTHS)


def _generate(params, prompts, mesh=None, method="dense", capacity=CAPACITY, settings=None, impl="xla",
              new_tokens=NEW_TOKENS, **kw):
  return gen.generate(params, CFG, prompts, method=make_method(method, **(settings or {})),
                      max_new_tokens=new_tokens, chunk=4, eos_ids=(), attention_impl=impl, capacity=capacity,
                      mesh=mesh, **kw)


@on_four_devices
def test_merging_the_devices_partials_is_softmax_over_all_their_rows():
  """Each of 4 devices attends its quarter of the keys (some rows see none of a device's, one row none at all);
  the merged output and log-sum-exp are softmax attention over every key at once."""
  B, H, T, g, D, S = 3, 2, 2, 3, 16, 64
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (B, H, T, g, D), jnp.float32)
  k, v = (2 * jax.random.normal(key, (B, H, S, D), jnp.float32) for key in keys[1:3])
  seen = jnp.arange(S)[None, None, :] < jnp.array([[40, 10], [64, 64], [0, 20]])[:, :, None]  # [B, T, S]
  mesh = sharding.make_mesh("seq=4")

  def per_device(q, k, v, seen):
    o, lse = decode_attention(q, 0, segments=((k, v, seen),), impl="xla", return_lse=True)
    return merge_across_seq(o, lse)

  run = sharding.shard_map(per_device, mesh=mesh, in_specs=(P(), P(None, None, "seq"), P(None, None, "seq"),
                                                             P(None, None, "seq")), out_specs=(P(), P()))
  o, lse = run(q, k, v, seen)
  want_o, want_lse = gqa_attention_reference(q, k, v, seen, return_lse=True)
  np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5)
  assert np.all(np.asarray(o)[2, :, 0] == 0)  # the row that saw no key


@on_four_devices
@pytest.mark.parametrize("mesh", ["seq=4", "seq=2,model=2"])
def test_a_prompts_attention_split_by_rows_is_causal_attention(mesh, monkeypatch):
  """``prompt_attention`` over seq: each device's range of rows over every key before it and causally over its own
  (``prompt_attention_by_ranges``, which it calls with ``flash``) is causal attention over the whole prompt, for
  every real row of right-padded prompts of lengths that end in each range, one of them padding in every range but
  the first. (fp32 on the CPU: ``chunk_attention``'s XLA path where a GPU's bf16 takes cuDNN's.)"""
  calls = []
  by_ranges = context_parallel.prompt_attention_by_ranges
  monkeypatch.setattr(context_parallel, "prompt_attention_by_ranges", lambda *a, **kw: calls.append(1) or by_ranges(
      *a, **kw))
  B, H, T, g, D = 4, 2, 32, 3, 16
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (B, H, T, g, D), jnp.float32)
  k, v = (2 * jax.random.normal(key, (B, H, T, D), jnp.float32) for key in keys[1:])
  lengths = np.array([32, 19, 5, 26])
  positions = jnp.asarray(np.where(np.arange(T)[None] < lengths[:, None], np.arange(T)[None], -1), jnp.int32)
  with sharding.use_mesh(sharding.make_mesh(mesh)):
    out = jax.jit(functools.partial(prompt_attention, flash=True))(q, k, v, positions)
  want = gqa_attention_reference(q, k, v, prompt_mask(positions))
  real = np.asarray(positions >= 0)[:, None, :, None, None]
  np.testing.assert_allclose(np.where(real, out, 0), np.where(real, want, 0), rtol=1e-5, atol=1e-5)
  assert calls == [1]


@on_four_devices
def test_the_cache_holds_a_quarter_of_each_sequence_on_each_device():
  spec = CacheSpec.for_model(CFG, 2, CAPACITY)
  cache = sharding.create_cache(make_method("dense"), spec, "xla", sharding.make_mesh("seq=4"))
  for x in (cache.state.k, cache.state.v):
    assert x.shape == (2, 2, 2, CAPACITY, 64)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 2, 2, CAPACITY // 4, 64)}
    assert len({s.device for s in x.addressable_shards}) == 4


@pytest.fixture(scope="module")
def one_device_tokens(params, prompts):
  tokens = _generate(params, prompts).tokens
  assert len({tuple(t) for t in tokens}) == len(prompts)
  return tokens


@on_four_devices
@pytest.mark.parametrize("mesh", ["seq=4", "seq=2,model=2", "data=2,seq=2"])
def test_generate_over_seq_equals_one_device(params, prompts, one_device_tokens, mesh):
  """Whole prompts (each device stores its range of them) and chunks that straddle the ranges."""
  split = _generate(params, prompts, mesh=mesh)
  assert split.stats["mesh"] == sharding.mesh_label(sharding.make_mesh(mesh)) and split.tokens == one_device_tokens
  chunked = _generate(params, prompts, mesh=mesh, prefill_chunk=CHUNK)
  assert chunked.stats["prefill_chunk"] == CHUNK and chunked.tokens == one_device_tokens


@on_four_devices
@pytest.mark.parametrize("T, rows", [(CAPACITY, CAPACITY // 4), (CAPACITY - 2, CAPACITY - 2)])
def test_a_prompts_mlp_runs_on_a_quarter_of_its_tokens_on_each_device(params, T, rows):
  """Over seq=4 each device runs the projections and the MLP, whose weights it holds whole, on its quarter of a
  prompt's tokens (the compiled per-device program's gate/up product has T / 4 rows); where 4 does not divide the
  prompt, on all of them."""
  if jax.default_backend() != "cpu":
    pytest.skip("reads the CPU compiler's dot instructions (a GPU's are library calls)")
  mesh = sharding.make_mesh("seq=4")
  with sharding.use_mesh(mesh):
    cache = sharding.create_cache(make_method("dense"), CacheSpec.for_model(CFG, 2, CAPACITY), "xla", mesh)
    placed = sharding.shard_params(params, CFG, mesh)
    tokens = jnp.ones((2, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    step = jax.jit(functools.partial(forward, cfg=CFG, prefill=True))
    hlo = step.lower(placed, tokens, positions, cache).compile().as_text()
  shapes = [line.split(" = ")[1].split("[")[1].split("]")[0] for line in hlo.splitlines() if " dot(" in line]
  gate_up = {tuple(map(int, s.split(","))) for s in shapes if s.endswith(f",{2 * CFG.ffw_size}")}  # [..., 2 ffw]
  assert gate_up and {int(np.prod(s[:-1])) for s in gate_up} == {2 * rows}, gate_up  # B x the device's rows


def _logits(params, prompts, mesh, method=make_method("dense"), chunk=CHUNK, capacity=CAPACITY):
  """Each prompt's last-token logits after a prefill (in chunks of ``chunk``; None: whole), then those of 6 decode
  steps fed fixed tokens: [7, B, vocab]."""
  return _logits_and_cache(params, prompts, mesh, method, chunk, capacity)[0]


def _logits_and_cache(params, prompts, mesh, method, chunk, capacity, steps=6, watch=None):
  """``_logits`` (after ``steps`` decode steps: [steps + 1, B, vocab]), and the cache after the decode steps. A method
  with a speculative row (SpeCache) runs its pre-decode pass on a fixed token first, and each step carries a fixed
  speculative token after the real one (both rows' logits: [steps + 1, B, 2, vocab], the prompt's repeated);
  ``watch(cache)`` is called after each decode step."""
  mesh = sharding.make_mesh(mesh)
  with sharding.use_mesh(mesh):
    plan = gen.plan_generation(CFG, method, prompts, max_new_tokens=steps + 2, capacity=capacity, prefill_chunk=chunk,
                               attention_impl="xla", mesh=mesh)
    cache = sharding.create_cache(method, CacheSpec.for_model(CFG, len(prompts), plan.capacity), "xla", mesh)
    placed = sharding.shard_params(params, CFG, mesh)
    run = prefill_lib.Prefill(plan.prefill, CFG, prefill_lib.pad_prompts(prompts, plan.prefill.width, 0),
                              [len(p) for p in prompts])
    logits, cache = run(placed, cache)
    out = [np.asarray(logits)]
    rows = 1 + method.speculative_rows
    step = jax.jit(lambda p, tokens, cache, pre_decode: forward(
        p, tokens, cache.lengths[:, None] + jnp.arange(tokens.shape[1]), cache, cfg=CFG, pre_decode=pre_decode),
        static_argnames="pre_decode")
    fixed = lambda i, n: jnp.broadcast_to((3 + 11 * i + 5 * jnp.arange(n)) % CFG.vocab_size, (len(prompts), n))
    if rows > 1:
      out = [np.repeat(out[0][:, None], rows, axis=1)]
      _, cache = step(placed, fixed(0, 1), cache, True)
    for i in range(steps):
      logits, cache = step(placed, fixed(i, rows), cache, False)
      out.append(np.asarray(logits if rows > 1 else logits[:, 0]))
      if watch is not None:
        watch(cache)
  return np.stack(out), cache


@on_four_devices
def test_logits_over_seq_equal_one_devices(params, prompts):
  one, split = _logits(params, prompts, None), _logits(params, prompts, "seq=4")
  assert np.std(one) > 1  # logits that a wrong merge would move
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def one_device_kivi(params, prompts):
  """One device's tokens with KIVI's small blocks: whole prompts, and prompts in chunks (which attend the held
  tokens quantized, so they differ from whole prompts' tokens)."""
  whole = _generate(params, prompts, **SMALL_KIVI).tokens
  chunked = _generate(params, prompts, prefill_chunk=KIVI_CHUNK, **SMALL_KIVI).tokens
  assert whole != chunked
  return whole, chunked


@on_four_devices
@pytest.mark.parametrize("mesh", ["seq=4", "seq=2,model=2"])
def test_kivi_over_seq_equals_one_device(params, prompts, one_device_kivi, mesh):
  """KIVI's store split by ranges, its rings on every device: blocks flushed in each range, whole prompts and chunks
  stored across ranges' boundaries, the window attended once."""
  whole, chunked = one_device_kivi
  assert _generate(params, prompts, mesh=mesh, **SMALL_KIVI).tokens == whole
  split = _generate(params, prompts, mesh=mesh, prefill_chunk=KIVI_CHUNK, **SMALL_KIVI)
  assert split.stats["prefill_chunk"] == KIVI_CHUNK and split.tokens == chunked


@on_four_devices
def test_kivi_at_its_defaults_over_seq_equals_one_device(params, prompts):
  """A key block of 128 tokens: every token in the first device's range (the capacity rounds up to 4 blocks), the
  other three attend nothing."""
  split = _generate(params, prompts, mesh="seq=4", method="kivi")
  assert split.stats["capacity"] == 4 * 128 and split.tokens == _generate(params, prompts, method="kivi").tokens


@on_four_devices
def test_kivi_in_the_mma_packing_over_seq_equals_one_device(params):
  """The Hopper kernel's packing (read by XLA here) over seq=4's ranges of 64 tokens: the first prompt is stored in
  three devices' stores, and its decode reaches position 192, where the end of a step flushes a key block and packs
  a value tile into the third device's store, which the next steps read."""
  prompts = _random_prompts(8, (190, 130))
  method = make_method("kivi", residual=64, group_size=32, mma=True)
  one, split = (_logits(params, prompts, mesh, method, chunk=None, capacity=2 * CAPACITY) for mesh in (None, "seq=4"))
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-4)


@on_four_devices
def test_kivi_logits_over_seq_equal_one_devices(params, prompts):
  """Scales and zero-points in fp32: seq splits a chunk's projections by token, whose fp32 rounding (1e-6) moved
  one fp16 key scale of the first layer by its last bit, and the second layer's codes and logits after it (by up to
  0.02)."""
  method = make_method("kivi", meta_dtype="float32", **SMALL_KIVI["settings"])
  one, split = (_logits(params, prompts, mesh, method, KIVI_CHUNK) for mesh in (None, "seq=4"))
  assert np.std(one) > 1
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-4)


@on_four_devices
def test_fakequant_over_seq_equals_one_device(params, prompts):
  """Groups of 16 tokens, two in each range of seq=4: each device quantizes its own, the sequence's last, partial
  group zero-padded by the device that holds it; prompts in chunks (the first stored as a whole prompt is). Scales
  in fp32, as in the KIVI logits' test: fp16 ones took the split projections' rounding to a token."""
  kw = dict(method="fakequant", settings=dict(group_size=16, meta_dtype="float32"), prefill_chunk=KIVI_CHUNK)
  assert _generate(params, prompts, mesh="seq=4", **kw).tokens == _generate(params, prompts, **kw).tokens


@pytest.fixture(scope="module")
def one_device_ott(params, prompts):
  """One device's tokens with OTT's pools in every layer: whole prompts, and prompts in chunks (which attend the
  held tokens quantized)."""
  whole = _generate(params, prompts, **SMALL_OTT).tokens
  chunked = _generate(params, prompts, prefill_chunk=OTT_CHUNK, **SMALL_OTT).tokens
  assert whole != chunked
  return whole, chunked


@on_four_devices
@pytest.mark.parametrize("mesh", ["seq=4", "seq=2,model=2"])
def test_ott_over_seq_equals_one_device(params, prompts, one_device_ott, mesh):
  """OTT's store split by ranges, its buffer and pools on every device: block events in prefill and decode, whole
  prompts and chunks stored across a range's end, the competitions run alike on every device."""
  whole, chunked = one_device_ott
  assert _generate(params, prompts, mesh=mesh, **SMALL_OTT).tokens == whole
  split = _generate(params, prompts, mesh=mesh, prefill_chunk=OTT_CHUNK, **SMALL_OTT)
  assert split.stats["prefill_chunk"] == OTT_CHUNK and split.tokens == chunked


@on_four_devices
@pytest.mark.parametrize("layout", [dict(meta_dtype="float32"), dict(mma=True)], ids=["library", "mma"])
def test_ott_logits_and_pools_over_seq_equal_one_devices(params, layout):
  """A prompt in three chunks: the chunks' planned capacity, 320, splits over seq=4 as 512, in ranges of 128 slots;
  the second chunk straddles the first range's end, and the third reads holes of the second range (their tokens in
  the pools). The logits are one device's, and so is every layer's outlier selection (the pools' positions,
  evictions included). In the library layout, scales and zero-points in fp32: in fp16 the merge's rounding (keys of
  the second layer 3e-6 apart after the prefill) moved 7 zero-points by one step of fp16 (0.002), and logits by up
  to 4e-4. The MMA packing (read by XLA here: block events merged into tiles of the device's range) takes 16-bit
  ones only; there the rounding of projections split by token moved two logits by 1.5e-4 (atol 1e-3)."""
  prompts = _random_prompts(8, (200, 130))
  method = make_method("ott", **layout, **SMALL_OTT["settings"])
  (one, one_cache), (split, split_cache) = (_logits_and_cache(params, prompts, mesh, method, OTT_CHUNK, None)
                                            for mesh in (None, "seq=4"))
  assert split_cache.spec.capacity == 512
  assert np.std(one) > 1
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-3 if method.mma else 1e-4)
  pools = np.asarray(one_cache.state.pool_pos)  # [L, B, H, N + A]
  assert np.all(pools[..., :4] >= 0) and np.any(pools[..., 4:] >= 0)  # full pools, tokens evicted
  # Tokens of the second range, quantized by the second chunk's store (q(192) = 144), pooled (and never dropped).
  assert np.any((pools >= 128) & (pools < 144))
  np.testing.assert_array_equal(np.asarray(split_cache.state.pool_pos), pools)


_zip_generate = functools.partial(_generate, new_tokens=ZIP_NEW_TOKENS, **SMALL_ZIPCACHE)


@pytest.fixture(scope="module")
def one_device_zipcache(params):
  """One device's tokens with ZipCache's small groups: whole prompts, and prompts in chunks (each scored by its own
  probes, so they differ from whole prompts' tokens)."""
  whole = _zip_generate(params, ZIP_PROMPTS).tokens
  chunked = _zip_generate(params, ZIP_PROMPTS, prefill_chunk=ZIP_CHUNK).tokens
  assert whole != chunked
  return whole, chunked


@on_four_devices
@pytest.mark.parametrize("mesh", ["seq=4", "seq=2,model=2"])
def test_zipcache_over_seq_equals_one_device(params, one_device_zipcache, mesh):
  """ZipCache's pools split by ranges of rows, its window on every device: every prompt, chunk and window scored and
  split alike on each device, which writes the pool rows of its range; the window attended once, its probes
  weighed by the probabilities merged over every device."""
  whole, chunked = one_device_zipcache
  assert _zip_generate(params, ZIP_PROMPTS, mesh).tokens == whole
  split = _zip_generate(params, ZIP_PROMPTS, mesh, prefill_chunk=ZIP_CHUNK)
  assert split.stats["prefill_chunk"] == ZIP_CHUNK and split.tokens == chunked


def _zip_pools_over_seq(params, method, chunk):
  """The first two ZipCache prompts (in chunks of ``chunk``, or whole) and 34 decode steps on one device and on
  seq=4: checks that the logits and both pools' fills are one device's, then yields (name, one device's pool,
  seq=4's pool) of each pool."""
  (one, one_cache), (split, split_cache) = (
      _logits_and_cache(params, ZIP_PROMPTS[:2], mesh, method, chunk, SMALL_ZIPCACHE["capacity"], steps=34)
      for mesh in (None, "seq=4"))
  assert np.std(one) > 1
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-4)
  for name in ("high", "low"):
    one_pool, split_pool = getattr(one_cache.state, name), getattr(split_cache.state, name)
    np.testing.assert_array_equal(np.asarray(split_pool.fill), np.asarray(one_pool.fill))  # [L, B]
    yield name, one_pool, split_pool


@on_four_devices
def test_zipcache_logits_and_pools_over_seq_equal_one_devices(params):
  """Prompts in chunks of 96 and 34 decode steps (a window compressed at step 32) on seq=4: the logits are one
  device's, and so are both pools' rows below their fill in every layer (which tokens are salient, in which row:
  each row's value scale and zero-point are its token's), their codes and counters. Scales in fp32 (as OTT's test,
  so the merge's rounding moves none)."""
  method = make_method("zipcache", meta_dtype="float32", **SMALL_ZIPCACHE["settings"])
  for name, one_pool, split_pool in _zip_pools_over_seq(params, method, ZIP_CHUNK):
    np.testing.assert_array_equal(np.asarray(split_pool.prompt_rows), np.asarray(one_pool.prompt_rows))
    rows = int(np.asarray(one_pool.fill).max())
    assert rows > split_pool.v_codes.shape[3] // 2  # rows in the third of seq=4's four ranges
    for field, axis in (("v_codes", 3), ("v_scale", 3), ("v_zero", 3), ("k_codes", 4), ("k_scale", 4),
                        ("k_zero", 4)):
      def cut(pool):  # the entries of the rows below the fill (a word or a key group spans several rows)
        x = np.asarray(getattr(pool, field))
        return np.take(x, np.arange(rows // (pool.v_codes.shape[3] // x.shape[axis])), axis=axis)
      np.testing.assert_allclose(cut(split_pool), cut(one_pool), rtol=1e-5, atol=1e-5, err_msg=f"{name}.{field}")


_spec_generate = functools.partial(_generate, new_tokens=SPEC_NEW_TOKENS, **SMALL_SPECACHE)


@pytest.fixture(scope="module")
def one_device_specache(params):
  """One device's tokens and hit rate with SpeCache: whole prompts, and prompts in chunks."""
  whole, chunked = _spec_generate(params, SPEC_PROMPTS), _spec_generate(params, SPEC_PROMPTS, prefill_chunk=SPEC_CHUNK)
  assert 0 < whole.stats["method_stats"]["speculation_hit_rate"] < 1  # a selection a wrong mass would move
  return whole, chunked


@on_four_devices
@pytest.mark.parametrize("mesh", ["seq=4", "seq=2,model=2"])
def test_specache_over_seq_equals_one_device(params, one_device_specache, mesh):
  """SpeCache's low-bit copy split as KIVI's and its host copy by ranges, the fetched positions on every device: the
  tokens and the speculation hit rate (every step's fetched set against the real row's top k, by the probabilities
  merged over every device) are one device's, whole prompts and chunks."""
  for run, kw in zip(one_device_specache, (dict(), dict(prefill_chunk=SPEC_CHUNK))):
    split = _spec_generate(params, SPEC_PROMPTS, mesh, **kw)
    assert split.tokens == run.tokens
    assert split.stats["method_stats"] == pytest.approx(run.stats["method_stats"], rel=1e-6)


@on_four_devices
@pytest.mark.parametrize("settings", [dict(), dict(prefetch=False), dict(mma=True, residual=64), dict(speculate=False),
                                      dict(repair=True)],
                         ids=["prefetch", "no-prefetch", "mma", "no-speculation", "repair"])
def test_specache_logits_and_fetched_rows_over_seq_equal_one_devices(params, settings):
  """Prompts in chunks, the pre-decode pass and 30 steps of fixed real and speculative tokens on seq=4: both rows'
  logits are one device's, and so is every layer's fetched set after every step (which positions, in which order:
  the top k by the merged probabilities), the counted hits too. The rows fetched at the end of each step into a
  buffer per device, or by each layer when it attends; the low-bit copy in the MMA packing too (read by XLA here;
  key blocks of 64, a range's, flushed and value tiles packed by the end of a step into the range that holds
  them). The non-speculative baseline (one real row a step, its selection from its own first pass) and repair (the
  fixed guesses are all wrong: every step repairs its real row by a second pass) likewise."""
  method = make_method("specache", **{**SMALL_SPECACHE["settings"], **settings})
  runs = []
  for mesh in (None, "seq=4"):
    fetched = []
    watch = lambda cache: fetched.append((np.asarray(cache.state.fetched_idx), np.asarray(cache.state.fetched_ok)))
    logits, cache = _logits_and_cache(params, SPEC_PROMPTS, mesh, method, SPEC_CHUNK, SMALL_SPECACHE["capacity"],
                                      steps=SPEC_NEW_TOKENS, watch=watch)
    runs.append((logits, cache, fetched))
  (one, one_cache, one_fetched), (split, split_cache, split_fetched) = runs
  assert np.std(one) > 1
  np.testing.assert_allclose(split, one, rtol=1e-5, atol=1e-4)
  for (one_idx, one_ok), (idx, ok) in zip(one_fetched, split_fetched):
    np.testing.assert_array_equal(ok, one_ok)
    np.testing.assert_array_equal(np.where(ok, idx, -1), np.where(one_ok, one_idx, -1))
  assert np.any(one_fetched[-1][0][one_fetched[-1][1]] >= 128)  # rows of the third range fetched
  for name in ("hit_sum", "hit_steps") if method.counts_hits else ():
    np.testing.assert_allclose(np.asarray(getattr(split_cache.state, name)), np.asarray(getattr(one_cache.state, name)),
                               rtol=1e-6)


@on_four_devices
def test_zipcache_mma_packing_over_seq_equals_one_devices(params):
  """The MMA packing on seq=4 (read by XLA here): whole prompts and 34 decode steps (a window compressed, its rows
  merged into tiles of a later range) give one device's logits and every tile below the fill, codes and scale
  words; prompts in chunks give one device's tokens. Whole prompts for the tiles: a chunk's attention merged across
  devices moves later layers' keys by about 1e-6, which with 16-bit scales (the packing's only kind) can move a
  zero-point by one step (docs/methods/zipcache.md)."""
  settings = dict(SMALL_ZIPCACHE["settings"], mma=True)
  method = make_method("zipcache", **settings)
  for name, one_pool, split_pool in _zip_pools_over_seq(params, method, None):
    tiles = -(-int(np.asarray(one_pool.fill).max()) // 64)
    assert tiles > split_pool.k_tiles.shape[3] // 4  # rows past seq=4's first range
    for field, rows_per_entry in (("k_tiles", 64), ("v_tiles", 64), ("v_meta", 64), ("k_meta", method.key_group)):
      cut = lambda pool: np.asarray(getattr(pool, field))[:, :, :, :tiles * 64 // rows_per_entry]
      np.testing.assert_array_equal(cut(split_pool), cut(one_pool), err_msg=f"{name}.{field}")
  chunked = lambda mesh: _generate(params, ZIP_PROMPTS, mesh, method="zipcache", settings=settings,
                                   capacity=SMALL_ZIPCACHE["capacity"], new_tokens=ZIP_NEW_TOKENS,
                                   prefill_chunk=ZIP_CHUNK).tokens
  assert chunked("seq=4") == chunked(None)


# (method, settings, capacity, document tokens, tokens of it the saved cache holds: its whole chunks)
SAVED = {"kivi": (dict(residual=16, group_size=16), CAPACITY * 2, 100, 96),
         "zipcache": (SMALL_ZIPCACHE["settings"], SMALL_ZIPCACHE["capacity"], 150, 128),
         "specache": (SMALL_SPECACHE["settings"], SMALL_SPECACHE["capacity"], 180, 160)}


@on_four_devices
@pytest.mark.parametrize("name", list(SAVED))
def test_a_cache_saved_on_seq_is_continued_there_as_one_device_would(params, tmp_path, name):
  """A document prefilled and saved on seq=4 (each array as one device's over the whole capacity, ranges in place),
  then continued by a question on seq=4 and on one device: the tokens of one device's chunked generate of document
  + question, whose chunk boundary falls at the end of the document's whole chunks. On one device ZipCache's pools
  and SpeCache's prefetched rows are shorter than seq=4 rounded them (what lies past is zeros, cut). And the same
  document saved on one device, continued on seq=4."""
  settings, capacity, n, head = SAVED[name]
  doc, question = _random_prompts(11, (n, 20))
  run = dict(method=name, settings=settings, capacity=capacity, new_tokens=8, prefill_chunk=head)
  directory = str(tmp_path / "doc")
  saving = _generate(params, [doc], "seq=4", save_cache=directory, **run)
  assert saving.stats["cache_saved"]["held_bytes"] > 0
  want = _generate(params, [doc + question], **run).tokens
  for mesh in ("seq=4", None):
    assert _generate(params, [question], mesh, cache=directory, **run).tokens == want
  _generate(params, [doc], save_cache=str(tmp_path / "one"), **run)  # saved on one device, continued on seq=4
  assert _generate(params, [question], "seq=4", cache=str(tmp_path / "one"), **run).tokens == want


@on_four_devices
@pytest.mark.parametrize("kw, message", [
    (dict(capacity=130), "capacity 130 does not split over seq=4"),
])
def test_what_seq_does_not_take_is_a_one_line_error(params, prompts, kw, message):
  with pytest.raises(ValueError) as e:
    _generate(params, prompts, mesh="seq=4", **kw)
  assert message in str(e.value) and "\n" not in str(e.value)


@on_four_devices
def test_a_method_without_spans_is_refused_on_seq():
  """A method that stores only whole sequences (no ``store_span``) cannot split tokens: refused in one line."""
  from jkv.cache import CacheMethod
  from jkv.methods.dense import Dense

  @dataclasses.dataclass(frozen=True)
  class WholeOnly(Dense):
    store_span = CacheMethod.store_span

  assert make_method("dense").splits_tokens() and not WholeOnly().splits_tokens()
  with pytest.raises(ValueError) as e:
    context_parallel.check(WholeOnly(), sharding.make_mesh("seq=4"))
  assert "cannot split a sequence's tokens over devices (mesh data=1,model=1,seq=4)" in str(e.value)
  assert "\n" not in str(e.value)
