"""The one quantizer and the one bit-packing routine of jkv, in plain jnp.

Asymmetric min-max quantization over groups of ``group_size`` consecutive elements along one axis (KIVI,
arXiv:2402.02750; docs/methods/kivi.md):

    z = min(group), s = (max(group) - min(group)) * fl(1 / (2**bits - 1))   (fp32, then stored in ``meta_dtype``)
    c = clip(round_half_even((x - z) / s), 0, 2**bits - 1)                  (with the *stored* s and z)
    x' = c * s + z

At 1 bit the grid is SpeCache's (docs/methods/specache.md; SpeCache's Eq. 3): z = (3 min + max) / 4,
s = (max - min) / 2, so the two levels are the quarter points of the range, and c = 1 iff x - z >= s / 2 (the
midpoint goes up); plain min-max at 1 bit would map every value to the group's min or max.

Codes are computed from the stored (rounded) s and z, so quantize and dequantize agree; a constant group (s = 0)
divides by 1 instead and reconstructs exactly. Codes are packed into uint32 words, ``32 // bits`` per word along
one axis, element j of a word at bits [bits*j, bits*j + bits), j = 0 least significant (as KIVI's code).

Bit-exact on every backend. The Pallas kernel (Triton) and the reference (XLA) must produce the same codes on CPU
and GPU, and a floating-point division is where they differ: Triton lowers fp32 ``/`` to the approximate
``div.full.f32`` (up to 2 ulp off), XLA emits an IEEE division, and XLA's simplifier rewrites ``x / const`` into
``x * (1 / const)``; one ulp in (x - z) / s moves a value that sits near a rounding boundary to the next code
(seen on an H100). So the arithmetic here uses no division whose rounding matters:

- s multiplies by the fp32 constant fl(1/qmax) (one correctly rounded product everywhere; it differs from
  (max - min) / qmax by at most one fp32 ulp before the cast to ``meta_dtype``).
- c is *defined* as the integer nearest to the exact real quotient (x - z) / s (ties to even), and computed
  so: an estimate c0 = floor((x - z) * (1 / s) + 0.5) from any approximate reciprocal (within one code of the
  answer, since the estimate is off by far less than one half), then one correction step that compares d = x - z
  with the decision thresholds (c0 ± 0.5) * s. With s in fp16 or bf16 (<= 11 significant bits) and c0 + 0.5 in
  at most 9 bits, those products are exact in fp32, d is one IEEE subtraction and comparisons are exact, so the
  codes do not depend on how either compiler rounds, contracts (FMA) or divides. With an fp32 ``meta_dtype`` the
  thresholds are rounded products, still identical on every backend (a multiply followed by a compare cannot be
  contracted).

The ``*_last_axis`` / ``quantize_groups`` forms are the in-register versions that the Pallas kernels call on a tile:
they use only operations the Triton lowering has (no ``round``, no gathers), so the kernels and the references here
run the very same arithmetic.
"""

import jax
import jax.numpy as jnp

BITS = (1, 2, 4, 8)


def codes_per_word(bits: int) -> int:
  """Number of ``bits``-wide codes in one uint32 word."""
  check_bits(bits)
  return 32 // bits


def check_bits(bits: int, allowed: tuple[int, ...] = BITS) -> None:
  if bits not in allowed:
    raise ValueError(f"bits must be one of {allowed}, got {bits}")


def _correct_code(c0, d, s):
  """The integer nearest to d / s (exact quotient, ties to even), given an estimate c0 within one of it.

  Compares d with the decision thresholds (c0 +- 0.5) * s; a tie goes to the even neighbour.
  """
  c0_is_odd = (c0 - 2.0 * jnp.floor(0.5 * c0)) == 1.0
  upper = (c0 + 0.5) * s
  lower = (c0 - 0.5) * s
  up = (d > upper) | ((d == upper) & c0_is_odd)
  down = (d < lower) | ((d == lower) & c0_is_odd)
  return c0 + jnp.where(up, 1.0, 0.0) - jnp.where(down, 1.0, 0.0)


def _nearest_code(d, s, qmax: int):
  """clip(round_half_even(d / s), 0, qmax) for d = x - z and s > 0, with the exact quotient (module docstring).

  The estimate may come from any approximate reciprocal (Triton's and XLA's differ); the correction step makes
  the result independent of it.
  """
  c0 = jnp.floor(d * (1.0 / s) + 0.5)
  return jnp.clip(_correct_code(c0, d, s), 0.0, float(qmax))


def as_stored(x, dtype):
  """x rounded to ``dtype`` as it will be stored, for use in the same XLA program: XLA on a GPU may drop an
  f32 -> f16 -> f32 round trip (it allows excess precision), in some fusions and not others, so a value computed
  and then used at higher precision could differ from the stored one; an optimization barrier keeps the rounding.
  (Not inside a Triton kernel: no such rewrite there, and no lowering for the barrier.)"""
  return jax.lax.optimization_barrier(jax.tree.map(lambda a: a.astype(dtype), x))


def quantize_groups(x, *, bits: int, meta_dtype=jnp.float16, xla: bool = True):
  """Quantizes each row of the last axis as one group.

  Args:
    x: [..., G] values; every slice along the last axis is one group.
    bits: code width.
    meta_dtype: dtype in which scale and zero are stored.
    xla: this runs under XLA (the reference, or a kernel in interpret mode), not inside a compiled Triton kernel:
      scale and zero go through ``as_stored``, so the codes, and a caller dequantizing in the same program
      (fake quantization, a test's oracle), use the rounded values.

  Returns:
    codes [..., G] uint32, scale [...] and zero [...] in ``meta_dtype``.
  """
  qmax = 2**bits - 1
  x = x.astype(jnp.float32)
  lo = jnp.min(x, axis=-1)
  hi = jnp.max(x, axis=-1)
  if bits == 1:
    # SpeCache's 1-bit quantizer (its Eq. 3): the two levels are the quarter points (3 min + max) / 4 and
    # (min + 3 max) / 4, not min and max (which inflate every magnitude). Scaling by 1/4 and 1/2 is exact, so
    # no backend can round these differently.
    scale, zero = (hi - lo) * jnp.float32(0.5), lo + (hi - lo) * jnp.float32(0.25)
  else:
    scale, zero = (hi - lo) * jnp.float32(1.0 / qmax), lo
  # Codes from the stored (rounded) scale and zero, so that dequantize(quantize(x)) uses the same grid.
  scale, zero = as_stored((scale, zero), meta_dtype) if xla else (scale.astype(meta_dtype), zero.astype(meta_dtype))
  s = scale.astype(jnp.float32)[..., None]
  z = zero.astype(jnp.float32)[..., None]
  if bits == 1:
    # The nearer of the two stored levels, the midpoint going up (round half up); 0.5 * s is exact.
    codes = jnp.where(x - z >= 0.5 * s, 1.0, 0.0)
  else:
    codes = _nearest_code(x - z, jnp.where(s == 0.0, 1.0, s), qmax)
  return codes.astype(jnp.uint32), scale, zero


def _group_view(x, axis: int, group_size: int):
  """Moves ``axis`` last and splits it into [n_groups, group_size]; checks divisibility."""
  axis = axis % x.ndim
  length = x.shape[axis]
  if length % group_size:
    raise ValueError(f"axis {axis} has length {length}, which is not divisible by group_size {group_size}")
  moved = jnp.moveaxis(x, axis, -1)
  return moved.reshape(*moved.shape[:-1], length // group_size, group_size), axis


def quantize(x, *, bits: int, axis: int, group_size: int, meta_dtype=jnp.float16):
  """Asymmetric min-max quantization over groups of ``group_size`` consecutive elements along ``axis``.

  Args:
    x: array of any float dtype; ``x.shape[axis]`` must be divisible by ``group_size``.
    bits: one of 1, 2, 4, 8 (1: SpeCache's quarter-point levels, module docstring).
    axis: the grouping axis (keys: tokens, values: channels).
    group_size: elements per group along ``axis``.
    meta_dtype: storage dtype of scale and zero.

  Returns:
    codes: uint32, x.shape, values in [0, 2**bits - 1].
    scale, zero: ``meta_dtype``, x.shape with ``axis`` divided by ``group_size``.
  """
  check_bits(bits)
  groups, axis = _group_view(x, axis, group_size)
  codes, scale, zero = quantize_groups(groups, bits=bits, meta_dtype=meta_dtype)
  codes = jnp.moveaxis(codes.reshape(*codes.shape[:-2], -1), -1, axis)
  return codes, jnp.moveaxis(scale, -1, axis), jnp.moveaxis(zero, -1, axis)


def dequantize(codes, scale, zero, *, axis: int, group_size: int, dtype):
  """x' = c * s + z in fp32, cast to ``dtype``; scale and zero have ``axis`` shorter by ``group_size``."""
  axis = axis % codes.ndim
  expected = codes.shape[:axis] + (codes.shape[axis] // group_size,) + codes.shape[axis + 1:]
  if codes.shape[axis] % group_size or scale.shape != expected or zero.shape != expected:
    raise ValueError(
        f"codes {codes.shape} with group_size {group_size} along axis {axis} need scale and zero of shape "
        f"{expected}, got {scale.shape} and {zero.shape}")
  s = jnp.repeat(scale.astype(jnp.float32), group_size, axis=axis)
  z = jnp.repeat(zero.astype(jnp.float32), group_size, axis=axis)
  return (codes.astype(jnp.float32) * s + z).astype(dtype)


def pack_last_axis(codes, *, bits: int):
  """[..., n * P] codes (uint32, each < 2**bits) -> [..., n] uint32 words, P = 32 // bits."""
  per_word = 32 // bits
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  fields = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_word, per_word) << shifts
  # The bit fields are disjoint, so their sum is their bitwise or (and the Triton lowering has sum, not or).
  return jnp.sum(fields, axis=-1, dtype=jnp.uint32)


def unpack_last_axis(words, *, bits: int):
  """[..., n] uint32 words -> [..., n * P] uint32 codes, P = 32 // bits; the inverse of ``pack_last_axis``."""
  per_word = 32 // bits
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  codes = (words[..., None] >> shifts) & jnp.uint32(2**bits - 1)
  return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def codes_as_float32(codes):
  """uint32 codes (< 2**23) -> float32, exactly: the bits of 2**23 + c minus 2**23 (full-rate integer and float
  ops on a GPU, where an int-to-float conversion runs at a quarter of the rate)."""
  return jax.lax.bitcast_convert_type(codes | jnp.uint32(0x4B000000), jnp.float32) - 8388608.0


def dequantize_packed_last_axis(words, scale, zero, *, bits: int, group_size: int, dtype):
  """Unpack and dequantize in one pass: words [..., n] with scale, zero [..., max(1, n * P / G)] -> [..., n * P].

  The in-register form the kernels use. It equals ``dequantize(unpack_last_axis(words), ...)`` exactly, but is
  shaped for a GPU: the scales are broadcast per word (G / P words share one) rather than per code, so the
  only full-size reshape is the last one; and a code becomes a float by ``codes_as_float32``. A tile that
  lies inside one group (G >= n * P: a kernel block shorter than a key group) takes that group's one scale and
  zero column [..., 1], broadcast over every word without a reshape.
  """
  per_word = 32 // bits
  *lead, n = words.shape
  groups = max(1, n * per_word // group_size)
  if groups == 1:  # the tile lies inside one group: its one column on every word
    s = jnp.broadcast_to(scale.astype(jnp.float32), (*lead, n))
    z = jnp.broadcast_to(zero.astype(jnp.float32), (*lead, n))
  else:
    s = jnp.broadcast_to(scale.astype(jnp.float32)[..., None], (*lead, groups, n // groups))
    z = jnp.broadcast_to(zero.astype(jnp.float32)[..., None], (*lead, groups, n // groups))
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  codes = (words[..., None] >> shifts) & jnp.uint32(2**bits - 1)  # [..., n, P]
  x = codes_as_float32(codes) * s.reshape(*lead, n)[..., None] + z.reshape(*lead, n)[..., None]
  return x.reshape(*lead, n * per_word).astype(dtype)


def pack(codes, *, bits: int, axis: int):
  """Packs ``32 // bits`` codes per uint32 word along ``axis`` (whose length must be a multiple of that)."""
  per_word = codes_per_word(bits)
  axis = axis % codes.ndim
  if codes.shape[axis] % per_word:
    raise ValueError(f"axis {axis} has length {codes.shape[axis]}, not a multiple of {per_word} codes per word "
                     f"at {bits} bits")
  words = pack_last_axis(jnp.moveaxis(codes.astype(jnp.uint32), axis, -1), bits=bits)
  return jnp.moveaxis(words, -1, axis)


def unpack(words, *, bits: int, axis: int):
  """Inverse of ``pack``: ``axis`` grows by ``32 // bits``."""
  check_bits(bits)
  axis = axis % words.ndim
  codes = unpack_last_axis(jnp.moveaxis(words.astype(jnp.uint32), axis, -1), bits=bits)
  return jnp.moveaxis(codes, -1, axis)
