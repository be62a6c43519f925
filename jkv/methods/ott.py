"""``ott``: KIVI plus a full-precision pool of outlier tokens (OTT, arXiv:2505.10938; docs/methods/ott.md).

Schedule. New keys and values wait in a full-precision buffer of G + R slots (slot p mod
(G + R)). Once G + R tokens have gathered and the step holding them has attended, the oldest G become one
quantized block (keys per channel over the G tokens, values per token in groups of Gv channels, KIVI's
quantizer and layouts) and R stay. jkv runs that event when the next token arrives, before storing it (see
``Ott.quantized``), so between steps a sequence of n tokens holds q(n) = G*floor(max(0, n - 1 - R)/G)
quantized tokens. Like KIVI's boundaries, this is a function of the length alone: every sequence of a batch
reaches its block events at its own steps, and no counter is stored.

A block event (the paper's Sec. 3.2 and Appendix E) runs a competition per KV head. The G tokens compete with
the layer's outlier pool (N slots) by the L1 norm of their unquantized post-RoPE key, and the N smallest hold the
pool (ties go to the older token). A winner from the block is quantized as a placeholder: the block's
per-channel mean, for K and V, so it cannot widen a key range. Its slot is also flagged as a hole in the store's
``valid`` mask. A pool member that loses its slot moves to the auxiliary pool (A slots); it is never re-quantized
and never dropped. Once the auxiliary pool could overflow at the next event (more than A - N entries), the head
stops selecting, and later blocks are quantized exactly as KIVI would quantize them. Layers [0, no_pool_layers)
have no pool (the paper's Sec. 4.4: its shallow layers show no outlier tokens).

Attention is one softmax over three parts, so every token counts once: the quantized store with its
holes masked, the pools (one segment: the N pool slots, then the A auxiliary slots, each masked per KV head where
empty) and the full-precision buffer.

With ``mma=True`` the store is kept in the MMA-ready packing (``jkv_kernels.mma_layout``) that the Hopper
tensor-core kernel reads, holes and all: a block event merges its G tokens into the tile that holds them
(``cache_arrays.write_mma_tokens``; G divides 64, or is a multiple of it), with the same codes, scales and
placeholders.

On a mesh's ``seq`` axis (``jkv.context_parallel``) each device holds the store and hole mask of a range of whole
tiles; the buffer and the pools are held, and every competition run, by every device alike, so the pools are the
ones one device selects (section 'one range of each sequence').
"""

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.attention import MmaStore, QuantizedStore, decode_attention, mma_left_open, read_store
from jkv.cache import ArrayInfo, CacheMethod, CacheSpec, HeldBytes, SplitByPosition, StepContext
from jkv.cache_arrays import write_at, write_layer, write_mma_tokens, write_positions
from jkv.chunk_attention import HeldRows
from jkv.config import DTYPES
from jkv.methods.kivi import KIVI_BITS
from jkv.methods.registry import register
from jkv_kernels.mma_layout import TILE, check_mma_packing
from jkv_kernels.quantize_pack import quantize_pack, quantize_pack_reference

PREFILL_SELECTIONS = ("oneshot", "sequential")


@struct.dataclass
class OttState:
  """Every array is stacked over layers. Prefill writes all of a layer's arrays: the mask and the pools are
  meaningful only after it (an empty pool slot has position -1 and score +inf)."""

  k_codes: jax.Array  # [L, B, H, D, C/Pk] uint32, keys packed along tokens (KIVI layout)
  k_scale: jax.Array  # [L, B, H, D, C/G] meta dtype
  k_zero: jax.Array  # [L, B, H, D, C/G] meta dtype
  v_codes: jax.Array  # [L, B, H, C, D/Pv] uint32, values packed along channels
  v_scale: jax.Array  # [L, B, H, C, D/Gv] meta dtype
  v_zero: jax.Array  # [L, B, H, C, D/Gv] meta dtype
  valid: jax.Array  # [L, B, H, C] bool: False where a slot holds an outlier's placeholder (a hole); C = 0 if N = 0
  k_fp: jax.Array  # [L, B, H, G + R, D] model dtype: unquantized keys, slot p mod (G + R)
  v_fp: jax.Array  # [L, B, H, G + R, D] model dtype
  pool_k: jax.Array  # [L, B, H, N + A, D] model dtype: outlier pool (slots [0, N)), then the auxiliary pool
  pool_v: jax.Array  # [L, B, H, N + A, D] model dtype
  pool_pos: jax.Array  # [L, B, H, N + A] int32 position of each pooled token, -1 for an empty slot
  pool_score: jax.Array  # [L, B, H, N] float32 key L1 norm of the outlier pool, ascending by (score, position)
  aux_count: jax.Array  # [L, B, H] int32 tokens in the auxiliary pool
  frozen: jax.Array  # [L, B, H] bool: this head has stopped selecting outliers


@struct.dataclass
class OttMmaState:
  """OTT's state with the store in the MMA-ready packing (``Ott(mma=True)``); the other arrays are OttState's."""

  k_tiles: jax.Array  # [L, B, H, C/64, 2 D bits] uint32: key tiles
  k_meta: jax.Array  # [L, B, H, C/G, D] uint32: per key group, (scale, zero) pairs
  v_tiles: jax.Array  # [L, B, H, C/64, 2 D bits] uint32: value tiles
  v_meta: jax.Array  # [L, B, H, C/64, D/Gv 64] uint32: per value tile, (scale, zero) pairs
  valid: jax.Array
  k_fp: jax.Array
  v_fp: jax.Array
  pool_k: jax.Array
  pool_v: jax.Array
  pool_pos: jax.Array
  pool_score: jax.Array
  aux_count: jax.Array
  frozen: jax.Array


def compete(pool_score, pool_pos, block_score, block_pos, capacity):
  """The outlier-pool competition (the paper's Appendix E), per (batch row, KV head).

  Args:
    pool_score: [B, H, N] float32, ascending by (score, position); +inf in empty slots.
    pool_pos: [B, H, N] int32, -1 in empty slots.
    block_score: [B, H, M] float32 key L1 norms of the block; +inf for tokens that do not compete.
    block_pos: [B, H, M] int32 positions of the block's tokens.
    capacity: int32 scalar N_l <= N, the pool slots this layer uses.

  Returns:
    (order [B, H, N] int32 index of each new pool slot's token among [pool, block], win [B, H, N] bool which
    new slots hold a token, kept [B, H, N] bool which old pool slots keep their token, admitted [B, H, M] bool
    which block tokens join the pool). The new pool is the ``capacity`` smallest finite scores of the union by
    (score, position), in that order.
  """
  N, M = pool_score.shape[-1], block_score.shape[-1]
  score = jnp.concatenate([pool_score, block_score], axis=-1)
  pos = jnp.concatenate([pool_pos, block_pos], axis=-1)
  index = jnp.broadcast_to(jnp.arange(N + M, dtype=jnp.int32), score.shape)
  sorted_score, _, order = jax.lax.sort((score, pos, index), dimension=-1, num_keys=2)
  order = order[..., :N]
  win = (jnp.arange(N) < capacity) & jnp.isfinite(sorted_score[..., :N])
  chosen = lambda candidates: jnp.any((order[..., None] == candidates) & win[..., None], axis=-2)
  return order, win, chosen(jnp.arange(N)), chosen(N + jnp.arange(M))


def _quantize_pack(x, *, bits, group_size, axis, meta_dtype, impl):
  """The Pallas quantize-and-pack kernel where kernels run, its jnp reference on the XLA path (bit-identical)."""
  if impl != "xla":
    return quantize_pack(x, bits=bits, group_size=group_size, axis=axis, meta_dtype=meta_dtype,
                         interpret=impl == "interpret")
  return quantize_pack_reference(x, bits=bits, group_size=group_size, axis=axis, meta_dtype=meta_dtype)


@register
@dataclasses.dataclass(frozen=True)
class Ott(SplitByPosition, CacheMethod):
  """OTT settings. The defaults were chosen on the default model's quality-per-byte frontier
  (``jkv frontier``, docs/frontier.md): 2-bit codes, key groups of G = 16 tokens, values in groups of 32
  channels, R = 32 and an 8-token pool. At 512 + 64 tokens they reached perplexity 12.526 where KIVI-2's default
  reached 14.341 (dense 11.851) at 0.84x its bytes per token on pydoc_data.topics (73% of KIVI-2's loss recovered),
  13.538 against 15.423 (dense 12.609; 67%) on the held-out text, and 8.447 against 9.402 (dense 7.910; 64%) at
  0.98x its bytes at 2048 + 128 tokens. The lever is the key group: G = 32 (the previous default) recovered 61% on
  the tuning text but 46% on the held-out one; pool size, residual and the first layers' pool moved little. A
  16-token key group costs one fp16 scale and zero per 16 tokens of a channel: 57 bytes per quantized token and KV
  head at D = 64 against KIVI-2's 48 (the previous default's 49). Its small full-precision part (R = 32 against
  KIVI's 128) pays for that up to about 2048 tokens; over long contexts the ratio to KIVI-2's bytes approaches
  57/48 = 1.19x, where ``group_size=32`` stays near 49/48. With 1-bit codes (32 per word) G must be a multiple of
  32: pass ``group_size=32``. The paper's main configuration (its Sec. 4.1: G = 128, R = 32, N = 3; values grouped
  as keys, as KIVI's code does) is the preset ``paper``; there it reached 14.014 and 15.672 at 1.09x KIVI-2's
  bytes: a 128-token key group spans more spread on this model than the pool repairs."""

  name = "ott"
  presets = {"paper": dict(bits=2, group_size=128, residual=32, value_group=None, pool_size=3, aux_size=32,
                           no_pool_layers=2)}
  bits: int = dataclasses.field(default=2, metadata={"help": "code width of keys and values"})
  group_size: int = dataclasses.field(default=16, metadata={
      "help": "G: tokens per key group; also the quantization period (a block of G tokens every G steps)"})
  residual: int = dataclasses.field(default=32, metadata={
      "help": "R: newest tokens that always stay in full precision (the buffer holds R to G+R-1 between steps)"})
  value_group: Optional[int] = dataclasses.field(default=32, metadata={
      "help": "Gv: channels per value group, at most the head dim (value_group=none in a spec: min(G, head dim), "
              "as KIVI's code and the paper preset)"})
  pool_size: int = dataclasses.field(default=8, metadata={
      "help": "N: outlier-pool slots per layer and KV head, for the whole sequence (0: KIVI on OTT's schedule)"})
  aux_size: int = dataclasses.field(default=32, metadata={
      "help": "A: slots for tokens evicted from the outlier pool; selection stops before it could overflow"})
  no_pool_layers: int = dataclasses.field(default=2, metadata={
      "help": "the first this many layers keep no outlier pool (the paper: layers 0 and 1)"})
  prefill_selection: str = dataclasses.field(default="oneshot", metadata={
      "help": "'oneshot': the prompt's N smallest-norm tokens in one competition; 'sequential': one "
              "competition per block, as decoding runs them (same pool; evicted tokens fill the auxiliary pool)"})
  meta_dtype: str = dataclasses.field(default="float16", metadata={"help": "dtype of scales and zero-points"})
  mma: Optional[bool] = dataclasses.field(default=None, metadata={
      "help": "keep the store in the packing the Hopper tensor-core kernel reads (16-bit scales, G "
              "dividing 64 or a multiple of it); default: where that kernel runs (a Hopper GPU, attention impl "
              "pallas) and the settings and model allow the packing"})

  def __post_init__(self):
    G, R = self.group_size, self.residual
    if self.bits not in KIVI_BITS:
      raise ValueError(f"ott bits={self.bits} is not supported; choose one of {', '.join(map(str, KIVI_BITS))}")
    if self.meta_dtype not in DTYPES:
      raise ValueError(f"ott meta_dtype={self.meta_dtype!r}; choose one of {', '.join(DTYPES)}")
    if self.prefill_selection not in PREFILL_SELECTIONS:
      raise ValueError(f"ott prefill_selection={self.prefill_selection!r}; choose one of "
                       f"{', '.join(PREFILL_SELECTIONS)}")
    if G < 1 or R < 0:
      raise ValueError(f"ott group_size={G} must be positive and residual={R} non-negative")
    per_word = 32 // self.bits
    for label, size in (("group_size", G), ("value_group", self.value_group)):
      if size is not None and (size < 1 or size % per_word):
        hint = f"; set {label}={per_word}" if size > 0 and per_word > size else ""  # 1-bit under G = 16
        raise ValueError(f"ott {label}={size} must be a positive multiple of {per_word} "
                         f"({self.bits}-bit codes pack {per_word} per word){hint}")
    for label, n in (("pool_size", self.pool_size), ("aux_size", self.aux_size),
                     ("no_pool_layers", self.no_pool_layers)):
      if n < 0:
        raise ValueError(f"ott {label}={n} must be non-negative")
    if self.mma:  # the head dim is checked with the spec
      self._check_mma(head_dim=64 * -(-(self.value_group or G) // 64), capacity=TILE)

  @property
  def window(self) -> int:
    """G + R: slots of the full-precision buffer."""
    return self.group_size + self.residual

  @property
  def meta(self):
    return DTYPES[self.meta_dtype]

  @property
  def pool_slots(self) -> int:
    """N + A: the pool segment's slots (none without an outlier pool: nothing is ever evicted)."""
    return self.pool_size + self.aux_size if self.pool_size else 0

  def value_group_for(self, head_dim: int) -> int:
    """Gv for this head dim: ``value_group`` (or G where it is None), at most the head dim."""
    return min(self.value_group or self.group_size, head_dim)

  def check(self, spec: CacheSpec) -> None:
    for label, n in (("pool_size", self.pool_size), ("aux_size", self.aux_size)):
      if n > spec.capacity:
        raise ValueError(f"ott {label}={n} exceeds the capacity of {spec.capacity} tokens (its slots hold tokens "
                         "of the sequence)")
    Gv = self.value_group_for(spec.head_dim)
    if spec.head_dim % Gv or Gv % (32 // self.bits):
      raise ValueError(f"ott value group {Gv} must divide the head dim {spec.head_dim} and be a multiple of "
                       f"{32 // self.bits} ({self.bits}-bit codes pack {32 // self.bits} per word)")
    if self.mma:
      self._check_mma(head_dim=spec.head_dim, capacity=spec.capacity)

  def _check_mma(self, *, head_dim: int, capacity: int) -> None:
    """One-line errors for settings, or a head dim, that the MMA packing does not take."""
    G = self.group_size
    if 64 % G and G % 64:
      raise ValueError(f"ott mma=true needs group_size={G} to divide 64 or be a multiple of it (a block event "
                       "writes whole key groups into a tile)")
    check_mma_packing(k_bits=self.bits, v_bits=self.bits, k_group=G, v_group=self.value_group_for(head_dim),
                      head_dim=head_dim, tokens=self._store_capacity(capacity), meta_dtype=self.meta)

  def _store_capacity(self, capacity: int) -> int:
    """Slots of the store: whole key groups (``_compress`` writes the block after the last quantized one) and whole
    tiles of 64 tokens. The MMA packing needs the tiles; the Triton kernel walks blocks of the largest power of two
    that divides the slots, and slots of 16 G = 16 groups (131,088 at 128k) made it walk 16 tokens a block."""
    unit = math.lcm(self.group_size, TILE)
    return -(-capacity // unit) * unit

  def for_impl(self, spec: CacheSpec, impl: str) -> "Ott":
    """``mma`` left open (None) is on where the Hopper kernel would read the store: impl "pallas" on a Hopper GPU,
    at most 16 query rows per KV head and settings the packing takes (the store's slots are whole tiles either
    way, so the bytes memory planning counted with ``mma`` still open are the bytes allocated)."""
    return mma_left_open(self, impl, spec.q_per_kv,
                         lambda: self._check_mma(head_dim=spec.head_dim, capacity=spec.capacity))

  def capacity_multiple(self) -> int:
    return self.group_size

  def range_multiple(self) -> int:
    """Whole tiles: the store's slots are whole tiles (``_store_capacity``), so a ``seq`` split of the sequence's
    slots into ranges of whole tiles splits the store into the same ranges."""
    return math.lcm(self.group_size, TILE)

  def chunk_multiple(self) -> int:
    """Two groups: a chunk stored with the buffer's rows before it (``store_chunk``) writes whole groups up to
    2G - 2 tokens past its own end."""
    return 2 * self.group_size

  def quantized(self, n):
    """q(n) = G*floor(max(0, n - 1 - R)/G): tokens held quantized by a sequence of n tokens between steps.

    A full buffer (G + R tokens) gives up its oldest G when the next token arrives, before that token is
    stored (as KIVI's flush), not right after the step that filled it attends. Every step attends
    over the same tokens either way, and the store's arrays are written before attention reads them in the
    step, which lets XLA update them in place (a write after the read costs a copy of each array)."""
    G, R = self.group_size, self.residual
    return G * (jnp.maximum(n - 1 - R, 0) // G)

  def layer_capacity(self, layer):
    """N_l: outlier-pool slots that ``layer`` (traced int32) uses."""
    return jnp.where(layer < self.no_pool_layers, 0, self.pool_size)

  # ---------------------------------------------------------------------------------------------- state

  def abstract(self, spec: CacheSpec) -> OttState:
    L, B, H, D = spec.num_layers, spec.batch, spec.kv_heads, spec.head_dim
    G, Gv, per_word = self.group_size, self.value_group_for(D), 32 // self.bits
    C = self._store_capacity(spec.capacity)
    N, P = self.pool_size, self.pool_slots
    lead = ("layers", "batch", "kv_heads")
    by_channel = lambda n, dtype: ArrayInfo((L, B, H, D, n), dtype, lead + ("head_dim", "token_groups"))
    by_token = lambda n, dtype: ArrayInfo((L, B, H, C, n), dtype, lead + ("tokens", "channel_groups"))
    rows = lambda n, axis: ArrayInfo((L, B, H, n, D), spec.dtype, lead + (axis, "head_dim"))
    per_head = lambda dtype: ArrayInfo((L, B, H), dtype, lead)
    if self.mma:
      tiles = ArrayInfo((L, B, H, C // TILE, 2 * D * self.bits), jnp.uint32, lead + ("tiles", "tile_words"))
      key_groups = ArrayInfo((L, B, H, C // G, D), jnp.uint32, lead + ("token_groups", "head_dim"))
      tile_meta = ArrayInfo((L, B, H, C // TILE, D // Gv * TILE), jnp.uint32, lead + ("tiles", "meta_words"))
      store = dict(k_tiles=tiles, k_meta=key_groups, v_tiles=tiles, v_meta=tile_meta)
    else:
      store = dict(k_codes=by_channel(C // per_word, jnp.uint32), k_scale=by_channel(C // G, self.meta),
                   k_zero=by_channel(C // G, self.meta), v_codes=by_token(D // per_word, jnp.uint32),
                   v_scale=by_token(D // Gv, self.meta), v_zero=by_token(D // Gv, self.meta))
    return (OttMmaState if self.mma else OttState)(
        **store,
        valid=ArrayInfo((L, B, H, C if N else 0), jnp.bool_, lead + ("tokens",)),
        k_fp=rows(self.window, "ring"),
        v_fp=rows(self.window, "ring"),
        pool_k=rows(P, "pool"),
        pool_v=rows(P, "pool"),
        pool_pos=ArrayInfo((L, B, H, P), jnp.int32, lead + ("pool",)),
        pool_score=ArrayInfo((L, B, H, N), jnp.float32, lead + ("pool",)),
        aux_count=per_head(jnp.int32),
        frozen=per_head(jnp.bool_),
    )

  def _fp_positions(self, held):
    """[B, G + R] position held by each buffer slot when a sequence holds ``held`` [B] tokens (negative when
    the sequence is shorter than the buffer)."""
    last = held[:, None] - 1
    return last - (last - jnp.arange(self.window)[None]) % self.window

  # ---------------------------------------------------------------------------------------------- prefill

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    """Quantize the prompt's first q(n) tokens with outliers selected, the rest into the buffer (the paper gives no
    prefill: docs/methods/ott.md, 'Schedule and state')."""
    del q
    state = self._emptied(state, layer)
    return self._store_prompt(state, layer, k, v, jnp.zeros((k.shape[0],), jnp.int32), ctx.lengths, ctx.impl)

  @staticmethod
  def _emptied(state, layer, fresh=None):
    """The state with the layer's pools empty and its store without holes, for the sequences where ``fresh`` [B]
    (every one when None: a prompt's start); the others keep theirs."""
    def empty(buf, value):
      new = jnp.full(buf.shape[1:], value, buf.dtype)
      if fresh is not None:
        new = jnp.where(fresh.reshape((-1,) + (1,) * (new.ndim - 1)), new, buf[layer])
      return write_layer(buf, layer, new)
    return state.replace(valid=empty(state.valid, True), pool_pos=empty(state.pool_pos, -1),
                         pool_score=empty(state.pool_score, jnp.inf), aux_count=empty(state.aux_count, 0),
                         frozen=empty(state.frozen, False))

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    """A prompt chunk stored as a prompt that starts at the first token not yet quantized: the buffer's rows from
    there to the length, then the chunk's; the pools carry on (one competition per chunk with ``oneshot``, one per
    block with ``sequential``, as prefill runs them)."""
    return self._store_from_buffer(state, layer, k, v, ctx.lengths, ctx.positions, ctx.impl)

  def _store_from_buffer(self, state, layer, k, v, n, positions, impl, first_slot=None):
    """``store_chunk`` of rows k, v [B, H, T, D] at positions [B, T] (-1 past a prompt's end) after n [B] held
    tokens; with ``first_slot``, the store holds the slots of positions from it on (``store_span``)."""
    W, T = self.window, k.shape[2]
    start = self.quantized(n)  # the buffer holds [start, n), at most G + R tokens
    pos = start[:, None] + jnp.arange(W + T)[None]
    idx = jnp.clip(jnp.where(pos < n[:, None], pos % W, W + pos - n[:, None]), 0, W + T - 1)[:, None, :, None]
    rows = lambda buf, new: jnp.take_along_axis(jnp.concatenate([buf[layer], new.astype(buf.dtype)], axis=2), idx,
                                                axis=2)
    end = n + jnp.sum(positions >= 0, axis=1).astype(n.dtype)
    return self._store_prompt(state, layer, rows(state.k_fp, k), rows(state.v_fp, v), start, end, impl, first_slot)

  def held_rows(self, state, layer, lengths) -> HeldRows:
    """The n = ``lengths`` held tokens as the state holds them: the store before q(n) dequantized, each hole
    filled by the pooled token taken from it (every hole's token is in the outlier or auxiliary pool), the buffer
    after. (The next step's block event may quantize one more block of the buffer first.)"""
    return self._held(state, layer, lengths, 0)

  def _held(self, state, layer, n, first_slot):
    """``held_rows`` of n [B] held tokens, row i the position ``first_slot`` + i (store slot i): the store's range
    of them, its holes filled by the pooled tokens of the range, and the buffer's positions that lie in it
    (``held_span``)."""
    n_q = self.quantized(n)
    k, v = read_store(self._store(state, jnp.clip(n_q - first_slot, 0, self._slots(state))), layer,
                      state.k_fp.dtype)
    B, H, C, _ = k.shape
    if self.pool_slots:
      slot = state.pool_pos[layer] - first_slot  # [B, H, N + A]; negative for an empty pool slot (position -1)
      at = (jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], jnp.where(slot >= 0, slot, C))  # C+: dropped
      k = k.at[at].set(state.pool_k[layer], mode="drop")
      v = v.at[at].set(state.pool_v[layer], mode="drop")
    p = first_slot + jnp.arange(C)
    buffered = (p[None] >= n_q[:, None])[:, None, :, None]
    buf = lambda x: x[layer][:, :, p % self.window]
    return HeldRows(jnp.where(buffered, buf(state.k_fp), k), jnp.where(buffered, buf(state.v_fp), v),
                    jnp.clip(n - first_slot, 0, C))

  def _store_prompt(self, state, layer, k, v, start, end, impl, first_slot=None):
    """Rows k, v [B, H, T, D] of positions start [B] + [0, T) (start: the first token not yet quantized, a
    multiple of G), which leave ``end`` [B] tokens held: tokens [start, q(end)) quantized with outliers selected,
    the buffer's slots of positions at or past ``start`` from the rows. With ``first_slot`` the store holds the
    positions from it on and keeps the quantized rows of those; the competitions, the pools and the buffer are
    the same whatever it is."""
    B, H, T, _ = k.shape
    G, N = self.group_size, self.pool_size
    count = self.quantized(end) - start
    T_pad = -(-T // G) * G
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, T_pad - T), (0, 0)))
    k_pad, v_pad = pad(k), pad(v)
    if self.prefill_selection == "oneshot" or N == 0:
      state = self._compress(state, layer, k_pad, v_pad, start, count, impl, first_slot)
    else:
      def block(j, state):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, j * G, G, axis=2)
        due = jnp.where((j + 1) * G <= count, G, 0)
        return self._compress_if_any(state, layer, rows(k_pad), rows(v_pad), start + j * G, due, impl, first_slot)
      state = jax.lax.fori_loop(0, T_pad // G, block, state)
    rel = self._fp_positions(end) - start[:, None]
    fresh = (rel >= 0)[:, None, :, None]  # slots of earlier positions keep what the buffer holds
    take = lambda x, buf: jnp.where(fresh, jnp.take_along_axis(x, jnp.clip(rel, 0, T - 1)[:, None, :, None], axis=2),
                                    buf[layer])
    return state.replace(k_fp=write_layer(state.k_fp, layer, take(k, state.k_fp)),
                         v_fp=write_layer(state.v_fp, layer, take(v, state.v_fp)))

  # ---------------------------------------------------------------------------------------------- decode

  def step(self, state, layer, q, k, v, ctx: StepContext):
    """Store the T rows, each after the block event its arrival completes, then attend."""
    T = k.shape[2]
    if T > self.residual + 2:
      raise ValueError(f"ott steps of {T} rows need residual >= {T - 2} (got {self.residual}): a row must not see "
                       "quantized tokens of later rows")
    n = ctx.lengths
    for t in range(T):  # T is 1..4 at decode: a short static loop
      state = self._append(state, layer, k[:, :, t:t + 1], v[:, :, t:t + 1], n + t, ctx.impl)
    return self._attend(state, layer, q, ctx.positions, n + T, ctx.impl), state

  def _append(self, state, layer, k, v, position, impl, first_slot=None):
    """One row per sequence, k, v [B, H, 1, D] at ``position`` [B], stored after the block event its arrival
    completes (``first_slot``: as in ``_store_prompt``)."""
    state = self._event_if_due(state, layer, position, impl, first_slot)
    slot = position % self.window
    return state.replace(k_fp=write_at(state.k_fp, layer, k, slot, axis=2),
                         v_fp=write_at(state.v_fp, layer, v, slot, axis=2))

  def _event_if_due(self, state, layer, position, impl, first_slot=None):
    """The block event of the sequences whose buffer is full (G + R tokens) when the token at ``position`` [B]
    arrives: positions [position - R - G, position - R) leave the buffer before that token takes a slot."""
    G, R = self.group_size, self.residual
    due = (position >= G + R) & ((position - R) % G == 0)
    start = self.quantized(position)  # = position - R - G where due; elsewhere the first slot not yet quantized
    slots = ((start[:, None] + jnp.arange(G)[None]) % self.window)[:, None, :, None]  # [B, 1, G, 1]
    rows = lambda x: jnp.take_along_axis(x[layer], slots, axis=2)
    return jax.lax.cond(
        jnp.any(due),
        lambda s: self._compress(s, layer, rows(s.k_fp), rows(s.v_fp), start, jnp.where(due, G, 0), impl,
                                 first_slot),
        lambda s: s, state)

  def _compress_if_any(self, state, layer, k, v, start, count, impl, first_slot=None):
    return jax.lax.cond(jnp.any(count > 0), lambda s: self._compress(s, layer, k, v, start, count, impl, first_slot),
                        lambda s: s, state)

  def _compress(self, state, layer, k, v, start, count, impl, first_slot=None):
    """Quantize rows k, v [B, H, M, D] (M a multiple of G; positions start [B] + [0, M)) into the store, where
    their first count[b] tokens (a multiple of G) compete for the outlier pool first.

    Every sequence's rows are written, with no read of what was there: ``start`` must be the sequence's first
    slot not yet quantized (a multiple of G), so rows past ``count`` (a sequence with no event now, or the
    prompt's tail) land in slots that nothing reads before the event that quantizes them rewrites them. The
    store's capacity is a multiple of G above every held position, so such a write always fits unclamped. Not
    reading the old slots keeps the stacked arrays in place (a per-sequence read of them is a transpose on CPU).
    With ``first_slot`` the store holds the positions from it on, and the rows outside it are dropped (the
    competition, on rows every device holds, runs on each alike).
    """
    B, H, M, D = k.shape
    G, N, Gv = self.group_size, self.pool_size, self.value_group_for(D)
    pos = start[:, None] + jnp.arange(M)[None]  # [B, M]
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    admitted = jnp.zeros((B, H, M), bool)
    if N:
      state, admitted = self._select(state, layer, k, v, pos, jnp.arange(M)[None] < count[:, None])
    # Placeholders (the paper's "mean values of all tokens", read per block): the per-channel mean of the block's
    # original rows, so no key range widens.
    block_mean = lambda x: jnp.repeat(jnp.mean(x.reshape(B, H, M // G, G, D), axis=3), G, axis=2)
    kq = jnp.where(admitted[..., None], block_mean(kf), kf)
    vq = jnp.where(admitted[..., None], block_mean(vf), vf)
    quant = lambda x, group, axis: _quantize_pack(x, bits=self.bits, group_size=group, axis=axis,
                                                  meta_dtype=self.meta, impl=impl)
    kc, ks, kz = quant(kq, G, -2)  # [B, H, D, M/Pk], [B, H, D, M/G]
    vc, vs, vz = quant(vq, Gv, -1)  # [B, H, M, D/Pv], [B, H, M, D/Gv]

    put = lambda buf, new, unit, axis: write_positions(buf, layer, new, start, unit, axis, first_slot=first_slot)
    if self.mma:
      k_tiles, k_meta, v_tiles, v_meta = write_mma_tokens(
          (state.k_tiles, state.k_meta, state.v_tiles, state.v_meta), layer, (kc, ks, kz), (vc, vs, vz), start,
          k_bits=self.bits, v_bits=self.bits, k_group=G, first_slot=first_slot)
      state = state.replace(k_tiles=k_tiles, k_meta=k_meta, v_tiles=v_tiles, v_meta=v_meta)
    else:
      per_word = 32 // self.bits
      state = state.replace(
          k_codes=put(state.k_codes, kc, per_word, 3), k_scale=put(state.k_scale, ks, G, 3),
          k_zero=put(state.k_zero, kz, G, 3), v_codes=put(state.v_codes, vc, 1, 2),
          v_scale=put(state.v_scale, vs, 1, 2), v_zero=put(state.v_zero, vz, 1, 2))
    return state.replace(valid=put(state.valid, ~admitted, 1, 2)) if N else state

  def _select(self, state, layer, k, v, pos, competing):
    """Competition and pool updates for rows k, v [B, H, M, D] at positions pos [B, M], of which ``competing``
    [B, M] take part. Returns (state, admitted [B, H, M] bool)."""
    B, H, M, _ = k.shape
    N, A = self.pool_size, self.pool_slots - self.pool_size
    capacity = self.layer_capacity(layer)
    frozen, aux_count = state.frozen[layer], state.aux_count[layer]  # [B, H]
    pool_k, pool_v, pool_pos = state.pool_k[layer], state.pool_v[layer], state.pool_pos[layer]
    pool_score = state.pool_score[layer]
    heads = (capacity > 0) & ~frozen & jnp.any(competing, axis=1)[:, None]  # [B, H]
    # Scores: the L1 norm of the unquantized key (the paper's Appendix E), in fp32.
    score = jnp.sum(jnp.abs(k.astype(jnp.float32)), axis=-1)
    score = jnp.where(competing[:, None, :] & heads[..., None], score, jnp.inf)
    block_pos = jnp.broadcast_to(pos[:, None, :], (B, H, M)).astype(jnp.int32)
    order, win, kept, admitted = compete(pool_score, pool_pos[..., :N], score, block_pos, capacity)

    # Losers of the old pool move to the auxiliary pool, in slot order after those already there.
    evicted = (pool_pos[..., :N] >= 0) & ~kept & heads[..., None]  # [B, H, N]
    target = aux_count[..., None] + jnp.cumsum(evicted, axis=-1) - evicted  # [B, H, N]
    lands = (target[..., None] == jnp.arange(A)) & evicted[..., None]  # [B, H, N, A]
    source = jnp.argmax(lands, axis=2)  # [B, H, A]: the old pool slot that lands in each aux slot
    arrived = jnp.any(lands, axis=2)
    move = lambda old, aux: jnp.where(arrived, jnp.take_along_axis(old, source, axis=2), aux)
    move_rows = lambda old, aux: jnp.where(arrived[..., None],
                                           jnp.take_along_axis(old, source[..., None], axis=2), aux)
    new_aux_count = aux_count + jnp.sum(evicted, axis=-1, dtype=jnp.int32)

    pick = lambda pool, block: jnp.take_along_axis(jnp.concatenate([pool, block], axis=2), order[..., None], axis=2)
    new_k = jnp.concatenate([pick(pool_k[:, :, :N], k.astype(pool_k.dtype)),
                             move_rows(pool_k[:, :, :N], pool_k[:, :, N:])], axis=2)
    new_v = jnp.concatenate([pick(pool_v[:, :, :N], v.astype(pool_v.dtype)),
                             move_rows(pool_v[:, :, :N], pool_v[:, :, N:])], axis=2)
    cand_pos = jnp.concatenate([pool_pos[..., :N], block_pos], axis=-1)
    cand_score = jnp.concatenate([pool_score, score], axis=-1)
    new_pos = jnp.concatenate([jnp.where(win, jnp.take_along_axis(cand_pos, order, axis=-1), -1),
                               move(pool_pos[..., :N], pool_pos[..., N:])], axis=-1)
    new_score = jnp.where(win, jnp.take_along_axis(cand_score, order, axis=-1), jnp.inf)
    # The overflow rule: stop once the next event could evict more tokens than the auxiliary pool has room for.
    new_frozen = frozen | (heads & (new_aux_count > A - capacity))

    h = heads[..., None]
    state = state.replace(
        pool_k=write_layer(state.pool_k, layer, jnp.where(h[..., None], new_k, pool_k)),
        pool_v=write_layer(state.pool_v, layer, jnp.where(h[..., None], new_v, pool_v)),
        pool_pos=write_layer(state.pool_pos, layer, jnp.where(h, new_pos, pool_pos)),
        pool_score=write_layer(state.pool_score, layer, jnp.where(h, new_score, pool_score)),
        aux_count=write_layer(state.aux_count, layer, new_aux_count),
        frozen=write_layer(state.frozen, layer, new_frozen))
    return state, admitted & heads[..., None]

  # ---------------------------------------------------------------------------------------------- attention

  def _store(self, state, n_q):
    """The store as attention reads it: its first n_q [B] slots, holes masked."""
    D = state.k_fp.shape[-1]
    valid = state.valid if self.pool_size else None
    if self.mma:
      return MmaStore(state.k_tiles, state.k_meta, state.v_tiles, state.v_meta, n_q, self.bits, self.bits,
                      self.group_size, self.value_group_for(D), valid=valid)
    return QuantizedStore(k_codes=state.k_codes, k_scale=state.k_scale, k_zero=state.k_zero,
                          v_codes=state.v_codes, v_scale=state.v_scale, v_zero=state.v_zero, length=n_q,
                          k_bits=self.bits, v_bits=self.bits, k_group=self.group_size,
                          v_group=self.value_group_for(D), valid=valid)

  def _attend(self, state, layer, q, q_positions, held, impl, first_slot=0, return_lse: bool = False):
    """One softmax over the store (holes masked), the pools and the buffer, for held [B] tokens
    (the step's rows included). A store of the positions from ``first_slot`` on (``attend``) is read for those of
    them before q(held), and the pools and the buffer only where it is 0: every device holds the same pools and
    buffer, and the range that starts the sequence counts them once."""
    n_q = self.quantized(held)
    fp_pos = self._fp_positions(held)  # [B, W]
    fp_mask = ((fp_pos >= n_q[:, None]) & (fp_pos >= 0))[:, None, :] & (fp_pos[:, None, :] <= q_positions[:, :, None])
    store = self._store(state, jnp.clip(n_q - first_slot, 0, self._slots(state)))
    segments = [(state.k_fp, state.v_fp, fp_mask & (first_slot == 0))]
    if self.pool_slots:
      pool_pos = state.pool_pos[layer][:, :, None, :]  # [B, H, 1, N + A]
      pool_mask = (pool_pos >= 0) & (pool_pos <= q_positions[:, None, :, None])  # [B, H, T, N + A]
      segments.append((state.pool_k, state.pool_v, pool_mask & (first_slot == 0)))
    return decode_attention(q, layer, stores=(store,), segments=tuple(segments), impl=impl, return_lse=return_lse)

  def _slots(self, state) -> int:
    """Slots of the store of ``state`` (either layout; a device's range of them on a ``seq`` axis)."""
    return state.k_tiles.shape[3] * TILE if self.mma else state.v_codes.shape[3]

  # ------------------------------------------------------------------------------- one range of each sequence
  # Context parallelism (jkv.context_parallel): the store and its hole mask hold slots [0, C) of positions
  # first_slot + [0, C), first_slot whole tiles (``range_multiple``), so a block lies in one device's store. The
  # buffer and the pools are the same on every device: each stores every row into the buffer and runs every
  # competition on rows it holds (the buffer's or the prompt's), so the pools are one device's, and the first
  # range's device attends them.

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    """A step's row stored as ``step`` stores it, a prompt's or a chunk's rows as ``store_chunk`` stores a chunk,
    the store keeping those of its range; a sequence at position 0 (a prompt's start) first empties its pools, as
    ``prefill`` does. (A row alone is a step's or a one-token prompt's: real, never padding.)"""
    first, n = ctx.first_slot, ctx.lengths + ctx.first_slot
    fresh = n == 0
    state = jax.lax.cond(jnp.any(fresh), lambda s: self._emptied(s, layer, fresh), lambda s: s, state)
    if k.shape[2] == 1:
      return self._append(state, layer, k, v, n, ctx.impl, first)
    return self._store_from_buffer(state, layer, k, v, n, ctx.positions + first, ctx.impl, first)


  # ---------------------------------------------------------------------------------------------- memory

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    """Bytes of the live state between steps (the paper gives no formula; this is jkv's state): q(n) quantized tokens
    (codes, one fp16 scale and zero per G tokens of a key channel and per Gv channels of a value, one bool of
    the hole mask), n - q(n) tokens in the buffer, and per pooled token its K and V, position and (in the
    outlier pool) score; per layer and KV head with a pool, the auxiliary count and the frozen flag; one int32
    length per sequence. ``state=None`` counts every pool full: min(N, q(n)) pooled tokens and
    min(A, q(n) - N) auxiliary ones in each layer with a pool."""
    n = np.asarray(lengths, np.int64)
    D, H, L = spec.head_dim, spec.kv_heads, spec.num_layers
    G, Gv, N, A = self.group_size, self.value_group_for(D), self.pool_size, self.pool_slots - self.pool_size
    meta, act = jnp.dtype(self.meta).itemsize, jnp.dtype(spec.dtype).itemsize
    n_q = np.asarray(self.quantized(n))
    hole_mask = 1 if N else 0  # one bool per quantized slot
    per_head = (n_q * (2 * self.bits / 8 * D + 2 * meta * D / G + 2 * meta * D / Gv + hole_mask)
                + (n - n_q) * 2 * act * D)
    total = L * H * per_head.sum() + 4 * len(n)
    pool_layers = max(L - self.no_pool_layers, 0) if N else 0
    if state is None:
      pooled = np.minimum(N, n_q)
      aux = np.minimum(A, np.maximum(n_q - N, 0))
      pooled, aux = pool_layers * H * pooled.sum(), pool_layers * H * aux.sum()
    else:
      pos = np.asarray(state.pool_pos)[:, :len(n)]
      pooled, aux = int(np.sum(pos[..., :N] >= 0)), int(np.sum(pos[..., N:] >= 0))
    total += (pooled + aux) * (2 * act * D + 4) + pooled * 4 + pool_layers * H * len(n) * 5
    return HeldBytes(device=int(round(total)))
