"""KIVI: streaming equals the position-mask oracle (docs/methods/kivi.md), exactness limits, batching, memory, model.

The oracle below is written from that page, independently of the method: quantize K[0:bK] per channel
and all of V per token in one shot, keep the rest exact, one softmax.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import generate as gen
from jkv.cache import CacheSpec, KVCache, StepContext
from jkv.methods import make_method
from jkv.methods.kivi import Kivi
from jkv_kernels.attention_reference import gqa_attention_reference
from jkv_kernels.mma_layout import pack_key_tiles
from jkv_kernels.quantization import dequantize, pack, quantize

H, G_Q, D = 2, 3, 64  # KV heads, query heads per KV head, head dim


def _spec(batch, capacity, dtype=jnp.float32):
  return CacheSpec(num_layers=2, batch=batch, capacity=capacity, kv_heads=H, head_dim=D, q_per_kv=G_Q, dtype=dtype)


def _prefill(method, state, layer, k, v, lengths, impl="xla"):
  """Prefill a right-padded prompt k, v [B, H, T, D] with ``lengths`` valid tokens per sequence, jitted as the model
  runs it (one compile per method and shape, where op-by-op dispatch compiled a hundred small programs)."""
  T = k.shape[2]
  positions = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T)[None], -1)
  return _prefill_jit(method, layer, impl, state, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32),
                      jnp.asarray(positions, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _prefill_jit(method, layer, impl, state, k, v, lengths, positions):
  return method.prefill(state, layer, None, k, v, StepContext(lengths=lengths, positions=positions, impl=impl))


@functools.lru_cache(maxsize=None)
def _step_fn(method, layer, impl="xla"):
  """A jitted decode step as the model runs it, ``step`` then ``end_step``: (state, q [B, H, T, g, D], k, v
  [B, H, T, D], held [B]) -> (out, state), rows at positions held + [0, T). Cached: cases with equal settings
  share one compile per shape."""
  @jax.jit
  def step(state, q, k, v, held):
    positions = held[:, None] + jnp.arange(k.shape[2])[None]
    ctx = StepContext(lengths=held, positions=positions, impl=impl)
    out, state = method.step(state, layer, q, k, v, ctx)
    return out, method.end_step(state, ctx)
  return lambda state, q, k, v, held: step(state, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                           jnp.asarray(held, jnp.int32))


def _qkv(rng, batch, n):
  k = rng.normal(size=(batch, H, n, D)).astype(np.float32)
  k[:, :, :, 5] *= 12.0  # an outlier channel, as real keys have
  v = rng.normal(size=(batch, H, n, D)).astype(np.float32)
  q = rng.normal(size=(batch, H, n, G_Q, D)).astype(np.float32)
  return q, k, v


@jax.jit
def _oracle_jit(q_row, k, v, n, b_k, b_v, k_bits, v_bits):
  """One-shot form: every group of K (per channel) and V (per token) quantized at once; positions < b_k / b_v
  read dequantized, the rest exact; positions >= n masked. Key groups below b_k (a multiple of G) are the
  same whether quantized now or when they streamed in."""
  def fake(x, axis, bits):
    c, s, z = quantize(x, bits=bits, axis=axis, group_size=32, meta_dtype=jnp.float16)
    return dequantize(c, s, z, axis=axis, group_size=32, dtype=jnp.float32)
  pos = jnp.arange(k.shape[2])[None, None, :, None]
  k_hat = jnp.where(pos < b_k, jax.lax.switch(k_bits // 4, [lambda: fake(k, 2, 2), lambda: fake(k, 2, 4)]), k)
  v_hat = jnp.where(pos < b_v, jax.lax.switch(v_bits // 4, [lambda: fake(v, 3, 2), lambda: fake(v, 3, 4)]), v)
  mask = (jnp.arange(k.shape[2]) < n)[None, None, :]
  return gqa_attention_reference(q_row, k_hat, v_hat, mask)


def _oracle(method, q_rows, k, v, n):
  """Attention of the query rows q_rows [1, H, T, g, D] of a step that ends at length n (row t at position
  n - T + t, seeing the positions up to its own), with the boundaries of docs/methods/kivi.md at n:
  bK = R*floor((n - λ)/R) and bV = max(0, n - λ - R)."""
  lam, R, rows = method.lam, method.residual, q_rows.shape[2]
  b_k = R * ((n - lam) // R)
  b_v = max(0, n - lam - R)
  return jnp.concatenate([
      _oracle_jit(jnp.asarray(q_rows[:, :, t:t + 1]), jnp.asarray(k), jnp.asarray(v), n - rows + 1 + t, b_k, b_v,
                  method.kb, method.vb) for t in range(rows)], axis=2)


@pytest.mark.parametrize("bits, lam_before, prompt_len, mma, rows", [
    (2, False, 1, False, 1), (2, False, 31, False, 1), (2, False, 64, False, 1), (4, False, 65, False, 1),
    (2, False, 133, False, 1), (2, True, 64, False, 1), (4, True, 100, False, 1), (2, True, 1, False, 1),
    (2, False, 31, True, 1), (4, False, 65, True, 1), (2, True, 100, True, 1), (2, False, 64, True, 1),
    (2, False, 62, True, 3),
])
def test_streaming_equals_position_mask_oracle(bits, lam_before, prompt_len, mma, rows):
  """Prefill, then steps of ``rows`` rows across several flushes; every step's attention and the key codes equal
  the oracle. With mma=True the store is the MMA packing (tiles, a value tail, a flush and a value tile's packing
  at the end of the step before): the same oracle holds (to within the packing's rounding of its folded
  zero-points), also where a flush falls inside a step of 3 rows."""
  method = Kivi(bits=bits, group_size=32, residual=64, quantize_before_attend=lam_before, mma=mma)
  steps = 150
  rng = np.random.default_rng(prompt_len + 10 * bits)
  q, k, v = _qkv(rng, 1, 384)  # random past the end too: the oracle must mask it
  state = _prefill(method, method.init(_spec(1, 384)), 1, k[:, :, :prompt_len], v[:, :, :prompt_len], [prompt_len])
  step = _step_fn(method, 1)
  for n in range(prompt_len + rows, prompt_len + steps + 1, rows):
    p = n - rows
    out, state = step(state, q[:, :, p:n], k[:, :, p:n], v[:, :, p:n], [p])
    if rows == 1 and n % 5 and (n - 1) % 64 not in (0, 1, 63):  # every 5th step, and every step around a flush
      continue
    ref = _oracle(method, q[:, :, p:n], k, v, n)
    if mma:  # the packing rounds its folded zero-points (z - M s) to fp16: 2.2% at most here, where the keys'
      # outlier channel has a scale of about 19 (M s dominates z - M s)
      assert np.linalg.norm(np.asarray(out) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref)) <= 3e-2
    else:
      np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
  # The packed key store equals one-shot quantization of every flushed block.
  n = prompt_len + steps
  b_k = int(method.key_boundary(n))
  c, s, z = quantize(jnp.swapaxes(jnp.asarray(k[:, :, :b_k]), 2, 3), bits=bits, axis=3, group_size=32,
                     meta_dtype=jnp.float16)
  if mma:
    words, meta = pack_key_tiles(pack(c, bits=bits, axis=3), s, z, bits=bits)
    np.testing.assert_array_equal(np.asarray(state.k_tiles[1, :, :, :b_k // 64]), np.asarray(words))
    np.testing.assert_array_equal(np.asarray(state.k_meta[1, :, :, :b_k // 32]), np.asarray(meta))
    assert not np.any(np.asarray(state.k_tiles[0]))  # layer 0 was never touched
    return
  np.testing.assert_array_equal(np.asarray(state.k_codes[1, :, :, :, :b_k * bits // 32]),
                                np.asarray(pack(c, bits=bits, axis=3)))
  np.testing.assert_array_equal(np.asarray(state.k_scale[1, :, :, :, :b_k // 32]), np.asarray(s))
  # Layer 0 was never touched.
  assert not np.any(np.asarray(state.k_codes[0]))


def _grid_values(rng, shape):
  """Integers in [0, 255] with 0 and 255 in every group of 32 along both axes: exact at 8 bits either way."""
  x = rng.integers(0, 256, size=shape).astype(np.float32)
  x[..., ::32, :] = 0.0
  x[..., 1::32, :] = 255.0
  x[..., :, ::32] = 0.0
  x[..., :, 1::32] = 255.0
  return x / 64.0  # power-of-two scale keeps the grid exact


@pytest.mark.parametrize("method", [
    Kivi(bits=8, group_size=32, residual=32),
    Kivi(bits=2, group_size=32, residual=512),  # every token stays in the residual
], ids=["8bit-exact-grid", "all-residual"])
def test_exact_cases_equal_dense_attention(method):
  rng = np.random.default_rng(0)
  n = 300
  k, v = _grid_values(rng, (2, H, n, D)), _grid_values(rng, (2, H, n, D))
  q = rng.normal(size=(2, H, 1, G_Q, D)).astype(np.float32)
  lengths = np.array([n - 57, n])
  state = _prefill(method, method.init(_spec(2, 512)), 0, k[:, :, :-1], v[:, :, :-1], lengths - 1)
  # The last token of each sequence arrives as a decode step.
  last = np.stack([k[b, :, lengths[b] - 1] for b in range(2)])[:, :, None]
  last_v = np.stack([v[b, :, lengths[b] - 1] for b in range(2)])[:, :, None]
  out, _ = _step_fn(method, 0)(state, q, last, last_v, lengths - 1)
  mask = jnp.arange(n)[None, None, :] < lengths[:, None, None]
  ref = gqa_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,mma", [("xla", False), ("interpret", False), ("xla", True)])
def test_batch_of_different_lengths_equals_each_alone(impl, mma):
  """Sequences of different lengths step together (each at its own position, crossing flushes and, in the MMA
  packing, value tiles at different steps); every step's output and the stored codes equal each sequence run
  alone."""
  method = Kivi(bits=2, group_size=32, residual=64, mma=mma)
  rng = np.random.default_rng(3)
  lengths = np.array([40, 100, 170])
  q, k, v = _qkv(rng, 3, 256)
  step = _step_fn(method, 0, impl)
  state = _prefill(method, method.init(_spec(3, 256)), 0, k[:, :, :200], v[:, :, :200], lengths, impl)
  alone = [_prefill(method, method.init(_spec(1, 256)), 0, k[b:b + 1, :, :n], v[b:b + 1, :, :n], [n], impl)
           for b, n in enumerate(lengths)]
  for t in range(40 if impl == "xla" else 12):  # crosses a flush for every sequence, each at its own step (xla)
    pos = lengths + t
    row = lambda x: np.stack([x[b, :, pos[b]] for b in range(3)])[:, :, None]
    qq = np.stack([q[b, :, pos[b]] for b in range(3)])[:, :, None]
    out, state = step(state, qq, row(k), row(v), pos)
    for b in range(3):
      ref, alone[b] = step(alone[b], qq[b:b + 1], row(k)[b:b + 1], row(v)[b:b + 1], pos[b:b + 1])
      np.testing.assert_allclose(np.asarray(out[b:b + 1]), np.asarray(ref), rtol=1e-5, atol=1e-5)
  n = lengths + t + 1
  for b in range(3):
    n_k = int(method.key_boundary(n[b]))
    stored = ((state.k_tiles[0, b, :, :n_k // 64], alone[b].k_tiles[0, 0, :, :n_k // 64]) if mma else
              (state.k_codes[0, b, :, :, :n_k // 16], alone[b].k_codes[0, 0, :, :, :n_k // 16]))
    np.testing.assert_array_equal(*map(np.asarray, stored))


def test_planted_outlier_channels_favour_per_channel_keys():
  """KIVI's Table 2 pattern: with a few large fixed channels, per-channel key groups err far less than per-token."""
  rng = np.random.default_rng(0)
  k = rng.normal(size=(4, 256, 128)).astype(np.float32)
  k[:, :, [3, 40, 77]] = rng.normal(20.0, 5.0, size=(4, 256, 3))
  @functools.partial(jax.jit, static_argnums=1)  # one program per grouping rather than its ops one by one
  def rel_err(k, axis):
    c, s, z = quantize(k, bits=2, axis=axis, group_size=32)
    k_hat = dequantize(c, s, z, axis=axis, group_size=32, dtype=jnp.float32)
    return jnp.linalg.norm(k_hat - k) / jnp.linalg.norm(k)
  per_channel, per_token = float(rel_err(jnp.asarray(k), 1)), float(rel_err(jnp.asarray(k), 2))
  assert per_channel < 0.5 * per_token


def test_memory_matches_the_bytes_formula():
  """The formula of docs/methods/kivi.md, 'Bytes', at Llama-2-7B shapes (32 layers, 32 KV heads, D=128, fp16),
  G=32, R=128."""
  spec = CacheSpec(num_layers=32, batch=1, capacity=8192, kv_heads=32, head_dim=128, q_per_kv=1,
                   dtype=jnp.float16)
  mib = 2**20
  fp16 = 2 * 32 * 32 * 128 * 2
  kivi2_, kivi4_ = Kivi(bits=2), Kivi(bits=4)
  kivi2 = lambda spec, n: kivi2_.held_bytes(spec, None, n).device
  kivi4 = lambda spec, n: kivi4_.held_bytes(spec, None, n).device
  # Right after 4096 tokens: rK = 0, rV = 128 -> 410.0 MiB (5.00x) and 662.0 MiB (3.09x), plus the length counter.
  assert kivi2(spec, np.array([4096])) == 410 * mib + 4
  assert kivi4(spec, np.array([4096])) == 662 * mib + 4
  # 127 tokens later both residuals are (nearly) full: the formula's upper bound at this length, 4.70x and 2.99x.
  n = 4096 + 127
  assert kivi2(spec, np.array([n])) / (fp16 * n) == pytest.approx(1 / 4.70, rel=0.01)
  assert kivi4(spec, np.array([n])) / (fp16 * n) == pytest.approx(1 / 2.99, rel=0.01)
  # Long sequences approach the asymptote b/8 + 2*2/G bytes per element: 5.33x and 3.2x.
  big = 1 << 22
  assert fp16 * big / kivi2(spec, np.array([big])) == pytest.approx(16 / 3, rel=1e-3)
  # Batch rows add up.
  assert kivi2(spec, np.array([4096, 4096])) == 2 * (410 * mib + 4)


@pytest.mark.parametrize("options, message", [
    (dict(bits=3), "bits=3 is not supported"),
    (dict(bits=2, residual=100), "residual=100 must be a multiple of group_size=32"),
    (dict(bits=2, group_size=48, residual=96), "does not divide the head dim 64"),
    (dict(bits=2, group_size=8, residual=64), "must be a multiple of 16"),
    (dict(v_bits=1), "v_bits=1 is not supported"),
    (dict(bits=2, residual=32, mma=True), "residual=32 a multiple of 64"),
    (dict(bits=2, residual=64, meta_dtype="float32", mma=True), "16-bit scales"),
])
def test_invalid_settings_are_rejected(options, message):
  with pytest.raises(ValueError, match=message):
    KVCache.create(make_method("kivi", **options), _spec(1, 256))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_mma_packing_equals_the_library_layout_on_a_ragged_batch(impl):
  """KIVI with its store in the MMA packing against the library's layout: a ragged batch (prompts of 40, 129
  and 200 tokens, each crossing value-tile and key-flush boundaries at its own step), two rows per step; every
  output is the same (the same codes and scales, read by another path) but for the packing's fp16 rounding of
  its folded zero-points (z - M s): within 2% (the keys' outlier channel has a scale of about 19)."""
  rng = np.random.default_rng(8)
  lengths = np.array([40, 129, 200])
  q, k, v = _qkv(rng, 3, 320)
  outs = {}
  for mma in (False, True):
    method = Kivi(bits=2, group_size=32, residual=64, mma=mma)
    state = _prefill(method, method.init(_spec(3, 320)), 1, k[:, :, :200], v[:, :, :200], lengths, impl)
    step = _step_fn(method, 1, impl)
    outs[mma] = []
    for t in range(0, 80 if impl == "xla" else 8, 2):
      pos = lengths + t
      rows = lambda x: np.stack([x[b, :, pos[b]:pos[b] + 2] for b in range(3)])
      out, state = step(state, rows(q), rows(k), rows(v), pos)
      outs[mma].append(np.asarray(out))
  got, want = np.stack(outs[True]), np.stack(outs[False])
  assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 2e-2


def test_mma_left_open_follows_the_kernel_that_would_read_the_store(monkeypatch):
  """mma=None is the MMA packing exactly where the Hopper kernel would read it (impl pallas, the kernel takes the
  query rows, the settings pack); an explicit setting is kept; KVCache.create allocates the layout decided."""
  import jkv.attention as attention
  spec = _spec(2, 256)
  monkeypatch.setattr(attention, "hopper_kernel_takes", lambda rows: rows <= 16)
  assert Kivi().for_impl(spec, "pallas").mma is True
  assert Kivi().for_impl(spec, "xla").mma is False
  assert Kivi(mma=False).for_impl(spec, "pallas").mma is False
  assert Kivi(residual=32).for_impl(spec, "pallas").mma is False  # a flush would not pack whole tiles
  assert Kivi(bits=8).for_impl(spec, "pallas").mma is True
  assert Kivi().for_impl(dataclasses.replace(spec, q_per_kv=17), "pallas").mma is False
  assert Kivi().for_impl(dataclasses.replace(spec, head_dim=32), "pallas").mma is False
  cache = jax.eval_shape(lambda: KVCache.create(Kivi(), spec, "pallas"))
  assert cache.method.mma is True and hasattr(cache.state, "k_tiles")
  monkeypatch.setattr(attention, "hopper_kernel_takes", lambda rows: False)  # not a Hopper GPU
  assert Kivi().for_impl(spec, "pallas").mma is False


@pytest.mark.parametrize("bits,group_size", [(2, 32), (4, 64), (1, 32)])
def test_mma_packing_allocates_the_library_layouts_bytes(bits, group_size):
  """Memory is planned before the layout is decided (``jkv.memory`` sees mma left open): both must allocate the
  same bytes."""
  from jkv.cache import abstract_bytes
  spec = CacheSpec(num_layers=3, batch=2, capacity=640, kv_heads=2, head_dim=128, q_per_kv=4, dtype=jnp.bfloat16)
  layouts = [abstract_bytes(Kivi(bits=bits, group_size=group_size, mma=mma).abstract(spec)) for mma in (False, True)]
  assert layouts[0] == layouts[1]


def _hopper() -> bool:
  from jkv.attention import hopper_kernel_available
  return hopper_kernel_available()


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Mosaic GPU")
def test_mma_packing_on_the_hopper_kernel_equals_the_xla_path():
  """On a Hopper GPU, KIVI-2 with mma=true through the tensor-core kernel (impl pallas) against the same state
  read by the XLA path, bf16, a ragged batch across tile and flush boundaries: the kernel rounds p and the
  dequantized codes to 16 bits, hence the tolerance."""
  rng = np.random.default_rng(9)
  lengths = np.array([40, 129, 200])
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(rng, 3, 320))
  method = Kivi(bits=2, group_size=32, residual=64, mma=True)
  spec = _spec(3, 320, jnp.bfloat16)
  states = {impl: _prefill(method, method.init(spec), 1, k[:, :, :200], v[:, :, :200], lengths, impl)
            for impl in ("pallas", "xla")}
  steps = {impl: _step_fn(method, 1, impl) for impl in states}
  for t in range(70):
    pos = lengths + t
    rows = lambda x: np.stack([x[b, :, pos[b]:pos[b] + 1] for b in range(3)])
    outs = {}
    for impl in states:
      outs[impl], states[impl] = steps[impl](states[impl], rows(q), rows(k), rows(v), pos)
    got, want = (np.asarray(outs[i], np.float64) for i in ("pallas", "xla"))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-2


def test_fused_kernel_path_equals_xla_path():
  """The method does not care which attention runs: the Pallas kernel (interpreted here) matches the XLA path on
  a ragged batch (one sequence 60 tokens behind the other), across a flush, two rows per step."""
  rng = np.random.default_rng(5)
  q, k, v = _qkv(rng, 2, 256)
  lengths = np.array([70, 130])
  outs = {}
  for impl in ("xla", "interpret"):
    method = Kivi(bits=2, group_size=32, residual=64)
    state = _prefill(method, method.init(_spec(2, 256)), 0, k[:, :, :130], v[:, :, :130], lengths, impl)
    step = _step_fn(method, 0, impl)
    outs[impl] = []
    for t in range(0, 8, 2):
      pos = lengths + t
      rows = lambda x: np.stack([x[b, :, pos[b]:pos[b] + 2] for b in range(2)])
      out, state = step(state, rows(q), rows(k), rows(v), pos)
      outs[impl].append(np.asarray(out))
  np.testing.assert_allclose(np.stack(outs["interpret"]), np.stack(outs["xla"]), rtol=1e-4, atol=1e-4)


def test_default_model_kivi4_matches_dense_and_kivi2_knows_paris(default_model):
  m = default_model
  tok = m.tokenizer
  prompt = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                       add_bos=False)]
  run = lambda method, n: gen.generate(m.params, m.config, prompt, method=method, max_new_tokens=n, eos_ids=())
  dense = run(make_method("dense"), 40)
  kivi4 = run(Kivi(bits=4, residual=32), 40)
  # R=32 so that, past the 37-token prompt, decoding really reads quantized keys and values.
  assert kivi4.tokens[0][:32] == dense.tokens[0][:32]
  kivi2 = gen.generate(m.params, m.config, prompt, method=Kivi(bits=2, residual=32), max_new_tokens=16)
  assert "Paris" in tok.decode(kivi2.tokens[0])
  # Bytes counted from first principles for 37 + 39 = 76 tokens, not from the method: keys in whole
  # flushed blocks of R=32 are 4-bit codes plus an fp16 scale and zero per 32 tokens, the other 12 keys fp32;
  # values older than the newest 32 are 4-bit plus fp16 scale and zero per 32 channels, the newest 32 fp32.
  n = len(prompt[0]) + 39
  assert n == 76
  per_channel = (64 * 0.5 + 2 * 2 * 2) + (76 - 64) * 4 + (44 * 0.5 + 44 * 4 / 32) + 32 * 4
  assert kivi4.stats["kv_bytes"] == round(30 * 3 * 64 * per_channel) + 4
