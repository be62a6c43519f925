"""Cache interface v2: a new method written against it runs through generate and compare untouched; the decode
step reads the stacked cache in place; sub-batched prefill equals one call; the abstract description drives
allocation and byte counts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from jkv import attention
from jkv import generate as gen
from jkv import memory
from jkv import prefill as prefill_lib
from jkv.cache import ArrayInfo, CacheMethod, CacheSpec, HeldBytes, KVCache, abstract_bytes, is_array_info
from jkv.cache_arrays import write_at, write_layer
from jkv.evaluation import compare as compare_lib
from jkv.evaluation import perplexity as ppl_lib
from jkv.methods import make_method, registry
from jkv.sampling import Greedy
from jkv_kernels.attention_reference import gqa_attention_reference
from conftest import random_prompts

METHODS = [("dense", {}), ("kivi", dict(bits=2, residual=32)), ("fakequant", dict(bits=2))]
# The methods built on interface v2, with settings that make each do its work inside a 64-token cache.
V2_METHODS = [("zipcache", dict(interval=8, key_group=16, random_probes=0.3)),
              ("ott", dict(group_size=32, residual=8, aux_size=8, no_pool_layers=0)),
              ("specache", dict(residual=32, fetch_rows=8))]

def _dense_store_mass(q, layer, **kwargs):
  """``attention.decode_attention`` with each store's token mass as the [B, H, R, C] array its ``TokenMass``
  stands for (``dense()``), as the references give it."""
  out = attention.decode_attention(q, layer, **kwargs)
  if not kwargs.get("token_mass_rows"):
    return out
  of_stores, of_segments = out[-1]
  return out[:-1] + ((tuple(mass.dense() for mass in of_stores), of_segments),)


# ``decode_attention`` compiled whole, as the methods run it (inside their jitted steps): op by op, each call's
# shapes compiled every one of its small ops anew.
decode_attention = jax.jit(_dense_store_mass, static_argnames=("impl", "return_lse", "token_mass_rows", "store_mass"))


# ------------------------------------------------------------------------------------------------- a new method

@struct.dataclass
class SinkWindowState:
  k: jax.Array  # [L, B, H, N + W, D]: slots [0, N) the first N tokens, slot N + p mod W the newest W
  v: jax.Array  # [L, B, H, N + W, D]


@dataclasses.dataclass(frozen=True)
class SinkWindow(CacheMethod):
  """Keep the first ``sink`` and the last ``window`` tokens, drop the rest (StreamingLLM-style): written here
  against the interface alone, to show a method needs nothing else."""

  name = "sink_window_test"
  sink: int = 4
  window: int = 16

  def abstract(self, spec):
    info = ArrayInfo((spec.num_layers, spec.batch, spec.kv_heads, self.sink + self.window, spec.head_dim),
                     spec.dtype, ("layers", "batch", "kv_heads", "slots", "head_dim"))
    return SinkWindowState(k=info, v=info)

  def _slots(self, positions):
    return jnp.where(positions < self.sink, positions, self.sink + positions % self.window)

  def _positions(self, n):
    """[B, N + W] position held by each slot when n [B] tokens are held (-1: empty)."""
    s = jnp.arange(self.sink + self.window)[None]
    last = n[:, None] - 1
    ring = last - (last - (s - self.sink)) % self.window
    pos = jnp.where(s < self.sink, s, jnp.where(ring >= self.sink, ring, -1))
    return jnp.where(pos < n[:, None], pos, -1)

  def prefill(self, state, layer, q, k, v, ctx):
    held = self._positions(ctx.lengths)
    take = lambda x: jnp.take_along_axis(x, jnp.clip(held, 0)[:, None, :, None], axis=2)
    return SinkWindowState(k=write_layer(state.k, layer, take(k)), v=write_layer(state.v, layer, take(v)))

  def step(self, state, layer, q, k, v, ctx):
    for t in range(k.shape[2]):
      slot = self._slots(ctx.lengths + t)
      state = SinkWindowState(k=write_at(state.k, layer, k[:, :, t:t + 1], slot, axis=2),
                              v=write_at(state.v, layer, v[:, :, t:t + 1], slot, axis=2))
    held = self._positions(self.advance(ctx.lengths, k.shape[2]))
    mask = (held[:, None, :] >= 0) & (held[:, None, :] <= ctx.positions[:, :, None])
    return decode_attention(q, layer, segments=((state.k, state.v, mask),), impl=ctx.impl), state

  def held_bytes(self, spec, state, lengths):
    n = np.minimum(np.asarray(lengths), self.sink + self.window)
    return HeldBytes(device=int(2 * spec.num_layers * spec.kv_heads * spec.head_dim * n.sum()
                                * jnp.dtype(spec.dtype).itemsize))


@pytest.fixture
def sink_window(monkeypatch):
  monkeypatch.setitem(registry._REGISTRY, SinkWindow.name, SinkWindow)
  return SinkWindow


def test_a_new_method_runs_through_generate_and_compare(tiny_llama, sink_window):
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [9, 30], seed=5)
  method = make_method("sink_window_test", sink=4, window=16)
  res = gen.generate(m.params, m.config, prompts, method=method, max_new_tokens=12, eos_ids=(), chunk=4)
  dense = gen.generate(m.params, m.config, prompts, max_new_tokens=12, eos_ids=(), chunk=4)
  # The 9-token prompt never outgrows 4 + 16 tokens within 12 steps: exactly dense. The 30-token one drops tokens.
  assert res.tokens[0][:11] == dense.tokens[0][:11]
  assert res.stats["kv_bytes"] == 2 * 2 * 2 * 64 * 4 * (20 + 20)
  # Its first step (40 tokens held, 20 kept) against a direct computation over the kept tokens.
  alone = gen.generate(m.params, m.config, prompts[1:], method=method, max_new_tokens=12, eos_ids=(), chunk=4)
  assert alone.tokens[0] == res.tokens[1]

  ids = np.random.default_rng(2).integers(2, m.config.vocab_size, 500).tolist()
  specs = compare_lib.parse_methods(["dense", "sink_window_test:window=8"])
  plan = ppl_lib.WindowPlan(context=20, scored=6, num_windows=2, batch_size=2)
  rows = compare_lib.compare(m, specs, token_ids=ids, ppl=plan, passkey=None, progress=False)
  assert rows[1]["method"] == "sink_window_test:window=8" and rows[1]["settings"] == dict(sink=4, window=8)
  assert rows[1]["kv_bytes"] == 2 * 2 * 2 * 64 * 4 * 12 and rows[1]["compression"] == pytest.approx(26 / 12)
  assert rows[1]["ppl"] != pytest.approx(rows[0]["ppl"], rel=1e-6)  # it did drop tokens


def test_sink_window_attention_equals_attention_over_the_kept_tokens(sink_window):
  """The test method is itself right: one step equals the reference over exactly the tokens it keeps."""
  method, rng = SinkWindow(sink=2, window=5), np.random.default_rng(0)
  spec = CacheSpec(num_layers=1, batch=1, capacity=64, kv_heads=2, head_dim=16, q_per_kv=2, dtype=jnp.float32)
  k, v = rng.normal(size=(2, 1, 2, 12, 16)).astype(np.float32)
  q = rng.normal(size=(1, 2, 1, 2, 16)).astype(np.float32)
  from jkv.cache import StepContext
  ctx = StepContext(lengths=jnp.asarray([11]), positions=jnp.arange(11)[None])
  state = method.prefill(method.init(spec), 0, None, jnp.asarray(k[:, :, :11]), jnp.asarray(v[:, :, :11]), ctx)
  out, _ = method.step(state, 0, jnp.asarray(q), jnp.asarray(k[:, :, 11:]), jnp.asarray(v[:, :, 11:]),
                       StepContext(lengths=jnp.asarray([11]), positions=jnp.asarray([[11]])))
  keep = [0, 1, 7, 8, 9, 10, 11]
  ref = gqa_attention_reference(jnp.asarray(q), jnp.asarray(k[:, :, keep]), jnp.asarray(v[:, :, keep]),
                                jnp.ones((1, 1, len(keep)), bool))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- no cache copies

@pytest.mark.parametrize("name, options", METHODS[:2])
def test_decode_step_reads_the_stacked_cache_in_place(tiny_llama, name, options):
  """Compile the decode chunk (XLA path) with a 4096-token cache: its temporaries grow, from a 256-token cache's,
  by far less than one layer's cache in float32 (the size a per-layer slice, or a dequantized layer, would take;
  the difference cancels what does not scale with the cache, such as a GPU's fixed 32 MiB cuBLAS workspace),
  and the donated cache is aliased to the output, not copied."""
  _, m = tiny_llama
  cfg = m.config
  B, C = 2, 4096

  def compiled(capacity):
    cache = KVCache.create(make_method(name, **options), CacheSpec.for_model(cfg, B, capacity), "xla")
    no = jnp.zeros((B,), bool)
    args = (m.params, cache, jnp.zeros((B,), jnp.int32), jnp.zeros((B, 0), jnp.int32), no, no,
            jnp.zeros((B, 2), jnp.int32), jax.random.key(0), jnp.asarray([1]), jnp.int32(0))
    lowered = gen._decode_chunk.lower(*args, cfg=cfg, sampler=Greedy(), steps=2)
    return cache, lowered.compile().memory_analysis()

  cache, analysis = compiled(C)
  _, small = compiled(256)
  layer_f32 = 2 * B * cfg.kv_heads * C * cfg.head_dim * 4
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(cache.state))
  growth = analysis.temp_size_in_bytes - small.temp_size_in_bytes
  assert growth < layer_f32 / 4, (analysis.temp_size_in_bytes, small.temp_size_in_bytes, layer_f32)
  assert analysis.alias_size_in_bytes >= state_bytes


# ------------------------------------------------------------------------------------------------- prefill

def reordering_bound(cfg, T: int) -> float:
  """How far, relative to the largest logit, two fp32 evaluations of the model's prefill may differ when they differ
  only in rounding: the order in which a sum's terms are added (the algorithm cuBLAS runs for a matmul is chosen,
  and autotuned by XLA, per shape) and whether a multiply-add rounds once or twice (fused or not).

  A sum of K fp32 terms, added in any order, is within gamma_K = K u / (1 - K u) (u = 2^-24) of the sum of its terms'
  magnitudes from the exact sum (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5); two
  orders are within twice that of each other. A logit's path crosses, per layer, the q, k and v projections
  (K = embed each), the attention scores (K = head_dim) and their weighted values (K = T), the output projection
  (K = q_heads x head_dim), the MLP's gate and up (K = embed each) and down (K = ffw_size), then the LM head
  (K = embed). Counting every path term at the logits' own scale, first order (the residual stream adds each
  layer's output to its input; the norms and the softmax rescale but do not amplify), gives the sum below: for the
  tiny test model, 2.8e-4 of the largest logit. Mixed-up or stale rows differ by the logits' whole scale.
  """
  gamma = lambda k: k * 2.0**-24 / (1 - k * 2.0**-24)
  layer = [cfg.embed] * 3 + [cfg.head_dim, T, cfg.q_heads * cfg.head_dim, cfg.embed, cfg.embed, cfg.ffw_size]
  return 2 * (cfg.num_layers * sum(map(gamma, layer)) + gamma(cfg.embed))


@pytest.mark.parametrize("name, options", METHODS + V2_METHODS)
def test_sub_batched_prefill_equals_one_call(tiny_llama, name, options, record_property):
  """Prefill of 5 prompts in sub-batches of 2 (the last one overlapping) leaves the same cache and the same logits
  as one call, so generation is unchanged: bit for bit on the CPU, where XLA's arithmetic does not depend on the
  batch. On a GPU the two calls are two programs (batch 5 and batch 2) whose matmuls may add their terms in
  another order (an H100 run: ott and specache logits apart by up to 1.2e-6 in 74% of elements, others equal):
  there the logits and the cache's floating-point arrays are held to ``reordering_bound``, plus, for an array
  stored narrower than fp32 (fp16 scales), one rounding to its dtype, which inputs that far apart can fall on
  either side of. The integer arrays (codes, counters, positions) stay exact: a code flips only where its input
  lies within the bound of a rounding boundary, about 1e-7 of a quantization step here."""
  _, m = tiny_llama
  cfg = m.config
  prompts = random_prompts(cfg.vocab_size, [5, 17, 32, 9, 28], seed=9)
  method = make_method(name, **options)
  tokens = prefill_lib.pad_prompts(prompts, 32, 0)
  results = []
  for rows in (5, 2):
    cache = KVCache.create(method, CacheSpec.for_model(cfg, 5, 64), "xla")
    plan = prefill_lib.PrefillPlan(batch=5, width=32, rows=rows, chunk=32, capacity=64)
    results.append(prefill_lib.Prefill(plan, cfg, tokens, [len(p) for p in prompts])(m.params, cache))
  (logits_one, cache_one), (logits_sub, cache_sub) = results
  bound = 0.0 if jax.default_backend() == "cpu" else reordering_bound(cfg, tokens.shape[1])
  # In the JUnit report (--junitxml): how far apart the GPU's two programs came, against the bound.
  record_property("logits_max_abs_difference", float(np.abs(np.asarray(logits_sub) - np.asarray(logits_one)).max()))
  record_property("logits_allowed_difference", float(bound * np.abs(np.asarray(logits_one)).max()))
  for a, b in zip([logits_one] + jax.tree.leaves(cache_one), [logits_sub] + jax.tree.leaves(cache_sub)):
    if bound and a.sharding.memory_kind == "pinned_host":
      # A sub-batch's host array is made inside jit, where XLA allocates zeros moved to host without filling them:
      # only the rows prefill wrote ([0, T) on the token axis) are defined (test_specache holds the rest unread).
      a, b = a[..., :tokens.shape[1], :], b[..., :tokens.shape[1], :]
    a, b = np.asarray(a), np.asarray(b)
    if jnp.issubdtype(a.dtype, jnp.floating) and bound:
      eps = float(jnp.finfo(a.dtype).eps)
      a, b = a.astype(np.float32), b.astype(np.float32)
      np.testing.assert_allclose(b, a, rtol=eps, atol=bound * np.abs(a).max())
    else:
      np.testing.assert_array_equal(b, a)
  one = gen.generate(m.params, cfg, prompts, method=method, max_new_tokens=10, eos_ids=(), chunk=5)
  sub = gen.generate(m.params, cfg, prompts, method=method, max_new_tokens=10, eos_ids=(), chunk=5,
                     prefill_tokens=64)
  assert sub.tokens == one.tokens and sub.stats["prefill_sub_batch"] == 2 and one.stats["prefill_sub_batch"] == 5


def test_prefill_starts_cover_the_batch_with_one_shape():
  assert prefill_lib.prefill_starts(5, 2) == [0, 2, 3]
  assert prefill_lib.prefill_starts(6, 3) == [0, 3]
  assert prefill_lib.prefill_starts(1, 1) == [0]
  for batch in range(1, 12):
    for rows in range(1, batch + 1):
      covered = set()
      for s in prefill_lib.prefill_starts(batch, rows):
        assert 0 <= s and s + rows <= batch
        covered |= set(range(s, s + rows))
      assert covered == set(range(batch))


# ------------------------------------------------------------------------------------------------- description

@pytest.mark.parametrize("name, options", METHODS)
def test_abstract_describes_what_init_allocates(name, options):
  method = make_method(name, **options)
  spec = CacheSpec(num_layers=3, batch=2, capacity=128, kv_heads=2, head_dim=64, q_per_kv=3, dtype=jnp.bfloat16)
  abstract, state = method.abstract(spec), method.init(spec)
  infos = jax.tree.leaves(abstract, is_leaf=is_array_info)
  arrays = jax.tree.leaves(state)
  assert len(infos) == len(arrays)
  for info, x in zip(infos, arrays):
    assert x.shape == info.shape and x.dtype == info.dtype
    assert info.axes[:3] == ("layers", "batch", "kv_heads")
    assert not np.any(np.asarray(x))  # zeros, never uninitialized memory
  assert abstract_bytes(abstract) == HeldBytes(device=sum(x.nbytes for x in arrays))


def test_largest_batch_fits_and_one_more_does_not():
  """The batch limit follows from the cache description: at a Llama-3-8B shape on 80 GB with 16 GB of weights,
  4k + 512 tokens, KIVI-2's cache lets more than 4x dense's batch fit."""
  from jkv.config import ModelConfig
  cfg = ModelConfig(architecture="llama", vocab_size=128256, embed=4096, ffw_size=14336, num_layers=32,
                    q_heads=32, kv_heads=8, head_dim=128, max_position=131072, dtype="bfloat16")
  device, weights, capacity = 80 * 10**9, 16 * 10**9, 4096 + 512
  batches = {}
  for name, options in (("dense", {}), ("kivi", dict(bits=2))):
    method = make_method(name, **options)
    b = memory.largest_batch(cfg, method, capacity, 4096, device_bytes=device, weight_bytes=weights)
    # Beside the weights, the reserve and one prompt's prefill: its activations and a sub-batch's fresh sequence.
    budget = (device - weights - memory.RESERVE_BYTES - memory.prefill_bytes_per_token(cfg) * 4096
              - memory.cache_bytes(method, cfg, 1, capacity))
    assert memory.cache_bytes(method, cfg, b, capacity) <= budget < memory.cache_bytes(method, cfg, b + 1, capacity)
    batches[name] = b
  # dense: 2 * 32 * 8 * 128 * 2 bytes = 128 KiB per token, 4608 tokens: 576 MiB per sequence.
  sequence = 4608 * 131072 + 4
  assert batches["dense"] == (device - weights - memory.RESERVE_BYTES - memory.prefill_bytes_per_token(cfg) * 4096
                              - sequence) // sequence
  assert batches["kivi"] > 4 * batches["dense"]


# ------------------------------------------------------------------------------------------------- xla path

def _random_store(rng, L, B, H, C, D, *, k_bits, v_bits, k_group, v_group, lengths, holes=None,
                  channel_scale=False):
  """A stacked store quantized with the project's quantizer from random K/V, layers 0 and 2 poisoned (NaN)."""
  from jkv_kernels.dequant_attention import QuantizedStore
  from jkv_kernels.quantization import pack, quantize
  poison = lambda x: x.at[jnp.asarray([0, 2])].set(jnp.nan)
  k = jnp.asarray(rng.normal(size=(L, B, H, C, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(L, B, H, C, D)), jnp.float32)
  kc, ks, kz = quantize(jnp.swapaxes(k, 3, 4), bits=k_bits, axis=4, group_size=k_group)
  vc, vs, vz = quantize(v, bits=v_bits, axis=4, group_size=v_group)
  scale = poison(jnp.asarray(rng.uniform(0.5, 3.0, size=(L, B, H, D)), jnp.float32)) if channel_scale else None
  return QuantizedStore(pack(kc, bits=k_bits, axis=4), poison(ks), poison(kz), pack(vc, bits=v_bits, axis=4),
                        poison(vs), poison(vz), jnp.asarray(lengths, jnp.int32), k_bits=k_bits, v_bits=v_bits,
                        k_group=k_group, v_group=v_group, valid=holes, v_channel_scale=scale)


@pytest.mark.parametrize("n_stores", [0, 1, 2])
def test_xla_decode_attention_equals_the_reference(n_stores):
  """The blockwise XLA path (stores dequantized a block at a time, stacked segments read a block at a time) against
  the kernel module's plain reference: outputs, lse and the token mass of two rows, reading layer 1 of 3 with the
  other layers NaN. Two stores: a KIVI-like one with stacked holes, and a 4/1-bit one with key groups of 64, value
  groups of 32, per-step holes and a value channel scale (the layouts ZipCache, OTT and SpeCache use)."""
  from jkv_kernels.dequant_attention import decode_attention_reference
  rng = np.random.default_rng(4 + n_stores)
  L, B, H, T, g, D, C, S = 3, 2, 2, 2, 3, 64, 256, 40
  poison = lambda x: x.at[jnp.asarray([0, 2])].set(jnp.nan)
  q = jnp.asarray(rng.normal(size=(B, H, T, g, D)), jnp.float32)
  stores = (
      _random_store(rng, L, B, H, C, D, k_bits=2, v_bits=4, k_group=32, v_group=32, lengths=[100, 37],
                    holes=jnp.asarray(rng.random((L, B, H, C)) < 0.8)),
      _random_store(rng, L, B, H, 128, D, k_bits=4, v_bits=1, k_group=64, v_group=32, lengths=[128, 5],
                    holes=jnp.asarray(rng.random((B, H, 128)) < 0.5), channel_scale=True),
  )[:n_stores]
  k_all = poison(jnp.asarray(rng.normal(size=(L, B, H, C, D)), jnp.float32))
  v_all = poison(jnp.asarray(rng.normal(size=(L, B, H, C, D)), jnp.float32))
  stacked_mask = jnp.asarray(rng.random((B, T, C)) < 0.3)
  k_step = jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.float32)
  v_step = jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.float32)
  step_mask = jnp.asarray(rng.random((B, H, T, S)) < 0.5)
  segments = ((k_all, v_all, stacked_mask), (k_step, v_step, step_mask))
  o, lse, mass = decode_attention(q, jnp.int32(1), stores=stores, segments=segments, impl="xla", return_lse=True,
                                  token_mass_rows=(1, 0))
  o_ref, lse_ref, mass_ref = decode_attention_reference(q, jnp.int32(1), stores, segments, return_lse=True,
                                                        token_mass_rows=(1, 0))
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=1e-5, atol=1e-5)
  assert [len(m) for m in mass] == [n_stores, 2]
  for got, want in zip(jax.tree.leaves(mass), jax.tree.leaves(mass_ref)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  # every chosen row's mass sums to g (one probability per query head) over all sources
  np.testing.assert_allclose(sum(np.asarray(m).sum(-1) for m in jax.tree.leaves(mass)), g, rtol=1e-5)


def _store_and_segments_for_mma(rng, dtype, holes=False):
  """Layer 1 of 3 (others NaN) of a KIVI-2/4 store of 512 slots with bf16 scales (the MMA packing takes 16-bit
  ones), q and a per-step segment in ``dtype``. ``holes``: a third of the slots are holes (all of sequence 1's
  second tile) and the values have a channel scale (OTT's and ZipCache's stores)."""
  L, B, H, T, g, D, C, S = 3, 2, 2, 1, 4, 64, 512, 24
  valid = jnp.asarray(rng.random((L, B, H, C)) < 0.67).at[:, 1, :, 64:128].set(False) if holes else None
  store = _random_store(rng, L, B, H, C, D, k_bits=2, v_bits=4, k_group=32, v_group=32, lengths=[300, 200],
                        holes=valid, channel_scale=holes)
  bf16 = lambda x: x.astype(jnp.bfloat16)
  store = dataclasses.replace(store, k_scale=bf16(store.k_scale), k_zero=bf16(store.k_zero),
                              v_scale=bf16(store.v_scale), v_zero=bf16(store.v_zero))
  q = jnp.asarray(rng.normal(size=(B, H, T, g, D)), dtype)
  segment = (jnp.asarray(rng.normal(size=(B, H, S, D)), dtype), jnp.asarray(rng.normal(size=(B, H, S, D)), dtype),
             jnp.asarray(rng.random((B, H, T, S)) < 0.5))
  return q, store, segment


@pytest.mark.parametrize("impl,holes", [("xla", False), ("interpret", False), ("xla", True)])
def test_an_mma_store_reads_as_the_store_it_was_packed_from(impl, holes):
  """An MmaStore beside a segment, through the XLA path (where every impl reads it off a Hopper GPU), against
  the same store in the library's layout: the same keys and values but for the packing's fp16 rounding of its
  folded zero-points (z - M s: within 1% here), one softmax, the same token mass (holes and a value channel scale
  too)."""
  from jkv_kernels.mma_layout import pack_mma_store
  q, store, segment = _store_and_segments_for_mma(np.random.default_rng(21), jnp.float32, holes)
  o, lse = decode_attention(q, jnp.int32(1), stores=(pack_mma_store(store),), segments=(segment,), impl=impl,
                            return_lse=True)
  o_ref, lse_ref = decode_attention(q, jnp.int32(1), stores=(store,), segments=(segment,), impl="xla",
                                    return_lse=True)
  assert np.linalg.norm(np.asarray(o) - np.asarray(o_ref)) / np.linalg.norm(np.asarray(o_ref)) <= 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=1e-2)
  _, mass = decode_attention(q, jnp.int32(1), stores=(pack_mma_store(store),), segments=(segment,), impl=impl,
                            token_mass_rows=(0,))
  _, mass_ref = decode_attention(q, jnp.int32(1), stores=(store,), segments=(segment,), impl="xla",
                                 token_mass_rows=(0,))
  for got, want in zip(jax.tree.leaves(mass), jax.tree.leaves(mass_ref), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-4)
  with pytest.raises(ValueError, match="not both at once"):
    decode_attention(q, jnp.int32(1), stores=(pack_mma_store(store), store), impl="xla", token_mass_rows=(0,))


@pytest.mark.parametrize("impl,packed", [("xla", False), ("xla", True), ("interpret", False)])
def test_without_the_stores_mass_the_segments_mass_and_o_are_unchanged(impl, packed):
  """``store_mass=False`` (ZipCache's probes): no store mass, and the same o and segment mass as with it."""
  from jkv_kernels.mma_layout import pack_mma_store
  q, store, segment = _store_and_segments_for_mma(np.random.default_rng(23), jnp.float32, holes=True)
  call = functools.partial(decode_attention, q, jnp.int32(1), stores=(pack_mma_store(store) if packed else store,),
                           segments=(segment,), impl=impl, token_mass_rows=(0,))
  o, (of_stores, of_segments) = call()
  o_alone, (none, of_segments_alone) = call(store_mass=False)
  assert none == () and len(of_stores) == 1 and np.asarray(of_stores[0]).sum() > 0
  np.testing.assert_allclose(np.asarray(o_alone), np.asarray(o), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(of_segments_alone[0]), np.asarray(of_segments[0]), rtol=1e-6, atol=1e-7)


def _hopper() -> bool:
  from jkv.attention import hopper_kernel_available
  return hopper_kernel_available()


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Mosaic GPU")
@pytest.mark.parametrize("holes, joined", [(False, False), (True, False), (True, True)])
def test_an_mma_store_on_the_hopper_kernel_merges_with_the_segments(holes, joined):
  """impl "pallas" on a Hopper GPU: the tensor-core kernel over the MmaStore and the first segment (2 * 2 * 24
  rows of D: it reads them in place), the Triton kernel over the second (2 * 2 * 5 rows: it does not), merged by
  log-sum-exp, against the plain reference over the library-layout store (bf16: 16-bit rounding); with holes and
  a value channel scale too. The token mass of the query row: the store's and the kernel's segment's from the slot
  weights the kernel writes out, the second's from XLA, each against the merged lse. ``joined``: a third segment
  the kernel reads too (2 * 2 * 8 rows, its mask per head), joined with the first into one it reads, whose mass is
  cut back into theirs (SpeCache's window, fetched rows and own rows)."""
  from jkv_kernels.dequant_attention import decode_attention_reference
  from jkv_kernels.mma_layout import pack_mma_store
  rng = np.random.default_rng(22)
  q, store, segment = _store_and_segments_for_mma(rng, jnp.bfloat16, holes)
  short = (segment[0][:, :, :5] * 2, segment[1][:, :, 3:8], jnp.asarray(rng.random((2, 2, 1, 5)) < 0.5))
  segments = (segment, short)
  if joined:
    segments += ((segment[1][:, :, 8:16], segment[0][:, :, :8] * 0.5, jnp.asarray(rng.random((2, 2, 1, 8)) < 0.7)),)
  o, lse, mass = decode_attention(q, jnp.int32(1), stores=(pack_mma_store(store),), segments=segments,
                                  impl="pallas", return_lse=True, token_mass_rows=(0,))
  o_ref, lse_ref, mass_ref = decode_attention_reference(q, jnp.int32(1), (store,), segments,
                                                        return_lse=True, token_mass_rows=(0,))
  o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
  assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=0.05)
  assert [len(m) for m in mass] == [1, len(segments)]
  for got, want in zip(jax.tree.leaves(mass), jax.tree.leaves(mass_ref), strict=True):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() + 1e-4
  o_alone, (none, of_segments) = decode_attention(q, jnp.int32(1), stores=(pack_mma_store(store),),
                                                  segments=segments, impl="pallas", token_mass_rows=(0,),
                                                  store_mass=False)  # the kernel writes no logits
  assert none == ()
  np.testing.assert_allclose(np.asarray(o_alone, np.float64), o, rtol=1e-6, atol=1e-6)
  # fp16 p in the kernel's segment (the joined one's segments all come from it), XLA's float32 for the rest
  rtols = (2.0**-10, 1e-5) + ((2.0**-10,) if joined else ())
  for got, want, rtol in zip(of_segments, mass[1], rtols, strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6)


def test_readable_segments_join_into_one_and_their_parts_are_named():
  """``attention._joined_segments``: the segments the Hopper kernel reads (16-bit, rows a multiple of 8) become
  one, their keys and values at the layer concatenated and their masks per head, followed by the others; parts
  names each original segment's place, so a mass over the joined one cuts back into theirs."""
  rng = np.random.default_rng(5)
  L, B, H, T = 3, 2, 2, 2
  bf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  window = (bf(L, B, H, 12, 64), bf(L, B, H, 12, 64), jnp.asarray(rng.random((B, H, T, 12)) < 0.5))
  odd = (bf(B, H, 3, 64), bf(B, H, 3, 64), jnp.asarray(rng.random((B, T, 3)) < 0.5))  # 12 rows of D: not read
  fetched = (bf(B, H, 4, 64), bf(B, H, 4, 64), jnp.asarray(rng.random((B, T, 4)) < 0.5))  # mask shared by heads
  segments, parts = attention._joined_segments(jnp.int32(2), (window, odd, fetched))
  assert parts == (((0, 0, 12), (2, 12, 4)), ((1, 0, 3),))
  (k, v, mask), rest = segments[0], segments[1:]
  np.testing.assert_array_equal(np.asarray(k, np.float32), np.concatenate(
      [np.asarray(window[0][2], np.float32), np.asarray(fetched[0], np.float32)], axis=2))
  np.testing.assert_array_equal(np.asarray(v, np.float32), np.concatenate(
      [np.asarray(window[1][2], np.float32), np.asarray(fetched[1], np.float32)], axis=2))
  np.testing.assert_array_equal(np.asarray(mask), np.concatenate(
      [np.asarray(window[2]), np.broadcast_to(np.asarray(fetched[2])[:, None], (B, H, T, 4))], axis=-1))
  assert len(rest) == 1 and rest[0] is odd
  alone, alone_parts = attention._joined_segments(jnp.int32(0), (window, odd))  # one readable: nothing joined
  assert alone == (window, odd) and alone_parts == (((0, 0, 12),), ((1, 0, 3),))


def test_reference_store_holes_and_channel_scale_by_brute_force():
  """The reference's reading of a store with holes and a value channel scale, against attention over the
  explicitly dequantized K/V of the slots that are not holes (numpy, float64)."""
  from jkv_kernels.dequant_attention import decode_attention_reference
  from jkv_kernels.quantization import dequantize, unpack
  rng = np.random.default_rng(11)
  L, B, H, T, g, D, C = 3, 2, 2, 1, 2, 32, 64
  holes = jnp.asarray(rng.random((L, B, H, C)) < 0.7)
  store = _random_store(rng, L, B, H, C, D, k_bits=2, v_bits=2, k_group=16, v_group=32, lengths=[64, 20],
                        holes=holes, channel_scale=True)
  q = jnp.asarray(rng.normal(size=(B, H, T, g, D)), jnp.float32)
  o = np.asarray(decode_attention_reference(q, jnp.int32(1), (store,)), np.float64)
  k = np.asarray(dequantize(unpack(store.k_codes[1], bits=2, axis=3), store.k_scale[1], store.k_zero[1], axis=3,
                            group_size=16, dtype=jnp.float32), np.float64).swapaxes(2, 3)
  v = np.asarray(dequantize(unpack(store.v_codes[1], bits=2, axis=3), store.v_scale[1], store.v_zero[1], axis=3,
                            group_size=32, dtype=jnp.float32), np.float64)
  v = v * np.asarray(store.v_channel_scale[1], np.float64)[:, :, None, :]
  for b in range(B):
    for h in range(H):
      keep = [c for c in range(int(store.length[b])) if holes[1, b, h, c]]
      logits = np.asarray(q[b, h, 0], np.float64) @ k[b, h, keep].T / np.sqrt(D)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      np.testing.assert_allclose(o[b, h, 0], (p / p.sum(-1, keepdims=True)) @ v[b, h, keep], rtol=1e-5, atol=1e-5)
