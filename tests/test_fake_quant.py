"""fakequant against a brute-force float64 numpy oracle: every key/value grouping, 2 and 4 bits, partial groups.

The oracle is written from docs/methods/kivi.md (the quantizer, the grouping axes) and the method's docstring (the
fake-quant protocol), not from ``jkv_kernels.quantization``: for each sequence, quantize-dequantize its first N
tokens (per-channel groups of G tokens zero-padded past N; per-token groups of G channels; the numpy quantizer
of ``quant_oracle``, which every method test shares), then softmax attention in float64.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jkv import cli
from jkv.cache import CacheSpec, KVCache, StepContext
from jkv.methods import make_method
from jkv.methods.fake_quant import FakeQuant
import quant_oracle

G = 32
H, QPK, D = 2, 2, 64  # KV heads, query heads per KV head, head dim
LAYOUTS = [(k, v) for k in ("channel", "token") for v in ("channel", "token")]




# ------------------------------------------------------------------------------------------------- oracle


def oracle_groups(x, n, axis):
  """The quantization groups of the first n rows of x [C, D] (rows tokens, columns channels), in float64.

  'channel': groups of G consecutive tokens of one channel, over the token axis zero-padded to a multiple of G;
  'token': groups of G consecutive channels of one token. Returns ([n_groups, G] values, and the function that
  puts [n_groups, G] values back as [n, D], dropping the padding).
  """
  x = np.asarray(x[:n], np.float64)
  if axis == "channel":
    n_pad = -(-n // G) * G
    padded = np.zeros((n_pad, x.shape[1]))
    padded[:n] = x
    groups = padded.T.reshape(x.shape[1], n_pad // G, G).reshape(-1, G)  # [D * n_pad/G, G]
    unflatten = lambda g: g.reshape(x.shape[1], n_pad).T[:n]
  else:
    groups = x.reshape(n, x.shape[1] // G, G).reshape(-1, G)  # [n * D/G, G]
    unflatten = lambda g: g.reshape(n, x.shape[1])
  return groups, unflatten


def oracle_scale_zero(groups, bits):
  """Per group: scale (max - min) / (2^b - 1) and zero min as stored in fp16 (``quant_oracle``), in float64."""
  _, scale, zero = quant_oracle.quantize_groups(groups, bits)
  return scale.astype(np.float64), zero.astype(np.float64)


def oracle_codes_real(groups, scale, zero, bits):
  """(x - z) / s before rounding, clipped to [0, qmax]; s == 0 divides by 1."""
  s = np.where(scale == 0, 1.0, scale)[:, None]
  return np.clip((groups - zero[:, None]) / s, 0, 2**bits - 1)


def oracle_fake_quant(x, n, axis, bits):
  """Quantize-dequantize the first n rows of x [N_any, D] with the given grouping; returns [n, D] float64."""
  groups, unflatten = oracle_groups(x, n, axis)
  return unflatten(oracle_dequantized(groups, bits))


def oracle_dequantized(groups, bits):
  """[n_groups, G] -> quantized and dequantized, float64."""
  codes, scale, zero = quant_oracle.quantize_groups(groups, bits)
  return codes * scale.astype(np.float64)[:, None] + zero.astype(np.float64)[:, None]


def oracle_attention(q, k, v, q_pos):
  """q [T, g, D], k/v [n, D] float64; row t sees keys s <= q_pos[t]. Returns [T, g, D]."""
  out = np.zeros(q.shape)
  for t, p in enumerate(q_pos):
    logits = np.einsum("gd,sd->gs", q[t], k[:p + 1]) / np.sqrt(q.shape[-1])
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    out[t] = (w / w.sum(axis=-1, keepdims=True)) @ v[:p + 1]
  return out


def oracle_output(q, k, v, lengths, q_positions, key_axis, value_axis, bits):
  """The whole batch: q [B, H, T, g, D], k/v [B, H, C, D]."""
  out = np.zeros(q.shape)
  for b, n in enumerate(lengths):
    for h in range(k.shape[1]):
      kq = oracle_fake_quant(k[b, h], n, key_axis, bits)
      vq = oracle_fake_quant(v[b, h], n, value_axis, bits)
      out[b, h] = oracle_attention(np.float64(q[b, h]), kq, vq, q_positions[b])
  return out


# ------------------------------------------------------------------------------------------------- data


def planted_kv(rng, batch, capacity):
  """K and V [B, H, C, D] float32: N(0, 1) with one outlier channel each (large offset and spread), as in
  the KIVI paper's key statistics; values get their outlier in another channel."""
  k = rng.standard_normal((batch, H, capacity, D))
  v = rng.standard_normal((batch, H, capacity, D))
  k[..., 5] = 12.0 + 4.0 * k[..., 5]
  v[..., 40] = -8.0 + 3.0 * v[..., 40]
  return k.astype(np.float32), v.astype(np.float32)


def _real(n, axis, d):
  """[n_groups, G] bool in ``oracle_groups`` order: True for data, False for the zero padding past n."""
  if axis == "channel":
    return np.tile((np.arange(-(-n // G) * G) < n).reshape(-1, G), (d, 1))
  return np.ones((n * d // G, G), bool)


def _ill_conditioned(groups, n, axis, bits, d):
  """Where float32 arithmetic (or XLA's division by a constant, computed as a multiplication by its reciprocal)
  could round differently from float64: a raw scale within 1e-3 fp16 ulp of an fp16 rounding midpoint, or a real
  element's (x - z) / s within 1e-4 of a .5 tie. Returns (bad scale [n_groups], bad element [n_groups, G])."""
  qmax = 2**bits - 1
  raw = (groups.max(axis=1) - groups.min(axis=1)) / qmax
  stored = raw.astype(np.float16)
  ulp = np.spacing(stored).astype(np.float64)
  bad_scale = (raw > 0) & (np.abs(np.abs(raw - stored.astype(np.float64)) - ulp / 2) < 1e-3 * ulp)
  scale, zero = oracle_scale_zero(groups, bits)
  y = oracle_codes_real(groups, scale, zero, bits)
  bad_code = _real(n, axis, d) & (scale[:, None] > 0) & (np.abs(y - np.floor(y) - 0.5) < 1e-4)
  return bad_scale, bad_code, scale, ulp, y


def well_conditioned(x, lengths, axis, bits):
  """Nudge x [B, H, C, D] (float32) so that the float32 method and the float64 oracle cannot round apart.

  The method computes scales and codes in float32 (its quantizer: "fp32, then stored in fp16"), the oracle in float64.
  At an exact rounding tie the two may differ by one fp16 ulp of a scale or one code, which is arithmetic noise,
  not a difference in the algorithm. A group whose scale sits on an fp16 midpoint gets its max raised by a quarter
  ulp of scale (its min lowered when the max is padding); an element on a code tie moves 1% of its scale away
  (it is interior to its group, so no scale or zero changes). Only the first n tokens are data; padding is never
  attended and is left alone.
  """
  x = x.copy()
  qmax = 2**bits - 1
  for b, n in enumerate(lengths):
    for h in range(x.shape[1]):
      for _ in range(10):
        groups, unflatten = oracle_groups(x[b, h], n, axis)
        bad_scale, bad_code, scale, ulp, y = _ill_conditioned(groups, n, axis, bits, x.shape[-1])
        if not bad_scale.any() and not bad_code.any():
          break
        real = _real(n, axis, x.shape[-1])
        delta = np.where(bad_code, np.where(y - np.floor(y) < 0.5, -0.01, 0.01) * scale[:, None], 0.0)
        for g in np.nonzero(bad_scale)[0]:
          top, bottom = np.argmax(groups[g]), np.argmin(groups[g])
          if real[g, top]:
            delta[g, top] += qmax * ulp[g] / 4
          else:
            delta[g, bottom] -= qmax * ulp[g] / 4
        x[b, h, :n] = unflatten(groups + delta).astype(np.float32)
      else:
        raise AssertionError("could not condition the test data")
  return x


def run_method(method, k, v, q, lengths, q_positions):
  """Prefill all but the last token of each sequence into layer 0 of a 1-layer cache, then one decode step
  with the last token (stored, then attended by q [B, H, 1, g, D] at position length - 1)."""
  B, _, C, _ = k.shape
  spec = CacheSpec(num_layers=1, batch=B, capacity=C, kv_heads=H, head_dim=D, q_per_kv=QPK, dtype=jnp.float32)
  cache = KVCache.create(method, spec)
  held = jnp.asarray(lengths, jnp.int32) - 1
  assert np.array_equal(q_positions[:, 0], held)
  # Positions past each length hold garbage that must not matter.
  ctx = StepContext(lengths=held, positions=jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C)))
  state = method.prefill(cache.state, 0, None, jnp.asarray(k), jnp.asarray(v), ctx)
  last = lambda x: jnp.asarray(np.stack([x[b, :, n - 1] for b, n in enumerate(lengths)])[:, :, None])
  out, _ = method.step(state, 0, jnp.asarray(q), last(k), last(v),
                       StepContext(lengths=held, positions=held[:, None]))
  return np.asarray(out, np.float64)


def make_case(seed, lengths, key_axis, value_axis, bits, capacity):
  rng = np.random.default_rng(seed)
  k, v = planted_kv(rng, len(lengths), capacity)
  # Garbage (not zeros) past each length: the method must treat those slots as zeros / ignore them.
  k = well_conditioned(k, lengths, key_axis, bits)
  v = well_conditioned(v, lengths, value_axis, bits)
  q = rng.standard_normal((len(lengths), H, 1, QPK, D)).astype(np.float32)
  q_positions = np.array([[n - 1] for n in lengths], np.int32)  # the newest token's row
  return k, v, q, q_positions


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("lengths, capacity", [
    ([37], 64),  # a whole group and a partial one (5 of 32 tokens real)
    ([64], 96),  # whole groups only, capacity beyond them
    ([100, 37, 64], 128),  # a batch of different lengths: no group mixes sequences or sees padding
])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("key_axis, value_axis", LAYOUTS)
def test_attend_matches_float64_oracle(key_axis, value_axis, bits, lengths, capacity):
  k, v, q, q_positions = make_case(1000 * bits + sum(lengths), lengths, key_axis, value_axis, bits, capacity)
  method = make_method("fakequant", bits=bits, key_axis=key_axis, value_axis=value_axis)
  out = run_method(method, k, v, q, lengths, q_positions)
  want = oracle_output(q, k, v, lengths, q_positions, key_axis, value_axis, bits)
  np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)

  # The comparison has teeth: exact attention (no quantization) is far outside the tolerance.
  exact = np.zeros(q.shape)
  for b, n in enumerate(lengths):
    for h in range(H):
      exact[b, h] = oracle_attention(np.float64(q[b, h]), np.float64(k[b, h, :n]), np.float64(v[b, h, :n]),
                                     q_positions[b])
  assert np.max(np.abs(exact - want)) > 100 * 1e-4


@pytest.mark.parametrize("key_axis, value_axis", [("channel", "channel"), ("channel", "token")])
def test_partial_channel_groups_are_zero_padded(key_axis, value_axis):
  """The last partial per-channel group counts positions >= N as zeros (zero-padded, as in KIVI's Sec. 3.1). With an
  outlier channel far from zero those zeros set the group's min, so grouping the N real tokens alone would give
  other outputs."""
  lengths, capacity, bits = [37], 64, 2
  k, v, q, q_positions = make_case(7, lengths, key_axis, value_axis, bits, capacity)
  out = run_method(make_method("fakequant", bits=bits, key_axis=key_axis, value_axis=value_axis),
                   k, v, q, lengths, q_positions)
  n = lengths[0]

  def fake_no_padding(x, axis):  # the alternative reading: the partial group holds only its 5 real tokens
    x = np.float64(x[:n])
    if axis == "token":
      return oracle_fake_quant(x, n, axis, bits)
    out = np.empty_like(x)
    for start in range(0, n, G):
      block = x[start:start + G]  # [<= G, D]: one group per channel
      out[start:start + G] = oracle_dequantized(block.T, bits).T
    return out

  other = np.zeros(q.shape)
  for h in range(H):
    other[0, h] = oracle_attention(np.float64(q[0, h]), fake_no_padding(k[0, h], key_axis),
                                   fake_no_padding(v[0, h], value_axis), q_positions[0])
  assert np.max(np.abs(out - other)) > 1e-2


def test_constant_group_reconstructs_exactly():
  """A constant group has scale 0: the quantizer divides by 1 and every element comes back exactly."""
  lengths, capacity = [64], 64
  rng = np.random.default_rng(3)
  k = np.full((1, H, capacity, D), 0.75, np.float32)  # every key group constant
  v = rng.standard_normal((1, H, capacity, D)).astype(np.float32)
  q = rng.standard_normal((1, H, 1, QPK, D)).astype(np.float32)
  q_positions = np.array([[63]], np.int32)
  for key_axis in ("channel", "token"):
    out = run_method(make_method("fakequant", bits=2, key_axis=key_axis, value_axis="token"),
                     k, v, q, lengths, q_positions)
    want = oracle_output(q, k, v, lengths, q_positions, key_axis, "token", 2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # Constant keys give uniform attention: the mean of the (fake-quantized) values.
    vq = np.stack([oracle_fake_quant(v[0, h], 64, "token", 2) for h in range(H)])
    np.testing.assert_allclose(out[0, :, 0], np.broadcast_to(vq.mean(axis=1)[:, None], (H, QPK, D)),
                               rtol=1e-5, atol=1e-5)


def test_kv_bytes_formula_key_channel_value_token():
  """Codes of b bits per element plus one fp16 scale and zero per group; per-channel key groups cover the token
  axis zero-padded to a multiple of G. Counted here group by group for the default model's shapes."""
  L, Hm, Dm = 30, 3, 64
  spec = CacheSpec(num_layers=L, batch=2, capacity=128, kv_heads=Hm, head_dim=Dm, q_per_kv=3, dtype=jnp.float32)
  lengths = np.array([37, 100])
  want = 0
  for n in lengths:
    n_pad = -(-n // G) * G
    key_groups = Dm * n_pad // G  # per (layer, head)
    value_groups = n * Dm // G
    key_bytes = n_pad * Dm * 2 / 8 + key_groups * 2 * 2
    value_bytes = n * Dm * 2 / 8 + value_groups * 2 * 2
    want += L * Hm * (key_bytes + value_bytes)
  assert FakeQuant(bits=2, key_axis="channel", value_axis="token").held_bytes(spec, None, lengths).device == want
  # The same by hand: 37 -> keys 64 * 0.375 + values 37 * 0.375; 100 -> keys 128 * 0.375 + values 100 * 0.375.
  assert want == L * Hm * Dm * 0.375 * (64 + 37 + 128 + 100) == 710_640


@pytest.mark.parametrize("options, word", [
    (dict(key_axis="tokens"), "key_axis='tokens'"),
    (dict(value_axis="head"), "value_axis='head'"),
    (dict(bits=3), "bits=3"),
    (dict(group_size=0), "group_size=0"),
    (dict(group_size=-32), "group_size=-32"),
    (dict(meta_dtype="int8"), "meta_dtype='int8'"),
    (dict(group_size=48), "group_size=48 does not divide the head dim 64"),
])
def test_invalid_settings_are_rejected(options, word):
  spec = CacheSpec(num_layers=1, batch=1, capacity=96, kv_heads=H, head_dim=D, q_per_kv=QPK, dtype=jnp.float32)
  with pytest.raises(ValueError, match=word.replace("(", r"\(")) as e:
    KVCache.create(make_method("fakequant", **options), spec)
  assert "\n" not in str(e.value)
  if "axis" in word:
    assert "choose 'channel' or 'token'" in str(e.value)


def test_invalid_key_axis_on_the_command_line(capsys, default_model_once):
  rc = cli.main(["info", "--method", "fakequant", "--key-axis", "tokens", "--tokens", "64"])
  out, err = capsys.readouterr()
  assert rc == 2 and out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jkv: error:") and "key_axis='tokens'" in lines[0]
  assert "Traceback" not in err


def test_default_model_generates_with_2bit_key_channel_value_token(capsys, default_model_once):
  rc = cli.main(["generate", "What is the capital of France?", "--method", "fakequant", "--bits", "2",
                 "--key-axis", "channel", "--value-axis", "token", "--max-new-tokens", "8", "--json"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  res = json.loads(out)
  assert res["method"] == "fakequant"
  assert res["method_config"] == dict(bits=2, key_axis="channel", value_axis="token", group_size=32,
                                      meta_dtype="float16")
  assert 1 <= len(res["tokens"]) <= 8 and res["text"].strip()
  assert "Paris" in res["text"]  # the best 2-bit layout (KIVI Table 1) still answers a one-fact question
  # Bytes for the tokens held (prompt + decode steps), counted here from first principles: 2-bit codes plus an
  # fp16 scale and zero per group of 32; keys per channel over the tokens padded to a multiple of 32.
  held = res["dense_kv_bytes"] // (2 * 30 * 3 * 64 * 4)
  assert res["dense_kv_bytes"] == held * 2 * 30 * 3 * 64 * 4
  assert res["prompt_tokens"][0] + len(res["tokens"]) - 1 <= held <= res["prompt_tokens"][0] + 7
  padded = -(-held // 32) * 32
  per_channel = (padded + held) * (2 / 8 + 2 * 2 / 32)
  assert res["kv_bytes"] == round(30 * 3 * 64 * per_channel) < res["dense_kv_bytes"]
