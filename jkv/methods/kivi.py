"""``kivi``: keys quantized per channel, values per token, with a full-precision residual (KIVI, ICML 2024).

Algorithm: docs/methods/kivi.md; paper arXiv:2402.02750. State per layer (C = capacity, a multiple of R;
Pk = 32/k_bits, Pv = 32/v_bits):

- keys are quantized in groups of G tokens of one channel, once R of them have gathered in the key ring
  (a flush); values are quantized per token in groups of G channels the moment they arrive (per-token groups do
  not depend on neighbours, so this equals quantizing them when they leave the window);
- two rings of W = R + λ slots hold the newest W positions, slot p mod W: values exact, keys exact from bK on
  and, before bK, as the store gives them back (a flush rewrites its block's slots dequantized). The window
  the softmax reads is then the rings themselves, in place: no per-step gather or dequantization.

With λ = 1 (the reference code's order, the default) a step attends and then compresses, so at a step with N
tokens keys before bK = R⌊(N-1)/R⌋ and values before bV = max(0, N-1-R) are read dequantized; λ = 0 is the
paper's Algorithm 1 (quantize, then attend). Those two boundaries are the whole semantics (docs/methods/kivi.md,
'State and boundaries'), which is why the state needs no counters beyond the sequence length.

With ``mma=True`` the store is kept in the MMA-ready packing (``jkv_kernels.mma_layout``) that the Hopper
tensor-core kernel reads: key tiles of 64 tokens are packed at each flush, and a value tile at the end of the step
that brings its 64th token, quantized per token from the value ring (which holds all 64: W >= R >= 64); both for
every layer at once, in ``end_step`` (a flush that λ = 1 puts before a step's first row is done at the end of the
step before: nothing reads the ring in between). Per-token groups do not depend on neighbours, so these are the
codes the library's layout stores token by token; and since bV = N - λ - R < 64⌊N/64⌋, every value the softmax
reads quantized is in a packed tile. The same codes, scales and boundaries, one softmax over the packed store and
the rings.

``bits=1`` uses SpeCache's 1-bit quantizer (quarter-point levels, ``jkv_kernels.quantization``) for keys and
values together: SpeCache's KIVI-1bit baseline (docs/methods/specache.md; arXiv:2503.16163).
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.attention import MmaStore, QuantizedStore, decode_attention, mma_left_open, read_store
from jkv.cache import ArrayInfo, CacheMethod, CacheSpec, HeldBytes, SplitByPosition, StepContext
from jkv.cache_arrays import read_at, write_at, write_layer, write_positions
from jkv.chunk_attention import HeldRows
from jkv.config import DTYPES
from jkv.methods.registry import register
from jkv_kernels.mma_layout import TILE, check_mma_packing, pack_key_tiles, pack_value_tiles
from jkv_kernels.quantization import dequantize, unpack_last_axis
from jkv_kernels.quantize_pack import quantize_pack, quantize_pack_reference

KIVI_BITS = (1, 2, 4, 8)


@struct.dataclass
class KiviState:
  k_codes: jax.Array  # [L, B, H, D, C/Pk] uint32, packed along tokens
  k_scale: jax.Array  # [L, B, H, D, C/G] meta dtype
  k_zero: jax.Array  # [L, B, H, D, C/G] meta dtype
  v_codes: jax.Array  # [L, B, H, C, D/Pv] uint32, packed along channels
  v_scale: jax.Array  # [L, B, H, C, D/G] meta dtype
  v_zero: jax.Array  # [L, B, H, C, D/G] meta dtype
  k_ring: jax.Array  # [L, B, H, R + λ, D] keys, slot p mod (R + λ): exact from bK, dequantized before it
  v_ring: jax.Array  # [L, B, H, R + λ, D] exact values, slot p mod (R + λ)


@struct.dataclass
class KiviMmaState:
  """KIVI's state with the store in the MMA-ready packing (``Kivi(mma=True)``; module docstring)."""
  k_tiles: jax.Array  # [L, B, H, C/64, 2 D k_bits] uint32: key tiles
  k_meta: jax.Array  # [L, B, H, C/G, D] uint32: per key group, (scale, zero) pairs
  v_tiles: jax.Array  # [L, B, H, C/64, 2 D v_bits] uint32: value tiles
  v_meta: jax.Array  # [L, B, H, C/64, D/G 64] uint32: per value tile, (scale, zero) pairs
  k_ring: jax.Array  # as KiviState's
  v_ring: jax.Array


@register
@dataclasses.dataclass(frozen=True)
class Kivi(SplitByPosition, CacheMethod):
  """KIVI settings. ``bits`` sets both widths unless ``k_bits``/``v_bits`` override one."""

  name = "kivi"
  bits: int = dataclasses.field(default=2, metadata={
      "help": "code width of keys and values (1: SpeCache's quarter-point 1-bit quantizer)"})
  k_bits: Optional[int] = dataclasses.field(default=None, metadata={"help": "key code width (overrides --bits)"})
  v_bits: Optional[int] = dataclasses.field(default=None, metadata={"help": "value code width (overrides --bits)"})
  group_size: int = dataclasses.field(default=32, metadata={
      "help": "G: tokens per key group, channels per value group"})
  residual: int = dataclasses.field(default=128, metadata={
      "help": "R: keys are quantized every R tokens; the newest R values stay in full precision"})
  quantize_before_attend: bool = dataclasses.field(default=False, metadata={
      "help": "quantize before attending (the paper's Algorithm 1) instead of after (the reference code)"})
  meta_dtype: str = dataclasses.field(default="float16", metadata={"help": "dtype of scales and zero-points"})
  mma: Optional[bool] = dataclasses.field(default=None, metadata={
      "help": "keep the store in the packing the Hopper tensor-core kernel reads (16-bit scales, "
              "residual a multiple of 64); default: where that kernel runs (a Hopper GPU, attention impl pallas) "
              "and the settings and model allow the packing"})

  def __post_init__(self):
    G, R = self.group_size, self.residual
    for label, b in (("bits", self.bits), ("k_bits", self.kb), ("v_bits", self.vb)):
      if b not in KIVI_BITS:
        raise ValueError(f"kivi {label}={b} is not supported; choose one of {', '.join(map(str, KIVI_BITS))}")
    if 1 in (self.kb, self.vb) and self.kb != self.vb:
      label = "k_bits" if self.kb == 1 else "v_bits"
      raise ValueError(f"kivi {label}=1 is not supported beside {max(self.kb, self.vb)}-bit codes: 1 bit (SpeCache's "
                       "quarter-point quantizer) is for keys and values together, bits=1")
    if self.meta_dtype not in DTYPES:
      raise ValueError(f"kivi meta_dtype={self.meta_dtype!r}; choose one of {', '.join(DTYPES)}")
    if G < 1 or R < 1:
      raise ValueError(f"kivi group_size={G} and residual={R} must be positive")
    if R % G:
      raise ValueError(f"kivi residual={R} must be a multiple of group_size={G}")
    for b in (self.kb, self.vb):
      if G % (32 // b):
        raise ValueError(f"kivi group_size={G} must be a multiple of {32 // b} ({b}-bit codes pack {32 // b} per word)")
    if self.mma:  # the head dim and capacity are checked with the spec
      self._check_mma(head_dim=max(64, G), capacity=TILE)

  @property
  def kb(self) -> int:
    return self.bits if self.k_bits is None else self.k_bits

  @property
  def vb(self) -> int:
    return self.bits if self.v_bits is None else self.v_bits

  @property
  def lam(self) -> int:
    return 0 if self.quantize_before_attend else 1

  @property
  def meta(self):
    return DTYPES[self.meta_dtype]

  def check(self, spec: CacheSpec) -> None:
    if spec.head_dim % self.group_size:
      raise ValueError(f"kivi group_size={self.group_size} does not divide the head dim {spec.head_dim} "
                       "(value groups span channels)")
    if self.mma:
      self._check_mma(head_dim=spec.head_dim, capacity=spec.capacity)

  def _check_mma(self, *, head_dim: int, capacity: int) -> None:
    """One-line errors for settings, or a head dim and capacity, that the MMA packing does not take."""
    if self.residual % TILE:
      raise ValueError(f"kivi mma=true needs residual={self.residual} a multiple of {TILE} (a flush packs whole key "
                       "tiles)")
    check_mma_packing(k_bits=self.kb, v_bits=self.vb, k_group=self.group_size, v_group=self.group_size,
                      head_dim=head_dim, tokens=capacity, meta_dtype=self.meta)

  def capacity_multiple(self) -> int:
    return self.residual

  def for_impl(self, spec: CacheSpec, impl: str) -> "Kivi":
    """``mma`` left open (None) is on where the Hopper kernel would read the store: impl "pallas" on a Hopper GPU,
    at most 16 query rows per KV head, and settings the packing takes. There it decodes at 2.7x the library
    layout's tokens/s at KIVI-2's largest batch (benchmarks/README.md, generate_decode.py --part maxbatch)."""
    return mma_left_open(self, impl, spec.q_per_kv,
                         lambda: self._check_mma(head_dim=spec.head_dim, capacity=spec.capacity))

  # ---------------------------------------------------------------------------------------------- state

  def abstract(self, spec: CacheSpec) -> KiviState:
    L, B, H, C, D = spec.num_layers, spec.batch, spec.kv_heads, spec.capacity, spec.head_dim
    G, R = self.group_size, self.residual
    lead = ("layers", "batch", "kv_heads")
    by_channel = lambda n, dtype: ArrayInfo((L, B, H, D, n), dtype, lead + ("head_dim", "token_groups"))
    by_token = lambda n, dtype: ArrayInfo((L, B, H, C, n), dtype, lead + ("tokens", "channel_groups"))
    ring = lambda n: ArrayInfo((L, B, H, n, D), spec.dtype, lead + ("ring", "head_dim"))
    if self.mma:
      tiles = lambda bits: ArrayInfo((L, B, H, C // TILE, 2 * D * bits), jnp.uint32, lead + ("tiles", "tile_words"))
      return KiviMmaState(
          k_tiles=tiles(self.kb),
          k_meta=ArrayInfo((L, B, H, C // G, D), jnp.uint32, lead + ("token_groups", "head_dim")),
          v_tiles=tiles(self.vb), v_meta=ArrayInfo((L, B, H, C // TILE, D // G * TILE), jnp.uint32,
                                                   lead + ("tiles", "meta_words")),
          k_ring=ring(R + self.lam), v_ring=ring(R + self.lam))
    return KiviState(
        k_codes=by_channel(C * self.kb // 32, jnp.uint32),
        k_scale=by_channel(C // G, self.meta),
        k_zero=by_channel(C // G, self.meta),
        v_codes=by_token(D * self.vb // 32, jnp.uint32),
        v_scale=by_token(D // G, self.meta),
        v_zero=by_token(D // G, self.meta),
        k_ring=ring(R + self.lam),
        v_ring=ring(R + self.lam),
    )

  def key_boundary(self, n):
    """bK: at a step holding n tokens, keys before this position are read dequantized."""
    R = self.residual
    return R * (jnp.maximum(n - self.lam, 0) // R)

  def value_boundary(self, n):
    """bV: at a step holding n tokens, values before this position are read dequantized."""
    return jnp.maximum(n - self.lam - self.residual, 0)

  def _quantize_pack(self, x, bits, axis, impl, fused):
    """The Pallas quantize-and-pack kernel for whole prompts and flushes (``fused``) where kernels run; the
    jnp reference for single tokens, where a kernel launch would cost more than the work. axis -2 groups
    tokens per channel (keys: codes [..., D, T/Pk]), -1 channels per token (values: codes [..., T, D/Pv])."""
    if fused and impl != "xla":
      return quantize_pack(x, bits=bits, group_size=self.group_size, axis=axis, meta_dtype=self.meta,
                           interpret=impl == "interpret")
    return quantize_pack_reference(x, bits=bits, group_size=self.group_size, axis=axis, meta_dtype=self.meta)

  # ---------------------------------------------------------------------------------------------- updates

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    """Quantize every whole group of the prompt and fill both rings from the prompt's tail (keys before bK as
    the store gives them back).

    Key groups at or past bK hold codes of exact-ring tokens or of padding; they are never read as
    quantized and the flush that reaches them rewrites them from the ring.
    """
    return self._store_prompt(state, layer, k, v, None, ctx.lengths, ctx.impl)

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    """A prompt chunk stored as a prompt that starts at the state's key boundary: the rings' exact rows from there
    to the length, then the chunk's. Codes of those ring rows are written again, the same (per-token value groups
    do not depend on neighbours; their key blocks were never quantized)."""
    return self._store_from_ring(state, layer, k, v, ctx.lengths, ctx.positions, ctx.impl)

  def _store_from_ring(self, state, layer, k, v, n, positions, impl, first_slot=None):
    """``store_chunk`` of rows k, v [B, H, T, D] at positions [B, T] (-1 past a prompt's end) after n [B] held
    tokens; with ``first_slot``, the store holds the slots of positions from it on (``store_span``)."""
    R, W, T = self.residual, self.residual + self.lam, k.shape[2]
    start = self._flushed(n)  # n - start <= R
    pos = start[:, None] + jnp.arange(R + T)[None]  # [B, R + T]
    idx = jnp.clip(jnp.where(pos < n[:, None], pos % W, W + pos - n[:, None]), 0, W + T - 1)[:, None, :, None]
    rows = lambda ring, new: jnp.take_along_axis(jnp.concatenate([ring[layer], new.astype(ring.dtype)], axis=2),
                                                 idx, axis=2)
    end = n + jnp.sum(positions >= 0, axis=1).astype(n.dtype)
    return self._store_prompt(state, layer, rows(state.k_ring, k), rows(state.v_ring, v), start, end, impl,
                              first_slot)

  def held_rows(self, state, layer, lengths) -> HeldRows:
    """What the next step's first row (position n = ``lengths``) reads of the n held tokens, as its step would: the
    store before bV(n + 1), the rings after, whose keys before bK(n + 1) are as the store gives them back. A key
    block that step would flush first (the state's, [_flushed(n), bK(n + 1))) is read from the store's codes, which
    prefill and ``store_chunk`` write for every whole block."""
    return self._held(state, layer, lengths, 0)

  def _held(self, state, layer, n, first_slot):
    """``held_rows`` of n [B] held tokens, row i the position ``first_slot`` + i (store slot i): the store's range
    of them, and the rings' positions that lie in it (``held_span``)."""
    b_k, b_v, flushed = self.key_boundary(n + 1), self.value_boundary(n + 1), self._flushed(n)
    k, v = read_store(self.store(state, b_v), layer, state.k_ring.dtype)
    p = first_slot + jnp.arange(k.shape[2])[None]
    ring = lambda x: x[layer][:, :, p[0] % (self.residual + self.lam)]
    rows = lambda where: where[:, None, :, None]
    key_stored = (p < b_v[:, None]) | ((p >= flushed[:, None]) & (p < b_k[:, None]))
    return HeldRows(jnp.where(rows(key_stored), k, ring(state.k_ring)),
                    jnp.where(rows(p < b_v[:, None]), v, ring(state.v_ring)), jnp.clip(n - first_slot, 0, k.shape[2]))

  def _flushed(self, n):
    """The key boundary of the state between steps with n [B] tokens: keys before it are in the store, the rest in
    the key ring exactly. With the MMA packing the block ending at n is flushed already (``end_step``)."""
    return self.key_boundary(n + (self.lam if self.mma else 0))

  def _store_prompt(self, state, layer, k, v, start, end, impl, first_slot=None):
    """Rows k, v [B, H, T, D] of positions start [B] + [0, T) (start a multiple of R: a key block's; None: 0),
    which leave ``end`` [B] tokens held: every whole group quantized from ``start``, and the rings' slots of
    positions at or past ``start`` from the rows (keys before bK as the store gives them back). With
    ``first_slot`` (a multiple of R) the store holds the positions from it on, and the rows outside it are
    dropped; the rings, every position's, are the same whatever it is."""
    B, H, T, D = k.shape
    R = self.residual
    T_pad = -(-T // R) * R
    k_pad = jnp.pad(k, ((0, 0), (0, 0), (0, T_pad - T), (0, 0)))
    kc, ks, kz = self._quantize_pack(k_pad, self.kb, -2, impl, fused=True)
    vc, vs, vz = self._quantize_pack(v, self.vb, -1, impl, fused=True)
    if start is None:  # one in-place update of the whole layer, where a per-sequence offset would be a scatter
      write, offset = (lambda buf, x, unit, axis: write_layer(buf, layer, x)), jnp.zeros((B,), jnp.int32)
    else:
      write, offset = (lambda buf, x, unit, axis: write_positions(buf, layer, x, start, unit, axis,
                                                                  first_slot=first_slot)), start
    if self.mma:
      k_words, k_meta = pack_key_tiles(kc, ks, kz, bits=self.kb)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, -T % TILE), (0, 0)))
      v_words, v_meta = pack_value_tiles(pad(vc), pad(vs), pad(vz), bits=self.vb)
      state = state.replace(
          k_tiles=write(state.k_tiles, k_words, TILE, 2), k_meta=write(state.k_meta, k_meta, self.group_size, 2),
          v_tiles=write(state.v_tiles, v_words, TILE, 2), v_meta=write(state.v_meta, v_meta, TILE, 2))
    else:
      Pk, G = 32 // self.kb, self.group_size
      state = state.replace(
          k_codes=write(state.k_codes, kc, Pk, 3), k_scale=write(state.k_scale, ks, G, 3),
          k_zero=write(state.k_zero, kz, G, 3), v_codes=write(state.v_codes, vc, 1, 2),
          v_scale=write(state.v_scale, vs, 1, 2), v_zero=write(state.v_zero, vz, 1, 2))
    b_k = self._flushed(end)
    held = self.ring_positions(end)  # [B, W]
    rel = held - offset[:, None]
    take = lambda x: jnp.take_along_axis(x, jnp.clip(rel, 0, T - 1)[:, None, :, None], axis=2)
    # Positions before bK in the rings lie in the last quantized block [bK - R, bK) (W <= R + 1), within the rows.
    block_start = jnp.maximum(b_k - R, offset)
    block = self._dequantized_block(kc, ks, kz, block_start - offset, state.k_ring.dtype)
    k_new = self._with_block(take(k), held, block, block_start, held < b_k[:, None])
    fresh = (rel >= 0)[:, None, :, None]  # slots of earlier positions keep what the rings hold
    return state.replace(k_ring=write_layer(state.k_ring, layer, jnp.where(fresh, k_new, state.k_ring[layer])),
                         v_ring=write_layer(state.v_ring, layer, jnp.where(fresh, take(v), state.v_ring[layer])))

  def step(self, state, layer, q, k, v, ctx: StepContext):
    rows = k.shape[2]
    for t in range(rows):  # T is 1..4 at decode: a short static loop
      # With the MMA packing, a block ending at a step's first position was flushed by the step before's end_step.
      state = self.append_one(state, layer, k[:, :, t], v[:, :, t], ctx.lengths + t, ctx.impl,
                              flush_before=not (self.mma and t == 0),
                              pack_values=not self._packs_at_end_step(rows))
    return self._attend(state, layer, q, ctx.positions, self.advance(ctx.lengths, rows), ctx.impl), state

  def append_one(self, state, layer, k, v, pos, impl, flush_before: bool = True, pack_values: bool = True,
                 first_slot=None):
    """Store one token per sequence: k, v [B, H, D] at positions pos [B]. ``flush_before`` (λ = 1): flush the key
    block that ends at pos here; ``pack_values`` (MMA packing): pack the value tile that pos completes here;
    ``first_slot``: the store holds the range of positions from it on (``store_span``)."""
    R, W = self.residual, self.residual + self.lam
    state = state.replace(v_ring=write_at(state.v_ring, layer, v[:, :, None], pos % W, axis=2))
    if self.mma and pack_values:
      due = pos % TILE == TILE - 1
      state = jax.lax.cond(jnp.any(due), lambda s: self._pack_value_tile(s, layer, pos // TILE, due, impl,
                                                                         first_slot), lambda s: s, state)
    elif not self.mma:
      vc, vs, vz = self._quantize_pack(v[:, :, None], self.vb, -1, impl, fused=False)  # [B, H, 1, ...]
      put = lambda buf, x: write_positions(buf, layer, x, pos, 1, 2, first_slot=first_slot)
      state = state.replace(v_codes=put(state.v_codes, vc), v_scale=put(state.v_scale, vs),
                            v_zero=put(state.v_zero, vz))
    if self.lam == 1 and flush_before:  # the block before p leaves the ring before p takes slot 0
      state = self._flush(state, layer, pos, (pos % R == 0) & (pos > 0), impl, first_slot)
    state = state.replace(k_ring=write_at(state.k_ring, layer, k[:, :, None], pos % W, axis=2))
    if self.lam == 0:  # the block ending at p is quantized before this step attends
      state = self._flush(state, layer, pos + 1, (pos + 1) % R == 0, impl, first_slot)
    return state

  def end_step(self, state, ctx: StepContext):
    """With the MMA packing, per-layer conditional work done once for every layer: the value tile a step of one
    row completed is packed (``_packs_at_end_step``), and (λ = 1) the key block that ends at the new
    length is flushed, which the next step's first row would otherwise flush in each layer before attending
    (nothing reads the ring in between). Two conditionals a step instead of two per layer (64 for Llama-3-8B,
    each a ``set_case_condition`` launch in the profile: benchmarks/results/profile_decode_step_kivi2_mma_b307_*):
    KIVI-2 at its largest batch on an H100 went from 29.63 to 29.43 ms/step (one run each, same call)."""
    rows, first = ctx.positions.shape[1], ctx.first_slot
    n = ctx.lengths if first is None else ctx.lengths + first
    return self.settle(state, n + rows, self._packs_at_end_step(rows), ctx.impl, first)

  def settle(self, state, end, pack_values: bool, impl, first_slot=None):
    """``end_step``'s work for a step that leaves end [B] tokens stored (SpeCache's low-bit copy calls it with its
    one stored row): ``pack_values``, whether the step's rows left the value tile they completed to it;
    ``first_slot``, as in ``append_one``."""
    if not self.mma:
      return state
    every_layer = lambda work, due: lambda s: jax.lax.fori_loop(0, s.k_ring.shape[0], lambda i, s: work(s, i, due), s)
    if pack_values:
      pack_due = end % TILE == 0  # the row completed its tile
      pack = lambda s, layer, due: self._pack_value_tile(s, layer, end // TILE - 1, due, impl, first_slot)
      state = jax.lax.cond(jnp.any(pack_due), every_layer(pack, pack_due), lambda s: s, state)
    if self.lam == 1:
      flush_due = end % self.residual == 0
      flush = lambda s, layer, due: self._flush_now(s, layer, end, due, impl, first_slot)
      state = jax.lax.cond(jnp.any(flush_due), every_layer(flush, flush_due), lambda s: s, state)
    return state

  @staticmethod
  def _packs_at_end_step(rows: int) -> bool:
    """Whether a step of ``rows`` rows leaves its value tile to ``end_step`` (MMA packing): a step of one row; in a
    longer step a tile completed by an early row can be read by the same step's attention (R = 64)."""
    return rows == 1

  def _pack_value_tile(self, state, layer, tile, due, impl, first_slot=None):
    """Quantize the values of tile ``tile`` [B] (positions 64 tile + [0, 64), all in the value ring) per token
    and pack them, for the sequences where ``due`` (``first_slot``: as in ``append_one``)."""
    W = self.residual + self.lam
    positions = TILE * tile[:, None] + jnp.arange(TILE)[None]  # [B, 64]
    values = jnp.take_along_axis(state.v_ring[layer], (positions % W)[:, None, :, None], axis=2)
    codes = self._quantize_pack(values, self.vb, -1, impl, fused=True)
    words, meta = pack_value_tiles(*codes, bits=self.vb)  # [B, H, 1, ...]
    put = lambda buf, x: write_positions(buf, layer, x, TILE * tile, TILE, 2, due, first_slot)
    return state.replace(v_tiles=put(state.v_tiles, words), v_meta=put(state.v_meta, meta))

  def _flush(self, state, layer, end, due, impl, first_slot=None):
    """Quantize the keys of positions [end - R, end) from the key ring into the key store, and put them back in
    the ring as the store gives them back, for the sequences where ``due`` (with ``first_slot``, into the store of
    the range from it, where the block lies in it; into the rings always).

    Runs only on steps where some sequence is due (one step in R for a batch in lockstep).
    """
    return jax.lax.cond(jnp.any(due), lambda s: self._flush_now(s, layer, end, due, impl, first_slot), lambda s: s,
                        state)

  def _flush_now(self, state, layer, end, due, impl, first_slot=None):
    R, G, W = self.residual, self.group_size, self.residual + self.lam
    start = jnp.maximum(end - R, 0)
    slot = lambda x, pos: jnp.take_along_axis(x, (pos % W)[:, None, :, None], axis=2)
    ring = state.k_ring[layer]  # [B, H, W, D]
    block = slot(ring, start[:, None] + jnp.arange(R)[None])  # [B, H, R, D], positions [end - R, end)
    kc, ks, kz = self._quantize_pack(block, self.kb, -2, impl, fused=True)  # [B, H, D, R/Pk], [B, H, D, R/G]
    Pk = 32 // self.kb
    # Each slot's position at this point (the newest ≡ slot mod W before ``end``); the block's slots change.
    held = self.ring_positions(end)
    k_ring = self._with_block(ring, held, self._dequantize(kc, ks, kz, ring.dtype), start,
                              due[:, None] & (held >= start[:, None]))
    if self.mma:
      words, meta = pack_key_tiles(kc, ks, kz, bits=self.kb)  # [B, H, R/64, ...], [B, H, R/G, D]
      put = lambda buf, x, unit: write_positions(buf, layer, x, start, unit, 2, due, first_slot)
      stored = dict(k_tiles=put(state.k_tiles, words, TILE), k_meta=put(state.k_meta, meta, G))
    else:
      put = lambda buf, x, unit: write_positions(buf, layer, x, start, unit, 3, due, first_slot)
      stored = dict(k_codes=put(state.k_codes, kc, Pk), k_scale=put(state.k_scale, ks, G),
                    k_zero=put(state.k_zero, kz, G))
    return state.replace(**stored, k_ring=write_layer(state.k_ring, layer, k_ring))

  def _with_block(self, keys, held, block, start, replace):
    """Ring keys [B, H, W, D] (slot positions ``held`` [B, W]) with the slots where ``replace`` [B, W] taken
    from block [B, H, R, D], the keys of positions start [B] + [0, R)."""
    at = jnp.clip(held - start[:, None], 0, self.residual - 1)[:, None, :, None]
    return jnp.where(replace[:, None, :, None], jnp.take_along_axis(block, at, axis=2), keys)

  def _dequantize(self, words, scale, zero, dtype):
    """Keys [B, H, n, D] in ``dtype`` of key codes [B, H, D, n/Pk] and their scales and zero-points
    [B, H, D, n/G]: what reading them from the store gives."""
    k = dequantize(unpack_last_axis(words, bits=self.kb), scale, zero, axis=-1, group_size=self.group_size,
                   dtype=dtype)
    return jnp.swapaxes(k, -1, -2)

  def _dequantized_block(self, codes, scale, zero, start, dtype):
    """Keys [B, H, R, D] of positions [start, start + R) (start [B], a multiple of R; clipped to 0) as the store
    gives them back, from the library-layout key codes [B, H, D, n/Pk] and scales [B, H, D, n/G] of a prompt."""
    R, G, Pk = self.residual, self.group_size, 32 // self.kb
    start = jnp.maximum(start, 0)
    read = lambda x, unit: read_at(x[None], 0, start // unit, R // unit, axis=3)
    return self._dequantize(read(codes, Pk), read(scale, G), read(zero, G), dtype)

  # ---------------------------------------------------------------------------------------------- attention

  def _attend(self, state, layer, q, q_positions, lengths, impl, first_slot=0, return_lse: bool = False):
    """One softmax over the quantized store and the window. The store is read for positions before
    bV, where both keys and values are quantized; the window [bV, N) (at most R + λ tokens) is the rings, read
    in place: exact values, keys dequantized before bK and exact from bK on. A store of the positions from
    ``first_slot`` on (``attend``) is read for those of them before bV, and the window only where it is 0: every
    device holds the same rings, and the range that starts the sequence counts them once."""
    win, in_window = self.window(lengths)
    mask = in_window[:, None, :] & (win[:, None, :] <= q_positions[:, :, None]) & (first_slot == 0)
    window = (state.k_ring, state.v_ring, mask)
    store = self.store(state, jnp.clip(self.value_boundary(lengths) - first_slot, 0, self.capacity(state)))
    return decode_attention(q, layer, stores=(store,), segments=(window,), impl=impl, return_lse=return_lse)

  # ------------------------------------------------------------------------------- one range of each sequence
  # Context parallelism (jkv.context_parallel): the store holds slots [0, C) of positions first_slot + [0, C),
  # first_slot a multiple of R, so a key block or value tile lies in one device's store; the rings hold the newest
  # positions as on one device, the same on every device (each stores every row into them).

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    """A step's row stored as ``step`` stores it, a prompt's or a chunk's rows as ``store_chunk`` stores a chunk,
    the store keeping those of its range. (A row alone is a step's or a one-token prompt's: real, never padding.)"""
    first, n = ctx.first_slot, ctx.lengths + ctx.first_slot
    if k.shape[2] == 1:  # (the flags as ``step`` sets them for a step of one row)
      return self.append_one(state, layer, k[:, :, 0], v[:, :, 0], n, ctx.impl, flush_before=not self.mma,
                             pack_values=not self._packs_at_end_step(1), first_slot=first)
    return self._store_from_ring(state, layer, k, v, n, ctx.positions + first, ctx.impl, first)


  def store(self, state, b_v, valid=None):
    """The quantized store read for positions before b_v [B]; ``valid`` [B, H, C] marks holes (SpeCache): an
    ``MmaStore`` with the MMA packing (bV < 64⌊N/64⌋: the positions before bV are in packed tiles), else a
    ``QuantizedStore``."""
    G = self.group_size
    if self.mma:
      return MmaStore(state.k_tiles, state.k_meta, state.v_tiles, state.v_meta, b_v, self.kb, self.vb, G, G,
                      valid=valid)
    return QuantizedStore(k_codes=state.k_codes, k_scale=state.k_scale, k_zero=state.k_zero,
                          v_codes=state.v_codes, v_scale=state.v_scale, v_zero=state.v_zero, length=b_v,
                          k_bits=self.kb, v_bits=self.vb, k_group=G, v_group=G, valid=valid)

  def capacity(self, state) -> int:
    """Slots of the quantized store of ``state`` (either layout)."""
    return state.k_tiles.shape[3] * TILE if self.mma else state.v_codes.shape[3]

  def ring_positions(self, lengths):
    """[B, W] int32: the position ring slot s holds with ``lengths`` [B] tokens stored (the newest ≡ s mod W;
    negative for a slot not yet filled)."""
    W = self.residual + self.lam
    last = lengths[:, None] - 1
    return last - (last - jnp.arange(W)[None]) % W

  def window(self, lengths):
    """The window at a step holding ``lengths`` [B] tokens, per ring slot: the position it holds [B, W] int32
    (clipped to 0) and whether it belongs to the window [B, W] bool (filled, and at or past bV). Its keys and
    values are the rings (``k_ring``, ``v_ring`` at the layer)."""
    W = self.residual + self.lam
    win = jnp.clip(self.ring_positions(lengths), 0)
    in_window = (win >= self.value_boundary(lengths)[:, None]) & (jnp.arange(W)[None] < lengths[:, None])
    return win, in_window

  # ---------------------------------------------------------------------------------------------- memory

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    """Bytes of the live state between steps (docs/methods/kivi.md, 'Bytes'): nK = R⌊N/R⌋ quantized keys and
    N - nK exact ones, nV = max(0, N - R) quantized values and min(N, R) exact ones, plus one int32 length per
    sequence. The state adds nothing the lengths do not determine."""
    del state
    n = np.asarray(lengths, np.int64)
    R, G = self.residual, self.group_size
    meta = jnp.dtype(self.meta).itemsize
    act = jnp.dtype(spec.dtype).itemsize
    n_k = R * (n // R)
    n_v = np.maximum(n - R, 0)
    per_row = ((self.kb / 8 + 2 * meta / G) * n_k + (self.vb / 8 + 2 * meta / G) * n_v
               + act * ((n - n_k) + (n - n_v)))
    return HeldBytes(device=int(round(spec.num_layers * spec.kv_heads * spec.head_dim * per_row.sum())) + 4 * len(n))

