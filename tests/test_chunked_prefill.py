"""Chunked prefill: the chunk's attention (jkv.chunk_attention) against the one reference, each method's held rows
against its own decode-path attention, chunks stored against the same rows stored whole, the prefill plan, and
generate chunked against whole where the method holds a prompt exactly."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import generate as gen
from jkv import memory
from jkv import prefill as prefill_lib
from jkv.attention import decode_attention, prompt_attention, prompt_mask
from jkv.cache import CacheSpec, KVCache, StepContext
from jkv.chunk_attention import HeldRows, chunk_attention, held_attention, held_steps
from jkv.config import ModelConfig
from jkv.methods import make_method
from jkv_kernels.attention_reference import MASK_VALUE, gqa_attention_reference
from conftest import has_pallas_gpu, random_prompts


def _normal(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.normal(size=shape), dtype)


def _chunk_reference(q, k, v, positions, held):
  """Attention over [held rows; the chunk] with one mask: held rows [0, count), chunk rows causally among the real
  ones; the fp32 reference."""
  B, H, T, g, D = q.shape
  S = held.k.shape[2]
  keys = jnp.concatenate([held.k, k], axis=2)
  values = jnp.concatenate([held.v, v], axis=2)
  past = jnp.broadcast_to((jnp.arange(S)[None] < held.count[:, None])[:, None, :], (B, T, S))
  own = (jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]) & (positions >= 0)[:, None, :]
  return gqa_attention_reference(q, keys, values, jnp.concatenate([past, own], axis=2))


def _chunk_case(rng, B, H, T, g, D, S, dtype):
  q = _normal(rng, (B, H, T, g, D), dtype)
  k, v = _normal(rng, (B, H, T, D), dtype), _normal(rng, (B, H, T, D), dtype)
  held = HeldRows(_normal(rng, (B, H, S, D), dtype), _normal(rng, (B, H, S, D), dtype),
                  jnp.asarray(rng.integers(1, S + 1, B), jnp.int32))
  real = jnp.asarray(rng.integers(1, T + 1, B), jnp.int32)  # ragged: the last chunk of a shorter prompt
  positions = jnp.where(jnp.arange(T)[None] < real[:, None], held.count[:, None] + jnp.arange(T)[None], -1)
  return q, k, v, positions, held


def _real_rows(x, positions):
  """x [B, H, T, ...] with the rows past each prompt's end zeroed (their output is unspecified)."""
  return jnp.where((positions >= 0)[:, None, :, None, None], x.astype(jnp.float32), 0.0)


@pytest.mark.parametrize("B, H, T, g, D, S, dtype, tol", [
    (1, 2, 16, 1, 64, 64, jnp.float32, 1e-5),
    (2, 2, 48, 4, 64, 96, jnp.float32, 1e-5),
    (2, 1, 32, 3, 128, 200, jnp.bfloat16, 2e-2),
])
def test_chunk_attention_equals_the_reference(B, H, T, g, D, S, dtype, tol):
  """The XLA path's two online softmaxes (held rows, then the chunk causally) merged, against one masked softmax over
  both, on fresh random inputs with ragged held counts and chunk ends."""
  rng = np.random.default_rng(B * 100 + T)
  q, k, v, positions, held = _chunk_case(rng, B, H, T, g, D, S, dtype)
  out = jax.jit(chunk_attention, static_argnames=("impl", "block"))(q, k, v, positions, held, impl="xla", block=32)
  ref = _chunk_reference(q, k, v, positions, held)
  assert out.dtype == dtype and out.shape == q.shape
  a, b = _real_rows(out, positions), _real_rows(ref, positions)
  assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < tol


def _softmax_attend(q, k, v, causal=False, kv_lengths=None):
  """A flash-attention call's contract in plain jnp: q [B, N, T, D] over k, v [B, K, S, D], keys [0, kv_lengths)
  (all without), -> (o [B, N, T, D], lse [B, N, T])."""
  assert not causal
  B, N, T, D = q.shape
  K, S = k.shape[1], k.shape[2]
  exact = jax.lax.Precision.HIGHEST  # (a GPU's fp32 products are TF32 by default)
  logits = jnp.einsum("bkgtd,bksd->bkgts", q.reshape(B, K, N // K, T, D), k, precision=exact) * D**-0.5
  if kv_lengths is not None:
    logits = jnp.where(jnp.arange(S) < kv_lengths[:, None, None, None, None], logits, -jnp.inf)
  o = jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(logits, axis=-1), v, precision=exact)
  return o.reshape(B, N, T, D), jax.nn.logsumexp(logits, axis=-1).reshape(B, N, T)


@pytest.mark.parametrize("counts", [(1000, 1000), (0, 7), (128, 903), (256, 256), (640, 999)])
def test_held_attention_splits_into_an_unmasked_bulk_and_the_rest_exactly(counts):
  """The held rows read as a bulk of whole steps with no mask plus the rest by key lengths (each branch of the
  switch: none held, a ragged batch, whole steps, all rows) equal one masked softmax over every held row; a
  sequence that holds nothing gets o = 0 and lse = MASK_VALUE."""
  B, N, K, T, S, D = 2, 4, 2, 8, 1000, 32
  step, n = held_steps(S)
  assert (step, n) == (128, 7)
  rng = np.random.default_rng(sum(counts))
  q = _normal(rng, (B, N, T, D))
  held = HeldRows(_normal(rng, (B, K, S, D)), _normal(rng, (B, K, S, D)), jnp.asarray(counts, jnp.int32))
  o, lse = jax.jit(held_attention, static_argnums=2)(q, held, _softmax_attend)
  ref_o, ref_lse = _softmax_attend(q, held.k, held.v, kv_lengths=held.count)
  for b, count in enumerate(counts):
    if count:
      np.testing.assert_allclose(o[b], ref_o[b], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(lse[b], ref_lse[b], rtol=1e-5)
    else:
      assert float(jnp.max(jnp.abs(o[b]))) == 0 and bool(jnp.all(lse[b] == MASK_VALUE))


# ------------------------------------------------------------------------------------------------- methods

B, H, G, D, L = 2, 2, 2, 64, 2
METHODS = [
    ("kivi", dict(mma=True)), ("kivi", dict(mma=True, quantize_before_attend=True)),
    ("kivi", dict(bits=4, residual=64, mma=False)), ("ott", dict(no_pool_layers=0, prefill_selection="sequential")),
    ("ott", dict(no_pool_layers=1, mma=True)), ("zipcache", {}), ("zipcache", dict(mma=True)),
    ("specache", dict(mma=True, exact_chunks=False)), ("dense", {}), ("fakequant", {}),
]


def _store(method, spec, layer, q, k, v, lengths, chunks):
  """The rows stored by one prefill of the first ``chunks[0]`` tokens, then ``store_chunk`` per later chunk, at
  ``layer`` of a fresh state; ``lengths`` [B] are the prompts' lengths."""
  T = k.shape[2]
  pos = jnp.where(jnp.arange(T)[None] < lengths[:, None], jnp.arange(T)[None], -1)
  state, start = method.init(spec), 0
  for i, size in enumerate(chunks):
    part = lambda x: x[:, :, start:start + size]
    held = jnp.clip(lengths, 0, start)
    ctx = StepContext(lengths=jnp.minimum(lengths, size) if i == 0 else held, positions=pos[:, start:start + size],
                      impl="xla")
    store = jax.jit(method.prefill if i == 0 else method.store_chunk, static_argnums=1)
    state = store(state, layer, part(q), part(k), part(v), ctx)
    start += size
  return state


def _held_rows(method, state, layer, lengths):
  # Each method call here runs as one jitted program: run eagerly, every jnp op inside compiles on its own (about
  # 40 ms each on a CPU, over a thousand per test).
  return jax.jit(method.held_rows, static_argnums=1)(state, layer, lengths)


def _method_case(name, options, capacity: int, chunks: int, about: int, seed: int):
  """The method as it runs on the XLA path, its cache spec, a chunk of about ``about`` tokens in whole blocks, and
  fresh random q, k, v of ``chunks`` such chunks."""
  method = make_method(name, **options)
  spec = CacheSpec(L, B, capacity, H, D, G, jnp.float32)
  method = method.for_impl(spec, "xla")
  chunk = method.chunk_multiple() * max(1, about // method.chunk_multiple())
  rng, T = np.random.default_rng(seed), chunks * chunk
  return method, spec, chunk, (_normal(rng, (B, H, T, G, D)), _normal(rng, (B, H, T, D)), _normal(rng, (B, H, T, D)))


@pytest.mark.parametrize("name, options", METHODS)
def test_held_rows_are_what_the_methods_decode_attention_reads(name, options):
  """Attention over a method's held rows (every held token once, as 16-bit rows) equals the method's own attention
  over its state (stores, holes, pools, windows, through ``decode_attention``) for query rows that see every held
  token: after a prefill and a chunk, ragged (the second sequence's prompt ends inside the first chunk)."""
  method, spec, chunk, (q, k, v) = _method_case(name, options, capacity=768, chunks=2, about=256, seed=7)
  T = 2 * chunk
  lengths = jnp.asarray([T - 3, chunk - 37], jnp.int32)
  layer = 1
  state = _store(method, spec, layer, q, k, v, lengths, [chunk, chunk])
  held = _held_rows(method, state, layer, lengths)
  assert held.k.dtype == spec.dtype and np.array_equal(np.asarray(held.count), np.asarray(lengths))
  probe = _normal(np.random.default_rng(8), (B, H, 3, G, D))
  S = held.k.shape[2]
  mask = jnp.broadcast_to((jnp.arange(S)[None] < held.count[:, None])[:, None, :], (B, 3, S))
  got = gqa_attention_reference(probe, held.k, held.v, mask)
  want = jax.jit(_decode_path, static_argnums=(0, 2))(method, state, layer, probe, lengths)
  assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5


def _decode_path(method, state, layer, q, n):
  """The method's attention, by its decode path, of query rows at position n - 1 (they see exactly the held
  tokens) over a state holding n tokens."""
  positions = jnp.broadcast_to((n - 1)[:, None], q.shape[:1] + q.shape[2:3])
  if method.name == "kivi":  # its step reads the store and rings at bV(n + 1); the slot of n is masked
    return method._attend(state, layer, q, positions, n + 1, "xla")
  if method.name == "specache":
    return method.low_bit._attend(state.low, layer, q, positions, n + 1, "xla")
  if method.name == "ott":
    return method._attend(state, layer, q, positions, n, "xla")
  if method.name == "zipcache":
    window = jnp.arange(state.k_window.shape[3])[None] < state.window_len[layer][:, None]
    return decode_attention(q, layer, stores=method._stores(state, layer),
                            segments=((state.k_window, state.v_window, window[:, None, :]),), impl="xla")
  k, v = state.k[layer], state.v[layer]
  if method.name == "fakequant":
    k, v = method._fake(k, method.key_axis, n), method._fake(v, method.value_axis, n)
  mask = jnp.broadcast_to((jnp.arange(k.shape[2])[None] < n[:, None])[:, None, :], (q.shape[0], q.shape[2],
                                                                                      k.shape[2]))
  return gqa_attention_reference(q, k, v, mask)


@pytest.mark.parametrize("name, options", [
    ("kivi", dict(mma=False)), ("kivi", dict(mma=True)), ("kivi", dict(quantize_before_attend=True)),
    ("ott", dict(no_pool_layers=0, prefill_selection="sequential")),
    ("ott", dict(no_pool_layers=0, prefill_selection="sequential", mma=True, group_size=32, residual=64)),
    ("specache", dict(exact_chunks=False)), ("dense", {}), ("fakequant", {}), ("zipcache", dict(salient_ratio=1.0)),
])
def test_rows_stored_in_chunks_hold_what_they_hold_stored_whole(name, options):
  """The same K/V stored by one prefill, or by a prefill and chunks, leave the same held rows, in a batch where one
  prompt ends inside the second chunk and another inside the first (whose state the later chunks leave alone):
  KIVI's state is a function of the length; OTT's block events with sequential selection are the same events;
  SpeCache's host copy gets every row; ZipCache with every token salient splits nothing (its channel scale is the
  first chunk's, so its keys are compared)."""
  method, spec, chunk, (q, k, v) = _method_case(name, options, capacity=1024, chunks=3, about=192, seed=3)
  T = 3 * chunk
  lengths = jnp.asarray([T - 5, chunk - 11], jnp.int32)
  layer = 1
  whole = _held_rows(method, _store(method, spec, layer, q, k, v, lengths, [T]), layer, lengths)
  chunked_state = _store(method, spec, layer, q, k, v, lengths, [chunk] * 3)
  chunked = _held_rows(method, chunked_state, layer, lengths)
  compared = (0,) if name == "zipcache" else (0, 1)
  for i in compared:
    for b in range(B):
      n = int(lengths[b])
      np.testing.assert_array_equal(np.asarray(chunked[i][b, :, :n]), np.asarray(whole[i][b, :, :n]))
  if name == "specache":
    host = np.asarray(chunked_state.host_kv[layer])
    for b in range(B):
      n = int(lengths[b])
      np.testing.assert_array_equal(host[b, :, :n], np.concatenate([k, v], axis=-1)[b, :, :n])


@pytest.mark.parametrize("name, options", [("dense", {}), ("specache", dict(exact_chunks=True))])
def test_a_method_that_stores_a_chunk_first_keeps_its_held_rows(name, options):
  """A method whose ``extend`` stores the chunk before reading its held rows (``store_spares_held_rows``) gives the
  same held rows for the tokens held before the chunk either way. The others must not claim it: their stores
  rewrite rings, windows or pools that their held rows read."""
  others = [make_method(n, **o) for n, o in METHODS if n != "dense"]  # SpeCache's with low-bit chunks
  assert not [m for m in others if m.store_spares_held_rows()]
  method, spec, chunk, (q, k, v) = _method_case(name, options, capacity=1024, chunks=2, about=192, seed=5)
  lengths = jnp.asarray([chunk, chunk - 13], jnp.int32)
  layer = 1
  state = _store(method, spec, layer, q, k, v, lengths, [chunk])
  part = lambda x: x[:, :, chunk:]
  ctx = StepContext(lengths=lengths, positions=lengths[:, None] + jnp.arange(chunk)[None], impl="xla")
  before = method.held_rows(state, layer, lengths)
  after = method.held_rows(method.store_chunk(state, layer, part(q), part(k), part(v), ctx), layer, lengths)
  assert method.store_spares_held_rows()
  for i in (0, 1):
    for b in range(B):
      n = int(lengths[b])
      np.testing.assert_array_equal(np.asarray(after[i][b, :, :n]), np.asarray(before[i][b, :, :n]))


@pytest.mark.parametrize("name, options", [("dense", {}), ("specache", dict(exact_chunks=True))])
def test_a_compiled_chunk_copies_no_whole_cache_array(name, options):
  """Two layers of ``extend``, the second's rows made from the first's output as in the model: the compiled program
  holds no copy the size of a whole stacked cache array (read first, XLA copied each such array every layer to keep
  the read's operand from the store's in-place write; SpeCache's exact copy lives in host memory)."""
  method, spec, chunk, (q, k, v) = _method_case(name, options, capacity=1024, chunks=1, about=192, seed=6)
  state = method.init(spec)  # allocated: SpeCache's exact copy in host memory
  lengths = jnp.asarray([chunk, chunk - 13], jnp.int32)

  def two_layers(state, q, k, v, lengths):
    ctx = StepContext(lengths=lengths, positions=lengths[:, None] + jnp.arange(chunk)[None], impl="xla")
    for layer in range(2):
      o, state = method.extend(state, layer, q, k, v, ctx)
      q, k, v = q + o, k + o[:, :, :, 0], v + o[:, :, :, -1]
    return q, state

  text = jax.jit(two_layers, donate_argnums=0).lower(state, q, k, v, lengths).compile().as_text()
  whole = {tuple(x.shape) for x in jax.tree.leaves(state) if x.shape[:1] == (L,) and x.size >= spec.capacity * D}
  copies = [tuple(int(d) for d in m.group(1).split(",")) for m in re.finditer(r"\w+\[([\d,]+)\]\S* copy\(", text)]
  assert whole and not [c for c in copies if c in whole], copies


# ------------------------------------------------------------------------------------------------- the plan


def test_the_plan_takes_whole_prompts_where_they_fit_and_chunks_where_none_does(tiny_llama):
  _, m = tiny_llama
  cfg, kivi = m.config, make_method("kivi", residual=64)
  whole = prefill_lib.plan(cfg, kivi, [300, 20], 1024, prefill_tokens=10_000)
  assert (whole.rows, whole.chunk, whole.width, whole.capacity) == (2, 512, 512, 1024) and not whole.chunked
  sub = prefill_lib.plan(cfg, kivi, [300, 20], 1024, prefill_tokens=600)
  assert (sub.rows, sub.chunk) == (1, 512) and not sub.chunked
  chunked = prefill_lib.plan(cfg, kivi, [1500, 20], 2048, prefill_tokens=1200)
  # 600 a sequence: three chunks, as even as whole residuals let them be; room for a residual past the last one
  assert chunked.chunked and chunked.rows == 2 and chunked.chunk == 512 and chunked.calls() == 3
  assert chunked.width == 1536 and chunked.capacity == 2048
  grown = prefill_lib.plan(cfg, kivi, [1500, 20], 1536, prefill_tokens=1200)
  assert grown.capacity == 1600
  tiny = prefill_lib.plan(cfg, kivi, [1500, 20], 2048, prefill_tokens=1)
  assert tiny.chunk == memory.MIN_CHUNK  # not chunks of a token
  asked = prefill_lib.plan(cfg, kivi, [300, 20], 1024, chunk=100)  # rounded up to the residual
  assert asked.chunk == 128 and asked.chunked and asked.calls() == 3
  one = prefill_lib.plan(cfg, kivi, [300, 20], 1024, chunk=4096)  # one chunk holds the prompt: whole
  assert not one.chunked and one.rows == 2
  with pytest.raises(ValueError, match="prefill chunk must be >= 1"):
    prefill_lib.plan(cfg, kivi, [300], 1024, chunk=0)
  assert make_method("zipcache").chunk_multiple() == 160  # ceil(0.6 C) and C in whole key groups of 32
  with pytest.raises(ValueError, match="splits no chunk"):
    make_method("zipcache", salient_ratio=0.1234567).chunk_multiple()


def test_the_default_plan_chunks_when_not_one_prompt_fits_the_free_memory(tiny_llama, monkeypatch):
  """With the device's memory known and too small for one prompt's activations beside the cache, the default plan
  chunks the whole batch, in chunks that fit half the free memory beside the chunk's held rows."""
  _, m = tiny_llama
  cfg, method = m.config, make_method("kivi", residual=64)
  per_token = memory.prefill_bytes_per_token(cfg)
  cache = memory.cache_bytes(method, cfg, 2, 2048)
  held = memory.held_rows_bytes(cfg, 2, 2048)
  monkeypatch.setattr(memory, "RESERVE_BYTES", 0)
  monkeypatch.setattr(memory, "device_memory", lambda device=None: dict(
      limit=cache + held + 2 * 700 * per_token + (1 << 30), in_use=1 << 30, peak=1 << 30))
  plan = prefill_lib.plan(cfg, method, [1500, 900], 2048)
  assert plan.chunked and plan.rows == 2 and plan.chunk == 320  # 350 tokens a sequence, in whole residuals
  assert plan.capacity >= plan.width + method.chunk_multiple()


def test_a_prompt_whose_buckets_cache_does_not_fit_is_held_at_its_own_length(tiny_llama, monkeypatch):
  """A new prompt's capacity is its power-of-two bucket where that fits; where only its own length does (the longest
  context ``jkv info`` reports, 429,967 tokens of dense on an H100, was refused for its 524,288 bucket), generate
  holds it at its own length, prefills it in chunks and gives the tokens the unconstrained run gives."""
  _, m = tiny_llama
  cfg, method = m.config, make_method("dense")
  prompts = random_prompts(cfg.vocab_size, [700], seed=11)
  free = gen.generate(m.params, cfg, prompts, method=method, max_new_tokens=6, eos_ids=())
  bucketed = gen.plan_capacity(cfg, method, [700], 6, 6)
  tight = prefill_lib.round_up(706, method.capacity_multiple())
  assert bucketed >= 1024 and free.stats["capacity"] == bucketed
  cache = lambda capacity: memory.cache_bytes(method, cfg, 1, capacity, max_decode=6)
  monkeypatch.setattr(memory, "RESERVE_BYTES", 0)
  # Room for the cache at its own length and 64 tokens more (a chunked plan's last chunk may grow it a little).
  monkeypatch.setattr(memory, "device_memory", lambda device=None: dict(
      limit=(1 << 30) + cache(tight + 64), in_use=1 << 30, peak=1 << 30))
  assert not memory.cache_fits(cfg, method, 1, bucketed, max_decode=6)
  held = gen.generate(m.params, cfg, prompts, method=method, max_new_tokens=6, eos_ids=())
  assert tight <= held.stats["capacity"] <= tight + 64 and held.stats["prefill_calls"] > 1
  assert held.tokens == free.tokens


def test_longest_context_is_the_last_capacity_that_fits():
  """The longest single sequence on an 80 GiB device at the Llama-3-8B shape: its cache, a chunk's held rows, the
  reserve and the activations of chunks of ``LONG_PROMPT_CHUNK`` tokens fit beside the weights, and one more chunk
  multiple does not; KIVI-2's is several times dense's (its cache is about 5x smaller)."""
  cfg = ModelConfig(architecture="llama", vocab_size=128256, embed=4096, ffw_size=14336, num_layers=32, q_heads=32,
                    kv_heads=8, head_dim=128, max_position=8192, dtype="bfloat16")
  device, weights = 80 << 30, 15 << 30
  found = {}
  for name, options in (("dense", {}), ("kivi", dict(bits=2, mma=True)), ("zipcache", {})):
    method = make_method(name, **options)
    n = memory.longest_context(cfg, method, device_bytes=device, weight_bytes=weights)
    # The cache of a prompt (nothing decoded after it), or of any mix of prompt and decoded tokens.
    need = lambda t, decode=0: (memory.cache_bytes(method, cfg, 1, t, max_decode=decode)
                                + memory.held_rows_bytes(cfg, 1, t) + memory.RESERVE_BYTES
                                + 2 * memory.LONG_PROMPT_CHUNK * memory.prefill_bytes_per_token(cfg) + weights)
    step = method.chunk_multiple()
    assert n % step == 0 and need(n) <= device < need(n + step)
    found[name] = n
  assert found["dense"] > 400_000 and found["kivi"] > 4 * found["dense"]
  # ZipCache's decoded windows take whole key groups in each pool (twice a prompt's rows): pools sized for a prompt
  # hold about twice as long a one as pools sized for any mix of prompt and decoded tokens.
  any_mix = memory._largest(lambda m: need(m * step, None) <= device, n // step) * step
  assert 1.7 < found["zipcache"] / any_mix < 2.1


@pytest.mark.parametrize("method_name, settings", [("dense", {}), ("kivi", dict(bits=2, mma=True))])
def test_the_longest_prompt_is_planned_in_long_chunks(method_name, settings, monkeypatch):
  """A prompt of the longest context, on an H100's memory at 95% (75.22 GiB, 14.96 GiB of Llama-3-8B weights in
  use), is prefilled in chunks of about ``LONG_PROMPT_CHUNK`` tokens at its own length, not in ``MIN_CHUNK``s (dense:
  1,680 calls of 256 tokens; KIVI-2 in its 2^21-token bucket, 256 too) or in a bucket that leaves less room."""
  cfg = ModelConfig(architecture="llama", vocab_size=128256, embed=4096, ffw_size=14336, num_layers=32, q_heads=32,
                    kv_heads=8, head_dim=128, max_position=1 << 27, dtype="bfloat16")
  limit, weights = int(75.22 * (1 << 30)), int(14.96 * (1 << 30))
  monkeypatch.setattr(memory, "device_memory", lambda device=None: dict(limit=limit, in_use=weights, peak=weights))
  method = make_method(method_name, **settings)
  n = memory.longest_context(cfg, method, device_bytes=limit, weight_bytes=weights)
  prefill = gen.plan_generation(cfg, method, [[2] * n], max_new_tokens=16, chunk=16).prefill
  assert prefill.chunked and 0.9 * memory.LONG_PROMPT_CHUNK <= prefill.chunk <= memory.LONG_PROMPT_CHUNK
  assert prefill.capacity < prefill_lib.bucket(n) and prefill.capacity - n < 2 * prefill.chunk


# ------------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("name, options", [("dense", {}), ("specache", dict(exact_chunks=True))])
def test_generate_chunked_equals_whole_where_the_cache_is_exact(tiny_llama, name, options):
  """Dense holds every token exactly, and SpeCache's chunks with ``exact_chunks`` attend its exact host copy, so a
  chunked prefill gives the same tokens as a whole one, on a ragged batch whose shorter prompt ends in the first
  chunk (the later chunks leave its cache alone)."""
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [300, 70], seed=4)
  method = make_method(name, **options)
  whole = gen.generate(m.params, m.config, prompts, method=method, max_new_tokens=6, eos_ids=())
  chunked = gen.generate(m.params, m.config, prompts, method=method, max_new_tokens=6, eos_ids=(), prefill_chunk=128)
  assert chunked.stats["prefill_chunk"] == 128 and chunked.stats["prefill_calls"] == 3
  assert whole.stats["prefill_chunk"] is None and whole.stats["prefill_calls"] == 1
  assert chunked.tokens == whole.tokens


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestChunkAttentionGpu:
  """cuDNN's calls compiled on the GPU against the fp32 reference: a chunk's (held rows in a bulk and the rest,
  then itself, merged by their log-sum-exps) and a whole prompt's, none of whose own calls take lengths."""

  @pytest.mark.parametrize("B, H, T, g, D, S, dtype", [
      (1, 8, 512, 4, 128, 4096, jnp.bfloat16), (2, 2, 300, 3, 64, 1000, jnp.float16),
      (2, 8, 1024, 4, 128, 2048, jnp.bfloat16)])
  def test_cudnn_equals_the_reference(self, B, H, T, g, D, S, dtype):
    rng = np.random.default_rng(S + T)
    q, k, v, positions, held = _chunk_case(rng, B, H, T, g, D, S, dtype)
    out = jax.jit(chunk_attention, static_argnames=("impl",))(q, k, v, positions, held, impl="pallas")
    ref = _chunk_reference(q, k, v, positions, held)
    a, b = _real_rows(out, positions), _real_rows(ref, positions)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2

  @pytest.mark.parametrize("counts", [(4096, 4096), (1024, 3001), (0, 511)])
  def test_cudnn_held_rows_in_a_bulk_and_the_rest(self, counts):
    """Held counts at whole steps, ragged, and none: every branch of ``held_attention`` on cuDNN."""
    rng = np.random.default_rng(sum(counts))
    q, k, v, positions, held = _chunk_case(rng, 2, 8, 512, 4, 128, 4096, jnp.bfloat16)
    held = held._replace(count=jnp.asarray(counts, jnp.int32))
    positions = jnp.where(positions >= 0, held.count[:, None] + jnp.arange(512)[None], -1)
    out = jax.jit(chunk_attention, static_argnames=("impl",))(q, k, v, positions, held, impl="pallas")
    ref = _chunk_reference(q, k, v, positions, held)
    a, b = _real_rows(out, positions), _real_rows(ref, positions)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2

  def test_prompt_attention_equals_the_reference(self):
    """A whole batch of right-padded prompts of ragged lengths: cuDNN's causal call without lengths gives every
    real row the fp32 reference's output."""
    rng = np.random.default_rng(7)
    B, H, T, g, D = 3, 8, 700, 4, 128
    q, k, v = _normal(rng, (B, H, T, g, D), jnp.bfloat16), *(_normal(rng, (B, H, T, D), jnp.bfloat16) for _ in "kv")
    lengths = jnp.asarray([700, 333, 1], jnp.int32)
    positions = jnp.where(jnp.arange(T)[None] < lengths[:, None], jnp.arange(T)[None], -1)
    out = jax.jit(prompt_attention, static_argnames=("flash",))(q, k, v, positions, flash=True)
    ref = gqa_attention_reference(q, k, v, prompt_mask(positions))
    a, b = _real_rows(out, positions), _real_rows(ref, positions)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2

  def test_generate_chunked_equals_whole_for_dense(self, tiny_llama):
    """On the GPU (the cuDNN path in bf16) a dense chunked prefill's first-token logits match the whole prompt's
    within bf16 rounding."""
    _, m = tiny_llama
    cfg = dataclasses.replace(m.config, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), m.params)
    prompts = random_prompts(cfg.vocab_size, [1000, 300], seed=5)
    logits = []
    for chunk in (None, 256):
      plan = prefill_lib.plan(cfg, make_method("dense"), [len(p) for p in prompts], 2048, chunk=chunk,
                              prefill_tokens=1 << 16)
      cache = KVCache.create(make_method("dense"), CacheSpec.for_model(cfg, 2, plan.capacity), "pallas")
      tokens = prefill_lib.pad_prompts(prompts, plan.width, 0)
      logits.append(np.asarray(prefill_lib.Prefill(plan, cfg, tokens, [1000, 300])(params, cache)[0]))
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[1] - logits[0]).max() < 0.05 * scale
