"""Fused quantize-and-pack (Pallas, Triton lowering): K/V rows in, KIVI-layout packed codes and metadata out.

One kernel serves both KIVI groupings of x [..., T, D] (tokens by channels), chosen by ``axis`` as in
``quantization.quantize``:

    axis=-2  per-channel keys: groups of G tokens per channel, packed along tokens, stored channel-major
             codes [..., D, T/P] uint32, scale and zero [..., D, T/G]       (the k_codes layout)
    axis=-1  per-token values: groups of G channels per token, packed along channels
             codes [..., T, D/P] uint32, scale and zero [..., T, D/G]       (the v_codes layout)

The arithmetic is ``quantization.quantize_groups`` and ``quantization.pack_last_axis`` run on a tile, so the kernel
and ``quantize_pack_reference`` agree bit for bit.
"""

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from jkv_kernels.dequant_attention import triton_compiler_params
from jkv_kernels.quantization import check_bits, pack, pack_last_axis, quantize, quantize_groups


def _quantize_pack_kernel(
    x_ref,      # [block_t, D]
    codes_ref,  # along tokens: [D, block_t // P]; along channels: [block_t, D // P]
    scale_ref,  # along tokens: [D, block_t // G]; along channels: [block_t, D // G]
    zero_ref,   # same as scale_ref
    *,
    bits: int,
    group_size: int,
    along_tokens: bool,
    interpret: bool,
):
  x = x_ref[...].astype(jnp.float32)
  if along_tokens:
    x = x.T  # [D, block_t]: groups and words now run along the last axis
  rows, length = x.shape
  codes, scale, zero = quantize_groups(x.reshape(rows, length // group_size, group_size), bits=bits,
                                       meta_dtype=scale_ref.dtype, xla=interpret)
  codes_ref[...] = pack_last_axis(codes.reshape(rows, length), bits=bits)
  scale_ref[...] = scale
  zero_ref[...] = zero


def _quantize_pack_pallas(
    x,  # [N, T, D]
    *,
    bits: int,
    group_size: int,
    along_tokens: bool,
    meta_dtype,
    block_t: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
  """One pallas_call over grid (N, T // block_t)."""
  batch, tokens, head_dim = x.shape
  per_word = 32 // bits
  if along_tokens:
    # The outputs are channel-major: token block i lands in column block i.
    out_shapes = [(head_dim, tokens // per_word), (head_dim, tokens // group_size)]
    out_blocks = [(head_dim, block_t // per_word), (head_dim, block_t // group_size)]
    out_index = lambda n, i: (n, 0, i)
  else:
    out_shapes = [(tokens, head_dim // per_word), (tokens, head_dim // group_size)]
    out_blocks = [(block_t, head_dim // per_word), (block_t, head_dim // group_size)]
    out_index = lambda n, i: (n, i, 0)
  (codes_shape, meta_shape), (codes_block, meta_block) = out_shapes, out_blocks
  kernel = functools.partial(_quantize_pack_kernel, bits=bits, group_size=group_size, along_tokens=along_tokens,
                             interpret=interpret)
  return pl.pallas_call(
      kernel,
      grid=(batch, tokens // block_t),
      in_specs=[pl.BlockSpec((None, block_t, head_dim), lambda n, i: (n, i, 0))],  # x
      out_specs=[
          pl.BlockSpec((None, *codes_block), out_index),  # codes
          pl.BlockSpec((None, *meta_block), out_index),   # scale
          pl.BlockSpec((None, *meta_block), out_index),   # zero
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, *codes_shape), jnp.uint32),  # codes
          jax.ShapeDtypeStruct((batch, *meta_shape), meta_dtype),   # scale
          jax.ShapeDtypeStruct((batch, *meta_shape), meta_dtype),   # zero
      ],
      compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"quantize_pack_{bits=}_{group_size=}_{along_tokens=}_{block_t=}",
  )(x)


def _is_power_of_2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@functools.partial(
    jax.jit,
    static_argnames=["bits", "group_size", "axis", "meta_dtype", "block_t", "num_warps", "num_stages", "interpret"])
def quantize_pack(
    x,  # [..., T, D]
    *,
    bits: int,
    group_size: int,
    axis: int,
    meta_dtype=jnp.float16,
    block_t: int = 128,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
):
  """Quantizes x [..., T, D] in groups along ``axis`` (-2: tokens, -1: channels) and packs the codes along it.

  Returns (codes uint32, scale, zero) in the layouts of the module docstring. ``block_t`` (tokens per program, a
  power of two) is clamped to the largest power of two dividing T; along tokens it must cover whole groups.
  """
  check_bits(bits)
  if x.ndim < 2 or axis % x.ndim not in (x.ndim - 2, x.ndim - 1):
    raise ValueError(f"axis must be -2 (tokens) or -1 (channels) of x [..., T, D], got {axis} for {x.shape}")
  along_tokens = axis % x.ndim == x.ndim - 2
  *lead, tokens, head_dim = x.shape
  per_word = 32 // bits
  length = tokens if along_tokens else head_dim
  if length % group_size or group_size % per_word:
    raise ValueError(f"axis {axis} of x {x.shape} has length {length}: it must be a multiple of group_size "
                     f"{group_size}, itself a multiple of the {per_word} codes per word at {bits} bits")
  # The Triton lowering needs power-of-two tiles.
  if not (_is_power_of_2(head_dim) and _is_power_of_2(group_size)):
    raise ValueError(f"head_dim {head_dim} and group_size {group_size} must be powers of two for the kernel")
  block_t = min(block_t, tokens & -tokens)
  if along_tokens and block_t % group_size:
    raise ValueError(f"block_t {block_t} (clamped to T {tokens}) must be a multiple of group_size {group_size}")
  codes, scale, zero = _quantize_pack_pallas(
      x.reshape(-1, tokens, head_dim), bits=bits, group_size=group_size, along_tokens=along_tokens,
      meta_dtype=meta_dtype, block_t=block_t, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
  return tuple(a.reshape(*lead, *a.shape[1:]) for a in (codes, scale, zero))


@functools.partial(jax.jit, static_argnames=["bits", "group_size", "axis", "meta_dtype"])
def quantize_pack_reference(x, *, bits: int, group_size: int, axis: int, meta_dtype=jnp.float16):
  """``quantize_pack`` from ``quantization.quantize`` and ``quantization.pack`` (plus the key transpose)."""
  codes, scale, zero = quantize(x, bits=bits, axis=axis, group_size=group_size, meta_dtype=meta_dtype)
  words = pack(codes, bits=bits, axis=axis)
  if axis % x.ndim == x.ndim - 2:
    return tuple(jnp.swapaxes(a, -1, -2) for a in (words, scale, zero))
  return words, scale, zero
