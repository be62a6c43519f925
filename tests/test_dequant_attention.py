"""The fused KIVI decode kernel against its reference (spec §8 K1-K3), and the reference against brute force.

The kernel runs in Pallas interpret mode on CPU (``INTERPRET = True``); the GPU subclass reruns every case compiled,
where a CUDA GPU of compute capability >= 8.0 is present. Inputs are random keys and values quantized and packed
with the project's quantizer, so the kernel is held to the reference on the same dequantized cache; slots past
quant_len and segment slots that no row attends are poisoned with NaN, so a masking slip cannot hide.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import quantization
from jkv_kernels.dequant_attention import decode_attention, decode_attention_reference
from conftest import has_pallas_gpu

# ‖o - ref‖ / ‖ref‖ and max |o - ref| / max |ref| budgets, by dtype.
TOLERANCE = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 6e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel configuration; one cache row per entry of quant_lens."""
  bits: int
  head_dim: int
  q_per_kv: int
  t_rows: int
  quant_lens: tuple[int, ...]
  segment_lens: tuple[int, ...] = ()
  dtype: type = jnp.float32
  capacity: int = 256
  group_size: int = 32
  block_k: int = 128
  k_splits: int = 2

  def __str__(self):
    return (f"{self.bits}bit_D{self.head_dim}_g{self.q_per_kv}_T{self.t_rows}_C{self.capacity}_"
            f"len{'-'.join(map(str, self.quant_lens))}_seg{'-'.join(map(str, self.segment_lens)) or 0}_"
            f"{jnp.dtype(self.dtype).name}_bk{self.block_k}_ks{self.k_splits}")


# A deliberate sweep: every value of each axis appears at least once (bits {2, 4}, D {64, 128}, g {1, 3, 4, 8},
# T {1, 2}, lengths 1, G - 1, 333 and C, zero to two segments, fp32 and bf16, block and split counts that leave
# masked tails, uneven splits and splits with nothing to do), without the full product that interpret mode
# cannot afford.
CASES = [
    Case(2, 64, 1, 1, (1, 31, 256)),
    Case(4, 64, 4, 2, (256, 0, 100), segment_lens=(40,)),
    Case(2, 128, 8, 1, (333, 512, 17), segment_lens=(128,), capacity=512, block_k=256, k_splits=16),
    Case(4, 128, 3, 2, (31, 480), segment_lens=(128, 5), capacity=512, k_splits=3),
    Case(2, 64, 4, 1, (200, 64), segment_lens=(128,), dtype=jnp.bfloat16, k_splits=1),
    Case(4, 128, 8, 2, (1, 333), segment_lens=(20, 64), dtype=jnp.bfloat16, capacity=384, block_k=64, k_splits=4),
    Case(2, 128, 3, 1, (0, 256), segment_lens=(), dtype=jnp.bfloat16, block_k=32, k_splits=16),
]


def _quantized_cache(rng, batch, kv_heads, capacity, head_dim, *, bits, group_size, dtype):
  """Keys (with a few large outlier channels, as in real models) and values, quantized and packed per spec §2.8."""
  k = rng.normal(size=(batch, kv_heads, capacity, head_dim))
  k[..., rng.choice(head_dim, 3, replace=False)] *= 8.0
  v = rng.normal(size=(batch, kv_heads, capacity, head_dim))
  k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
  k_codes, k_scale, k_zero = quantization.quantize(jnp.swapaxes(k, 2, 3), bits=bits, axis=3, group_size=group_size)
  v_codes, v_scale, v_zero = quantization.quantize(v, bits=bits, axis=3, group_size=group_size)
  return (quantization.pack(k_codes, bits=bits, axis=3), k_scale, k_zero,
          quantization.pack(v_codes, bits=bits, axis=3), v_scale, v_zero)


def _poison_past(cache, quant_lens, group_size):
  """NaN scales for key groups wholly past quant_len and for value rows past it: those slots must never be read."""
  k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = cache
  lens = np.asarray(quant_lens)[:, None, None, None]
  key_groups = np.arange(k_scale.shape[3])[None, None, None, :] * group_size >= lens
  value_rows = np.arange(v_scale.shape[2])[None, None, :, None] >= lens
  k_scale = jnp.where(key_groups, jnp.nan, k_scale).astype(k_scale.dtype)
  v_scale = jnp.where(value_rows, jnp.nan, v_scale).astype(v_scale.dtype)
  return k_codes, k_scale, k_zero, v_codes, v_scale, v_zero


def make_inputs(case: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  batch, kv_heads = len(case.quant_lens), 2
  q = jnp.asarray(rng.normal(size=(batch, kv_heads, case.t_rows, case.q_per_kv, case.head_dim)), case.dtype)
  cache = _quantized_cache(rng, batch, kv_heads, case.capacity, case.head_dim, bits=case.bits,
                           group_size=case.group_size, dtype=case.dtype)
  cache = _poison_past(cache, case.quant_lens, case.group_size)
  segments = []
  for seg_len in case.segment_lens:
    shape = (batch, kv_heads, seg_len, case.head_dim)
    mask = rng.random((batch, case.t_rows, seg_len)) < 0.6
    unused = ~mask.any(axis=1)[:, None, :, None]
    k = np.where(unused, np.nan, rng.normal(size=shape))
    v = np.where(unused, np.nan, rng.normal(size=shape))
    segments.append((jnp.asarray(k, case.dtype), jnp.asarray(v, case.dtype), jnp.asarray(mask)))
  quant_len = jnp.asarray(case.quant_lens, jnp.int32)
  return (q, *cache, quant_len, tuple(segments))


def _relative_errors(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return (np.linalg.norm(out - ref) / np.linalg.norm(ref), np.max(np.abs(out - ref)) / np.max(np.abs(ref)))




class TestDecodeAttentionInterpret:
  INTERPRET = True

  @pytest.mark.parametrize("case", CASES, ids=str)
  def test_matches_reference(self, case):
    inputs = make_inputs(case)
    static = dict(k_bits=case.bits, v_bits=case.bits, group_size=case.group_size)
    out = decode_attention(*inputs, **static, block_k=case.block_k, k_splits=case.k_splits,
                           interpret=self.INTERPRET)
    ref = decode_attention_reference(*inputs, **static)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert np.all(np.isfinite(np.asarray(ref, np.float32)))
    norm_err, max_err = _relative_errors(out, ref)
    norm_tol, max_tol = TOLERANCE[case.dtype]
    assert norm_err <= norm_tol and max_err <= max_tol, (norm_err, max_err)

  def test_mixed_bits_and_rows_without_keys(self):
    """k_bits != v_bits; a row with no valid token anywhere (quant_len 0, segment masked) returns exactly 0."""
    case = Case(4, 64, 4, 2, (0, 77), segment_lens=(16,))
    q, k_codes, k_scale, k_zero, _, _, _, quant_len, segments = make_inputs(case)
    *_, v_codes, v_scale, v_zero = _quantized_cache(np.random.default_rng(1), 2, 2, 256, 64, bits=2,
                                                    group_size=32, dtype=jnp.float32)
    (seg_k, seg_v, mask), = segments
    mask = mask.at[0, 1].set(False)  # batch row 0, query position 1: nothing to attend
    inputs = (q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, ((seg_k, seg_v, mask),))
    out = decode_attention(*inputs, k_bits=4, v_bits=2, group_size=32, block_k=64, k_splits=2,
                           interpret=self.INTERPRET)
    ref = decode_attention_reference(*inputs, k_bits=4, v_bits=2, group_size=32)
    np.testing.assert_array_equal(np.asarray(out[0, :, 1]), 0.0)
    assert max(_relative_errors(out, ref)) <= 1e-4


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestDecodeAttentionGpu(TestDecodeAttentionInterpret):
  INTERPRET = False


# (bits, dtype, T, g, D, capacity, block_k, k_splits, segment lengths): the benchmark's shapes and the corners.
LOWERING_CASES = [
    (2, jnp.bfloat16, 1, 4, 128, 4096, 256, 16, (128,)),
    (4, jnp.bfloat16, 1, 4, 128, 4096, 512, 32, (128,)),
    (8, jnp.float16, 4, 8, 128, 2048, 128, 8, (128, 300)),
    (2, jnp.float32, 2, 3, 64, 1024, 256, 3, (5,)),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"{c[0]}bit_{jnp.dtype(c[1]).name}_T{c[2]}_g{c[3]}")
def test_lowers_to_triton(case):
  """Lowering for CUDA runs on any machine and catches what the Triton lowering rejects before a GPU run:
  unsupported primitives, tiles that are not powers of two, dots smaller than 16."""
  bits, dtype, t_rows, q_per_kv, head_dim, capacity, block_k, k_splits, segment_lens = case
  batch, kv_heads, group_size, per_word = 2, 8, 32, 32 // bits
  spec = jax.ShapeDtypeStruct
  k_meta = spec((batch, kv_heads, head_dim, capacity // group_size), jnp.float16)
  v_meta = spec((batch, kv_heads, capacity, head_dim // group_size), jnp.float16)
  segments = tuple((spec((batch, kv_heads, s, head_dim), dtype), spec((batch, kv_heads, s, head_dim), dtype),
                    spec((batch, t_rows, s), jnp.bool_)) for s in segment_lens)
  args = (spec((batch, kv_heads, t_rows, q_per_kv, head_dim), dtype),
          spec((batch, kv_heads, head_dim, capacity // per_word), jnp.uint32),
          k_meta, k_meta,
          spec((batch, kv_heads, capacity, head_dim // per_word), jnp.uint32),
          v_meta, v_meta,
          spec((batch,), jnp.int32), segments)
  lowered = decode_attention.trace(*args, k_bits=bits, v_bits=bits, group_size=group_size, block_k=block_k,
                                   k_splits=k_splits).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text()


def test_reference_matches_brute_force():
  """The reference against float64 numpy: unpack bit by bit, dequantize, loop over heads and rows."""
  case = Case(2, 64, 3, 2, (45, 96), segment_lens=(7,), capacity=96)
  q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, segments = make_inputs(case)
  (seg_k, seg_v, seg_mask), = segments
  ref = np.asarray(decode_attention_reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len,
                                              segments, k_bits=2, v_bits=2, group_size=32), np.float64)
  q, k_scale, k_zero, v_scale, v_zero, seg_k, seg_v = (
      np.asarray(a, np.float64) for a in (q, k_scale, k_zero, v_scale, v_zero, seg_k, seg_v))
  k_words, v_words, seg_mask = (np.asarray(a) for a in (k_codes, v_codes, seg_mask))
  code = lambda word, j: (int(word) >> (2 * j)) & 3  # code j of a word sits at bits [2j, 2j + 2)
  batch, kv_heads, t_rows, q_per_kv, head_dim = q.shape
  for b in range(batch):
    for h in range(kv_heads):
      keys = [[code(k_words[b, h, d, t // 16], t % 16) * k_scale[b, h, d, t // 32] + k_zero[b, h, d, t // 32]
               for d in range(head_dim)] for t in range(int(quant_len[b]))]
      values = [[code(v_words[b, h, t, d // 16], d % 16) * v_scale[b, h, t, d // 32] + v_zero[b, h, t, d // 32]
                 for d in range(head_dim)] for t in range(int(quant_len[b]))]
      for t in range(t_rows):
        attended = [s for s in range(seg_k.shape[2]) if seg_mask[b, t, s]]
        all_k = np.array(keys + [seg_k[b, h, s] for s in attended])
        all_v = np.array(values + [seg_v[b, h, s] for s in attended])
        for i in range(q_per_kv):
          logits = all_k @ q[b, h, t, i] / np.sqrt(head_dim)
          p = np.exp(logits - logits.max())
          np.testing.assert_allclose(ref[b, h, t, i], p @ all_v / p.sum(), rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
  case = Case(2, 64, 4, 1, (10, 20), segment_lens=(8,))
  q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, segments = make_inputs(case)
  call = lambda **changes: decode_attention(
      **{**dict(q=q, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero, v_codes=v_codes, v_scale=v_scale,
                v_zero=v_zero, quant_len=quant_len, segments=segments), **changes},
      k_bits=2, v_bits=2, group_size=32, interpret=True)
  with pytest.raises(ValueError, match=r"k_codes has shape \(2, 2, 64, 8\), expected \(2, 2, 64, 16\)"):
    call(k_codes=k_codes[..., :8])
  with pytest.raises(ValueError, match="v_scale has shape"):
    call(v_scale=v_scale[:, :, :128])
  with pytest.raises(ValueError, match="quant_len must be int32"):
    call(quant_len=quant_len.astype(jnp.float32))
  with pytest.raises(ValueError, match="segment 0: mask"):
    call(segments=((segments[0][0], segments[0][1], segments[0][2][:, :, :4]),))
  with pytest.raises(ValueError, match="segment 0: k"):
    call(segments=((segments[0][0][..., :32], segments[0][1], segments[0][2]),))
  with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\)"):
    decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, k_bits=1, v_bits=2,
                     group_size=32, interpret=True)
