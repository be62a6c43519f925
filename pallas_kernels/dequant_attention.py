"""Fused decode attention over the stacked multi-layer cache, read in place (Pallas, Triton lowering).

One softmax runs over every source of keys for the current layer (docs/methods/kivi.md; KIVI, arXiv:2402.02750):
any number of quantized stores in the KIVI layout (each with its own widths and groupings, holes and value channel
scales) and any number of full-precision segments. Every cache array carries a leading layer axis L and is passed
whole; the kernel reads layer ``layer`` (a traced int32 scalar) by pointer offset, so no layer slice is ever
materialized by XLA. With no store, the same kernel is the dense decode kernel.

Layouts (C = capacity, Gk = k_group, Gv = v_group, Pk = 32 // k_bits, Pv = 32 // v_bits; T query positions, g
query heads per KV head, so q has T*g rows per KV head):

    q        [B, Hkv, T, g, D]
    stores   (QuantizedStore, ...):
      k_codes [L, B, Hkv, D, C/Pk] uint32   keys per channel: groups of Gk tokens, codes packed along tokens
      k_scale, k_zero [L, B, Hkv, D, C/Gk]
      v_codes [L, B, Hkv, C, D/Pv] uint32   values per token: groups of Gv channels, codes packed along channels
      v_scale, v_zero [L, B, Hkv, C, D/Gv]
      length  [B] int32                     slots [0, length[b]) may be valid for every query row
      valid   None, [L, B, Hkv, C] or [B, Hkv, C] bool: holes (False) inside [0, length)
      v_channel_scale None or [L, B, Hkv, D]: each value channel multiplied after dequantization
    segments ((k, v, mask), ...)            full-precision tokens: KIVI's exact window, outlier pools, prefetched
                                            rows, or the whole dense cache. S may differ per segment.
      k, v  [L, B, Hkv, S, D] (stacked: read at ``layer``) or [B, Hkv, S, D] (a per-step segment)
      mask  [B, T, S] bool (per query position) or [B, Hkv, T, S] bool (per KV head too)

Work is split along tokens (flash-decoding): the grid is (B, Hkv, P), where each store gets ``k_splits`` programs
and each segment ``s_splits`` (both clamped to the block count, so a short segment gets one); a program covers
one source. Each program loops over its blocks only up to the last token that can be valid (a store's
``length``; for a segment, the last True in its mask), writes an unnormalized partial (o, l, m) in fp32, and a
few jnp lines merge them exactly. The T*g query rows that share a KV head form one tile, so K/V are read once per
KV head (GQA without repeats). Quantized blocks are unpacked and dequantized in registers
(``quantization.dequantize_packed_last_axis``) with each store's own widths and groupings: a key group may span
several blocks (the block loads its group's one scale column) or a block several groups. A store's holes are
loaded with its block and ANDed with the length test; its value channel scale multiplies the program's partial
o once, after the loop (it is per channel, so it commutes with the sum over tokens). A store without holes or
channel scale costs nothing for them: the kernel branches at trace time.

Statistics from the same pass: ``return_lse`` gives the natural-log sum of exp of the scaled logits over every
valid key; ``token_mass_rows`` gives, for the chosen query positions, the softmax probability each key
receives, summed over the g query heads of its KV head. For the mass the kernel also writes the scaled logits of
the chosen rows (fp32, one write per visited key) and XLA normalizes them with the lse afterwards, so the cache
is still read once.

Masks are finite inside the kernel (``MASK_VALUE``), never -inf. A query row with no valid key gets o = 0 and
lse = MASK_VALUE (finite: merging it with other partials never makes NaN) and zero token mass. Keys that no
query row of a KV head may see can hold anything, NaN included.

Around the pallas_call, XLA does only small work: ``layer`` clamped to [0, L), each segment's bound (one reduction
over its mask), the segment masks cast to int8, and the merge of the partials. Per-step segments ([B, Hkv, S, D])
and per-step holes ([B, Hkv, C]) get a unit layer axis (a bitcast). Nothing indexes, slices, casts or pads a
stacked array outside the kernel (stacked holes go in as bool: Triton loads a bool tile through an int8 pointer).
"""

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jkv_kernels.attention_reference import MASK_VALUE, gqa_attention_probs, slot_mask
from jkv_kernels.quantization import BITS, check_bits, dequantize, dequantize_packed_last_axis, unpack

KERNEL_BITS = (1, 2, 4, 8)
STORE_PROGRAMS = 8192  # programs per store that ``k_splits=None`` aims for (B * Hkv * k_splits), at most 16 splits
MIN_PROGRAMS = 1024  # programs per store or segment that ``k_splits``/``s_splits=None`` give at least, any batch


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


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "length", "valid",
                 "v_channel_scale"],
    meta_fields=["k_bits", "v_bits", "k_group", "v_group"])
@dataclasses.dataclass(frozen=True)
class QuantizedStore:
  """One quantized part of the cache in the KIVI layout, every array stacked over layers (a pytree; widths and
  groupings static). Keys are grouped per channel over ``k_group`` tokens, values per token over ``v_group``
  channels; a method may pass several stores (ZipCache's high- and low-bit pools), each with its own widths.

  ``valid`` marks holes: slot c of KV head h is attended iff c < length[b] and valid[..., b, h, c] (OTT's
  outlier placeholders, SpeCache's rows attended from their fetched 16-bit copy, ZipCache's group tails).
  ``v_channel_scale`` multiplies every dequantized value channel (ZipCache's channel-separable token-wise values:
  v = (code * scale + zero) * v_channel_scale[d]).
  """
  k_codes: jax.Array  # [L, B, Hkv, D, C/Pk] uint32, packed along tokens
  k_scale: jax.Array  # [L, B, Hkv, D, C/k_group]
  k_zero: jax.Array   # [L, B, Hkv, D, C/k_group]
  v_codes: jax.Array  # [L, B, Hkv, C, D/Pv] uint32, packed along channels
  v_scale: jax.Array  # [L, B, Hkv, C, D/v_group]
  v_zero: jax.Array   # [L, B, Hkv, C, D/v_group]
  length: jax.Array   # [B] int32: slots [0, length) may be valid
  k_bits: int
  v_bits: int
  k_group: int        # tokens per key (scale, zero)
  v_group: int        # channels per value (scale, zero)
  valid: Optional[jax.Array] = None            # [L, B, Hkv, C] (stacked) or [B, Hkv, C] bool
  v_channel_scale: Optional[jax.Array] = None  # [L, B, Hkv, D] float

  @property
  def capacity(self) -> int:
    return self.v_codes.shape[3]

  def read_layer(self, layer, dtype=jnp.float32):
    """Layer ``layer`` dequantized by plain indexing: keys, values [B, Hkv, C, D] and the mask [B, Hkv, C] of the
    slots attended (length and holes). The reference's and the XLA path's one dequantization."""
    at = lambda a: a[layer]
    k = dequantize(unpack(at(self.k_codes), bits=self.k_bits, axis=3), at(self.k_scale), at(self.k_zero),
                   axis=3, group_size=self.k_group, dtype=jnp.float32)
    v = dequantize(unpack(at(self.v_codes), bits=self.v_bits, axis=3), at(self.v_scale), at(self.v_zero),
                   axis=3, group_size=self.v_group, dtype=jnp.float32)
    if self.v_channel_scale is not None:
      v = v * at(self.v_channel_scale).astype(jnp.float32)[:, :, None, :]
    return jnp.swapaxes(k, 2, 3).astype(dtype), v.astype(dtype), self.slot_mask(layer)

  def slot_mask(self, layer, start=0, size=None):
    """[B, Hkv, size] bool: slots [start, start + size) attended at ``layer`` (below ``length`` and not holes)."""
    size = self.capacity if size is None else size
    return slot_mask(self.length, self.valid, layer, start, size, self.v_codes.shape[2])


# ----------------------------------------------------------------------------------------------------------------
# Kernel


@dataclasses.dataclass(frozen=True)
class _StoreLayout:
  """Static description of one quantized store: code widths, groupings and which optional arrays it brings.

  The optional arrays are branched on at trace time, so a store without holes or a channel scale costs no load
  and no instruction for them."""
  k_bits: int
  v_bits: int
  k_group: int
  v_group: int
  holes: bool = False           # a ``valid`` array comes after the six code/scale arrays
  holes_stacked: bool = True    # ``valid`` carries the layer axis (else a unit axis added by the wrapper)
  channel_scale: bool = False   # a ``v_channel_scale`` array comes last

  @property
  def n_arrays(self) -> int:
    return 6 + self.holes + self.channel_scale


@dataclasses.dataclass(frozen=True)
class _Source:
  """Static description of one source of keys: which programs it gets and how they walk it."""
  first: int             # its first program along the grid's last axis
  splits: int            # programs it gets
  block: int             # tokens per loop step (a power of two)
  blocks_per_split: int
  length: int            # tokens (S for a segment, C for a store)
  ragged: bool = False   # length % block != 0: the last block's tail is masked at load time
  stacked: bool = True   # segment arrays carry the layer axis (else it is a unit axis added by the wrapper)
  store: Optional[_StoreLayout] = None  # a quantized store; None for a full-precision segment

  @property
  def n_arrays(self) -> int:
    return self.store.n_arrays if self.store is not None else 3


def _online_softmax_step(carry, logits, valid, v, precision, tokens_major):
  """One flash-decoding update with a block of n tokens, in either tile orientation.

  Args:
    carry: rows-major: (o [M, D] f32 unnormalized output, m [M] running max, l [M] running sum); tokens-major:
      (o [D, M], m [1, M], l [1, M]).
    logits: [M, n] f32 (tokens-major: [n, M]), already scaled.
    valid: [M or 1, n] bool (tokens-major: [n, M or 1]).
    v: [n, D] value tile in the dot dtype.
    precision: dot precision (HIGHEST for fp32 inputs, where Triton would otherwise use TF32).
    tokens_major: the orientation (see ``decode_attention``'s ``tokens_major``).
  """
  o, m, l = carry
  token_axis, row_axis = (0, 1) if tokens_major else (1, 0)
  block_max = jnp.max(jnp.where(valid, logits, MASK_VALUE), axis=token_axis, keepdims=tokens_major)
  m_next = jnp.maximum(m, block_max)
  alpha = jnp.exp(m - m_next)
  # Masked entries are zeroed, not just made small: a block where a row has no valid token has m_next = MASK_VALUE.
  p = jnp.where(valid, jnp.exp(logits - (m_next if tokens_major else m_next[:, None])), 0.0)
  # Slots that no row attends may hold garbage (even NaN): 0 * NaN would leak through the dot.
  slot_valid = jnp.max(valid.astype(jnp.int32), axis=row_axis, keepdims=tokens_major) > 0
  v = jnp.where(slot_valid if tokens_major else slot_valid[:, None], v, 0)
  if tokens_major:
    o = o * alpha + _dot(v, p.astype(v.dtype), trans_a=True, precision=precision)  # [D, M]
  else:
    o = o * alpha[:, None] + _dot(p.astype(v.dtype), v, precision=precision)      # [M, D]
  return o, m_next, l * alpha + jnp.sum(p, axis=token_axis, keepdims=tokens_major)


def _decode_attention_kernel(
    # inputs
    layer_ref,   # [1] int32, clamped to [0, L)
    bounds_ref,  # [n_sources] int32: keys at and past bounds[i] are never valid in source i (for this b, h)
    q_ref,       # [M, D] block over the T*g query rows of one KV head (rows past T*g are never read)
    *refs,       # per source, in order: a store's k_codes [L, D, C/Pk], k_scale [L, D, C/Gk], k_zero,
                 #   v_codes [L, C, D/Pv], v_scale [L, C, D/Gv], v_zero, then valid [L', C] bool (if it has
                 #   holes) and v_channel_scale [L, D] (if it has one); a segment's k [L', S_blk, D],
                 #   v [L', S_blk, D], mask [T, S_blk] int8. Then the outputs o [M, D] (unnormalized), l [M],
                 #   m [M], of which only the first n_rows exist; then, with token mass, the scaled logits
                 #   [M, C or S] of each source in mass_sources
    n_rows: int,
    q_per_kv: int,
    t_rows: int,
    sm_scale: float,
    sources: tuple[_Source, ...],
    mass_rows: tuple[int, ...],
    mass_sources: tuple[int, ...],
    tokens_major: bool,
):
  source_refs = []
  for source in sources:
    source_refs.append(refs[:source.n_arrays])
    refs = refs[source.n_arrays:]
  o_ref, l_ref, m_ref, *logit_refs = refs

  program = pl.program_id(2)
  layer = layer_ref[0]
  rows, head_dim = q_ref.shape
  dot_dtype = q_ref.dtype
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
  real_row = row < n_rows
  q = plgpu.load(q_ref, mask=jnp.broadcast_to(real_row[:, None], (rows, head_dim)), other=0)  # padding rows: 0
  row_position = row // q_per_kv  # query position t of row r = t * g + i
  mass_row = functools.reduce(jnp.logical_or, [row_position == t for t in mass_rows], row < 0)
  # Tiles are [M, n] (rows-major) or [n, M] (tokens-major); these place a row or a token vector along its axis.
  along_rows = lambda x: x[None, :] if tokens_major else x[:, None]
  along_tokens = lambda x: x[:, None] if tokens_major else x[None, :]
  stat_shape = (1, rows) if tokens_major else (rows,)
  init = (jnp.zeros((head_dim, rows) if tokens_major else (rows, head_dim), jnp.float32),
          jnp.full(stat_shape, MASK_VALUE, jnp.float32),
          jnp.zeros(stat_shape, jnp.float32))

  def write_partials(carry):
    # Only the T*g real rows are written: the padding rows would multiply the partials' traffic by M / (T*g).
    o, m, l = carry
    if tokens_major:
      o, m, l = o.T, m[0], l[0]
    plgpu.store(o_ref, o, mask=real_row[:, None])
    plgpu.store(l_ref, l, mask=real_row)
    plgpu.store(m_ref, m, mask=real_row)

  def write_logits(index, start, block, logits, valid, in_range):
    """Scaled logits of the chosen rows for the token-mass statistic (invalid keys, holes included: MASK_VALUE)."""
    if not mass_rows or index not in mass_sources:
      return
    mask = mass_row[:, None] & (in_range[None, :] if in_range is not None else True)
    logits = jnp.where(valid, logits, MASK_VALUE)
    logits = logits.T if tokens_major else logits
    plgpu.store(logit_refs[mass_sources.index(index)].at[:, pl.ds(start, block)], logits,
                mask=jnp.broadcast_to(mask, logits.shape))

  def run(index, source):
    """Programs [first, first + splits) walk this source's blocks, stopping at the last block that can be valid."""
    @pl.when((program >= source.first) & (program < source.first + source.splits))
    def _():
      first_block = (program - source.first) * source.blocks_per_split
      valid_blocks = (bounds_ref[index] + source.block - 1) // source.block
      n_blocks = jnp.clip(valid_blocks - first_block, 0, source.blocks_per_split)
      block_fn = store_block if source.store is not None else segment_block
      body = lambda i, carry: block_fn(index, source, source_refs[index], (first_block + i) * source.block, carry)
      o, m, l = lax.fori_loop(0, n_blocks, body, init)
      if source.store is not None and source.store.channel_scale:
        # Values are v_hat[s, d] * c[d], so sum_s p[s] v[s, d] = c[d] * sum_s p[s] v_hat[s, d]: the channel
        # scale multiplies this program's partial o once (it covers this store only), not every value it reads.
        channel_scale = source_refs[index][-1][layer, :].astype(jnp.float32)  # [D]
        o = o * (channel_scale[:, None] if tokens_major else channel_scale[None, :])
      write_partials((o, m, l))

  def store_block(index, source, refs, start, carry):
    """Tokens [start, start + block) of one quantized store."""
    store, block = source.store, source.block
    k_codes_ref, k_scale_ref, k_zero_ref, v_codes_ref, v_scale_ref, v_zero_ref = refs[:6]
    valid = along_tokens(start + lax.broadcasted_iota(jnp.int32, (block,), 0)) < bounds_ref[index]
    if store.holes:  # the block's slice of the holes mask (Triton reads a bool ref through an int8 pointer)
      holes_at = layer if store.holes_stacked else jnp.int32(0)
      valid = valid & along_tokens(refs[6][holes_at, pl.ds(start, block)])
    # The whole key tile is dequantized in registers and meets the query in one dot: every load is a 2-D tile
    # whose rows are contiguous. (Folding each group's key scales into the query instead costs block_k / G small
    # dots and column-wise scale loads; it measured 1.4x slower on an H100.) The block holds whole key groups
    # (one scale column each) or lies inside one group (k_group > block: that group's one column).
    groups = pl.ds(start // store.k_group, max(1, block // store.k_group))
    k_per_word = 32 // store.k_bits
    k_hat = dequantize_packed_last_axis(
        k_codes_ref[layer, :, pl.ds(start // k_per_word, block // k_per_word)],
        k_scale_ref[layer, :, groups], k_zero_ref[layer, :, groups],
        bits=store.k_bits, group_size=store.k_group, dtype=dot_dtype)  # [D, block]
    if tokens_major:
      logits = _dot(k_hat, q, trans_a=True, trans_b=True, precision=precision) * sm_scale  # [block, M] f32
    else:
      logits = _dot(q, k_hat, precision=precision) * sm_scale  # [M, block] f32
    write_logits(index, start, block, logits, valid, None)
    tokens = pl.ds(start, block)
    v_hat = dequantize_packed_last_axis(
        v_codes_ref[layer, tokens, :], v_scale_ref[layer, tokens, :], v_zero_ref[layer, tokens, :],
        bits=store.v_bits, group_size=store.v_group, dtype=dot_dtype)  # [block, D], before the channel scale
    return _online_softmax_step(carry, logits, valid, v_hat, precision, tokens_major)

  def segment_block(index, source, refs, start, carry):
    """Tokens [start, start + block) of one full-precision segment."""
    k_ref, v_ref, mask_ref = refs
    block = source.block
    at = layer if source.stacked else jnp.int32(0)
    tokens = pl.ds(start, block)
    in_range = None
    if source.ragged:  # the segment ends inside this block: never read past it
      in_range = (start + lax.broadcasted_iota(jnp.int32, (block,), 0)) < source.length
      load = lambda ref, idx, mask: plgpu.load(ref.at[idx], mask=mask, other=0)
      tile_in_range = jnp.broadcast_to(in_range[:, None], (block, head_dim))
      k = load(k_ref, (at, tokens, slice(None)), tile_in_range)
      v = load(v_ref, (at, tokens, slice(None)), tile_in_range)
      position_masks = [load(mask_ref, (jnp.int32(t), tokens), in_range) for t in range(t_rows)]
    else:
      k, v = k_ref[at, tokens, :], v_ref[at, tokens, :]
      position_masks = [mask_ref[t, tokens] for t in range(t_rows)]
    # Row r = t * g + i sees key s iff mask[t, s]; padding rows (t >= T) see nothing.
    valid = functools.reduce(jnp.logical_or, [along_rows(row_position == t) & along_tokens(mask_t != 0)
                                              for t, mask_t in enumerate(position_masks)])  # [M, block] or [block, M]
    k = k.astype(dot_dtype)
    if tokens_major:
      logits = _dot(k, q, trans_b=True, precision=precision) * sm_scale  # [block, M] f32
    else:
      logits = _dot(q, k, trans_b=True, precision=precision) * sm_scale  # [M, block] f32
    write_logits(index, start, block, logits, valid, in_range)
    return _online_softmax_step(carry, logits, valid, v.astype(dot_dtype), precision, tokens_major)

  for index, source in enumerate(sources):
    run(index, source)


# ----------------------------------------------------------------------------------------------------------------
# pallas_call


def _decode_attention_partials(
    layer,     # [1] int32
    bounds,    # [B, Hkv, n_sources] int32
    q,         # [B, Hkv, n_rows, D]
    inputs,    # per source: a store's arrays [L', B, Hkv, ...] (_StoreLayout order), or a segment's
               #   (k [L', B, Hkv, S, D], v [L', B, Hkv, S, D], mask [B, Hkv or 1, T, S] int8)
    *,
    sources: tuple[_Source, ...],
    q_per_kv: int,
    t_rows: int,
    sm_scale: float,
    mass_rows: tuple[int, ...],
    mass_sources: tuple[int, ...],
    tokens_major: bool,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
  """One pallas_call over grid (B, Hkv, P); returns the fp32 partials o, l, m (and the chosen rows' logits of the
  sources ``mass_sources``)."""
  batch, kv_heads, n_rows, head_dim = q.shape
  rows = max(16, _next_power_of_2(n_rows))  # M: the tile's rows (dots need >= 16)
  partials = sum(source.splits for source in sources)

  def whole_layers(array, *block):
    """Every layer of (b, h)'s slice; the kernel picks one layer by index, so nothing is sliced outside."""
    return pl.BlockSpec((array.shape[0], None, None, *block), lambda b, h, s: (0, b, h) + (0,) * len(block))

  in_specs = [
      pl.BlockSpec((1,), lambda b, h, s: (0,)),                                # layer
      pl.BlockSpec((None, None, len(sources)), lambda b, h, s: (b, h, 0)),   # bounds
      pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q (M >= n_rows rows)
  ]
  arrays = [layer, bounds, q]
  name = ""
  for source_arrays, source in zip(inputs, sources):
    arrays += source_arrays
    if source.store is not None:
      # k_codes, k_scale, k_zero, v_codes, v_scale, v_zero[, valid][, v_channel_scale]
      in_specs += [whole_layers(a, *a.shape[3:]) for a in source_arrays]
      store = source.store
      groups = f"{store.k_group}" if store.k_group == store.v_group else f"{store.k_group}x{store.v_group}"
      name += (f"_store_{store.k_bits}x{store.v_bits}bit_G{groups}{'_holes' if store.holes else ''}"
               f"{'_cscale' if store.channel_scale else ''}_bk{source.block}_ks{source.splits}")
      continue
    # The token axis of a block is rounded up to whole blocks: loads past S are masked (``ragged``).
    k, v, mask = source_arrays
    s_blk = source.splits * source.blocks_per_split * source.block
    per_head = mask.shape[1] != 1
    in_specs += [
        whole_layers(k, s_blk, head_dim),                                                      # k
        whole_layers(v, s_blk, head_dim),                                                      # v
        pl.BlockSpec((None, None, t_rows, s_blk), lambda b, h, s, per_head=per_head: (b, h if per_head else 0, 0, 0)),
    ]                                                                                          # mask
    name += f"_seg{source.length}_bs{source.block}_ss{source.splits}"

  out_specs = [
      pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),  # o
      pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),                # l
      pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),                # m
  ]
  out_shape = [
      jax.ShapeDtypeStruct((batch, kv_heads, partials, n_rows, head_dim), jnp.float32),  # o
      jax.ShapeDtypeStruct((batch, kv_heads, partials, n_rows), jnp.float32),            # l
      jax.ShapeDtypeStruct((batch, kv_heads, partials, n_rows), jnp.float32),            # m
  ]
  if mass_rows:
    for source in (sources[i] for i in mass_sources):  # the chosen rows' logits, each program writing its keys
      s_blk = source.splits * source.blocks_per_split * source.block
      out_specs.append(pl.BlockSpec((None, None, rows, s_blk), lambda b, h, s: (b, h, 0, 0)))
      out_shape.append(jax.ShapeDtypeStruct((batch, kv_heads, n_rows, source.length), jnp.float32))

  kernel = functools.partial(_decode_attention_kernel, n_rows=n_rows, q_per_kv=q_per_kv, t_rows=t_rows,
                             sm_scale=sm_scale, sources=tuple(sources), mass_rows=mass_rows,
                             mass_sources=mass_sources, tokens_major=tokens_major)
  return pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, partials),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"decode_attention_rows{rows}{name}{'_tokens_major' if tokens_major else ''}_{num_warps=}_{num_stages=}",
  )(*arrays)


# ----------------------------------------------------------------------------------------------------------------
# Public entry


def _split_plan(length: int, block: int, splits: int, first: int, **kw) -> _Source:
  """``splits`` clamped to the block count, then to what leaves no split without blocks."""
  n_blocks = pl.cdiv(length, block)
  splits = max(1, min(splits, n_blocks))
  blocks_per_split = pl.cdiv(n_blocks, splits)
  splits = pl.cdiv(n_blocks, blocks_per_split)
  return _Source(first=first, splits=splits, block=block, blocks_per_split=blocks_per_split, length=length, **kw)


def _store_plan(index: int, store: QuantizedStore, block_k: int, k_splits: int, first: int) -> _Source:
  """A store's walk: blocks of ``block_k`` tokens, raised to one word of key codes (32 tokens at 1 bit) and
  clamped to the largest power of two dividing the capacity, so no block straddles the end or a word."""
  name, capacity = f"stores[{index}]", store.capacity
  if store.k_group != _next_power_of_2(store.k_group):
    raise ValueError(f"{name}: k_group {store.k_group} must be a power of two for the Pallas kernel")
  block = min(max(block_k, 32 // store.k_bits), capacity & -capacity)
  if block < 16:  # dots need both dims >= 16
    raise ValueError(f"{name}: capacity {capacity} must be a multiple of 16 for the Pallas kernel")
  layout = _StoreLayout(store.k_bits, store.v_bits, store.k_group, store.v_group, holes=store.valid is not None,
                        holes_stacked=store.valid is not None and store.valid.ndim == 4,
                        channel_scale=store.v_channel_scale is not None)
  return _split_plan(capacity, block, k_splits, first, store=layout)


def _check_store(index, store, q, allowed_bits):
  batch, kv_heads, _, _, head_dim = q.shape
  name = f"stores[{index}]"
  check_bits(store.k_bits, allowed_bits)
  check_bits(store.v_bits, allowed_bits)
  if store.v_codes.ndim != 5:
    raise ValueError(f"{name}.v_codes must be [L, B, Hkv, C, D/Pv], got shape {store.v_codes.shape}")
  num_layers, capacity = store.v_codes.shape[0], store.v_codes.shape[3]
  pk, pv, kg, vg = 32 // store.k_bits, 32 // store.v_bits, store.k_group, store.v_group
  if kg < 1 or capacity % kg or kg % pk:
    raise ValueError(f"{name}: k_group {kg} must divide the capacity {capacity} and be a multiple of the {pk} key "
                     f"codes per word")
  if vg < 1 or head_dim % vg or vg % pv:
    raise ValueError(f"{name}: v_group {vg} must divide head_dim {head_dim} and be a multiple of the {pv} value "
                     f"codes per word")
  lead = (num_layers, batch, kv_heads)
  expected = {
      "k_codes": (store.k_codes, (*lead, head_dim, capacity // pk)),
      "k_scale": (store.k_scale, (*lead, head_dim, capacity // kg)),
      "k_zero": (store.k_zero, (*lead, head_dim, capacity // kg)),
      "v_codes": (store.v_codes, (*lead, capacity, head_dim // pv)),
      "v_scale": (store.v_scale, (*lead, capacity, head_dim // vg)),
      "v_zero": (store.v_zero, (*lead, capacity, head_dim // vg)),
      "length": (store.length, (batch,)),
  }
  if store.v_channel_scale is not None:
    expected["v_channel_scale"] = (store.v_channel_scale, (*lead, head_dim))
  for field, (array, shape) in expected.items():
    if array.shape != shape:
      raise ValueError(f"{name}.{field} has shape {array.shape}, expected {shape} for q {q.shape}, v_codes "
                       f"{store.v_codes.shape}, k_bits={store.k_bits}, v_bits={store.v_bits}, k_group={kg}, "
                       f"v_group={vg}")
  for field in ("k_codes", "v_codes"):
    if expected[field][0].dtype != jnp.uint32:
      raise ValueError(f"{name}.{field} must be uint32, got {expected[field][0].dtype}")
  if store.length.dtype != jnp.int32:
    raise ValueError(f"{name}.length must be int32, got {store.length.dtype}")
  if store.valid is not None and (store.valid.dtype != jnp.bool_ or store.valid.shape not in (
      (*lead, capacity), (batch, kv_heads, capacity))):
    raise ValueError(f"{name}.valid {store.valid.shape} {store.valid.dtype} must be bool [L, B, Hkv, C] = "
                     f"{[*lead, capacity]} or [B, Hkv, C]")


def _check_inputs(q, layer, stores, segments, *, allowed_bits, mass_rows):
  """Raises ValueError naming the shapes that disagree with the layouts in the module docstring."""
  if q.ndim != 5:
    raise ValueError(f"q must be [B, Hkv, T, g, D], got shape {q.shape}")
  batch, kv_heads, t_rows, _, head_dim = q.shape
  if layer is not None and (jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
    raise ValueError(f"layer must be an integer scalar, got {jnp.shape(layer)} {jnp.result_type(layer)}")
  if not isinstance(stores, (tuple, list)) or not all(isinstance(s, QuantizedStore) for s in stores):
    raise ValueError("stores must be a tuple of QuantizedStore")
  if not stores and not segments:
    raise ValueError("decode_attention needs a store or at least one segment")
  for t in mass_rows:
    if not 0 <= t < t_rows:
      raise ValueError(f"token_mass_rows {mass_rows} must be query positions in [0, {t_rows})")
  for index, store in enumerate(stores):
    _check_store(index, store, q, allowed_bits)
  for index, segment in enumerate(segments):
    if len(segment) != 3:
      raise ValueError(f"segment {index} must be (k, v, mask), got {len(segment)} arrays")
    k, v, mask = segment
    seg_len = k.shape[-2] if k.ndim in (4, 5) else -1
    lead = k.shape[:1] if k.ndim == 5 else ()
    if k.shape != (*lead, batch, kv_heads, seg_len, head_dim) or v.shape != k.shape or seg_len < 1:
      raise ValueError(f"segment {index}: k {k.shape} and v {v.shape} must both be [L, B, Hkv, S, D] or "
                       f"[B, Hkv, S, D] with B, Hkv, D = {batch}, {kv_heads}, {head_dim} (q {q.shape}), S >= 1")
    if mask.dtype != jnp.bool_ or mask.shape not in ((batch, t_rows, seg_len), (batch, kv_heads, t_rows, seg_len)):
      raise ValueError(f"segment {index}: mask {mask.shape} {mask.dtype} must be bool [B, T, S] = "
                       f"[{batch}, {t_rows}, {seg_len}] or [B, Hkv, T, S]")


def _num_layers(stores, segments):
  stacked = [store.k_codes.shape[0] for store in stores]
  stacked += [k.shape[0] for k, _, _ in segments if k.ndim == 5]
  if len(set(stacked)) > 1:
    raise ValueError(f"stacked arrays disagree on the number of layers: {stacked}")
  return stacked[0] if stacked else 1


def _results(o, lse, mass, *, return_lse, mass_rows):
  """o, then lse and the token mass where asked for."""
  extra = ((lse,) if return_lse else ()) + ((mass,) if mass_rows else ())
  return (o, *extra) if extra else o


def _token_mass(probs_or_logits, lse, valid, q_per_kv, mass_rows, from_logits):
  """[B, Hkv, T*g, S] logits (or [B, Hkv, T, g, S] probabilities) -> mass [B, Hkv, R, S] of the chosen rows.

  valid [B, Hkv or 1, T, S]: the keys a row may see, or at least every key whose logit the kernel did not write
  (it writes MASK_VALUE for the invalid keys it visits, which gives 0 unless the row has no valid key at all).
  """
  pick = lambda x: jnp.stack([x[:, :, t] for t in mass_rows], axis=2)  # static slices, no gather
  if from_logits:
    batch, kv_heads, _, length = probs_or_logits.shape
    logits = pick(probs_or_logits.reshape(batch, kv_heads, -1, q_per_kv, length))
    lse_rows = pick(lse)[..., None]
    p = jnp.where(lse_rows == MASK_VALUE, 0.0, jnp.exp(logits - lse_rows))  # a row with no valid key: 0
  else:
    p = pick(probs_or_logits)
  return jnp.sum(jnp.where(pick(valid)[:, :, :, None, :], p, 0.0), axis=3)


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "return_lse", "token_mass_rows", "store_mass", "block_k", "k_splits", "block_s",
                     "s_splits", "tokens_major", "num_warps", "num_stages", "interpret"])
def decode_attention(
    q,              # [B, Hkv, T, g, D]
    layer,          # int32 scalar (traced); None when nothing is stacked
    stores: tuple[QuantizedStore, ...] = (),
    segments=(),    # ((k [L, B, Hkv, S, D] or [B, Hkv, S, D], v (same), mask [B, T, S] or [B, Hkv, T, S] bool), ...)
    *,
    sm_scale: Optional[float] = None,
    return_lse: bool = False,
    token_mass_rows: tuple[int, ...] = (),
    store_mass: bool = True,
    block_k: int = 64,
    k_splits: Optional[int] = None,
    block_s: int = 64,
    s_splits: Optional[int] = None,
    tokens_major: Optional[bool] = None,
    num_warps: int = 4,
    num_stages: Optional[int] = None,
    interpret: bool = False,
):
  """Softmax attention of T query rows per sequence over layer ``layer`` of a stacked cache, in one pass.

  Layouts are in the module docstring. ``layer`` is clamped to [0, L). Stores are optional (dense decoding
  passes segments only); so are segments.

  Returns:
    o [B, Hkv, T, g, D] in q.dtype (0 for a row with no valid key); with ``return_lse`` also lse [B, Hkv, T, g]
    float32 (MASK_VALUE for a row with no valid key); with ``token_mass_rows`` (a static tuple of query
    positions t) also the token mass ``((store_mass [B, Hkv, R, C], ...), (segment_mass [B, Hkv, R, S], ...))``,
    R = len(token_mass_rows): the probability each key receives from row t, summed over the g query heads
    (0 for keys no row may see). In that order: ``o``, ``(o, lse)``, ``(o, mass)`` or ``(o, lse, mass)``.
    With ``store_mass`` False the stores' mass is () and the kernel writes only the segments' logits (ZipCache's
    probes score the window alone).

  Tunables (static; store defaults: the best of benchmarks/kernel_decode.py's autotune on an H100 at B=8,
  L=32768, KIVI-2):
    block_k: store tokens per loop step (a power of two >= 16); for each store raised to one word of key codes
      (32 at 1 bit) and clamped to the largest power of two dividing its capacity. Key groups may be longer
      than a block (one scale column per block) or shorter (several per block).
    k_splits: programs per (batch row, KV head) along each store (flash-decoding), clamped to its block count.
      None: enough for about STORE_PROGRAMS programs per store over the batch and KV heads, at most 16 (a
      small batch needs the splits to fill the GPU; a large one fills it already, and each split adds a
      partial to write and merge). Measured on an H100, KIVI-2, L=4096 (benchmarks/kernel_decode.py
      --autotune-grid): at B=256, 4 splits 1813 µs, 16 splits 1938 µs, 1 split 1865 µs; at B=8, 32k, 16. Past
      the cap, at least MIN_PROGRAMS: one sequence's 8 KV heads in 16 splits of a 128k store left an H200 idle
      (OTT at B = 1, 128k: 35.65 ms of a 41.10 ms step in this kernel).
    block_s: segment tokens per loop step (a power of two >= 16, clamped to the segment's length rounded up).
    s_splits: programs per (batch row, KV head) along each segment, clamped to its block count. None: enough for
      about MIN_PROGRAMS programs over the batch and KV heads, whatever the batch: a dense cache is one long
      segment, and one sequence's 8 KV heads in 16 splits left most of an H200 idle. Measured there (dense, 8 KV
      heads, D = 128, bf16, per layer, with ``num_stages=2``): B = 1, L = 131072: 16 splits 268.8 µs, 128 splits
      173.6 (best 166.9 at 64); B = 1, 524288: 1140.3 against 647.5 (best 621.6); B = 8, 32768 and B = 32, 8192
      within 5% of the best of 128 to 4096 programs.
    tokens_major: the orientation of the score tiles. Rows-major computes logits [M, block] = q @ K^T and
      o [M, D] += p @ V; tokens-major computes their transposes, logits [block, M] = K @ q^T and o [D, M] +=
      V^T @ p, with the row statistics along the minor axis. Same arithmetic, different register layouts and
      reductions in Triton. None chooses by layout, as measured on an H100 at B=8, L=32768
      (benchmarks/kernel_decode.py --orientations): tokens-major when a store has holes (SpeCache's, OTT's and
      ZipCache's layouts, 15-31% faster), rows-major otherwise (KIVI-2 and dense, where tokens-major was 13-17%
      slower).
    num_warps, num_stages: Triton launch and software-pipelining parameters. ``num_stages`` None: 2 when the
      call reads segments only (dense decoding: B = 1, L = 131072 at 1024 programs, 186.1 µs with 1 stage, 173.6
      with 2; every shape above was faster with 2), 1 with stores (their autotune).
    interpret: run the kernel in Pallas interpret mode (CPU tests).
  """
  mass_rows = tuple(token_mass_rows)
  stores = tuple(stores)
  _check_inputs(q, layer, stores, segments, allowed_bits=KERNEL_BITS, mass_rows=mass_rows)
  batch, kv_heads, t_rows, q_per_kv, head_dim = q.shape
  # The Triton lowering needs power-of-two tiles, and dots need both dims >= 16.
  if head_dim != _next_power_of_2(head_dim) or head_dim < 16:
    raise ValueError(f"head_dim {head_dim} must be a power of two >= 16 for the Pallas kernel")
  if block_k != _next_power_of_2(block_k) or block_k < 16:
    raise ValueError(f"block_k {block_k} must be a power of two >= 16")
  if block_s != _next_power_of_2(block_s) or block_s < 16:
    raise ValueError(f"block_s {block_s} must be a power of two >= 16")
  sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
  if tokens_major is None:
    tokens_major = any(store.valid is not None for store in stores)
  num_layers = _num_layers(stores, segments)
  layer = jnp.clip(jnp.asarray(0 if layer is None else layer, jnp.int32), 0, num_layers - 1).reshape(1)

  at_least = -(-MIN_PROGRAMS // (batch * kv_heads))
  if k_splits is None:
    k_splits = max(min(16, -(-STORE_PROGRAMS // (batch * kv_heads))), at_least)
  if s_splits is None:
    s_splits = at_least
  if num_stages is None:
    num_stages = 1 if stores else 2
  sources, inputs, bounds, first = [], [], [], 0
  for index, store in enumerate(stores):
    source = _store_plan(index, store, block_k, k_splits, first)
    first += source.splits
    sources.append(source)
    arrays = [store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero]
    if store.valid is not None:  # per-step holes [B, Hkv, C]: a unit layer axis (a bitcast, not a copy)
      arrays.append(store.valid if store.valid.ndim == 4 else store.valid[None])
    if store.v_channel_scale is not None:
      arrays.append(store.v_channel_scale)
    inputs.append(tuple(arrays))
    bounds.append(jnp.broadcast_to(jnp.clip(store.length, 0, store.capacity)[:, None], (batch, kv_heads)))

  for k, v, mask in segments:
    seg_len = k.shape[-2]
    block = max(16, min(block_s, _next_power_of_2(seg_len)))
    source = _split_plan(seg_len, block, s_splits, first, ragged=seg_len % block != 0, stacked=k.ndim == 5)
    first += source.splits
    sources.append(source)
    mask4 = mask if mask.ndim == 4 else mask[:, None]  # [B, Hkv or 1, T, S]
    # The loop stops after the last key any row of (b, h) may see (one small reduction over the mask).
    last = jnp.max(jnp.where(mask4, jnp.arange(1, seg_len + 1, dtype=jnp.int32), 0), axis=(2, 3))
    bounds.append(jnp.broadcast_to(last, (batch, kv_heads)))
    if k.ndim == 4:  # a per-step segment: a unit layer axis (a bitcast, not a copy)
      k, v = k[None], v[None]
    inputs.append((k, v, mask4.astype(jnp.int8)))

  n_rows = t_rows * q_per_kv
  q_rows = q.reshape(batch, kv_heads, n_rows, head_dim)
  o, l, m, *logits = _decode_attention_partials(
      layer, jnp.stack(bounds, axis=-1).astype(jnp.int32), q_rows, tuple(inputs), sources=tuple(sources),
      q_per_kv=q_per_kv, t_rows=t_rows, sm_scale=sm_scale, mass_rows=mass_rows,
      mass_sources=tuple(range(0 if store_mass else len(stores), len(sources))), tokens_major=tokens_major,
      num_warps=num_warps, num_stages=num_stages, interpret=interpret)

  # Exact softmax merge of the partials; a row with no valid key has l_all = 0.
  m_all = jnp.max(m, axis=2)
  alpha = jnp.exp(m - m_all[:, :, None])
  l_all = jnp.sum(alpha * l, axis=2)
  empty = l_all == 0
  o = jnp.sum(alpha[..., None] * o, axis=2) / jnp.where(empty, 1.0, l_all)[..., None]
  o = o.reshape(q.shape).astype(q.dtype)
  lse = jnp.where(empty, MASK_VALUE, m_all + jnp.log(jnp.where(empty, 1.0, l_all))).reshape(q.shape[:-1])

  mass = None
  if mass_rows:
    # A store's keys past its length were never visited (their logits are unwritten); holes below it got
    # MASK_VALUE from the kernel, so the stacked holes mask is never sliced here.
    below_length = lambda s: jnp.broadcast_to(
        (jnp.arange(s.capacity)[None, :] < s.length[:, None])[:, None, None, :], (batch, 1, t_rows, s.capacity))
    n_stores = len(stores) if store_mass else 0
    of_stores = tuple(_token_mass(store_logits, lse, below_length(s), q_per_kv, mass_rows, from_logits=True)
                      for store_logits, s in zip(logits[:n_stores], stores))
    of_segments = tuple(
        _token_mass(seg_logits, lse, mask if mask.ndim == 4 else mask[:, None], q_per_kv, mass_rows, True)
        for seg_logits, (_, _, mask) in zip(logits[n_stores:], segments))
    mass = (of_stores, of_segments)
  return _results(o, lse, mass, return_lse=return_lse, mass_rows=mass_rows)


@functools.partial(jax.jit, static_argnames=["sm_scale", "return_lse", "token_mass_rows"])
def decode_attention_reference(
    q, layer, stores: tuple[QuantizedStore, ...] = (), segments=(), *, sm_scale: Optional[float] = None,
    return_lse: bool = False, token_mass_rows: tuple[int, ...] = (),
):
  """``decode_attention`` in plain jnp and fp32 (same arguments, no tunables; same results).

  Reads layer ``layer`` of the stacked arrays by plain indexing (XLA may copy it), dequantizes every store
  (``QuantizedStore.read_layer``), appends the segments and runs one masked softmax. Takes every store the API
  describes (any widths, groupings, holes, channel scales).
  """
  mass_rows = tuple(token_mass_rows)
  stores = tuple(stores)
  _check_inputs(q, layer, stores, segments, allowed_bits=BITS, mass_rows=mass_rows)
  batch, kv_heads, t_rows, q_per_kv, _ = q.shape
  num_layers = _num_layers(stores, segments)
  layer = jnp.clip(jnp.asarray(0 if layer is None else layer, jnp.int32), 0, num_layers - 1)
  ks, vs, masks = [], [], []
  for store in stores:
    k, v, slots = store.read_layer(layer)
    ks.append(k)
    vs.append(v)
    masks.append(jnp.broadcast_to(slots[:, :, None], (batch, kv_heads, t_rows, store.capacity)))
  for k, v, mask in segments:
    if k.ndim == 5:
      k, v = k[layer], v[layer]
    ks.append(k.astype(jnp.float32))
    vs.append(v.astype(jnp.float32))
    masks.append(jnp.broadcast_to(mask if mask.ndim == 4 else mask[:, None], (batch, kv_heads, *mask.shape[-2:])))
  mask = jnp.concatenate(masks, axis=-1)  # [B, Hkv, T, S_all]
  # Slots that no query row of the head attends may hold garbage (even NaN); keep it out of q·K and p·V.
  seen = jnp.any(mask, axis=2)[..., None]
  k = jnp.where(seen, jnp.concatenate(ks, axis=2), 0.0)
  v = jnp.where(seen, jnp.concatenate(vs, axis=2), 0.0)
  p, lse = gqa_attention_probs(q, k, mask, sm_scale=sm_scale)
  o = jnp.einsum("bhtgs,bhsd->bhtgd", p, v, precision=lax.Precision.HIGHEST).astype(q.dtype)

  mass = None
  if mass_rows:
    pieces, offset = [], 0
    for piece_mask in masks:
      length = piece_mask.shape[-1]
      pieces.append(_token_mass(p[..., offset:offset + length], lse, piece_mask, q_per_kv, mass_rows, False))
      offset += length
    mass = (tuple(pieces[:len(stores)]), tuple(pieces[len(stores):]))
  return _results(o, lse, mass, return_lse=return_lse, mass_rows=mass_rows)
