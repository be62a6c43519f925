"""``zipcache``: mixed-precision KV quantization by normalized attention saliency (ZipCache, NeurIPS 2024).

Algorithm: docs/methods/zipcache.md; paper arXiv:2405.14256. Per (sequence, KV head), the ``salient_ratio``
share of tokens that probe queries find most salient is stored at ``high_bits``, the rest at ``low_bits``; new
tokens stay in full precision in a window of ``interval`` slots and are scored and compressed when it fills.
Saliency: saliency.py.

Layout, and why:

- Two pools per (sequence, KV head), each in the KIVI layout and read as one ``QuantizedStore``: high (salient)
  and low. The fused decode kernel reads both stores and the full-precision window (a segment) in one pass.
- Each prefill and each compressed window appends its rows to each pool from a key-group boundary; the tail of its
  last group is a hole. No group mixes two events, so old codes and parameters are never touched and
  recompression never re-quantizes the cache (the paper's reference code re-quantizes it all from dequantized
  values at every window). Which rows are holes follows from two counters (the prefill's real rows, and every
  window's fixed count), so no mask is stored.
- Keys per channel in groups of ``key_group`` rows of one pool, not the paper's one (min, step) per channel per
  pool: that form needs all of a pool's tokens at once, so every window would re-quantize the pool. Costs
  2 * meta bytes per channel per ``key_group`` rows, counted in ``held_bytes`` with the holes.
- Values token-wise over one head's D channels (v_group = D), not over all H*D channels of a token as in the
  paper: the salient set is per (sequence, KV head), so a pool row holds one head's token.
- CST (the paper's Sec. 4.1, Eq. 6): values are divided by c = sqrt(max |V|) per (sequence, head, channel) (per
  sequence, where the reference code shares c over the batch), computed over the prompt at prefill and reused
  by every window; dequantized as (code * scale + zero) * c. A later value above c stays exactly representable:
  the token-wise min and max adapt to V / c whatever its range; only the balancing of channels is then less even.
- Saliency at prefill from probe queries (5% recent + 5% random by default) scored against the prompt's keys; the
  prompt's own attention is the model's, exact. At decode, probes are the last n_rec steps of each window plus
  random steps (the paper's Algorithm 3; the window's last step is a probe, scored before the window is
  compressed); their attention on the window's tokens comes from the same attention pass
  (``token_mass_rows``) and accumulates until the window is full. Random probes come from
  ``fold_in(fold_in(key(probe_seed), layer), position)``, so generation stays a pure function of its inputs and a
  sequence draws the same probes in any batch.
- With ``mma=True`` both pools are kept in the MMA-ready packing (``jkv_kernels.mma_layout``) that the Hopper
  tensor-core kernel reads, holes and channel scale included; each event's rows are merged into the tiles that
  hold them (``cache_arrays.write_mma_tokens``).
- On a mesh's ``seq`` axis (``jkv.context_parallel``; either layout) each pool's rows are split into ranges of
  whole key groups and tiles, one per device, while the window, its probe scores and the channel scale are on every
  device: every device scores and splits every prompt, chunk and window alike (it has their rows) and writes the
  pool rows of its range, so the pools are one device's; the first range's device attends the window, and a probe
  weighs it by probabilities over the log-sum-exp merged across devices (``attended``).
"""

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.attention import MmaStore, QuantizedStore, decode_attention, mma_left_open, read_store
from jkv.cache import ArrayInfo, CacheMethod, CacheSpec, HeldBytes, StepContext
from jkv.cache_arrays import write_at, write_layer, write_mma_tokens, write_positions
from jkv.chunk_attention import HeldRows
from jkv.config import DTYPES
from jkv.context_parallel import range_start
from jkv.methods.registry import register
from jkv.methods.saliency import (NORMALIZE_BY, SALIENCY, ceil_fraction, exact_fraction, position_priority,
                                  prefill_probes, probe_counts, probe_mass, saliency_scores, split_by_score)
from jkv_kernels.mma_layout import TILE, check_mma_packing
from jkv_kernels.quantization import as_stored
from jkv_kernels.quantize_pack import quantize_pack, quantize_pack_reference

ZIPCACHE_BITS = (2, 4, 8)
POOL_MULTIPLE = 64  # pool capacities are multiples of this (and of key_group): whole blocks for the kernel
CHANNEL_SCALE_FLOOR = 1e-6  # c = sqrt(max(max |V|, floor)): an all-zero channel gets a finite scale
LEAD = ("layers", "batch", "kv_heads")


def round_up(n, multiple: int):
  return -(-n // multiple) * multiple


@struct.dataclass
class Pool:
  """Rows of one bit width: keys per channel in groups of key_group rows, CST values per row."""
  k_codes: jax.Array  # [L, B, H, D, C/Pk] uint32, packed along rows
  k_scale: jax.Array  # [L, B, H, D, C/key_group] meta dtype
  k_zero: jax.Array  # [L, B, H, D, C/key_group] meta dtype
  v_codes: jax.Array  # [L, B, H, C, D/Pv] uint32, codes of V / c packed along channels
  v_scale: jax.Array  # [L, B, H, C, 1] meta dtype
  v_zero: jax.Array  # [L, B, H, C, 1] meta dtype
  prompt_rows: jax.Array  # [L, B] int32 real rows the prefill wrote (holes follow up to a group boundary)
  fill: jax.Array  # [L, B] int32 rows written, holes included (a multiple of key_group)


@struct.dataclass
class MmaPool:
  """A pool in the MMA-ready packing (``ZipCache(mma=True)``); the counters are Pool's."""
  k_tiles: jax.Array  # [L, B, H, C/64, 2 D bits] uint32: key tiles
  k_meta: jax.Array  # [L, B, H, C/key_group, D] uint32: per key group, (scale, zero) pairs
  v_tiles: jax.Array  # [L, B, H, C/64, 2 D bits] uint32: value tiles (codes of V / c)
  v_meta: jax.Array  # [L, B, H, C/64, 64] uint32: per value tile, (scale, zero) pairs (one group of D channels)
  prompt_rows: jax.Array
  fill: jax.Array


@struct.dataclass
class ZipCacheState:
  high: Pool  # the salient tokens, high_bits
  low: Pool  # the others, low_bits
  v_channel_scale: jax.Array  # [L, B, H, D] meta dtype: CST's c, from the prompt
  k_window: jax.Array  # [L, B, H, N, D] model dtype: new tokens, slot = decode step within the window
  v_window: jax.Array  # [L, B, H, N, D] model dtype
  window_len: jax.Array  # [L, B] int32 tokens in the window
  window_mass: jax.Array  # [L, B, H, N] f32 attention the window's probes gave each window token
  window_seen: jax.Array  # [L, B, N] int32 probes that saw each window token


@register
@dataclasses.dataclass(frozen=True)
class ZipCache(CacheMethod):
  """ZipCache settings: the paper's (4/2 bits, r = 0.6, 5% + 5% probes) but for the recompression
  interval, 32 steps instead of N = 100 (docs/frontier.md): the full-precision window is most of
  the bytes a short context holds. On the default model, 512 + 64 tokens, it held 0.87x the paper setting's bytes
  per token for perplexity 12.229 against 12.148 on pydoc_data.topics and 12.873 against 12.867 on the held-out
  text (KIVI-2's default: 14.341 and 15.423 at 1.43x its bytes); in those 64 steps the paper's window never fills,
  so over a longer generation it holds more than that. The paper's setting is the preset ``paper``."""

  name = "zipcache"
  presets = {"paper": dict(high_bits=4, low_bits=2, salient_ratio=0.6, interval=100, recent_probes=0.05,
                           random_probes=0.05)}
  high_bits: int = dataclasses.field(default=4, metadata={"help": "code width of salient tokens"})
  low_bits: int = dataclasses.field(default=2, metadata={"help": "code width of the other tokens"})
  salient_ratio: float = dataclasses.field(default=0.6, metadata={
      "help": "r: share of each prompt's and each window's tokens stored at --high-bits, per KV head"})
  interval: int = dataclasses.field(default=32, metadata={
      "help": "N: new tokens stay in full precision; every N decode steps they are scored and compressed"})
  saliency: str = dataclasses.field(default="normalized", metadata={
      "help": "'normalized' (ZipCache: attention received / queries that see the token) or 'accumulated' "
              "(H2O, MiKV: attention received)"})
  normalize_by: str = dataclasses.field(default="probes", metadata={
      "help": "divisor of a normalized score: 'probes' that see the token (the paper) or all 'queries' that "
              "see it (the reference code)"})
  recent_probes: float = dataclasses.field(default=0.05, metadata={
      "help": "share of the newest queries used as probes (at least one)"})
  random_probes: float = dataclasses.field(default=0.05, metadata={
      "help": "share of the other queries drawn at random as probes"})
  probe_seed: int = dataclasses.field(default=0, metadata={
      "help": "seed of the random probes (folded with the layer and the position)"})
  key_group: int = dataclasses.field(default=32, metadata={
      "help": "rows of one pool per key scale and zero-point, per channel"})
  meta_dtype: str = dataclasses.field(default="float16", metadata={"help": "dtype of scales and zero-points"})
  mma: Optional[bool] = dataclasses.field(default=None, metadata={
      "help": "keep both pools in the packing the Hopper tensor-core kernel reads (2/4-bit, 16-bit scales, a key "
              "group dividing 64 or a multiple of it); default: where that kernel runs (a Hopper GPU, attention "
              "impl pallas) and the settings and model allow the packing"})

  def __post_init__(self):
    for label, b in (("high_bits", self.high_bits), ("low_bits", self.low_bits)):
      if b not in ZIPCACHE_BITS:
        raise ValueError(f"zipcache {label}={b} is not supported; choose one of "
                         f"{', '.join(map(str, ZIPCACHE_BITS))}")
    if self.low_bits > self.high_bits:
      raise ValueError(f"zipcache low_bits={self.low_bits} exceeds high_bits={self.high_bits}")
    if not 0.0 <= self.salient_ratio <= 1.0:
      raise ValueError(f"zipcache salient_ratio={self.salient_ratio} must lie in [0, 1]")
    if self.interval < 1:
      raise ValueError(f"zipcache interval={self.interval} must be >= 1")
    if self.saliency not in SALIENCY:
      raise ValueError(f"zipcache saliency={self.saliency!r}; choose one of {', '.join(SALIENCY)}")
    if self.normalize_by not in NORMALIZE_BY:
      raise ValueError(f"zipcache normalize_by={self.normalize_by!r}; choose one of {', '.join(NORMALIZE_BY)}")
    for label, f in (("recent_probes", self.recent_probes), ("random_probes", self.random_probes)):
      if not 0.0 <= f <= 1.0:
        raise ValueError(f"zipcache {label}={f} must lie in [0, 1]")
    if self.key_group < 1 or self.key_group % (32 // self.low_bits) or self.key_group % (32 // self.high_bits):
      raise ValueError(f"zipcache key_group={self.key_group} must be a multiple of {32 // self.low_bits} "
                       f"({self.low_bits}-bit codes pack {32 // self.low_bits} per word)")
    if self.meta_dtype not in DTYPES:
      raise ValueError(f"zipcache meta_dtype={self.meta_dtype!r}; choose one of {', '.join(DTYPES)}")
    if self.mma:  # the head dim is checked with the spec
      self._check_mma(head_dim=64)

  def _check_mma(self, *, head_dim: int) -> None:
    """One-line errors for settings, or a head dim, that the MMA packing does not take."""
    G = self.key_group
    if 64 % G and G % 64:
      raise ValueError(f"zipcache mma=true needs key_group={G} to divide 64 or be a multiple of it")
    for bits in (self.high_bits, self.low_bits):
      check_mma_packing(k_bits=bits, v_bits=bits, k_group=G, v_group=head_dim, head_dim=head_dim,
                        tokens=TILE, meta_dtype=self.meta)

  def for_impl(self, spec: CacheSpec, impl: str) -> "ZipCache":
    """``mma`` left open (None) is on where the Hopper kernel would read the pools: impl "pallas" on a Hopper GPU,
    one query row at a time (``step`` attends row by row) at most 16 query heads per KV head, and settings the
    packing takes."""
    return mma_left_open(self, impl, spec.q_per_kv, lambda: self._check_mma(head_dim=spec.head_dim))

  def check(self, spec: CacheSpec) -> None:
    if self.interval > spec.capacity:
      raise ValueError(f"zipcache interval={self.interval} exceeds the capacity of {spec.capacity} tokens (the "
                       "window of that many exact tokens would never fill)")
    per_word = 32 // self.low_bits
    if spec.head_dim % per_word:
      raise ValueError(f"zipcache needs a head dim that is a multiple of {per_word} ({self.low_bits}-bit value "
                       f"codes pack along channels), got {spec.head_dim}")
    if self.mma:
      self._check_mma(head_dim=spec.head_dim)

  @property
  def meta(self):
    return DTYPES[self.meta_dtype]

  @property
  def window_high(self) -> int:
    """Tokens of each compressed window stored at high bits: ceil(r N) (r applies per window: an old token never
    changes precision)."""
    return int(ceil_fraction(exact_fraction(self.salient_ratio), self.interval))

  def _rows(self, n):
    return round_up(n, self.key_group)

  def _salient(self, n):
    """ceil(r n), exactly."""
    return ceil_fraction(exact_fraction(self.salient_ratio), n)

  @functools.lru_cache(maxsize=64)
  def pool_capacities(self, capacity: int, ranges: int = 1, max_decode: Optional[int] = None) -> tuple[int, int]:
    """Rows of the high and low pools that no sequence of ``capacity`` tokens outgrows: the most over every
    prompt length p (its rows, then one window's rows per N of the tokens after it, at most ``max_decode``: None,
    up to the capacity); each pool splits into ``ranges`` equal ranges of whole blocks (a ``seq`` axis:
    ``CacheSpec.ranges``). A decoded window takes whole key groups in each pool (at the defaults 32 rows in each for
    32 tokens), a prompt about one row per token in all, so a cache for any mix holds about twice the rows that a
    prompt of its whole capacity fills (``CacheSpec.max_decode`` bounds the mix).

    A prompt's rows grow with p, the windows after it shrink: the most is at the longest prompt of each window
    count, p = capacity - w N for w windows (O(capacity / N) candidates, not every p)."""
    decode = capacity if max_decode is None else min(max_decode, capacity)
    p = capacity - self.interval * np.arange(decode // self.interval + 1)
    windows = np.minimum(capacity - p, decode) // self.interval
    n_high = self._salient(p)
    high = self._rows(n_high) + windows * self._rows(self.window_high)
    low = self._rows(p - n_high) + windows * self._rows(self.interval - self.window_high)
    multiple = ranges * math.lcm(self.key_group, POOL_MULTIPLE)
    return tuple(round_up(max(int(x.max()), 1), multiple) for x in (high, low))

  # ---------------------------------------------------------------------------------------------- state

  def _pool_abstract(self, spec: CacheSpec, rows: int, bits: int) -> Pool:
    L, B, H, D = spec.num_layers, spec.batch, spec.kv_heads, spec.head_dim
    by_channel = lambda n, dtype: ArrayInfo((L, B, H, D, n), dtype, LEAD + ("head_dim", "token_groups"))
    by_row = lambda n, dtype: ArrayInfo((L, B, H, rows, n), dtype, LEAD + ("tokens", "channel_groups"))
    counter = ArrayInfo((L, B), jnp.int32, ("layers", "batch"))
    groups = rows // self.key_group
    if self.mma:
      tiles = ArrayInfo((L, B, H, rows // TILE, 2 * D * bits), jnp.uint32, LEAD + ("tiles", "tile_words"))
      key_groups = ArrayInfo((L, B, H, groups, D), jnp.uint32, LEAD + ("token_groups", "head_dim"))
      tile_meta = ArrayInfo((L, B, H, rows // TILE, TILE), jnp.uint32, LEAD + ("tiles", "meta_words"))
      return MmaPool(k_tiles=tiles, k_meta=key_groups, v_tiles=tiles, v_meta=tile_meta, prompt_rows=counter,
                     fill=counter)
    return Pool(k_codes=by_channel(rows * bits // 32, jnp.uint32), k_scale=by_channel(groups, self.meta),
                k_zero=by_channel(groups, self.meta), v_codes=by_row(D * bits // 32, jnp.uint32),
                v_scale=by_row(1, self.meta), v_zero=by_row(1, self.meta), prompt_rows=counter, fill=counter)

  def abstract(self, spec: CacheSpec) -> ZipCacheState:
    L, B, H, D, N = spec.num_layers, spec.batch, spec.kv_heads, spec.head_dim, self.interval
    high, low = self.pool_capacities(spec.capacity, spec.ranges, spec.max_decode)
    window = ArrayInfo((L, B, H, N, D), spec.dtype, LEAD + ("window", "head_dim"))
    return ZipCacheState(
        high=self._pool_abstract(spec, high, self.high_bits), low=self._pool_abstract(spec, low, self.low_bits),
        v_channel_scale=ArrayInfo((L, B, H, D), self.meta, LEAD + ("head_dim",)),
        k_window=window, v_window=window,
        window_len=ArrayInfo((L, B), jnp.int32, ("layers", "batch")),
        window_mass=ArrayInfo((L, B, H, N), jnp.float32, LEAD + ("window",)),
        window_seen=ArrayInfo((L, B, N), jnp.int32, ("layers", "batch", "window")))

  def _layer_key(self, layer):
    return jax.random.fold_in(jax.random.key(self.probe_seed), layer)

  # ---------------------------------------------------------------------------------------------- pools

  def _quantize_pack(self, x, bits, group, axis, impl):
    """The Pallas quantize-and-pack kernel where kernels run, its jnp reference under XLA (same codes)."""
    if impl != "xla":
      return quantize_pack(x, bits=bits, group_size=group, axis=axis, meta_dtype=self.meta,
                           interpret=impl == "interpret")
    return quantize_pack_reference(x, bits=bits, group_size=group, axis=axis, meta_dtype=self.meta)

  def _append(self, pool: Pool, layer, k, v, src, channel_scale, start, bits, impl, due=None,
              first_row=None) -> Pool:
    """Quantize tokens ``src`` [B, H, R] of k, v [B, H, S, D] into pool rows [start, start + R) (start [B], a
    multiple of key_group); with ``due`` [B], only those sequences' rows change; with ``first_row``, the pool holds
    the rows from it on (``_first_row``) and the others are dropped."""
    take = lambda x: jnp.take_along_axis(x, src[..., None], axis=2).astype(jnp.float32)
    kc, ks, kz = self._quantize_pack(take(k), bits, self.key_group, -2, impl)  # [B, H, D, R/Pk], [B, H, D, R/G]
    values = take(v) / channel_scale.astype(jnp.float32)[:, :, None, :]
    vc, vs, vz = self._quantize_pack(values, bits, values.shape[-1], -1, impl)  # [B, H, R, D/Pv], [B, H, R, 1]

    if self.mma:
      k_tiles, k_meta, v_tiles, v_meta = write_mma_tokens(
          (pool.k_tiles, pool.k_meta, pool.v_tiles, pool.v_meta), layer, (kc, ks, kz), (vc, vs, vz), start,
          k_bits=bits, v_bits=bits, k_group=self.key_group, due=due, first_slot=first_row)
      return pool.replace(k_tiles=k_tiles, k_meta=k_meta, v_tiles=v_tiles, v_meta=v_meta)
    put = lambda buf, new, unit, axis: write_positions(buf, layer, new, start, unit, axis, due, first_row)
    G = self.key_group
    return pool.replace(
        k_codes=put(pool.k_codes, kc, 32 // bits, 3), k_scale=put(pool.k_scale, ks, G, 3),
        k_zero=put(pool.k_zero, kz, G, 3), v_codes=put(pool.v_codes, vc, 1, 2), v_scale=put(pool.v_scale, vs, 1, 2),
        v_zero=put(pool.v_zero, vz, 1, 2))

  def _pool_rows(self, pool: Pool) -> int:
    """Rows of ``pool`` (either layout; a device's range of them on a ``seq`` axis)."""
    return pool.k_tiles.shape[3] * TILE if self.mma else pool.v_codes.shape[3]

  def _first_row(self, pool: Pool, first_slot):
    """The pool row a device's row 0 holds where the state holds one range of the sequence (``first_slot`` not
    None: a ``seq`` device's, whose pools hold their range of rows, as its slots are split); else None."""
    return None if first_slot is None else range_start(self._pool_rows(pool))

  def _store(self, pool: Pool, layer, bits, window_real: int, channel_scale, first_row=None):
    """The pool as the attention reads it (a ``QuantizedStore``, or an ``MmaStore`` with the MMA packing): rows
    below ``fill``, holes masked. Real rows: the prefill's first ``prompt_rows``, then ``window_real`` at the
    start of every window's block of rows. With ``first_row``, the rows of the pool's range from it on."""
    B, H = pool.fill.shape[1], pool.k_meta.shape[2] if self.mma else pool.v_codes.shape[2]
    C = self._pool_rows(pool)
    first = 0 if first_row is None else first_row
    row = first + jnp.arange(C)[None]
    n0 = pool.prompt_rows[layer][:, None]
    f0 = self._rows(n0)
    block = self._rows(window_real)
    valid = row < n0
    if block:
      valid = jnp.where(row < f0, valid, (row - f0) % block < window_real)
    length = jnp.clip(pool.fill[layer] - first, 0, C)
    if self.mma:  # the heads share their holes: the kernel reads one row of them for all (a head axis of 1)
      return MmaStore(pool.k_tiles, pool.k_meta, pool.v_tiles, pool.v_meta, length, bits, bits,
                      self.key_group, pool.k_meta.shape[4], valid=valid[:, None], v_channel_scale=channel_scale)
    valid = jnp.broadcast_to(valid[:, None], (B, H, C))
    return QuantizedStore(
        k_codes=pool.k_codes, k_scale=pool.k_scale, k_zero=pool.k_zero, v_codes=pool.v_codes,
        v_scale=pool.v_scale, v_zero=pool.v_zero, length=length, k_bits=bits, v_bits=bits,
        k_group=self.key_group, v_group=pool.v_codes.shape[4] * (32 // bits),
        valid=valid, v_channel_scale=channel_scale)

  def _stores(self, state: ZipCacheState, layer, first_slot=None):
    return tuple(self._store(pool, layer, bits, real, state.v_channel_scale, self._first_row(pool, first_slot))
                 for pool, bits, real in ((state.high, self.high_bits, self.window_high),
                                          (state.low, self.low_bits, self.interval - self.window_high)))

  # ---------------------------------------------------------------------------------------------- prefill

  def prefill(self, state: ZipCacheState, layer, q, k, v, ctx: StepContext) -> ZipCacheState:
    """Score the prompt with its probes, split each (sequence, KV head) into salient and other tokens and
    quantize both sets into fresh pool rows; the window starts empty."""
    if q is None:
      raise ValueError("zipcache prefill needs the prompt's queries (its probes score the tokens)")
    zeros = jnp.zeros_like(ctx.lengths)
    return self._store_prompt(self._started(state, layer, v, ctx.lengths), layer, q, k, v, ctx.lengths, zeros,
                              ctx.impl)

  def _started(self, state: ZipCacheState, layer, v, n, fresh=None) -> ZipCacheState:
    """The state of a prompt's start for the sequences where ``fresh`` [B] (all when None): pools and window
    empty, CST's channel scale c from the prompt's first n [B] tokens of v [B, H, T, D]."""
    real = (jnp.arange(v.shape[2])[None, :] < n[:, None])[:, None, :, None]
    v_max = jnp.max(jnp.where(real, jnp.abs(v.astype(jnp.float32)), 0.0), axis=2)
    # Divide by c as stored, as decode does (else a batch and a sequence alone could quantize differently on a GPU).
    channel_scale = as_stored(jnp.sqrt(jnp.maximum(v_max, CHANNEL_SCALE_FLOOR)), self.meta)  # [B, H, D]

    def start(buf, new):
      new = jnp.broadcast_to(jnp.asarray(new, buf.dtype), buf.shape[1:])
      if fresh is not None:
        new = jnp.where(fresh.reshape((-1,) + (1,) * (new.ndim - 1)), new, buf[layer])
      return write_layer(buf, layer, new)

    return state.replace(
        high=state.high.replace(prompt_rows=start(state.high.prompt_rows, 0)),
        low=state.low.replace(prompt_rows=start(state.low.prompt_rows, 0)),
        v_channel_scale=start(state.v_channel_scale, channel_scale), window_len=start(state.window_len, 0),
        window_mass=start(state.window_mass, 0.0), window_seen=start(state.window_seen, 0))

  def store_chunk(self, state: ZipCacheState, layer, q, k, v, ctx: StepContext) -> ZipCacheState:
    """A prompt chunk scored by its own probes (over the chunk, as a prompt's over the prompt) and split into
    both pools after the rows the earlier chunks wrote. Whole chunks split into whole key groups of each pool
    (``chunk_multiple``), so the pools hold the prompt as one prefill lays it out: real rows, then the last group's
    holes. The channel scale stays the first chunk's, as decode's windows keep the prompt's."""
    return self._store_prompt(state, layer, q, k, v, jnp.sum(ctx.positions >= 0, axis=1).astype(jnp.int32),
                              ctx.lengths, ctx.impl)

  def chunk_multiple(self) -> int:
    """The fewest tokens C, a multiple of ``key_group``, whose salient share r C is whole and a multiple of it too
    (160 at r = 0.6, key_group = 32): every whole chunk then fills whole key groups of both pools, and k chunks hold
    ceil(r k C) = k r C salient tokens, as one prompt of k C tokens (the pools' capacities count on that)."""
    G, limit, r = self.key_group, 1 << 16, exact_fraction(self.salient_ratio)
    for size in range(G, limit + 1, G):
      if (r.numerator * size) % r.denominator == 0 and (r.numerator * size // r.denominator) % G == 0:
        return size
    raise ValueError(f"zipcache salient_ratio={self.salient_ratio} splits no chunk of up to {limit} tokens into whole "
                     f"key groups of {G}: chunked prefill needs a ratio such as 0.5, 0.6 or 0.3125")

  def held_rows(self, state: ZipCacheState, layer, lengths) -> HeldRows:
    """Both pools' real rows dequantized, then the window's tokens, gathered to the front (their order is free)."""
    del lengths
    return self._held(state, layer, None)

  def _held(self, state: ZipCacheState, layer, first_slot) -> HeldRows:
    """``held_rows`` of the pools' rows the state holds (``first_slot``: as in ``_stores``), and the window's
    tokens where the state holds the sequence's first range (or all of it)."""
    stores = self._stores(state, layer, first_slot)
    dtype = state.k_window.dtype
    parts = [read_store(store, layer, dtype) for store in stores] + [(state.k_window[layer], state.v_window[layer])]
    window = jnp.arange(state.k_window.shape[3])[None] < state.window_len[layer][:, None]
    if first_slot is not None:
      window = window & (first_slot == 0)
    real = jnp.concatenate([store.slot_mask(layer)[:, 0] for store in stores] + [window], axis=1)  # [B, S]
    order = jnp.argsort(~real, axis=1, stable=True)[:, None, :, None]  # real rows first
    gather = lambda i: jnp.take_along_axis(jnp.concatenate([part[i] for part in parts], axis=2), order, axis=2)
    return HeldRows(gather(0), gather(1), jnp.sum(real, axis=1).astype(jnp.int32))

  def _store_prompt(self, state: ZipCacheState, layer, q, k, v, n, offset, impl, first_slot=None) -> ZipCacheState:
    """Tokens [0, n) (n [B]) of rows q, k, v of positions offset [B] + [0, T), scored by their probes, split and
    appended to both pools after their real rows (``prompt_rows``, a group's end: prefill starts them at 0). With
    ``first_slot`` (a ``seq`` device's), the pools keep the rows of their range; the scores, and so the split,
    are the same on every device (every device of ``seq`` has the rows)."""
    T = k.shape[2]
    rows, ok = prefill_probes(self._layer_key(layer), n, T, self.recent_probes, self.random_probes, offset)
    mass, seen = probe_mass(q, k, rows, ok, impl=impl)
    score = saliency_scores(mass, seen, n, saliency=self.saliency, normalize_by=self.normalize_by)
    n_high_table = self._salient(np.arange(T + 1))
    n_high = jnp.asarray(n_high_table, jnp.int32)[n]
    rows_high, rows_low = self._rows(int(n_high_table.max())), self._rows(T - int(n_high_table[T]))
    high_src, low_src = split_by_score(score, n_high, n, rows_high, rows_low)
    channel_scale = state.v_channel_scale[layer]

    def fill(pool, src, bits, real, width):
      start = pool.prompt_rows[layer]
      if width:
        pool = self._append(pool, layer, k, v, src, channel_scale, start, bits, impl, due=n > 0,
                            first_row=self._first_row(pool, first_slot))
      return pool.replace(prompt_rows=write_layer(pool.prompt_rows, layer, start + real),
                          fill=write_layer(pool.fill, layer, self._rows(start + real)))

    return state.replace(high=fill(state.high, high_src, self.high_bits, n_high, rows_high),
                         low=fill(state.low, low_src, self.low_bits, n - n_high, rows_low))

  def synthetic_fill(self, state: ZipCacheState, lengths) -> ZipCacheState:
    """The counters a prefill of ``lengths`` [B] tokens leaves (ceil(r n) salient rows, the others in the low pool,
    an empty window), the rows' codes left as allocated and the channel scale 1: a benchmark's cache of a length
    no prefill in its time reaches. The pools are laid out by these counters, not by the cache's lengths, so
    setting the lengths alone would leave them empty."""
    n = jnp.asarray(lengths, jnp.int32)
    n_high = jnp.asarray(self._salient(np.asarray(lengths)), jnp.int32)
    every_layer = lambda x: jnp.broadcast_to(x, state.window_len.shape)
    pool = lambda p, rows: p.replace(prompt_rows=every_layer(rows), fill=every_layer(self._rows(rows)))
    zero = lambda x: jnp.zeros_like(x)
    return state.replace(high=pool(state.high, n_high), low=pool(state.low, n - n_high),
                         v_channel_scale=jnp.ones_like(state.v_channel_scale), window_len=zero(state.window_len),
                         window_mass=zero(state.window_mass), window_seen=zero(state.window_seen))

  # ---------------------------------------------------------------------------------------------- decode

  def step(self, state: ZipCacheState, layer, q, k, v, ctx: StepContext):
    """Rows one at a time (T is 1..4 at decode): each is written to the window, attends over both pools and the
    window, adds its mass to the window's scores if it is a probe, and compresses the window when it fills."""
    outs = []
    for t in range(k.shape[2]):
      out, state = self._step_row(state, layer, q[:, :, t:t + 1], k[:, :, t], v[:, :, t], ctx.positions[:, t],
                                  ctx.impl)
      outs.append(out)
    return jnp.concatenate(outs, axis=2), state

  def _step_row(self, state: ZipCacheState, layer, q, k, v, position, impl):
    """q [B, H, 1, g, D], k and v [B, H, D], position [B]."""
    B, H = k.shape[:2]
    state = self._to_window(state, layer, k, v)
    probe = self._probes(state, layer, position)
    attend = functools.partial(decode_attention, q, layer, stores=self._stores(state, layer),
                               segments=(self._window(state, layer),), impl=impl)

    def with_mass():
      out, (_, (mass,)) = attend(token_mass_rows=(0,), store_mass=False)
      return out, mass[:, :, 0]

    # Only probe steps pay for the token mass, and only the window's (a probe scores the window's tokens).
    out, mass = jax.lax.cond(jnp.any(probe), with_mass, lambda: (attend(), jnp.zeros((B, H, self.interval),
                                                                                      jnp.float32)))
    return out, self._scored(state, layer, probe, mass, impl)

  def _to_window(self, state: ZipCacheState, layer, k, v) -> ZipCacheState:
    """k, v [B, H, D] written to the window's next slot, which it then holds."""
    i = state.window_len[layer]  # [B] the slot this token takes
    return state.replace(k_window=write_at(state.k_window, layer, k[:, :, None], i, axis=2),
                         v_window=write_at(state.v_window, layer, v[:, :, None], i, axis=2),
                         window_len=write_layer(state.window_len, layer, i + 1))

  def _window(self, state: ZipCacheState, layer, first_slot=None):
    """The window as an attention segment: its tokens so far (the newest row's included), attended where the state
    holds the sequence's first range (or all of it)."""
    held = jnp.arange(self.interval)[None] < state.window_len[layer][:, None]  # [B, N]
    if first_slot is not None:
      held = held & (first_slot == 0)
    return state.k_window, state.v_window, held[:, None, :]

  def _probes(self, state: ZipCacheState, layer, position):
    """[B] whether the newest row, at ``position`` [B] in the window, is a probe: one of its last n_rec slots or a
    random step."""
    i = state.window_len[layer] - 1
    recent = int(probe_counts(self.interval, self.recent_probes, self.random_probes)[0])
    return (i >= self.interval - recent) | (position_priority(self._layer_key(layer), position) < self.random_probes)

  def _scored(self, state: ZipCacheState, layer, probe, mass, impl, first_slot=None) -> ZipCacheState:
    """The newest row's attention mass [B, H, N] on the window added to its scores where it is a ``probe`` [B], and
    the window compressed where that row filled it."""
    i = state.window_len[layer] - 1
    counted = probe[:, None] & (jnp.arange(self.interval)[None] <= i[:, None])  # [B, N] window tokens it sees
    state = state.replace(
        window_mass=write_layer(state.window_mass, layer,
                                state.window_mass[layer] + jnp.where(counted[:, None], mass, 0.0)),
        window_seen=write_layer(state.window_seen, layer, state.window_seen[layer] + counted))
    due = i == self.interval - 1
    return jax.lax.cond(jnp.any(due), lambda s: self._compress(s, layer, due, impl, first_slot), lambda s: s, state)

  def _compress(self, state: ZipCacheState, layer, due, impl, first_slot=None) -> ZipCacheState:
    """Score the full window, split it, append its rows to both pools and empty it, for sequences ``due``
    (``first_slot``: as in ``_store_prompt``)."""
    N, n_high = self.interval, self.window_high
    B = due.shape[0]
    full = jnp.full((B,), N, jnp.int32)
    score = saliency_scores(state.window_mass[layer], state.window_seen[layer], full, saliency=self.saliency,
                            normalize_by=self.normalize_by)
    rows_high, rows_low = self._rows(n_high), self._rows(N - n_high)
    high_src, low_src = split_by_score(score, jnp.full((B,), n_high, jnp.int32), full, rows_high, rows_low)
    k, v, c = state.k_window[layer], state.v_window[layer], state.v_channel_scale[layer]

    def append(pool, src, bits, width):
      if not width:
        return pool
      start = pool.fill[layer]
      pool = self._append(pool, layer, k, v, src, c, start, bits, impl, due, self._first_row(pool, first_slot))
      return pool.replace(fill=write_layer(pool.fill, layer, start + jnp.where(due, width, 0)))

    keep = lambda x: jnp.where(due.reshape((-1,) + (1,) * (x.ndim - 1)), 0, x)
    return state.replace(
        high=append(state.high, high_src, self.high_bits, rows_high),
        low=append(state.low, low_src, self.low_bits, rows_low),
        window_len=write_layer(state.window_len, layer, keep(state.window_len[layer])),
        window_mass=write_layer(state.window_mass, layer, keep(state.window_mass[layer])),
        window_seen=write_layer(state.window_seen, layer, keep(state.window_seen[layer])))

  # ------------------------------------------------------------------------------- one range of each sequence
  # Context parallelism (jkv.context_parallel): each pool's rows are split over seq as the slots are (device i holds
  # rows [i P/n, (i + 1) P/n) of a pool of P rows, whole key groups and tiles: ``pool_capacities``), so each pool
  # holds one device's rows. The window, its scores and the channel scale are the same on every device: each
  # stores every row into the window and, since every device of seq has a prompt's or a chunk's rows and the window,
  # scores and splits every prompt, chunk and window alike, writing the pool rows of its range. The first range's
  # device attends the window; a probe's mass on it comes from the log-sum-exp merged over every device.

  def store_span(self, state: ZipCacheState, layer, q, k, v, ctx: StepContext) -> ZipCacheState:
    """A step's row written to the window as ``step`` writes it (scored and compressed in ``attended``); a prompt's
    or a chunk's rows stored as ``store_chunk`` stores a chunk, a sequence at position 0 (a prompt's start) first
    started as ``prefill`` starts it. (A row alone after held tokens is a step's: real, never padding.)"""
    n = ctx.lengths + ctx.first_slot
    if k.shape[2] == 1:
      return jax.lax.cond(jnp.all(n > 0), lambda s: self._to_window(s, layer, k[:, :, 0], v[:, :, 0]),
                          lambda s: self._prompt_span(s, layer, q, k, v, n, ctx), state)
    return self._prompt_span(state, layer, q, k, v, n, ctx)

  def _prompt_span(self, state: ZipCacheState, layer, q, k, v, n, ctx: StepContext) -> ZipCacheState:
    """Rows of positions n [B] + [0, T) (n: the tokens held, whole sequence's count) stored as a chunk."""
    real = jnp.sum(ctx.positions + ctx.first_slot >= 0, axis=1).astype(jnp.int32)  # (-1 past a prompt's end)
    fresh = n == 0
    state = jax.lax.cond(jnp.any(fresh), lambda s: self._started(s, layer, v, real, fresh), lambda s: s, state)
    return self._store_prompt(state, layer, q, k, v, real, n, ctx.impl, ctx.first_slot)

  def attend(self, state: ZipCacheState, layer, q, ctx: StepContext):
    return decode_attention(q, layer, stores=self._stores(state, layer, ctx.first_slot),
                            segments=(self._window(state, layer, ctx.first_slot),), impl=ctx.impl, return_lse=True)

  def attended(self, state: ZipCacheState, layer, q, lse, ctx: StepContext) -> ZipCacheState:
    """A step's row (T = 1) scored on the window with its probabilities exp(s - lse) over every device's rows,
    the window compressed where it filled (every device alike)."""
    probe = self._probes(state, layer, ctx.positions[:, 0] + ctx.first_slot)
    held = self._window(state, layer)[2][:, None, :, None, :]  # [B, 1, 1, 1, N]
    logits = jnp.einsum("bhtgd,bhsd->bhtgs", q.astype(jnp.float32) * q.shape[-1] ** -0.5,
                        state.k_window[layer].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    mass = jnp.sum(jnp.where(held, jnp.exp(logits - lse[..., None]), 0.0), axis=3)[:, :, 0]  # [B, H, N]
    return self._scored(state, layer, probe, mass, ctx.impl, ctx.first_slot)

  def held_span(self, state: ZipCacheState, layer, ctx: StepContext) -> HeldRows:
    return self._held(state, layer, ctx.first_slot)

  # ---------------------------------------------------------------------------------------------- memory

  def _row_bytes(self, bits: int, head_dim: int) -> float:
    """One pool row of one head: key and value codes, the key (scale, zero) share of its group, the value's."""
    meta = jnp.dtype(self.meta).itemsize
    return 2 * head_dim * bits / 8 + 2 * meta * head_dim / self.key_group + 2 * meta

  def _bytes(self, spec: CacheSpec, high, low, window, n):
    """Bytes of one layer per sequence (arrays broadcast): every pool row written (holes included) with its codes
    and parameters, the channel scales, the window's tokens in the model dtype with their probe accumulators,
    and five int32 counters."""
    H, D = spec.kv_heads, spec.head_dim
    meta, act = jnp.dtype(self.meta).itemsize, jnp.dtype(spec.dtype).itemsize
    pools = H * (high * self._row_bytes(self.high_bits, D) + low * self._row_bytes(self.low_bits, D))
    window_bytes = window * H * (2 * D * act + 4) + window * 4  # K, V; the probe mass per head; the probe count
    return pools + window_bytes + np.where(n > 0, H * D * meta + 5 * 4, 0)

  def _bound(self, spec: CacheSpec, n: int) -> float:
    """Bytes of n tokens split into the prompt p <= n and n - p decoded tokens that costs the most."""
    if n == 0:
      return 0.0
    p = np.arange(1, n + 1)
    windows, window = np.divmod(n - p, self.interval)
    n_high = self._salient(p)
    high = self._rows(n_high) + windows * self._rows(self.window_high)
    low = self._rows(p - n_high) + windows * self._rows(self.interval - self.window_high)
    return spec.num_layers * float(self._bytes(spec, high, low, window, n).max())

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    """Bytes of the live state (``_bytes``), from its counters; ``state=None`` gives the worst case over how n
    tokens split into a prompt and decoded tokens."""
    n = np.asarray(lengths, np.int64)
    if state is None:
      total = sum(self._bound(spec, int(x)) for x in n)
    else:
      high, low, window = (np.asarray(x, np.int64) for x in (state.high.fill, state.low.fill, state.window_len))
      total = float(self._bytes(spec, high, low, window, n[None]).sum())  # [L, B] counters
    return HeldBytes(device=int(round(total)))
