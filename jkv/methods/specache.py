"""``specache``: SpeCache (ICML 2025): the full 16-bit K/V in host memory, a low-bit KIVI copy on the device, and a
speculative row per decode step that chooses which 16-bit rows the next step attends.

Algorithm: docs/methods/specache.md; paper arXiv:2503.16163. What one decode step does, per layer (the paper's §3.3
and Algorithm 3):

- it carries two rows: the real token at position n and the speculative token at n + 1 (the greedy output of the
  previous step's speculative row, ``CacheMethod.speculative_rows``); only the real row's K/V is stored: in the
  low-bit copy (``Kivi`` with residual R, bits 1 or 2) at once, and in the host copy at the end of the step
  (``end_step``: every layer's row in one write per sequence);
- both rows attend over every held token at its best precision: the k rows per (sequence, KV head) fetched from
  the host for this step in 16 bits, the residual window in full precision, every other token dequantized; the
  fetched positions are holes in the store (or in the window, for keys quantized while their value is still exact)
  and one segment of their own, so the one softmax runs over exactly the mixed cache (the paper's Eq. 1, by masks);
- the speculative row's attention probabilities, summed over the g query heads of each KV head (a mean over them in
  the paper's terms: the same ranking; the paper leaves GQA open), pick the top k positions among those whose key the
  next step reads quantized, [0, bK) of the next step: the rows it attends in 16 bits. (A literal reading takes this
  step's [0, bK); taking the next step's boundary also covers the R keys a flush quantizes in between, whose scores this
  step has from their exact copies, so k >= every candidate is exact at every step, flushes included.)

Before the first step the pre-decode pass (``pre_decode``) runs the first generated token over the low-bit cache
alone and picks the first top-k; it stores nothing.

The host/device boundary is ``gather_host_rows`` and the two host writes beside it. Verified on CPU with jax 0.10.2
(both memory kinds exist there): a jnp gather whose operand is a ``pinned_host`` array and whose indices are
device arrays is refused at trace time ("memory_space of all inputs passed to `gather` must be the same"), as the
measured on an H100 too; moving the indices to host memory first (``jax.device_put(idx, jax.memory.Space.Host)``)
makes it a host-side gather that traces and returns the right rows, and ``dynamic_update_slice`` into a
``pinned_host`` array (donated, inside ``lax.scan`` carries too) of an update moved to host memory writes in place.
On a GPU (impl "pallas") the fetch is a Pallas kernel reading the ``pinned_host`` operand in place (bit-exact on the
H100, 0.15 ms for one layer's 2 MiB of rows at B = 8, 13.8 GB/s:
benchmarks/results/specache_decode_nvidia_h100_80gb_hbm3.json). On the GPU, XLA refuses the CPU path's host gather
inside a larger program ("Bitcast cannot have different memory spaces"), so without the kernel the rows come one by one.
Everything runs in one program on one stream, where a copy cannot overlap the layers' compute, so the two fetch
schedules differ only in how the copies are batched: ``prefetch=True`` fetches the next step's rows of every layer in
one kernel call at the end of a step into a device buffer (the paper's overlap, §3.3);
``prefetch=False`` fetches each layer's rows inside the layer, when it attends (synchronous, no buffer). Both
give the same rows and outputs; benchmarks/specache_decode.py times them in one H100 run (B = 8, 32k, Llama-3-8B
shape): 28.94 ms/step with the buffer, 28.76 ms without, against 23.76 ms for KIVI-2 and 19.94 ms for dense
(benchmarks/README.md and the profile in benchmarks/results name the parts; since KIVI reads its window in place,
27.57 ms with the buffer against 23.95 for KIVI-2). The two schedules are equal within 1% (no overlap to win on
one stream); the buffer stays the default, as the paper's pipeline. A top-k over each layer's 32k candidates
(0.38 ms, a sort) is a tournament of small ones (``top_k_positions``), for every row that needs one at once, each
by counting ranks where that costs less than a sort (``top_k``).

``speculate=False`` is the paper's non-speculative baseline (Table 4's fetch-then-recompute, the upper
bound on the selection): one row per step and no pre-decode pass; in each layer the real row attends the low-bit
cache, its own probabilities pick the top k, those rows come from host memory and it attends again. It measures
what the guess costs in quality.

``repair=True`` checks each step's guess and repairs a miss (not in the paper, which never checks). The
guess was right exactly when the real token is the previous step's speculative token, and then the two rows'
layer-0 keys (same token, same position) agree; a different token's key differs in every channel. Where the
guess was wrong, the real row gets the fetch-then-recompute pass (its own top k, fetched and attended again); the
speculative row and the rows it picks for the next step are unchanged. A step pays the second pass only when some
sequence missed (``lax.cond``). Why (benchmarks/results/specache_quality_512.json, default model, 16
windows of 512 + 64 tokens of pydoc_data.topics): scored on a text, the speculative token was the text's next token
at 10.8% of the steps (each guess continues the previous guess, never the real token), and SpeCache-1 reached
perplexity 13.649 against dense's 11.851; with the text's own next token as the guess it reached 12.712, the
non-speculative baseline's 12.670. In greedy generation from the same contexts the guess was right at 50% of the
steps.

The speculation hit rate (``decode_stats``; docs/methods/specache.md, 'What the guess costs'): at each step and layer,
the fraction of the real row's top k (by its attention probability over the same candidates) that the fetched set
contains, averaged over KV heads, layers, sequences and steps.
"""

import dataclasses
import functools
from typing import Optional

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.attention import decode_attention, mma_left_open
from jkv.cache import ArrayInfo, CacheMethod, CacheSpec, HeldBytes, StepContext
from jkv.cache_arrays import write_layer
from jkv.chunk_attention import HeldRows
from jkv.config import DTYPES
from jkv.context_parallel import top_k_across_seq
from jkv.methods.kivi import Kivi, KiviState
from jkv.methods.registry import register
from jkv.token_mass import NOT_A_CANDIDATE
from jkv_kernels.dequant_attention import triton_compiler_params
from jkv_kernels.host_layer_copy import copy_layer

SPECACHE_BITS = (1, 2)
SELECT_RUN = 16  # slots per run of the top-k's first round over the store (the Hopper kernel's weights share a
                 # scale per 16-slot tile)


# ------------------------------------------------------------------------------------------------- host boundary

def to_host(x):
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x):
  return jax.device_put(x, jax.memory.Space.Device)


def host_write_layer(buf, layer, x):
  """Write x [B, ...] (device) into the host array buf [L, B, ...] at ``layer``, from index 0 on every axis."""
  return jax.lax.dynamic_update_slice(buf, to_host(x[None].astype(buf.dtype)), (layer,) + (0,) * x.ndim)


def host_write_rows(buf, first_layer, rows, start, impl: str, anywhere: bool = False):
  """Write rows [Lr, B, H, T, W] (device) into the host array buf [L, B, H, C, W] at layers first_layer + [0, Lr),
  slots start [B] + [0, T): one in-place ``dynamic_update_slice`` per sequence (the form verified on host arrays;
  a scatter into host memory is not), each update sliced on the device before it moves (slicing a host array
  would run as host compute).

  ``anywhere`` (buf holds a ``seq`` device's range of the slots: ``jkv.context_parallel``): start may lie anywhere
  and the rows outside [0, C) are dropped. A ``dynamic_update_slice`` would clip its start and write them over
  held rows, so each sequence writes a span of min(T, C) slots inside buf, from start clipped, whose slots that no
  row lands in are read back first (``gather_host_rows`` with ``impl``) and written as they were."""
  Lr, B, H, T, W = rows.shape
  at = start
  if anywhere:
    C = buf.shape[3]
    M = min(T, C)
    at = jnp.clip(start, 0, C - M)
    slots = at[:, None] + jnp.arange(M)[None]  # [B, M]
    held = gather_host_rows(buf, first_layer, jnp.broadcast_to(slots[None, :, None], (Lr, B, H, M)), impl)
    j = slots - start[:, None]  # each slot's row
    new = jnp.take_along_axis(rows, jnp.clip(j, 0, T - 1)[None, :, None, :, None], axis=3)
    rows = jnp.where(((j >= 0) & (j < T))[None, :, None, :, None], new, held)
  for b in range(B):
    buf = jax.lax.dynamic_update_slice(buf, to_host(rows[:, b:b + 1].astype(buf.dtype)), (first_layer, b, 0, at[b], 0))
  return buf


def gather_host_rows(host_kv, first_layer, idx, impl: str):
  """Rows idx [Lq, B, H, k] int32 of the host array host_kv [L, B, H, C, 2D], layer first_layer + i for idx[i]
  -> [Lq, B, H, k, 2D] on the device. Indices past C are clamped (the caller masks them).

  impl "pallas" (a GPU): the Pallas kernel reads the pinned-host operand in place. On a CPU: one gather in host
  memory with host-resident flat row indices (the form jax traces; see the module docstring), then one
  host-to-device copy of the rows. Elsewhere (a GPU without the Pallas kernels, or the XLA and interpret paths
  on a GPU, where XLA refuses that gather: "Bitcast cannot have different memory spaces"):
  ``gather_host_rows_one_by_one``, correct but slow. Like ``cache_arrays.write_at``, this looks at the backend
  only to pick how an array operation runs, never what it computes.
  """
  if impl == "pallas":
    return gather_rows_pallas(host_kv, first_layer, idx)
  if jax.default_backend() != "cpu":
    return gather_host_rows_one_by_one(host_kv, first_layer, idx)
  L, B, H, C, W = host_kv.shape
  layers = first_layer + jnp.arange(idx.shape[0])[:, None, None, None]
  flat = ((layers * B + jnp.arange(B)[:, None, None]) * H + jnp.arange(H)[:, None]) * C + jnp.clip(idx, 0, C - 1)
  rows = jnp.take(host_kv.reshape(L * B * H * C, W), to_host(flat.astype(jnp.int32)), axis=0, mode="clip")
  return to_device(rows)


def gather_host_rows_one_by_one(host_kv, first_layer, idx):
  """``gather_host_rows`` as one ``dynamic_slice`` of the host array and one host-to-device copy per row (the
  form measured correct on an H100, about 6 µs a row): the path for GPUs without the Pallas kernel."""
  L, B, H, C, W = host_kv.shape
  Lq, k = idx.shape[0], idx.shape[-1]
  idx = jnp.clip(idx, 0, C - 1)

  def one(i, out):
    l, b, h, j = i // (B * H * k), (i // (H * k)) % B, (i // k) % H, i % k
    row = jax.lax.dynamic_slice(host_kv, (first_layer + l, b, h, idx[l, b, h, j], 0), (1, 1, 1, 1, W))
    return jax.lax.dynamic_update_slice(out, to_device(row), (l, b, h, j, 0))

  return jax.lax.fori_loop(0, Lq * B * H * k, one, jnp.zeros((Lq, B, H, k, W), host_kv.dtype))


def _gather_rows_kernel(
    first_ref,  # [1] int32: the layer of idx[0]
    idx_ref,    # [k] int32 rows of this (layer, b, h)
    kv_ref,     # [L, C, W]: every layer of this (b, h); only the k rows of one layer are read
    out_ref,    # [k, W]
):
  out_ref[...] = kv_ref[first_ref[0] + pl.program_id(0), idx_ref[...], :]


@functools.partial(jax.jit, static_argnames=("interpret",))
def gather_rows_pallas(kv, first_layer, idx, interpret: bool = False):
  """kv [L, B, H, C, W] (any memory kind), rows idx [Lq, B, H, k] of layers first_layer + [0, Lq) ->
  [Lq, B, H, k, W] (Pallas, Triton lowering; grid over (Lq, B, H), all in one call). idx is clamped to [0, C) and
  padded to a power of two of at least 16 rows."""
  L, B, H, C, W = kv.shape
  Lq, k = idx.shape[0], idx.shape[-1]
  rows = max(16, 1 << (k - 1).bit_length())
  idx = jnp.pad(jnp.clip(idx, 0, C - 1).astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, rows - k)))
  out = pl.pallas_call(
      _gather_rows_kernel,
      grid=(Lq, B, H),
      in_specs=[
          pl.BlockSpec((1,), lambda l, b, h: (0,)),                                    # first layer
          pl.BlockSpec((None, None, None, rows), lambda l, b, h: (l, b, h, 0)),        # idx
          pl.BlockSpec((L, None, None, C, W), lambda l, b, h: (0, b, h, 0, 0)),        # kv
      ],
      out_specs=pl.BlockSpec((None, None, None, rows, W), lambda l, b, h: (l, b, h, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((Lq, B, H, rows, W), kv.dtype),
      compiler_params=triton_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name=f"specache_gather_rows_{rows=}_{W=}",
  )(jnp.clip(jnp.asarray(first_layer, jnp.int32), 0, L - Lq).reshape(1), idx, kv)
  return out[..., :k, :]


# Rows x length^2 at most this many pairs take ``top_k``'s count of ranks instead of a sort (benchmarks/top_k.py).
RANK_PAIRS = 1 << 23


def order_keys(scores):
  """int32 keys of float scores whose integer order is ``lax.top_k``'s total order of the scores."""
  bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats' magnitudes reversed


def top_k(scores, k: int, rank_pairs: int = RANK_PAIRS):
  """The k largest of float scores [..., N] and their positions [..., k], largest first, ties by position, in
  ``lax.top_k``'s total order (NaN above +inf, -0.0 below 0.0). XLA's sort costs about 8 us a call on an H200 for
  any rows up to 1024 long, a B = 1 step's three a layer about 0.8 ms; where rows x N^2 is at most
  ``rank_pairs``, each score's rank is counted instead (the scores above it, and the equal ones before it), in one
  fused comparison of every pair, and slot j takes the position whose rank is j, by a sum over the row (a scatter
  needs a zeroed buffer and a copy of it: two more kernels a call on a GPU, ``benchmarks/deviceless_step.py``,
  three calls a SpeCache layer). The pairs compare integer keys of that total order, so the ranks are distinct,
  0..N-1, whatever the scores; float comparisons do not promise it (a NaN is neither above, below nor equal to
  anything, so it would share a rank)."""
  N = scores.shape[-1]
  if (k > N or not jnp.issubdtype(scores.dtype, jnp.floating)
      or np.prod(scores.shape[:-1], dtype=np.int64) * N * N > rank_pairs):
    return jax.lax.top_k(scores, k)
  key = order_keys(scores)
  at = jnp.arange(N)
  s, t = key[..., :, None], key[..., None, :]
  rank = jnp.sum((t > s) | ((t == s) & (at < at[:, None])), axis=-1, dtype=jnp.int32)  # [..., N]
  hit = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, N]: one position a slot
  positions = jnp.sum(jnp.where(hit, at, 0), axis=-1, dtype=jnp.int32)
  return jnp.take_along_axis(scores, positions, axis=-1), positions


def top_k_positions(scores, k: int, block: int = 16):
  """Positions [..., k] of the k largest of scores [..., C] (a valid top k; ties in any order), by a tournament of
  small selections instead of one over C. The k blocks of ``block`` positions with the largest maxima hold a top k
  (a value outside them is at most the k-th largest block maximum, and each of those blocks holds one at least as
  large), so the top k of C is the top k of those blocks' k * block values; and those k blocks are the top k of the
  C / block maxima, chosen the same way, down to rows of at most 2 k * block. XLA's ``lax.top_k`` sorts, at a cost
  set by the row's length, not by the number of rows: on an H200, k = 64, 15 us for rows of 1024, 39 for 4096, 54
  for 4098, 59 for 16384, alike for 8, 16 or 32 rows (``benchmarks/top_k.py``).
  The end of C is padded to whole blocks with -inf, never chosen while C holds k finite scores."""
  C = scores.shape[-1]
  if C <= 2 * k * block:
    return top_k(scores, k)[1]
  lead, n = scores.shape[:-1], -(-C // block)
  if n * block > C:
    scores = jnp.pad(scores, [(0, 0)] * len(lead) + [(0, n * block - C)], constant_values=-jnp.inf)
  blocks = scores.reshape(lead + (n, block))
  chosen = top_k_positions(jnp.max(blocks, axis=-1), k, block)  # [..., k] block indices
  values = jnp.take_along_axis(blocks, chosen[..., None], axis=-2).reshape(lead + (k * block,))
  _, j = top_k(values, k)
  return jnp.take_along_axis(chosen, j // block, axis=-1) * block + j % block


# ------------------------------------------------------------------------------------------------- the method

def _named(check):
  """Run one of the low-bit copy's checks with its errors named as this method's (``specache group_size=...``)."""
  try:
    return check()
  except ValueError as e:
    raise ValueError(str(e).replace("kivi ", "specache ", 1)) from None


@struct.dataclass
class SpeCacheState:
  low: KiviState  # the low-bit copy on the device (KIVI's state, KiviMmaState with mma; its residual window in
                  # full precision)
  host_kv: jax.Array  # [L, B, H, C, 2D] model dtype, pinned_host: every stored token's key | value (rows not
                      # stored yet are undefined after a sub-batched prefill on a GPU: ``cache.allocate``)
  staged_kv: jax.Array  # [L, B, H, 1, 2D] model dtype: this step's real row, written to host_kv at its end (by the
                        # device whose range holds it, on a seq axis)
  fetched_idx: jax.Array  # [L, B, H, k] int32: positions the next step attends from their 16-bit rows
  fetched_ok: jax.Array  # [L, B, H, k] bool: which of them are real (none before pre-decode; fewer than k early)
  fetched_kv: jax.Array  # [L, B, H, k, 2D] model dtype: those rows, fetched at the end of the previous step
                         # (None when prefetch=False or speculate=False: each layer fetches them when it
                         # attends); on a seq axis [L, B, H, n k, 2D], each device's k the rows of its range
  hit_sum: jax.Array  # [L, B, H] float32: per step, the fraction of the real row's top k that was fetched
  hit_steps: jax.Array  # [L, B, H] float32: steps counted in hit_sum (per KV head, so a mesh that splits the
                        # heads counts every shard's); both None unless counts_hits
  spec_key: jax.Array  # [L, B, H, D] model dtype: the previous step's speculative row's key (layer 0's is read)
  guess_right: jax.Array  # [L, B, H] bool: layer 0's verdict on this step's guess (the others read row 0); both
                          # None unless repair


@register
@dataclasses.dataclass(frozen=True)
class SpeCache(CacheMethod):
  """SpeCache settings (defaults: docs/methods/specache.md, 'Defaults and choices'): a ``bits``-bit KIVI copy with
  residual R on the device, ``fetch_rows`` (the paper's k) 16-bit rows per (sequence, layer, KV head) fetched from host
  memory for each step."""

  name = "specache"
  bits: int = dataclasses.field(default=1, metadata={
      "help": "code width of the low-bit copy's keys and values (1: the quarter-point quantizer)"})
  fetch_rows: int = dataclasses.field(default=64, metadata={
      "help": "k: 16-bit rows fetched from host memory per sequence, layer and KV head for each step"})
  group_size: int = dataclasses.field(default=32, metadata={
      "help": "G: tokens per key group, channels per value group"})
  residual: int = dataclasses.field(default=64, metadata={
      "help": "R: keys are quantized every R tokens; the newest R values stay in full precision"})
  meta_dtype: str = dataclasses.field(default="float16", metadata={"help": "dtype of scales and zero-points"})
  prefetch: bool = dataclasses.field(default=True, metadata={
      "help": "fetch the next step's rows for every layer at the end of a step, in one call, into a device buffer "
              "(else each layer fetches its own when it attends)"})
  hit_rate: bool = dataclasses.field(default=True, metadata={
      "help": "measure the speculation hit rate (one more top-k per layer and step)"})
  speculate: bool = dataclasses.field(default=True, metadata={
      "help": "choose the fetched rows with the speculative next-token row (SpeCache); false: the real row picks "
              "them from the low-bit copy and attends again with them (the paper's fetch-then-recompute "
              "baseline: no guess, two attention passes per layer; prefetch does not apply)"})

  mma: Optional[bool] = dataclasses.field(default=None, metadata={
      "help": "keep the low-bit copy in the packing the Hopper tensor-core kernel reads (KIVI's mma: residual a "
              "multiple of 64); default: where that kernel runs (a Hopper GPU, attention impl pallas) and the "
              "settings and model allow the packing"})
  exact_chunks: bool = dataclasses.field(default=True, metadata={
      "help": "chunked prefill: each chunk attends the earlier chunks' exact 16-bit rows, the layer read from host "
              "memory, as a whole prompt's tokens attend each other (false: the low-bit device copy, which lost "
              "every pass key at 8k with chunks of 1024; at 128k on an H200 exact chunks took 12.3 s, low-bit 12.7)"})
  repair: bool = dataclasses.field(default=False, metadata={
      "help": "check each step's guess (the real row's layer-0 key equals the previous speculative row's only when "
              "the guess was the real token) and, where it was wrong, give the real row the fetch-then-recompute "
              "pass (its own top k)"})

  @property
  def speculative_rows(self) -> int:
    return 1 if self.speculate else 0

  @property
  def repairs(self) -> bool:
    """Whether steps check the guess and repair misses: only a speculative guess can miss."""
    return self.repair and self.speculate

  @property
  def counts_hits(self) -> bool:
    """Whether steps measure the hit rate: only a speculative guess can miss."""
    return self.hit_rate and self.speculate

  def __post_init__(self):
    if self.bits not in SPECACHE_BITS:
      raise ValueError(f"specache bits={self.bits} is not supported; choose one of "
                       f"{', '.join(map(str, SPECACHE_BITS))}")
    if self.fetch_rows < 0:
      raise ValueError(f"specache fetch_rows={self.fetch_rows} must be >= 0")
    if self.meta_dtype not in DTYPES:
      raise ValueError(f"specache meta_dtype={self.meta_dtype!r}; choose one of {', '.join(DTYPES)}")
    _named(lambda: self.low_bit)  # building the low-bit copy checks group size and residual

  @property
  def low_bit(self) -> Kivi:
    """The low-bit copy: KIVI with the reference code's order (attend, then compress), in the MMA packing with
    ``mma`` (the fetched rows are holes the Hopper kernel masks, and it writes out the logits the speculative
    top-k reads), else in the library layout."""
    return Kivi(bits=self.bits, group_size=self.group_size, residual=self.residual, meta_dtype=self.meta_dtype,
                mma=self.mma)

  def check(self, spec: CacheSpec) -> None:
    _named(lambda: self.low_bit.check(spec))

  def for_impl(self, spec: CacheSpec, impl: str) -> "SpeCache":
    """``mma`` left open (None) is on where the Hopper kernel would read the low-bit copy: impl "pallas" on a
    Hopper GPU, the step's rows (the real one and the speculative one) times the query heads per KV head at most
    16, and settings the packing takes (as ``Kivi.for_impl``)."""
    return mma_left_open(self, impl, (1 + self.speculative_rows) * spec.q_per_kv,
                         lambda: dataclasses.replace(self, mma=True).low_bit.check(spec))

  def capacity_multiple(self) -> int:
    return self.low_bit.capacity_multiple()

  def advance(self, lengths, rows: int):
    return lengths + rows - self.speculative_rows

  def fetch_capacity(self, spec: CacheSpec) -> int:
    """k as allocated: at most the capacity (a short cache fetches every candidate)."""
    return min(self.fetch_rows, spec.capacity)

  # ---------------------------------------------------------------------------------------------- state

  def abstract(self, spec: CacheSpec) -> SpeCacheState:
    L, B, H, C, D = spec.num_layers, spec.batch, spec.kv_heads, spec.capacity, spec.head_dim
    k = self.fetch_capacity(spec)
    lead = ("layers", "batch", "kv_heads")
    fetched = lambda dtype, *channels: ArrayInfo((L, B, H, k) + channels, dtype,
                                                 lead + ("fetched",) + ("kv_channels",) * len(channels))
    counter = ArrayInfo((L, B, H), jnp.float32, lead) if self.counts_hits else None
    return SpeCacheState(
        low=self.low_bit.abstract(spec),
        host_kv=ArrayInfo((L, B, H, C, 2 * D), spec.dtype, lead + ("tokens", "kv_channels"), memory_kind="pinned_host"),
        staged_kv=ArrayInfo((L, B, H, 1, 2 * D), spec.dtype, lead + ("row", "kv_channels")),
        fetched_idx=fetched(jnp.int32),
        fetched_ok=fetched(jnp.bool_),
        # Named as token slots, so that a seq axis splits them: each device fetches the rows its range holds.
        fetched_kv=(ArrayInfo((L, B, H, k * spec.ranges, 2 * D), spec.dtype, lead + ("tokens", "kv_channels"))
                    if self.prefetch and self.speculate else None),
        hit_sum=counter,
        hit_steps=counter,
        spec_key=ArrayInfo((L, B, H, D), spec.dtype, lead + ("kv_channels",)) if self.repairs else None,
        guess_right=ArrayInfo((L, B, H), jnp.bool_, lead) if self.repairs else None,
    )

  # ---------------------------------------------------------------------------------------------- calls

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    """The prompt into the low-bit copy (KIVI's prefill) and, whole, into host memory. Nothing is fetched yet:
    the first top-k comes from the pre-decode pass."""
    low = self.low_bit.prefill(state.low, layer, q, k, v, ctx)
    # Padding stays out of the host copy (zeros, as allocated), so it holds real rows only.
    real = (ctx.positions >= 0)[:, None, :, None]
    rows = jnp.where(real, jnp.concatenate([k, v], axis=-1), 0)
    return state.replace(low=low, host_kv=host_write_layer(state.host_kv, layer, rows))

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    """A prompt chunk into the low-bit copy (KIVI's ``store_chunk``) and into host memory after the held rows."""
    low = self.low_bit.store_chunk(state.low, layer, q, k, v, ctx)
    rows = jnp.where((ctx.positions >= 0)[:, None, :, None], jnp.concatenate([k, v], axis=-1), 0)
    return state.replace(low=low, host_kv=host_write_rows(state.host_kv, layer, rows[None], ctx.lengths, ctx.impl))

  def store_spares_held_rows(self) -> bool:
    return self.exact_chunks  # the host copy's rows past the held ones are written; the low-bit copy's ring is not

  def held_rows(self, state, layer, lengths) -> HeldRows:
    """What a prompt chunk attends. With ``exact_chunks`` the host copy's held rows of the layer, moved to the
    device: a chunked prompt's tokens then attend each other exactly, as a whole prompt's do. On a GPU the Pallas
    copy reads the host array in place, each sequence's held rows only (``jkv_kernels.host_layer_copy``); on a CPU
    one slice of the host array moves whole. Else the low-bit copy as the next step reads it (KIVI's
    ``held_rows``): nothing moves from host memory for a chunk."""
    if not self.exact_chunks:
      return self.low_bit.held_rows(state.low, layer, lengths)
    if jax.default_backend() == "cpu":  # how the rows move, never which rows (as ``gather_host_rows``)
      rows = to_device(jax.lax.dynamic_index_in_dim(state.host_kv, layer, 0, keepdims=False))  # [B, H, C, 2D]
    else:
      rows = copy_layer(state.host_kv, layer, lengths)
    D = rows.shape[-1] // 2
    return HeldRows(rows[..., :D], rows[..., D:], lengths)

  # ------------------------------------------------------------------------------- one range of each sequence
  # Context parallelism (jkv.context_parallel): the low-bit copy is split as KIVI's (its store by range, its rings on
  # every device), the host copy by range (each device its range's rows, written only there), and the fetched
  # positions are the same on every device, each attending those its range holds (module docstring).

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    """A prompt's or a chunk's rows stored as ``store_chunk`` stores them, each copy keeping the rows of its range:
    the low-bit copy as KIVI's ``store_span``, the host copy's rows of the range (``host_write_rows``)."""
    low = self.low_bit.store_span(state.low, layer, q, k, v, ctx)
    real = (ctx.positions + ctx.first_slot >= 0)[:, None, :, None]
    rows = jnp.where(real, jnp.concatenate([k, v], axis=-1), 0)
    host_kv = host_write_rows(state.host_kv, layer, rows[None], ctx.lengths, ctx.impl, anywhere=True)
    return state.replace(low=low, host_kv=host_kv)

  def held_span(self, state, layer, ctx: StepContext) -> HeldRows:
    """``held_rows`` of the range: with ``exact_chunks`` its rows of the host copy, else the low-bit copy's (KIVI's
    ``held_span``)."""
    if not self.exact_chunks:
      return self.low_bit.held_span(state.low, layer, ctx)
    return self.held_rows(state, layer, jnp.clip(ctx.lengths, 0, state.host_kv.shape[3]))

  def step_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    """``step`` on one device of ``seq``: its attention over the rows it holds, merged over every device (``_merged``),
    and the selection every device's top k by the merged probabilities, of which the top k (``_select``)."""
    return self._step(state, layer, q, k, v, ctx, merge)

  def pre_decode_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    """``pre_decode`` on one device of ``seq`` (as ``step_span``)."""
    return self._pre_decode(state, layer, q, k, v, ctx, merge)

  @staticmethod
  def _frame(ctx: StepContext):
    """(first_slot, lengths [B], positions [B, T]) counted the whole sequence's way: ctx's (first_slot None) on one
    device, shifted by the range's first slot on one of ``seq``."""
    first = ctx.first_slot
    if first is None:
      return None, ctx.lengths, ctx.positions
    return first, ctx.lengths + first, ctx.positions + first

  @staticmethod
  def _fetched_slots(idx, ok, first_slot, capacity: int):
    """The slots [B, H, k] (clipped into [0, capacity)) of fetched positions idx in a state whose slots hold the
    positions from ``first_slot`` on (None: 0, the whole sequence), and which of them it holds: ok and inside."""
    if first_slot is None:
      return idx, ok
    slot = idx - first_slot
    return jnp.clip(slot, 0, capacity - 1), ok & (slot >= 0) & (slot < capacity)

  # ---------------------------------------------------------------------------------------------- decode

  def pre_decode(self, state, layer, q, k, v, ctx: StepContext):
    """The first generated token (one row at position n = ctx.lengths) over the low-bit cache and its own K/V,
    nothing fetched and nothing stored (the paper's §3.3); its probabilities pick the first step's rows."""
    return self._pre_decode(state, layer, q, k, v, ctx, None)

  def _pre_decode(self, state, layer, q, k, v, ctx: StepContext, merge):
    """``pre_decode``, with ``merge`` on one device of ``seq`` (``step_span``)."""
    first, n, positions = self._frame(ctx)
    k_rows = state.fetched_idx.shape[-1]
    if self.repairs:  # the first step's real row is this token: its guess is right
      state = state.replace(spec_key=write_layer(state.spec_key, layer, k[:, :, 0]))
    own = (k, v, jnp.ones((k.shape[0], 1, 1), bool))
    mass_rows = (0,) if k_rows else ()
    out, mass = self._merged(q, self._attend(state.low, layer, q, positions, n, None, own, mass_rows, ctx.impl, first),
                             merge, mass_rows)
    if k_rows:
      idx, ok = self._select(mass, self.low_bit.key_boundary(n + 1)[:, None], k_rows, first)
      idx, ok = idx[:, :, 0], ok[:, :, 0]
      state = self._keep(state, layer, idx, ok)
      if self.prefetch:  # once per generation: this layer's rows now, not all layers at the end
        slots, _ = self._fetched_slots(idx, ok, first, state.host_kv.shape[3])
        rows = gather_host_rows(state.host_kv, layer, slots[None], ctx.impl)[0]
        state = state.replace(fetched_kv=write_layer(state.fetched_kv, layer, rows))
    return out, state

  def step(self, state, layer, q, k, v, ctx: StepContext):
    """Rows [real, speculative] at positions [n, n + 1] (q [B, H, 2, g, D]); stores the real row only. Without
    ``speculate``, the real row alone (q [B, H, 1, g, D])."""
    return self._step(state, layer, q, k, v, ctx, None)

  def _step(self, state, layer, q, k, v, ctx: StepContext, merge):
    """``step``, with ``merge`` on one device of ``seq`` (``step_span``)."""
    if k.shape[2] != 1 + self.speculative_rows:
      raise ValueError(f"specache steps carry the real row{' and one speculative row' if self.speculate else ''}, "
                       f"got {k.shape[2]} rows")
    first, n, positions = self._frame(ctx)
    k_rows = state.fetched_idx.shape[-1]
    # With the MMA packing the value tile the row completes is packed, and the key block ending at the new length
    # flushed, in ``end_step`` (KIVI's for steps of one row; the block ending at n was flushed by the step before).
    low = self.low_bit.append_one(state.low, layer, k[:, :, 0], v[:, :, 0], n, ctx.impl,
                                  flush_before=not self.mma, pack_values=not self.mma, first_slot=first)
    staged = write_layer(state.staged_kv, layer, jnp.concatenate([k[:, :, :1], v[:, :, :1]], axis=-1))
    if not self.speculate:
      out, fetched = self._fetch_then_recompute(low, state.host_kv, layer, q, positions, n, k_rows, ctx.impl, first,
                                                merge)
      state = state.replace(low=low, staged_kv=staged)
      return out, (state if fetched is None else self._keep(state, layer, *fetched[:2]))
    fetched = None
    if k_rows:
      idx, ok = self._fetched(state, layer)
      if self.prefetch:
        rows = state.fetched_kv[layer]
      else:  # rows at positions < bK, on the host since an earlier step ended
        slots, _ = self._fetched_slots(idx, ok, first, state.host_kv.shape[3])
        rows = gather_host_rows(state.host_kv, layer, slots[None], ctx.impl)[0]
      fetched = (idx, ok, rows)
    # The speculative row sees the real one (in the window now) and itself; the real row never sees it.
    own = (k[:, :, 1:], v[:, :, 1:], jnp.broadcast_to(jnp.array([False, True])[None, :, None], (k.shape[0], 2, 1)))
    mass_rows = ((0, 1) if self.counts_hits else (1,)) if k_rows else ()
    out, mass = self._merged(q, self._attend(low, layer, q, positions, n + 1, fetched, own, mass_rows, ctx.impl,
                                             first), merge, mass_rows)
    state = state.replace(low=low, staged_kv=staged)
    if self.repairs and k_rows:
      state, right = self._verify(state, layer, k)
      # On seq every device of a sequence's ranges holds the same heads and the same verdict: one branch for all.
      repaired = lambda: jnp.where(right[:, :, None, None, None], out[:, :, :1], self._fetch_then_recompute(
          low, state.host_kv, layer, q[:, :, :1], positions[:, :1], n, k_rows, ctx.impl, first, merge)[0])
      out = out.at[:, :, :1].set(jax.lax.cond(jnp.all(right), lambda: out[:, :, :1], repaired))
    if k_rows:  # mass's rows are mass_rows: the real row's (to count hits) and the speculative row's, one selection
      bounds = ((self.low_bit.key_boundary(n + 1),) if self.counts_hits else ()) + (self.low_bit.key_boundary(n + 2),)
      top, top_ok = self._select(mass, jnp.stack(bounds, axis=1), k_rows, first)
      if self.counts_hits:
        state = self._count_hits(state, layer, idx, ok, top[:, :, 0], top_ok[:, :, 0])
      state = self._keep(state, layer, top[:, :, -1], top_ok[:, :, -1])
    return out, state

  def _fetch_then_recompute(self, low, host_kv, layer, q, positions, n, k_rows, impl, first_slot=None, merge=None):
    """The non-speculative baseline (an upper bound on the guess's selection, and the paper's Table 4 comparison): the
    real row q [B, H, 1, g, D] at positions [B, 1] (its K/V already in the window) attends the low-bit cache, its own
    probabilities pick the top k among this step's quantized keys, those rows come from host memory, and it attends
    again with them. On one device of ``seq`` (``first_slot``, ``merge``) both passes merge over the devices and the
    selection is the top k of every device's, as a speculative step's (``_merged``, ``_select``). Returns the output
    and the rows fetched (idx, ok, rows; None when k = 0)."""
    fetched = None
    if k_rows:
      attended = self._attend(low, layer, q, positions, n + 1, None, None, (0,), impl, first_slot)
      idx, ok = self._select(self._merged(q, attended, merge, (0,))[1], self.low_bit.key_boundary(n + 1)[:, None],
                             k_rows, first_slot)
      idx, ok = idx[:, :, 0], ok[:, :, 0]
      slots, _ = self._fetched_slots(idx, ok, first_slot, host_kv.shape[3])
      fetched = (idx, ok, gather_host_rows(host_kv, layer, slots[None], impl)[0])
    attended = self._attend(low, layer, q, positions, n + 1, fetched, None, (), impl, first_slot)
    return self._merged(q, attended, merge, ())[0], fetched

  @staticmethod
  def _verify(state, layer, k):
    """Whether the previous step's speculative token was this step's real token, per (sequence, KV head): the same
    token at the same position gives the same layer-0 key (up to the last bits of how the two rows were
    computed), a different token a key that differs everywhere. Every layer stores its speculative row's key;
    the verdict is layer 0's, read by the later layers of the step. Returns the state and right [B, H]."""
    real, guess = k[:, :, 0].astype(jnp.float32), state.spec_key[layer].astype(jnp.float32)
    same = jnp.max(jnp.abs(real - guess), axis=-1) <= 1e-2 * jnp.max(jnp.abs(real), axis=-1)
    state = state.replace(spec_key=write_layer(state.spec_key, layer, k[:, :, 1]),
                          guess_right=write_layer(state.guess_right, layer, same))
    return state, state.guess_right[0]

  def end_step(self, state, ctx: StepContext):
    """After every layer: the real rows to host memory (one write per sequence, every layer at once) and, with
    prefetch, the next step's rows of every layer from it in one call (the rows chosen
    may include the one just written); with the MMA packing, the low-bit copy's value tile and key flush that
    the stored row completed (``Kivi.settle``). On one device of ``seq`` the row is written where the device's
    range holds it, and each device fetches the rows of its range."""
    first, n, _ = self._frame(ctx)
    host_kv = host_write_rows(state.host_kv, 0, state.staged_kv, ctx.lengths, ctx.impl, anywhere=first is not None)
    state = state.replace(low=self.low_bit.settle(state.low, n + 1, True, ctx.impl, first), host_kv=host_kv)
    if state.fetched_kv is not None and state.fetched_idx.shape[-1]:
      slots, _ = self._fetched_slots(state.fetched_idx, state.fetched_ok, first, state.host_kv.shape[3])
      state = state.replace(fetched_kv=gather_host_rows(state.host_kv, 0, slots, ctx.impl))
    return state

  # ---------------------------------------------------------------------------------------------- parts

  def _attend(self, low, layer, q, q_positions, lengths, fetched, own, mass_rows, impl, first_slot=None):
    """One softmax over the mixed cache of a step holding ``lengths`` [B] tokens, plus the rows' own K/V ``own``
    (k, v [B, H, r, D], mask [B, T, r]; None when they are all held already); fetched = (idx [B, H, k],
    ok [B, H, k], rows [B, H, k, 2D]) or None.

    With ``first_slot``, one device of ``seq`` (``jkv.context_parallel``), whose store holds the positions from it
    on (positions, lengths and idx count the whole sequence's way): the fetched positions its range holds are its
    holes and its fetched segment (``rows``: gathered from its range of the host copy), the others another
    device's; the window, less every fetched position, and the rows' own K/V are attended by the first range's
    device alone. There each query head is a row of its own (q as [B, H, T g, 1, D]), so that the mass comes per
    head, to be weighed by the merged log-sum-exp (``_merged``).

    Returns out [B, H, T, g, D], lse [B, H, T, g] float32 (on one device of ``seq``; else None) and the held
    positions' mass from the chosen rows (None with no rows): each position's probability from each row, summed
    over the g query heads (per head on one device of ``seq``: the rows R g, row r's head j at r g + j), at
    whichever precision it was read, as ``_select`` takes it: (the store's ``TokenMass``, ((positions
    [B, H or 1, 1, N], mass [B, H, R, N], held [B, H or 1, 1, N]) of the window and of the fetched rows)). A held
    position is in exactly one of the three on exactly one device: the store's slots below its value boundary that
    are not holes, the window's slots from there that are not fetched, the fetched rows.
    """
    kivi = self.low_bit
    split = first_slot is not None
    starts = (first_slot == 0) if split else True  # the device that attends the window and the own rows
    win, in_window = kivi.window(lengths)
    B, H, T, g, D = q.shape
    C = kivi.capacity(low)
    win_mask = in_window[:, None, :] & (win[:, None, :] <= q_positions[:, :, None]) & starts  # [B, T, W]
    win_held = in_window[:, None, None, :] & starts  # [B, 1, 1, W]
    valid = None
    segments = []
    if fetched is not None:
      idx, ok, rows = fetched
      slots, mine = self._fetched_slots(idx, ok, first_slot, C)
      b_i, h_i = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
      # A fetched position is read from its 16-bit row alone: a hole in the store, or out of the window (a key
      # quantized while its value is still exact). Positions are unique (``_select``), so the scatter has no
      # conflicts; the positions not held here are dropped.
      valid = ~jnp.zeros((B, H, C), bool).at[b_i, h_i, jnp.where(mine, slots, C)].set(True, mode="drop")
      in_fetched = jnp.any((win[:, None, :, None] == idx[:, :, None, :]) & ok[:, :, None, :], axis=-1)  # [B, H, W]
      win_mask = win_mask[:, None] & ~in_fetched[:, :, None, :]  # [B, H, T, W]
      win_held = win_held & ~in_fetched[:, :, None, :]
      # Rows not fetched point past the length, at host rows that may never have been written (``cache.allocate``):
      # zeroed, as a kernel that multiplies a masked value by p = 0 needs it finite.
      rows = jnp.where(mine[..., None], rows, 0).astype(q.dtype)
      segments.append((rows[..., :D], rows[..., D:], jnp.broadcast_to(mine[:, :, None, :], (B, H, T, mine.shape[-1]))))
    if own is not None:
      segments.append(own[:2] + (own[2] & starts,))
    segments = [(low.k_ring, low.v_ring, win_mask)] + segments
    store = kivi.store(low, jnp.clip(kivi.value_boundary(lengths) - (first_slot if split else 0), 0, C), valid)
    if split:  # one row per query head
      q = q.reshape(B, H, T * g, 1, D)
      segments = [(k, v, jnp.repeat(mask, g, axis=-2)) for k, v, mask in segments]
      mass_rows = tuple(r * g + j for r in mass_rows for j in range(g))
    out = decode_attention(q, layer, stores=(store,), segments=tuple(segments), impl=impl, return_lse=split,
                           token_mass_rows=mass_rows)
    out = out if isinstance(out, tuple) else (out,)
    o, lse = out[0].reshape(B, H, T, g, D), (out[1].reshape(B, H, T, g) if split else None)
    if not mass_rows:
      return o, lse, None
    (store_mass,), segment_mass = out[-1]
    held = ((win[:, None, None, :], segment_mass[0], win_held),)
    if fetched is not None:
      held += ((idx[:, :, None, :], segment_mass[1], mine[:, :, None, :]),)
    return o, lse, (store_mass, held)

  @staticmethod
  def _merged(q, attended, merge, mass_rows):
    """``_attend``'s (out, lse, mass) as ``_select`` and the caller take it: (out [B, H, T, g, D] in q.dtype, mass).
    With ``merge`` (one device of ``seq``): out merged over every device, and each query head's mass weighed by
    exp(lse - merged lse) of its row, which makes it the probability over every device's rows, then summed over
    the heads (a head's weights sum to 1 over its own softmax: summed before the weighing, heads whose softmax
    this device's rows dominate differently would be mixed in wrong proportions)."""
    out, lse, mass = attended
    if merge is None:
      return out, mass
    o, merged = merge(out, lse)
    if mass is None:
      return o.astype(q.dtype), None
    B, H, _, g = lse.shape
    rows = list(mass_rows)
    factor = jnp.exp(lse[:, :, rows] - merged[:, :, rows]).reshape(B, H, len(rows) * g)  # row r's head j at r g + j
    store, held = mass
    per_head = lambda x: x.reshape(x.shape[:3] + (len(rows), g))  # [B, H, n, R g, 1] -> [B, H, n, R, g]
    if store.scale is None:
      store = store.replace(weights=per_head(store.weights[..., 0].astype(jnp.float32) * factor[:, :, None]))
    else:  # the kernel's fp16 weights stay as written; their runs' factors take the weighing
      store = store.replace(weights=per_head(store.weights[..., 0]),
                            scale=per_head(store.scale[..., 0] * factor[:, :, None]))
    held = tuple((at, jnp.sum((m * factor[..., None]).reshape(B, H, len(rows), g, -1), axis=3), is_held)
                 for at, m, is_held in held)
    return o.astype(q.dtype), (store, held)

  @staticmethod
  def _select(mass, bound, k: int, first_slot=None):
    """Top k positions [B, H, R, k] of each of R rows among the held positions below bound [B, R] (``_attend``'s
    mass), and which are real (fewer than k held: the rest point past the capacity, each at its own slot, so the
    holes' scatter stays exact). The window's and the fetched rows' masses join the store's slots as runs of
    ``SELECT_RUN`` after its own; the k runs with the largest masses hold a top k (``top_k_positions``), and the
    top k of their k * SELECT_RUN slots is one. The store's runs come from one pass over its weights
    (``TokenMass.block_max``). Every selection goes in one call: it costs what one row's does.

    With ``first_slot`` (one device of ``seq``, its store's slots the positions from it on; the masses weighed by
    the merged log-sum-exp: ``_merged``): every device's top k of what it holds, and of those the top k, the same
    on every device (``top_k_across_seq``)."""
    store, held = mass
    first = 0 if first_slot is None else first_slot
    at, of = SpeCache._held_candidates(held, bound)
    store_bound = bound - first  # the store's slots count from its first
    store_runs = store.block_max(SELECT_RUN, store_bound)  # [B, H, R, n]
    runs = jnp.concatenate([store_runs, jnp.max(of.reshape(of.shape[:3] + (-1, SELECT_RUN)), axis=-1)], axis=-1)
    chosen = top_k_positions(runs, min(k, runs.shape[-1]))
    slots = (chosen[..., None] * SELECT_RUN + jnp.arange(SELECT_RUN)).reshape(chosen.shape[:3] + (-1,))
    extra = slots - store_runs.shape[-1] * SELECT_RUN  # >= 0: a slot of the window's and fetched rows' runs
    e = jnp.clip(extra, 0, of.shape[-1] - 1)
    values = jnp.where(extra >= 0, jnp.take_along_axis(of, e, axis=-1), store.at(slots, store_bound))
    positions = jnp.where(extra >= 0, jnp.take_along_axis(at, e, axis=-1), slots + first)
    best, j = top_k(values, min(k, values.shape[-1]))  # (fewer on a device whose range is shorter than k)
    idx, past = jnp.take_along_axis(positions, j, axis=-1), store.length
    if first_slot is not None:
      best, idx, n = top_k_across_seq(best, idx, k)
      past = n * store.length
    ok = best > NOT_A_CANDIDATE
    return jnp.where(ok, idx, past + jnp.arange(k)).astype(jnp.int32), ok

  @staticmethod
  def _held_candidates(held, bound):
    """The window's and the fetched rows' positions and masses (``_attend``'s held) as one row each, padded to whole
    runs of ``SELECT_RUN``: at [B, H, R, E] int32 and of [B, H, R, E] float32, NOT_A_CANDIDATE where a position is
    not held or not below bound [B, R]."""
    below = bound[:, None, :, None]
    at = jnp.concatenate([jnp.broadcast_to(pos, m.shape) for pos, m, _ in held], axis=-1)
    of = jnp.concatenate([jnp.where(is_held & (jnp.broadcast_to(pos, m.shape) < below), m, NOT_A_CANDIDATE)
                          for pos, m, is_held in held], axis=-1)
    pad = -of.shape[-1] % SELECT_RUN
    return (jnp.pad(at, ((0, 0),) * 3 + ((0, pad),)),
            jnp.pad(of, ((0, 0),) * 3 + ((0, pad),), constant_values=NOT_A_CANDIDATE))

  @staticmethod
  def _fetched(state, layer):
    """The positions [B, H, k] the previous step chose for this layer's step, and which are real (``_keep``'s)."""
    return state.fetched_idx[layer], state.fetched_ok[layer]

  @staticmethod
  def _keep(state, layer, idx, ok):
    """Record the positions the next step attends in 16 bits."""
    return state.replace(fetched_idx=write_layer(state.fetched_idx, layer, idx),
                         fetched_ok=write_layer(state.fetched_ok, layer, ok))

  def _count_hits(self, state, layer, idx, ok, top, top_ok):
    """Add this step's hit fraction per sequence: |fetched ∩ top k of the real row| / min(k, candidates), over
    the candidates the fetched set was chosen from (this step's [0, bK)), per KV head; top, top_ok [B, H, k]: the
    real row's own top k among them (``_select``)."""
    hits = jnp.sum((idx[..., :, None] == top[..., None, :]) & ok[..., :, None] & top_ok[..., None, :], axis=(-2, -1))
    slots = jnp.sum(top_ok, axis=-1)  # [B, H], equal across heads
    counted = slots > 0
    frac = hits / jnp.maximum(slots, 1)
    return state.replace(hit_sum=state.hit_sum.at[layer].add(jnp.where(counted, frac, 0.0)),
                         hit_steps=state.hit_steps.at[layer].add(counted.astype(jnp.float32)))

  # ---------------------------------------------------------------------------------------------- reports

  def decode_stats(self, state) -> dict:
    if not self.counts_hits:
      return {}
    steps = float(np.sum(np.asarray(state.hit_steps)))
    return {"speculation_hit_rate": float(np.sum(np.asarray(state.hit_sum))) / steps if steps else None}

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    """Device: the low-bit copy (KIVI's count at residual R), the k fetched 16-bit K/V rows per layer and KV head
    with their positions and flags, the step's staged row, the hit counters (``counts_hits``) and the guess check's
    keys and verdicts (``repairs``): docs/methods/specache.md's
    2·H·D·[n(b/8 + 4/G) + 2(R + k)] per layer plus those few bytes. Host: every stored token's K and V in the
    model dtype."""
    del state
    n = np.asarray(lengths, np.int64)
    L, H, D = spec.num_layers, spec.kv_heads, spec.head_dim
    act = jnp.dtype(spec.dtype).itemsize
    low = self.low_bit.held_bytes(spec, None, n)
    fetched = L * len(n) * H * self.fetch_capacity(spec) * (2 * D * act + 4 + 1)
    staged_and_counters = L * len(n) * H * (2 * D * act + (2 * 4 if self.counts_hits else 0)
                                            + ((D * act + 1) if self.repairs else 0))
    return HeldBytes(device=low.device + fetched + staged_and_counters, host=int(2 * L * H * D * act * n.sum()))
