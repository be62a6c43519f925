"""The quantizer and the bit packing (docs/methods/kivi.md, 'The quantizer'), on literal arrays and hypothesis-drawn
groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv_kernels import quantization
from jkv_kernels.quantization import pack, unpack

SETTINGS = settings(max_examples=25, deadline=None)
# Jitted so that each drawn shape compiles once instead of dispatching op by op.
quantize = jax.jit(quantization.quantize, static_argnames=("bits", "axis", "group_size", "meta_dtype"))
dequantize = jax.jit(quantization.dequantize, static_argnames=("axis", "group_size", "dtype"))


@st.composite
def grouped_arrays(draw):
  """A [3, 2 * G] float32 array with one of several value distributions, plus its bits and G."""
  bits = draw(st.sampled_from([2, 4, 8]))
  group_size = draw(st.sampled_from([16, 32, 64]))
  rows, n_groups = 3, 2
  kind = draw(st.sampled_from(["normal", "uniform", "heavy_tailed", "outliers"]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  shape = (rows, n_groups * group_size)
  if kind == "normal":
    x = rng.normal(size=shape)
  elif kind == "uniform":
    x = rng.uniform(-3, 5, size=shape)
  elif kind == "heavy_tailed":
    x = rng.standard_t(2, size=shape)
  else:
    x = rng.normal(size=shape)
    x[rng.random(shape) < 0.05] *= 50.0
  return x.astype(np.float32), bits, group_size


def _group_stats(x, group_size):
  """float64 per-group min and max of a [rows, n * G] array: [rows, n] each."""
  g = np.asarray(x, np.float64).reshape(x.shape[0], -1, group_size)
  return g.min(-1), g.max(-1)


@SETTINGS
@given(grouped_arrays())
def test_round_trip_bound_and_range(case):
  """|x - x'| <= s/2 + tol per group; codes in [0, qmax]; min -> 0, max -> qmax; x'(argmin) == z."""
  x, bits, group_size = case
  qmax = 2**bits - 1
  codes, scale, zero = quantize(jnp.asarray(x), bits=bits, axis=1, group_size=group_size)
  x_hat = np.asarray(dequantize(codes, scale, zero, axis=1, group_size=group_size, dtype=jnp.float32), np.float64)
  codes, s, z = np.asarray(codes), np.asarray(scale, np.float64), np.asarray(zero, np.float64)
  lo, hi = _group_stats(x, group_size)
  # Storing s and z in fp16 moves the grid: the top code can be off by qmax * |ds|, every code by |dz|.
  tol = qmax * np.abs(s - (hi - lo) / qmax) + np.abs(z - lo) + 4 * np.spacing(np.abs(x).max())
  err = np.abs(x - x_hat).reshape(x.shape[0], -1, group_size).max(-1)
  assert np.all(err <= s / 2 + tol)
  assert codes.min() >= 0 and codes.max() <= qmax
  grouped = lambda a: a.reshape(x.shape[0], -1, group_size)
  argmin, argmax = grouped(x).argmin(-1)[..., None], grouped(x).argmax(-1)[..., None]
  assert np.all(np.take_along_axis(grouped(codes), argmin, -1) == 0)
  assert np.all(np.take_along_axis(grouped(x_hat), argmin, -1)[..., 0] == z)
  top = np.take_along_axis(grouped(codes), argmax, -1)[..., 0]
  assert np.all((top == qmax) | (s == 0))


def test_constant_group_is_exact():
  """s = 0 gives no NaN and reconstructs bitwise."""
  x = jnp.full((2, 64), 1.25, jnp.float32).at[1, 32:].set(-7.0)
  codes, scale, zero = quantize(x, bits=2, axis=1, group_size=32)
  assert np.all(np.asarray(scale) == 0) and np.all(np.asarray(codes) == 0)
  x_hat = dequantize(codes, scale, zero, axis=1, group_size=32, dtype=jnp.float32)
  np.testing.assert_array_equal(x_hat, x)


@SETTINGS
@given(grouped_arrays())
def test_idempotent(case):
  """Quantizing the dequantized array gives the same codes, and s, z within one fp16 ulp."""
  x, bits, group_size = case
  codes, scale, zero = quantize(jnp.asarray(x), bits=bits, axis=1, group_size=group_size)
  x_hat = dequantize(codes, scale, zero, axis=1, group_size=group_size, dtype=jnp.float32)
  codes2, scale2, zero2 = quantize(x_hat, bits=bits, axis=1, group_size=group_size)
  np.testing.assert_array_equal(codes2, codes)
  for a, b in ((scale, scale2), (zero, zero2)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.abs(a - b) <= np.spacing(np.abs(a).astype(np.float16)).astype(np.float32))


@pytest.mark.parametrize("bits", [2, 4, 8])  # 1 bit has quarter-point levels: test_one_bit_quarter_points
def test_exact_grid(bits):
  """x = z + k * s with integer k (exactly representable s, z) gives codes k and x' == x."""
  rng = np.random.default_rng(bits)
  k = rng.integers(0, 2**bits, size=(3, 64))
  k[:, 0], k[:, 1] = 0, 2**bits - 1  # pin min and max so the group's s and z are the chosen ones
  x = jnp.asarray(-1.5 + 0.25 * k, jnp.float32)
  codes, scale, zero = quantize(x, bits=bits, axis=1, group_size=64)
  np.testing.assert_array_equal(codes, k)
  np.testing.assert_array_equal(dequantize(codes, scale, zero, axis=1, group_size=64, dtype=jnp.float32), x)


@SETTINGS
@given(grouped_arrays())
def test_codes_monotone_within_group(case):
  """x_i <= x_j implies c_i <= c_j inside a group."""
  x, bits, group_size = case
  codes = np.asarray(quantize(jnp.asarray(x), bits=bits, axis=1, group_size=group_size)[0])
  order = np.argsort(x.reshape(x.shape[0], -1, group_size), axis=-1, kind="stable")
  sorted_codes = np.take_along_axis(codes.reshape(order.shape), order, -1)
  assert np.all(np.diff(sorted_codes.astype(np.int64), axis=-1) >= 0)


def test_affine_equivariance():
  """alpha x + beta (alpha a power of two, so nothing rounds) keeps the codes and maps s, z affinely."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 64)), jnp.float32)
  codes, scale, zero = quantize(x, bits=4, axis=1, group_size=32, meta_dtype=jnp.float32)
  codes2, scale2, zero2 = quantize(4.0 * x, bits=4, axis=1, group_size=32, meta_dtype=jnp.float32)
  np.testing.assert_array_equal(codes2, codes)
  np.testing.assert_array_equal(scale2, 4.0 * scale)
  np.testing.assert_array_equal(zero2, 4.0 * zero)


def test_tie_rule_half_to_even():
  """The 2-bit group {0, 0.5, 2.5, 3} has z = 0, s = 1; the ties 0.5 and 2.5 go to the even codes 0 and 2."""
  codes, scale, zero = quantize(jnp.array([[0.0, 0.5, 2.5, 3.0]]), bits=2, axis=1, group_size=4)
  np.testing.assert_array_equal(codes, [[0, 0, 2, 3]])
  assert float(scale[0, 0]) == 1.0 and float(zero[0, 0]) == 0.0


@pytest.mark.parametrize("axis", [2, 3])
def test_grouping_axis_and_locality(axis):
  """Stats are the min/max of the right G elements; a perturbation changes only its own group."""
  group_size = 8
  x = np.random.default_rng(axis).normal(size=(2, 3, 16, 32)).astype(np.float32)  # [B, H, T, D]
  codes, scale, zero = map(np.asarray, quantize(jnp.asarray(x), bits=2, axis=axis, group_size=group_size))
  moved = np.moveaxis(x, axis, -1).reshape(*np.moveaxis(x, axis, -1).shape[:-1], -1, group_size)
  np.testing.assert_array_equal(np.moveaxis(zero, axis, -1), moved.min(-1).astype(np.float16))

  b, h, t, d = 1, 2, 5, 9
  bumped = x.copy()
  bumped[b, h, t, d] += 10.0
  codes2, scale2, zero2 = map(np.asarray, quantize(jnp.asarray(bumped), bits=2, axis=axis, group_size=group_size))
  group = [b, h, t, d]
  group[axis] //= group_size
  changed = np.argwhere(scale2 != scale)
  np.testing.assert_array_equal(changed, [group])
  changed_codes = np.argwhere(codes2 != codes)
  assert np.all(changed_codes[:, axis] // group_size == group[axis])
  other_axes = [a for a in range(4) if a != axis]
  assert np.all(changed_codes[:, other_axes] == np.array(group)[other_axes])


def test_pack_known_answer():
  """At 2 bits, codes [1, 2, 3, 0, 0, ...] pack to 0b00_11_10_01 = 57 (code j at bits 2j)."""
  codes = jnp.zeros(16, jnp.uint32).at[:3].set(jnp.array([1, 2, 3], jnp.uint32))
  np.testing.assert_array_equal(pack(codes, bits=2, axis=0), [57])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_pack_unpack_identity(bits, axis):
  """unpack(pack(c)) == c at every width, along any axis; the packed axis shrinks by 32 / bits."""
  per_word = 32 // bits
  shape = [3, 2 * per_word, per_word] if axis == 1 else [per_word, 3, 4 * per_word]
  codes = jnp.asarray(np.random.default_rng(bits).integers(0, 2**bits, size=shape), jnp.uint32)
  words = pack(codes, bits=bits, axis=axis)
  expected = list(shape)
  expected[axis] //= per_word
  assert words.shape == tuple(expected) and words.dtype == jnp.uint32
  np.testing.assert_array_equal(unpack(words, bits=bits, axis=axis), codes)


def test_kivi_layouts():
  """Keys [B, H, T, D] quantize per channel and pack along tokens into [B, H, D, T/P]; values along D."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 64, 32)), jnp.float32)
  codes, scale, _ = quantize(jnp.swapaxes(x, 2, 3), bits=2, axis=3, group_size=32)
  assert pack(codes, bits=2, axis=3).shape == (2, 3, 32, 4) and scale.shape == (2, 3, 32, 2)
  codes, scale, _ = quantize(x, bits=2, axis=3, group_size=16)
  assert pack(codes, bits=2, axis=3).shape == (2, 3, 64, 2) and scale.shape == (2, 3, 64, 2)


def test_bad_arguments_raise():
  x = jnp.ones((4, 48))
  with pytest.raises(ValueError, match="bits must be one of"):
    quantize(x, bits=3, axis=1, group_size=16)
  with pytest.raises(ValueError, match="48.*32"):
    quantize(x, bits=2, axis=1, group_size=32)
  with pytest.raises(ValueError, match="bits must be one of"):
    pack(jnp.zeros((4, 30), jnp.uint32), bits=3, axis=1)
  with pytest.raises(ValueError, match="30.*16"):
    pack(jnp.zeros((4, 30), jnp.uint32), bits=2, axis=1)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_fused_unpack_dequantize_equals_unpack_then_dequantize(bits):
  """The kernels' in-register form computes exactly what the plain pair does."""
  from jkv_kernels.quantization import dequantize_packed_last_axis
  rng = np.random.default_rng(bits)
  x = jnp.asarray(rng.normal(size=(3, 5, 128)).astype(np.float32))
  codes, scale, zero = quantize(x, bits=bits, axis=-1, group_size=32)
  words = pack(codes, bits=bits, axis=-1)
  expect = dequantize(unpack(words, bits=bits, axis=-1), scale, zero, axis=-1, group_size=32, dtype=jnp.float32)
  got = dequantize_packed_last_axis(words, scale, zero, bits=bits, group_size=32, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expect))


def _exact_codes(x, scale, zero, bits):
  """float64 oracle: the integer nearest to the exact quotient (x - z) / s (ties to even), x - z rounded in fp32."""
  s = np.asarray(scale, np.float32).astype(np.float64)[..., None]
  d = (np.asarray(x, np.float32) - np.asarray(zero, np.float32)[..., None]).astype(np.float64)
  return np.clip(np.round(d / np.where(s == 0, 1.0, s)), 0, 2**bits - 1)


@pytest.mark.parametrize("meta_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])  # 1 bit: test_one_bit_codes_are_the_nearer_stored_level
def test_codes_are_the_exact_nearest_code(bits, meta_dtype):
  """Codes are a function of the stored s and z alone (no division whose rounding a compiler chooses): random
  groups, and groups whose elements sit exactly on a decision threshold (c + 1/2) s or one fp32 ulp to either side
  of it, where an approximate division (Triton's div.full) would pick either neighbour."""
  rng = np.random.default_rng(bits)
  qmax = 2**bits - 1
  x = rng.normal(size=(64, 32)).astype(np.float32) * rng.uniform(0.01, 100.0, size=(64, 1)).astype(np.float32)
  # Threshold groups: min 0 and max qmax * s0 pin z = 0 and s = s0 (exact in fp16 and bf16); the rest sit on
  # thresholds (k + 1/2) s0 (exact in fp32) or one ulp either side.
  s0 = np.float32(0.375)
  k = rng.integers(0, qmax, size=(48, 30)).astype(np.float32)
  on = (k + np.float32(0.5)) * s0
  ties = np.stack([on, np.nextafter(on, np.float32(np.inf)), np.nextafter(on, np.float32(-np.inf))])
  ties = ties.reshape(-1, 30)
  ties = np.concatenate([np.zeros((len(ties), 1), np.float32), np.full((len(ties), 1), qmax * s0, np.float32),
                         ties], axis=1)
  x = np.concatenate([x, ties]).astype(np.float32)
  codes, scale, zero = quantize(jnp.asarray(x), bits=bits, axis=1, group_size=32, meta_dtype=meta_dtype)
  want = _exact_codes(x.reshape(len(x), 1, 32), scale, zero, bits).reshape(x.shape)
  np.testing.assert_array_equal(np.asarray(codes), want)
  # the threshold groups really have the pinned grid, and their ties went to the even code
  assert np.all(np.asarray(scale, np.float32)[-len(ties):] == s0) and np.all(np.asarray(zero)[-len(ties):] == 0)
  tie_codes = np.asarray(codes)[64:64 + 48, 2:]
  np.testing.assert_array_equal(tie_codes, k + (k % 2 == 1))


def test_code_correction_fixes_any_estimate_within_one():
  """The correction step returns the exact nearest code from an estimate off by one either way, ties included:
  so the estimate's reciprocal may be approximate (it is, in Triton) without changing a single code."""
  from jkv_kernels.quantization import _correct_code
  rng = np.random.default_rng(0)
  s = np.float32(0.0703125)  # 9 significant bits
  c = rng.integers(0, 256, size=4096).astype(np.float32)
  frac = rng.choice(np.array([-0.5, -0.25, 0.0, 0.25, 0.5, 0.4999], np.float32), size=c.shape)
  d = ((c + frac) * s).astype(np.float32)
  want = np.round(d.astype(np.float64) / np.float64(s))
  for offset in (-1.0, 0.0, 1.0):
    got = _correct_code(jnp.asarray(want + offset, jnp.float32), jnp.asarray(d), jnp.float32(s))
    np.testing.assert_array_equal(np.asarray(got), want)


# ------------------------------------------------------------------------------------------------- 1 bit (SpeCache)

def test_one_bit_quarter_points():
  """SpeCache's 1-bit grid (arXiv:2503.16163, Eq. 3): the levels are (3 mn + mx) / 4 and (mn + 3 mx) / 4, the code is
  x >= (mn + mx) / 2 and the midpoint itself maps to 1. Values are multiples of 1/4 in [-8, 8] with each group's
  min and max multiples of 2, so the quarter points and the midpoint are exact in fp16 and the identities hold
  bit for bit."""
  rng = np.random.default_rng(11)
  x = rng.integers(-32, 33, size=(6, 64)).astype(np.float32) / 4
  groups = x.reshape(6, 2, 32)
  groups[..., 0] = rng.integers(-4, -1, size=(6, 2)) * 2.0  # min
  groups[..., 1] = rng.integers(1, 5, size=(6, 2)) * 2.0  # max
  groups[:, 0, 2] = (groups[:, 0, 0] + groups[:, 0, 1]) / 2  # the midpoint of the first group
  groups = np.clip(groups, groups[..., :1], groups[..., 1:2])
  x = groups.reshape(6, 64)
  codes, scale, zero = quantize(jnp.asarray(x), bits=1, axis=1, group_size=32)
  mn, mx = groups.min(-1, keepdims=True), groups.max(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(codes).reshape(groups.shape), groups >= (mn + mx) / 2)
  assert np.all(np.asarray(codes).reshape(groups.shape)[:, 0, 2] == 1)
  x_hat = np.asarray(dequantize(codes, scale, zero, axis=1, group_size=32, dtype=jnp.float32)).reshape(groups.shape)
  levels = np.where(groups >= (mn + mx) / 2, (mn + 3 * mx) / 4, (3 * mn + mx) / 4)
  np.testing.assert_array_equal(x_hat, levels)


def test_one_bit_mse_is_a_quarter_of_plain_min_max():
  """On U(0, 1) groups the quarter-point quantizer's MSE is about range^2 / 48, where plain 1-bit
  min-max (every value to the group's min or max, computed here in numpy) gives about range^2 / 12."""
  x = np.random.default_rng(0).uniform(size=(256, 64)).astype(np.float32)
  codes, scale, zero = quantize(jnp.asarray(x), bits=1, axis=1, group_size=64, meta_dtype=jnp.float32)
  x_hat = np.asarray(dequantize(codes, scale, zero, axis=1, group_size=64, dtype=jnp.float32))
  mn, mx = x.min(1, keepdims=True), x.max(1, keepdims=True)
  plain = np.where(x - mn >= (mx - mn) / 2, mx, mn)
  mse, mse_plain = np.mean((x - x_hat) ** 2), np.mean((x - plain) ** 2)
  assert mse == pytest.approx(1 / 48, rel=0.1) and mse_plain == pytest.approx(1 / 12, rel=0.1)


@pytest.mark.parametrize("meta_dtype", [jnp.float16, jnp.bfloat16])
def test_one_bit_codes_are_the_nearer_stored_level(meta_dtype):
  """With the stored (rounded) s and z, the code picks the nearer of z and z + s, ties up; a constant group is
  finite and exact. Checked in float64 against each element's distance to both stored levels."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(64, 32)).astype(np.float32) * rng.uniform(0.01, 100.0, size=(64, 1)).astype(np.float32)
  x[0] = 3.0  # a constant group
  codes, scale, zero = quantize(jnp.asarray(x), bits=1, axis=1, group_size=32, meta_dtype=meta_dtype)
  s = np.asarray(scale, np.float32).astype(np.float64)
  z = np.asarray(zero, np.float32).astype(np.float64)
  d = (x - np.asarray(zero, np.float32)).astype(np.float64)  # x - z rounded once in fp32, as the quantizer does
  np.testing.assert_array_equal(np.asarray(codes), d >= s / 2)
  x_hat = np.asarray(dequantize(codes, scale, zero, axis=1, group_size=32, dtype=jnp.float32))
  assert np.all(np.isfinite(x_hat)) and np.all(x_hat[0] == 3.0)
  near = np.minimum(np.abs(x - z), np.abs(x - (z + s)))
  np.testing.assert_allclose(np.abs(x - x_hat), near, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis", [-2, -1])
def test_one_bit_quantize_pack_kernel_equals_reference(axis):
  """The fused quantize-and-pack kernel (interpret mode) writes the same 1-bit codes and metadata as the
  reference, in both KIVI layouts, and they unpack to ``quantize``'s codes."""
  from jkv_kernels.quantize_pack import quantize_pack, quantize_pack_reference
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 128, 64)), jnp.float32)
  got = quantize_pack(x, bits=1, group_size=32, axis=axis, interpret=True)
  want = quantize_pack_reference(x, bits=1, group_size=32, axis=axis)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  codes = quantize(x, bits=1, axis=axis, group_size=32)[0]
  expect = jnp.swapaxes(codes, -1, -2) if axis == -2 else codes  # keys are stored channel-major
  np.testing.assert_array_equal(np.asarray(unpack(got[0], bits=1, axis=-1)), np.asarray(expect))
