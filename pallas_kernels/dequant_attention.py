"""Fused decode attention over a KIVI-layout quantized cache plus full-precision segments (Pallas, Triton lowering).

Layout of one layer's cache (C = capacity, G = group_size, Pk = 32 // k_bits, Pv = 32 // v_bits):

    k_codes [B, Hkv, D, C/Pk] uint32   keys per channel: groups of G tokens, codes packed along tokens
    k_scale, k_zero [B, Hkv, D, C/G]
    v_codes [B, Hkv, C, D/Pv] uint32   values per token: groups of G channels, codes packed along channels
    v_scale, v_zero [B, Hkv, C, D/G]
    quant_len [B] int32                token positions [0, quant_len[b]) of the store are valid for every query row
    segments ((k [B, Hkv, S, D], v [B, Hkv, S, D], mask [B, T, S] bool), ...)   full-precision tokens (KIVI's
                                       residual window, outlier pools, prefetched rows); S may differ per segment

One softmax runs over everything (KIVI spec §2.6-2.7). The kernel stacks the T*g query rows that share a KV head
into one tile, so K/V are read once per KV head. Each block of block_k tokens is unpacked and dequantized in
registers (``quantization.dequantize_packed_last_axis``), so the packed cache is read once and never written
back dequantized; one dot gives the block's logits and one its values. The store is split along tokens (flash-decoding): every split and every segment writes
an unnormalized partial (o, l, m), and a few jnp lines merge them exactly.
"""

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jkv_kernels.attention_reference import MASK_VALUE, gqa_attention_reference
from jkv_kernels.quantization import BITS, check_bits, dequantize, dequantize_packed_last_axis, unpack

KERNEL_BITS = (2, 4, 8)


# Names moved between jax versions: `pl.TritonCompilerParams` became `plgpu.CompilerParams`, and `pl.dot` (now
# deprecated) moved to `plgpu.dot`.
_dot = getattr(plgpu, "dot", None) or pl.dot


def triton_compiler_params(*, num_warps: int, num_stages: int):
  """Triton compiler parameters under whichever name this jax has.

  Passing them explicitly selects the Triton lowering on every jax version (a bare ``pallas_call`` may lower
  differently); interpret mode ignores them.
  """
  params_class = getattr(plgpu, "CompilerParams", None) or pl.TritonCompilerParams
  return params_class(num_warps=num_warps, num_stages=num_stages)


def _next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _online_softmax_step(carry, logits, valid, v, precision):
  """One flash-decoding update with a block of n tokens.

  Args:
    carry: (o [M, D] f32 unnormalized output, m [M] running max, l [M] running sum).
    logits: [M, n] f32, already scaled.
    valid: [M or 1, n] bool.
    v: [n, D] value tile in the dot dtype.
    precision: dot precision (HIGHEST for fp32 inputs, where Triton would otherwise use TF32).
  """
  o, m, l = carry
  m_next = jnp.maximum(m, jnp.max(jnp.where(valid, logits, MASK_VALUE), axis=1))
  alpha = jnp.exp(m - m_next)
  # Masked entries are zeroed, not just made small: a block where a row has no valid token has m_next = MASK_VALUE.
  p = jnp.where(valid, jnp.exp(logits - m_next[:, None]), 0.0)
  # Slots that no row attends may hold garbage (even NaN): 0 * NaN would leak through the dot.
  slot_valid = jnp.max(valid.astype(jnp.int32), axis=0) > 0
  v = jnp.where(slot_valid[:, None], v, 0)
  o = o * alpha[:, None] + _dot(p.astype(v.dtype), v, precision=precision)
  return o, m_next, l * alpha + jnp.sum(p, axis=1)


def _decode_attention_kernel(
    # inputs
    quant_len_ref,  # [1] int32
    q_ref,          # [M, D]: the T*g query rows of one KV head, zero-padded to M
    k_codes_ref,    # [D, C // Pk] uint32
    k_scale_ref,    # [D, C // G]
    k_zero_ref,     # [D, C // G]
    v_codes_ref,    # [C, D // Pv] uint32
    v_scale_ref,    # [C, D // G]
    v_zero_ref,     # [C, D // G]
    *refs,          # per segment: k [S_pad, D], v [S_pad, D], mask [M, S_pad] int8; then the outputs:
                    # o [M, D] (unnormalized), l [M], m [M], of which only the first n_rows exist
    n_rows: int,
    k_bits: int,
    v_bits: int,
    group_size: int,
    sm_scale: float,
    block_k: int,
    blocks_per_split: int,
    k_splits: int,
    segment_blocks: tuple[int, ...],
):
  *segment_refs, o_ref, l_ref, m_ref = refs
  split = pl.program_id(2)
  rows, head_dim = q_ref.shape
  dot_dtype = q_ref.dtype
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  q = q_ref[...].astype(jnp.float32)
  init = (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))

  def store(carry):
    # Only the T*g real rows are written: the padding rows would multiply the partials' traffic by M / (T*g).
    o, m, l = carry
    real = lax.broadcasted_iota(jnp.int32, (rows,), 0) < n_rows
    plgpu.store(o_ref, o.astype(o_ref.dtype), mask=real[:, None])
    plgpu.store(l_ref, l, mask=real)
    plgpu.store(m_ref, m, mask=real)

  def quantized_block(i, carry):
    """Tokens [start, start + block_k) of the store."""
    start = (split * blocks_per_split + i) * block_k
    valid = (start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < quant_len_ref[0]

    # The whole key tile is dequantized in registers and meets the query in one dot: every load is a 2-D tile
    # whose rows are contiguous. (Folding each group's key scales into the query instead costs block_k / G small
    # dots and column-wise scale loads; it measured 1.4x slower on an H100.)
    groups = pl.ds(start // group_size, block_k // group_size)
    k_hat = dequantize_packed_last_axis(
        k_codes_ref[:, pl.ds(start // (32 // k_bits), block_k // (32 // k_bits))], k_scale_ref[:, groups],
        k_zero_ref[:, groups], bits=k_bits, group_size=group_size, dtype=dot_dtype)  # [D, block_k]
    logits = _dot(q.astype(dot_dtype), k_hat, precision=precision) * sm_scale
    tokens = pl.ds(start, block_k)
    v_hat = dequantize_packed_last_axis(v_codes_ref[tokens, :], v_scale_ref[tokens, :], v_zero_ref[tokens, :],
                                        bits=v_bits, group_size=group_size, dtype=dot_dtype)  # [block_k, D]
    return _online_softmax_step(carry, logits, valid, v_hat, precision)

  @pl.when(split < k_splits)
  def _():
    # Blocks wholly past quant_len are never visited: the trip count stops at the last valid block.
    first = split * blocks_per_split
    valid_blocks = pl.cdiv(quant_len_ref[0], block_k)
    n_blocks = jnp.clip(valid_blocks - first, 0, blocks_per_split)
    store(lax.fori_loop(0, n_blocks, quantized_block, init))

  for index, block_s in enumerate(segment_blocks):
    k_ref, v_ref, mask_ref = segment_refs[3 * index: 3 * index + 3]

    def segment_block(i, carry, k_ref=k_ref, v_ref=v_ref, mask_ref=mask_ref, block_s=block_s):
      window = pl.ds(i * block_s, block_s)
      k = k_ref[window, :].astype(dot_dtype)  # [block_s, D]
      logits = _dot(q.astype(dot_dtype), k, trans_b=True, precision=precision) * sm_scale
      valid = mask_ref[:, window] != 0  # [M, block_s]
      return _online_softmax_step(carry, logits, valid, v_ref[window, :].astype(dot_dtype), precision)

    @pl.when(split == k_splits + index)
    def _(segment_block=segment_block, k_ref=k_ref, block_s=block_s):
      store(lax.fori_loop(0, k_ref.shape[0] // block_s, segment_block, init))


def _decode_attention_partials(
    q,          # [B, Hkv, M, D]: n_rows query rows, zero-padded to M
    k_codes,    # [B, Hkv, D, C // Pk]
    k_scale,    # [B, Hkv, D, C // G]
    k_zero,     # [B, Hkv, D, C // G]
    v_codes,    # [B, Hkv, C, D // Pv]
    v_scale,    # [B, Hkv, C, D // G]
    v_zero,     # [B, Hkv, C, D // G]
    quant_len,  # [B] int32, clipped to [0, C]
    segments,   # ((k [B, Hkv, S_pad, D], v [B, Hkv, S_pad, D], mask [B, M, S_pad] int8), ...)
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    sm_scale: float,
    block_k: int,
    k_splits: int,
    n_rows: int,
    segment_blocks: tuple[int, ...],
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
  """One pallas_call: grid (B, Hkv, k_splits + len(segments)); returns the partials o, l, m of the n_rows rows."""
  batch, kv_heads, rows, head_dim = q.shape
  capacity = v_codes.shape[2]
  n_blocks = capacity // block_k
  blocks_per_split = pl.cdiv(n_blocks, k_splits)
  partials = k_splits + len(segments)
  kernel = functools.partial(
      _decode_attention_kernel, n_rows=n_rows, k_bits=k_bits, v_bits=v_bits, group_size=group_size, sm_scale=sm_scale,
      block_k=block_k, blocks_per_split=blocks_per_split, k_splits=k_splits, segment_blocks=segment_blocks)

  def per_head(*block):
    return pl.BlockSpec((None, None, *block), lambda b, h, s: (b, h) + (0,) * len(block))

  segment_specs, segment_arrays = [], []
  for k, v, mask in segments:
    seg_len = k.shape[2]
    segment_specs += [
        per_head(seg_len, head_dim),                                   # k
        per_head(seg_len, head_dim),                                   # v
        pl.BlockSpec((None, rows, seg_len), lambda b, h, s: (b, 0, 0)),  # mask
    ]
    segment_arrays += [k, v, mask]
  o, l, m = pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, partials),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (b,)),        # quant_len
          per_head(rows, head_dim),                        # q
          per_head(head_dim, k_codes.shape[3]),            # k_codes
          per_head(head_dim, k_scale.shape[3]),            # k_scale
          per_head(head_dim, k_zero.shape[3]),             # k_zero
          per_head(capacity, v_codes.shape[3]),            # v_codes
          per_head(capacity, v_scale.shape[3]),            # v_scale
          per_head(capacity, v_zero.shape[3]),             # v_zero
          *segment_specs,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),  # o
          pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),                # l
          pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),                # m
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, kv_heads, partials, n_rows, head_dim), q.dtype),  # o
          jax.ShapeDtypeStruct((batch, kv_heads, partials, n_rows), jnp.float32),        # l
          jax.ShapeDtypeStruct((batch, kv_heads, partials, n_rows), jnp.float32),        # m
      ],
      compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"kivi_decode_attention_{k_bits=}_{v_bits=}_{group_size=}_{block_k=}_{k_splits=}_{rows=}",
  )(quant_len, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *segment_arrays)
  return o, l, m


def _merge_partials(o, l, m):
  """Exact softmax merge of partials o [..., P, M, D], l, m [..., P, M] -> [..., M, D] f32; empty rows give 0."""
  m_all = jnp.max(m, axis=-2, keepdims=True)
  alpha = jnp.exp(m - m_all)
  l_all = jnp.sum(alpha * l, axis=-2)
  o_all = jnp.sum(alpha[..., None] * o.astype(jnp.float32), axis=-3)
  return o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _check_shapes(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, segments, *, k_bits, v_bits,
                  group_size, allowed_bits):
  """Raises ValueError naming the shapes that disagree with the KIVI layout in the module docstring."""
  check_bits(k_bits, allowed_bits)
  check_bits(v_bits, allowed_bits)
  if q.ndim != 5:
    raise ValueError(f"q must be [B, Hkv, T, g, D], got shape {q.shape}")
  batch, kv_heads, t_rows, _, head_dim = q.shape
  if v_codes.ndim != 4:
    raise ValueError(f"v_codes must be [B, Hkv, C, D/Pv], got shape {v_codes.shape}")
  capacity = v_codes.shape[2]
  if head_dim % group_size or capacity % group_size:
    raise ValueError(f"group_size {group_size} must divide head_dim {head_dim} and capacity {capacity}")
  pk, pv = 32 // k_bits, 32 // v_bits
  if group_size % pk or group_size % pv:
    raise ValueError(f"group_size {group_size} must be a multiple of the codes per word ({pk} keys, {pv} values)")
  expected = {
      "k_codes": (k_codes, (batch, kv_heads, head_dim, capacity // pk)),
      "k_scale": (k_scale, (batch, kv_heads, head_dim, capacity // group_size)),
      "k_zero": (k_zero, (batch, kv_heads, head_dim, capacity // group_size)),
      "v_codes": (v_codes, (batch, kv_heads, capacity, head_dim // pv)),
      "v_scale": (v_scale, (batch, kv_heads, capacity, head_dim // group_size)),
      "v_zero": (v_zero, (batch, kv_heads, capacity, head_dim // group_size)),
      "quant_len": (quant_len, (batch,)),
  }
  for name, (array, shape) in expected.items():
    if array.shape != shape:
      raise ValueError(f"{name} has shape {array.shape}, expected {shape} for q {q.shape}, v_codes "
                       f"{v_codes.shape}, {k_bits=}, {v_bits=}, {group_size=}")
  for name in ("k_codes", "v_codes"):
    if expected[name][0].dtype != jnp.uint32:
      raise ValueError(f"{name} must be uint32, got {expected[name][0].dtype}")
  if quant_len.dtype != jnp.int32:
    raise ValueError(f"quant_len must be int32, got {quant_len.dtype}")
  for index, segment in enumerate(segments):
    if len(segment) != 3:
      raise ValueError(f"segment {index} must be (k, v, mask), got {len(segment)} arrays")
    k, v, mask = segment
    seg_len = k.shape[2] if k.ndim == 4 else -1
    if k.shape != (batch, kv_heads, seg_len, head_dim) or v.shape != k.shape:
      raise ValueError(f"segment {index}: k {k.shape} and v {v.shape} must both be [B, Hkv, S, D] = "
                       f"[{batch}, {kv_heads}, S, {head_dim}] for q {q.shape}")
    if mask.shape != (batch, t_rows, seg_len) or mask.dtype != jnp.bool_:
      raise ValueError(f"segment {index}: mask {mask.shape} {mask.dtype} must be bool [B, T, S] = "
                       f"[{batch}, {t_rows}, {seg_len}]")


@functools.partial(
    jax.jit,
    static_argnames=["k_bits", "v_bits", "group_size", "sm_scale", "block_k", "k_splits",
                     "num_warps", "num_stages", "interpret"])
def decode_attention(
    q,          # [B, Hkv, T, g, D]
    k_codes,    # [B, Hkv, D, C // Pk] uint32
    k_scale,    # [B, Hkv, D, C // G]
    k_zero,     # [B, Hkv, D, C // G]
    v_codes,    # [B, Hkv, C, D // Pv] uint32
    v_scale,    # [B, Hkv, C, D // G]
    v_zero,     # [B, Hkv, C, D // G]
    quant_len,  # [B] int32
    segments=(),  # ((k [B, Hkv, S, D], v [B, Hkv, S, D], mask [B, T, S] bool), ...)
    *,
    k_bits: int,
    v_bits: int,
    group_size: int,
    sm_scale: float | None = None,
    block_k: int = 64,
    k_splits: int = 16,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
):
  """Softmax attention of T query rows per sequence over a KIVI-layout cache and full-precision segments.

  Layouts are in the module docstring. Returns o [B, Hkv, T, g, D] in q.dtype; a row with no valid token is 0.

  Tunables (static; defaults: the best of benchmarks/kernel_decode.py's autotune on an H100 at B=8, L=32768):
    block_k: store tokens per loop step (block_k / group_size key groups, unrolled); a power of two and a multiple
      of group_size, clamped to the largest power of two that divides the capacity.
    k_splits: programs per (batch row, KV head) along the store (flash-decoding), clamped to the block count;
      each segment gets one more program.
    num_warps, num_stages: Triton launch and software-pipelining parameters.
    interpret: run the kernel in Pallas interpret mode (CPU tests).
  """
  _check_shapes(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, segments, k_bits=k_bits,
                v_bits=v_bits, group_size=group_size, allowed_bits=KERNEL_BITS)
  batch, kv_heads, t_rows, q_per_kv, head_dim = q.shape
  capacity = v_codes.shape[2]
  # The Triton lowering needs power-of-two tiles, and dots need both dims >= 16.
  if head_dim != _next_power_of_2(head_dim) or head_dim < 16:
    raise ValueError(f"head_dim {head_dim} must be a power of two >= 16 for the Pallas kernel")
  if group_size != _next_power_of_2(group_size) or group_size < 16:
    raise ValueError(f"group_size {group_size} must be a power of two >= 16 for the Pallas kernel")
  block_k = min(block_k, capacity & -capacity)  # the largest power of two dividing the capacity
  if block_k % group_size:
    raise ValueError(f"block_k {block_k} (clamped to the capacity {capacity}) must be a multiple of group_size "
                     f"{group_size}")
  n_blocks = capacity // block_k
  k_splits = max(1, min(k_splits, n_blocks))
  k_splits = pl.cdiv(n_blocks, pl.cdiv(n_blocks, k_splits))  # no split left without blocks
  sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale

  n_rows = t_rows * q_per_kv
  rows = max(16, _next_power_of_2(n_rows))
  q_rows = jnp.pad(q.reshape(batch, kv_heads, n_rows, head_dim), ((0, 0), (0, 0), (0, rows - n_rows), (0, 0)))
  # Query row r = t * g + i belongs to query position t; padded rows copy the last position's mask.
  row_position = jnp.minimum(jnp.arange(rows) // q_per_kv, t_rows - 1)
  padded_segments, segment_blocks = [], []
  for k, v, mask in segments:
    seg_len = k.shape[2]
    block_s = max(16, min(block_k, _next_power_of_2(seg_len)))
    pad = -seg_len % block_s
    pad_tokens = ((0, 0), (0, 0), (0, pad), (0, 0))
    padded_segments.append((jnp.pad(k, pad_tokens), jnp.pad(v, pad_tokens),
                            jnp.pad(mask[:, row_position, :], ((0, 0), (0, 0), (0, pad))).astype(jnp.int8)))
    segment_blocks.append(block_s)

  o, l, m = _decode_attention_partials(
      q_rows, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, jnp.clip(quant_len, 0, capacity),
      tuple(padded_segments), k_bits=k_bits, v_bits=v_bits, group_size=group_size, sm_scale=sm_scale,
      block_k=block_k, k_splits=k_splits, n_rows=n_rows, segment_blocks=tuple(segment_blocks), num_warps=num_warps, num_stages=num_stages, interpret=interpret)
  return _merge_partials(o, l, m).reshape(q.shape).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=["k_bits", "v_bits", "group_size", "sm_scale"])
def decode_attention_reference(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, segments=(), *, k_bits: int, v_bits: int,
    group_size: int, sm_scale: float | None = None,
):
  """``decode_attention`` in plain jnp and fp32: dequantize the store, append the segments, one masked softmax.

  Also the XLA path for GPUs without Pallas support (compute capability < 8.0). Accepts 1-bit codes too.
  """
  _check_shapes(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_len, segments, k_bits=k_bits,
                v_bits=v_bits, group_size=group_size, allowed_bits=BITS)
  batch, _, t_rows, _, _ = q.shape
  capacity = v_codes.shape[2]
  k = dequantize(unpack(k_codes, bits=k_bits, axis=3), k_scale, k_zero, axis=3, group_size=group_size,
                 dtype=jnp.float32)
  v = dequantize(unpack(v_codes, bits=v_bits, axis=3), v_scale, v_zero, axis=3, group_size=group_size,
                 dtype=jnp.float32)
  quant_mask = jnp.arange(capacity)[None, None, :] < quant_len[:, None, None]
  ks = [jnp.swapaxes(k, 2, 3)] + [seg_k.astype(jnp.float32) for seg_k, _, _ in segments]
  vs = [v] + [seg_v.astype(jnp.float32) for _, seg_v, _ in segments]
  masks = [jnp.broadcast_to(quant_mask, (batch, t_rows, capacity))] + [mask for _, _, mask in segments]
  mask = jnp.concatenate(masks, axis=-1)
  # Slots that no query row attends may hold garbage (even NaN); keep it out of p·V.
  v = jnp.where(jnp.any(mask, axis=1)[:, None, :, None], jnp.concatenate(vs, axis=2), 0.0)
  return gqa_attention_reference(q, jnp.concatenate(ks, axis=2), v, mask, sm_scale=sm_scale)
