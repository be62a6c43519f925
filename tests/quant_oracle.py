"""Min-max group quantization in numpy, written from docs/methods/kivi.md, 'The quantizer' (for 1 bit SpeCache's
Eq. 3, arXiv:2503.16163), not from ``jkv_kernels.quantization``: the independent reference that method tests
build their oracles from.

It follows the stored format's arithmetic step by step in float32 (scale and zero computed in float32 and
rounded to fp16 as stored, codes from the float32 difference x - zero and the exact quotient), so its codes and
metadata are bit-identical to a correct quantizer on any backend, and its dequantized values are float64.
"""

import numpy as np


def quantize_groups(groups, bits: int):
  """groups [..., G] -> (codes [..., G] int64, scale [...] fp16, zero [...] fp16)."""
  x = np.asarray(groups, np.float32)
  lo, hi = x.min(axis=-1), x.max(axis=-1)
  if bits == 1:  # the quarter points (3 min + max) / 4 and (min + 3 max) / 4, level gap (max - min) / 2
    scale = ((hi - lo) * np.float32(0.5)).astype(np.float16)
    zero = (lo + (hi - lo) * np.float32(0.25)).astype(np.float16)
  else:
    scale = ((hi - lo) * np.float32(1.0 / (2**bits - 1))).astype(np.float16)
    zero = lo.astype(np.float16)
  d = (x - zero.astype(np.float32)[..., None]).astype(np.float64)
  s = scale.astype(np.float64)[..., None]
  if bits == 1:
    codes = (d >= 0.5 * s).astype(np.int64)  # round half up
  else:
    codes = np.clip(np.round(d / np.where(s == 0, 1.0, s)), 0, 2**bits - 1).astype(np.int64)  # half to even
  return codes, scale, zero


def quantize(x, *, bits: int, axis: int, group_size: int):
  """Groups of ``group_size`` consecutive elements along ``axis`` -> (codes like x, scale and zero with ``axis``
  shortened by ``group_size``)."""
  x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
  codes, scale, zero = quantize_groups(x.reshape(*x.shape[:-1], -1, group_size), bits)
  return np.moveaxis(codes.reshape(x.shape), -1, axis), np.moveaxis(scale, -1, axis), np.moveaxis(zero, -1, axis)


def fake_quant(x, *, bits: int, axis: int, group_size: int):
  """Quantize then dequantize (c * s + z in float64): x's shape, float64."""
  codes, scale, zero = quantize(x, bits=bits, axis=axis, group_size=group_size)
  per_element = lambda m: np.repeat(m.astype(np.float64), group_size, axis=axis)
  return codes * per_element(scale) + per_element(zero)
