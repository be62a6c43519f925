"""The cache interface (v2) every method implements, and the cache pytree the model carries.

A method is a frozen dataclass (hashable, so static under jit) holding its settings; settings that are wrong
whatever the model raise a one-line ValueError at construction, settings that depend on the model in
``check(spec)``. Its state is a registered dataclass pytree whose arrays all carry a leading layer axis. The
model scans layers with the whole state in the loop carry and hands each call the layer index, so every update is
an in-place ``dynamic_update_slice`` under buffer donation and attention reads the stacked arrays in place.
Generate, the model and the CLI reach a method only through this interface and the registry
(``jkv.methods.make_method``): nothing outside a method branches on its name.

What a method provides (shapes: B batch, H = kv_heads, T rows, g = q_per_kv, D = head_dim, C = capacity):

``abstract(spec)``
    The state as a tree of ``ArrayInfo`` (shape, dtype, logical axis names, memory kind) in the state's own
    dataclass. Allocation (``KVCache.create``), the bytes allocated and shardings all derive from it, so shapes
    are written once. Memory kind ``"device"`` or ``"pinned_host"`` (host-resident arrays, e.g. SpeCache's full
    16-bit copy).
``prefill(state, layer, q, k, v, ctx) -> state``
    Store a right-padded prompt for one layer: q [B, H, T, g, D], k and v [B, H, T, D] post-RoPE;
    ``ctx.lengths`` [B] counts each prompt's valid tokens, positions past it are padding. The state was empty.
    The prompt's own attention is exact and computed by the model; the queries are here for methods that score
    tokens with them (ZipCache's probes, SpeCache's first top-k).
``step(state, layer, q, k, v, ctx) -> (out, state)``
    One decode call for one layer: the T new rows' q, k, v (positions ``ctx.positions`` [B, T], the cache held
    ``ctx.lengths`` [B] tokens before the call). The method decides what it stores (all rows, or only some: a
    speculative row is attended, never stored), when it compresses (a flush, a block event, a recompression
    every N steps) and returns the attention of every row [B, H, T, g, D] in q.dtype over what it holds plus
    the rows it is given (row t sees positions <= positions[b, t]). Attention goes through
    ``jkv.attention.decode_attention`` with ``ctx.impl``; statistics of chosen rows (log-sum-exp, attention
    mass per token) come from that same pass.
``advance(lengths, rows) -> lengths``
    Tokens held after a step of ``rows`` rows (default: all stored).
``speculative_rows`` (default 0; SpeCache: 1)
    Rows a decode step carries after the real one. Generate then feeds [real, speculative] tokens at positions
    [n, n + 1]; the speculative token is the greedy output of the previous step's speculative row (a guess,
    never checked) and ``advance`` counts only the real row. Methods with 0 get one row per step, as before.
``extend(state, layer, q, k, v, ctx) -> (out, state)``
    One chunk of a prompt for one layer (chunked prefill, ``jkv.prefill``): ``prefill`` stored the first chunk, and
    earlier calls the chunks before this one. Rows sit at positions ``ctx.positions`` [B, T]: ``ctx.lengths`` [B]
    (the tokens held) + [0, T), and -1 past a prompt's end; a sequence whose prompt ended in an earlier chunk has
    every row at -1, and its state must not change. Returns every row's attention over what the method holds of
    the earlier chunks, as it holds them, plus the chunk itself causally in full precision, and the state with the
    chunk's rows stored. The default is built of two parts a method provides: ``held_rows(state, layer, lengths)``,
    every held token of the layer once as its attention reads it (dequantized where stored quantized), as 16-bit
    rows the chunk's attention runs over (``jkv.chunk_attention.HeldRows``: a transient of one layer, [B, H, C, D]
    at capacity C); and ``store_chunk(state, layer, q, k, v, ctx) -> state``, the rows stored as the method stores
    a prompt, from ``ctx.lengths`` on.
``chunk_multiple()``
    Chunks are a whole number of these tokens (default ``capacity_multiple``, of which it is a multiple): a chunk
    ends where the method's blocks end (KIVI's residual, OTT's groups, ZipCache's split into whole key groups).
    An ``extend`` call writes nothing past ctx.lengths + T + chunk_multiple on the token axis (KIVI rewrites up to
    R held rows with the chunk; padding rows land past a prompt's end): the planner leaves that much room.
``attend(state, layer, q, ctx) -> (out, lse)`` and ``store_span(state, layer, q, k, v, ctx) -> state``
    Optional: what a method provides to hold one range of each sequence's tokens on each device of a mesh's
    ``seq`` axis (context parallelism, ``jkv.context_parallel``, which composes decode steps and prompt chunks
    from them and merges the devices' attention exactly). ``attend``: q's rows over what the state holds, nothing
    stored, with the log-sum-exp. ``store_span``: rows stored at slots that may lie outside the state's, those
    rows dropped. Methods without them refuse a ``seq`` axis up front. There ``ctx`` counts lengths and positions
    from the state's first slot, which holds position ``ctx.first_slot`` of the sequence, and
    ``held_span(state, layer, ctx)`` gives ``held_rows`` of the state's range for a chunk (default: ``held_rows``
    of the count it holds, for a method whose held rows are its slots), and ``attended(state, layer, q, lse, ctx)
    -> state`` what a decode step's attention leaves in the state, from the log-sum-exp merged over every device
    (default nothing; ZipCache's probes weigh its window by the step's probabilities).
``step_span(state, layer, q, k, v, ctx, merge) -> (out, state)`` and ``pre_decode_span(...)``
    ``step`` and ``pre_decode`` of such a state, run on every device of ``seq`` in its frame, ``merge(o, lse) ->
    (o, lse)`` merging the devices' attention partials exactly. ``step_span``'s default composes ``store_span``,
    ``attend``, ``merge`` and ``attended``; a method whose update needs more of its attention pass than the merged
    log-sum-exp (SpeCache's selection, from each device's token mass) provides its own, and with
    ``speculative_rows`` > 0 ``pre_decode_span``.
``pre_decode(state, layer, q, k, v, ctx) -> (out, state)``
    Called only when ``speculative_rows`` > 0, once, between prefill and the first step: the first generated
    token (one row at position ``ctx.lengths``) attends over the cache and is not stored (lengths do not move);
    the method prepares its first step (SpeCache's first top-k). Its greedy output is the first speculative token.
``end_step(state, ctx) -> state``
    Called once per decode step after every layer's ``step`` (not after prefill or pre-decode), with the step's
    context: work that spans all layers, done once (SpeCache writes the step's rows to host memory in one
    write per sequence and fetches the next step's rows for every layer in one call); default nothing.
``decode_stats(state) -> dict``
    Statistics the method gathered while decoding (SpeCache's speculation hit rate), read once after decoding
    and reported in generate's stats; default none.
``held_bytes(spec, state, lengths) -> HeldBytes``
    Bytes really held for these sequence lengths, device and host apart, from the state (pool occupancy,
    counters); ``state=None`` gives the bound at those lengths (every pool full), which ``jkv info`` reports.
``capacity_multiple()``
    Capacities are rounded up to a multiple of this.
``range_multiple()``
    Each device's range of a ``seq`` split (``jkv.context_parallel``) is a whole number of these slots (default
    ``capacity_multiple``; OTT's whole tiles, to which its store rounds its slots).
``for_impl(spec, impl) -> method``
    The settings as they run with attention implementation ``impl``: a setting left open (KIVI's ``mma``, the
    store's packing) is decided here, by what ``jkv.attention`` says its kernels take. ``KVCache.create`` calls
    it, so a cache's ``method`` is always decided; default ``self``.
``settings() -> dict``
    The settings as results record them (default: the dataclass's fields).

``ctx.impl`` is the attention implementation, chosen once by the caller (``jkv.attention.choose_impl``):
``"pallas"`` (the fused kernels, GPUs of compute capability >= 8.0), ``"interpret"`` (the same kernels in
Pallas interpret mode, for CPU tests) or ``"xla"`` (plain XLA: CPU, T4-class GPUs, or when asked).
Methods never look at the device themselves: ``for_impl`` asks ``jkv.attention``.
"""

import abc
import dataclasses
import functools
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.chunk_attention import HeldRows, chunk_attention
from jkv.config import ModelConfig

IMPLS = ("pallas", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Static sizes of a cache: what ``abstract`` describes."""

  num_layers: int
  batch: int
  capacity: int  # tokens per sequence the buffers hold
  kv_heads: int
  head_dim: int
  q_per_kv: int  # query heads sharing one KV head (g)
  dtype: Any  # activation dtype of K/V entering the cache
  # Devices of a mesh's seq axis, each holding one contiguous range of the slots (jkv.context_parallel): a method
  # whose state's token axes are not the slots themselves sizes them to split as evenly (ZipCache's pools).
  ranges: int = 1
  # The most tokens any sequence stores after its prompt (decode steps; a prompt's chunks count as prompt), None: up
  # to the capacity. A method whose decode steps take more rows than prompt tokens do sizes its arrays by it
  # (ZipCache's pools); None where the bound is not known when the cache is made (a saved cache continued by
  # another run).
  max_decode: Optional[int] = None

  @classmethod
  def for_model(cls, cfg: ModelConfig, batch: int, capacity: int, max_decode: Optional[int] = None) -> "CacheSpec":
    return cls(cfg.num_layers, batch, capacity, cfg.kv_heads, cfg.head_dim, cfg.q_per_kv, cfg.jnp_dtype,
               max_decode=max_decode)

  def with_batch(self, batch: int) -> "CacheSpec":
    return dataclasses.replace(self, batch=batch)


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """One state array before it exists: shape, dtype, a logical name per axis and where it lives."""

  shape: tuple
  dtype: Any
  axes: tuple  # logical axis names, one per dimension: "layers", "batch", "kv_heads", "tokens", ...
  memory_kind: str = "device"  # or "pinned_host"

  def __post_init__(self):
    if len(self.axes) != len(self.shape):
      raise ValueError(f"ArrayInfo axes {self.axes} do not name every dimension of shape {self.shape}")

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


def is_array_info(x) -> bool:
  return isinstance(x, ArrayInfo)


@dataclasses.dataclass(frozen=True)
class HeldBytes:
  """Bytes a cache holds, on the device and in host memory."""

  device: int
  host: int = 0

  @property
  def total(self) -> int:
    return self.device + self.host

  def __add__(self, other: "HeldBytes") -> "HeldBytes":
    return HeldBytes(self.device + other.device, self.host + other.host)


@struct.dataclass
class StepContext:
  """What every prefill and step call is told besides q, k, v."""

  lengths: jax.Array  # [B] int32: prompt lengths at prefill; tokens held before the call at a step
  positions: jax.Array  # [B, T] int32 position of each row (-1 for prompt padding)
  impl: str = struct.field(pytree_node=False, default="xla")  # one of IMPLS
  # Where the state holds one range of the sequence (a seq device's, jkv.context_parallel): the position of its slot
  # 0, from which lengths and positions count (and may then lie outside its slots); None: the whole sequence.
  first_slot: Any = None


class SplitByPosition:
  """``attend`` and ``held_span`` (``jkv.context_parallel``) of a method whose own ``_attend(state, layer, q,
  q_positions, lengths, impl, first_slot, return_lse)`` and ``_held(state, layer, n, first_slot)`` count positions the
  whole sequence's way, its store holding the positions from ``first_slot`` on (KIVI, OTT): the device's frame
  shifted back by its range's first slot. Listed before ``CacheMethod`` among a method's bases."""

  def attend(self, state, layer, q, ctx: StepContext):
    first = ctx.first_slot
    return self._attend(state, layer, q, ctx.positions + first, ctx.lengths + first, ctx.impl, first,
                        return_lse=True)

  def held_span(self, state, layer, ctx: StepContext) -> HeldRows:
    return self._held(state, layer, ctx.lengths + ctx.first_slot, ctx.first_slot)


class CacheMethod(abc.ABC):
  """Operations of a KV-cache method (module docstring). Subclasses are frozen dataclasses registered with
  ``jkv.methods.register``; a field's ``metadata={"help": ...}`` becomes its CLI help."""

  name: ClassVar[str]

  def check(self, spec: CacheSpec) -> None:
    """Raise ValueError (one line, naming the problem) if these settings cannot serve this cache."""

  def capacity_multiple(self) -> int:
    return 1

  def range_multiple(self) -> int:
    """Slots of which each device's range of a ``seq`` split is a whole number (module docstring)."""
    return self.capacity_multiple()

  def settings(self) -> dict:
    """The settings as a dict (the dataclass's fields): what results record of the method."""
    return dataclasses.asdict(self)

  def for_impl(self, spec: CacheSpec, impl: str) -> "CacheMethod":
    """These settings as they run with attention implementation ``impl`` on this process's devices: a setting
    left to the device (KIVI's ``mma``) is decided here. ``KVCache.create`` calls it; the default is ``self``."""
    return self

  @abc.abstractmethod
  def abstract(self, spec: CacheSpec) -> Any:
    """The state with an ``ArrayInfo`` at every leaf."""

  def init(self, spec: CacheSpec) -> Any:
    """The empty state: zeros (never uninitialized memory) in each array's memory kind."""
    return jax.tree.map(allocate, self.abstract(spec), is_leaf=is_array_info)

  @abc.abstractmethod
  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    """Store a prompt for one layer; returns the state."""

  @abc.abstractmethod
  def step(self, state, layer, q, k, v, ctx: StepContext):
    """Store what the method keeps of the new rows and attend; returns (out [B, H, T, g, D], state)."""

  def chunk_multiple(self) -> int:
    return self.capacity_multiple()

  def extend(self, state, layer, q, k, v, ctx: StepContext):
    """Attend one prompt chunk over the held tokens and itself, then store it; returns (out [B, H, T, g, D], state)
    (module docstring)."""
    if self.store_spares_held_rows():
      state = self.store_chunk(state, layer, q, k, v, ctx)
      held = self.held_rows(state, layer, ctx.lengths)
      return chunk_attention(q, k, v, ctx.positions, held, impl=ctx.impl), state
    held = self.held_rows(state, layer, ctx.lengths)
    out = chunk_attention(q, k, v, ctx.positions, held, impl=ctx.impl)
    return out, self.store_chunk(state, layer, q, k, v, ctx)

  def store_spares_held_rows(self) -> bool:
    """True where storing a chunk leaves what ``held_rows`` gives for the tokens held before it unchanged (the store
    writes only rows past them): ``extend`` then stores first and reads the held rows from the stored state. Read
    first, nothing orders the in-place write after the read of the same arrays, and XLA keeps the read's operand by
    copying each whole [L, ...] array, every layer of every chunk (in host memory for SpeCache's exact copy)."""
    return False

  def held_rows(self, state, layer, lengths) -> HeldRows:
    """Every token held at ``layer`` with ``lengths`` [B] tokens stored, as 16-bit rows (module docstring)."""
    raise NotImplementedError(f"cache method {self.name!r} has no chunked prefill (held_rows)")

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    """Store one prompt chunk's rows after the held ones; returns the state (module docstring)."""
    raise NotImplementedError(f"cache method {self.name!r} has no chunked prefill (store_chunk)")

  def attend(self, state, layer, q, ctx: StepContext):
    """q [B, H, T, g, D] over the held tokens, nothing stored: row t sees slots s <= ctx.positions[b, t] (all the
    slots of a row whose position is past the capacity, none of one at a negative position); ctx.lengths [B]
    counts the tokens held (negative or past the capacity where the state's range lies after or before them).
    Returns (o [B, H, T, g, D] in q.dtype, lse [B, H, T, g] float32: MASK_VALUE and o = 0
    for a row that sees no slot). Context parallelism's per-device decode attention (``jkv.context_parallel``)."""
    raise NotImplementedError(f"cache method {self.name!r} cannot split a sequence over devices (attend)")

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    """Store T rows k, v [B, H, T, D] (a decode step's or a prompt chunk's; q [B, H, T, g, D]) at slots
    ctx.lengths + [0, T), where ctx.lengths [B] may be negative or past the capacity: rows whose slots lie outside
    [0, capacity) are dropped, and a sequence with none inside keeps its state (another device holds those
    tokens: ``jkv.context_parallel``). Returns the state."""
    raise NotImplementedError(f"cache method {self.name!r} cannot split a sequence over devices (store_span)")

  def attended(self, state, layer, q, lse, ctx: StepContext):
    """After a decode step's rows q [B, H, T, g, D] attended (``store_span``, then ``attend`` on every device of
    ``seq``): the state updated from their log-sum-exp lse [B, H, T, g] float32 over every device's held rows, the
    same on each (``jkv.context_parallel``); ctx as in ``attend``. Default: the state unchanged."""
    del layer, q, lse, ctx
    return state

  def step_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    """``step`` of a state that holds one range of each sequence's slots, on one device of ``seq`` (ctx as in
    ``attend``): merge(o, lse) -> (o float32, lse), the exact merge of every device's partial (o [B, H, T, g, D],
    lse [B, H, T, g] float32), the same on each. Returns (out [B, H, T, g, D] in q.dtype, state). The default stores
    the rows (``store_span``), attends, merges and updates the state from the merged log-sum-exp (``attended``)."""
    state = self.store_span(state, layer, q, k, v, ctx)
    held = ctx.replace(lengths=ctx.lengths + q.shape[2])
    o, lse = merge(*self.attend(state, layer, q, held))
    return o.astype(q.dtype), self.attended(state, layer, q, lse, held)

  def pre_decode_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    """``pre_decode`` of a state that holds one range of each sequence's slots (ctx and merge as in ``step_span``)."""
    raise NotImplementedError(f"cache method {self.name!r} has no pre-decode pass over a sequence split over devices")

  def held_span(self, state, layer, ctx: StepContext) -> HeldRows:
    """``held_rows`` of a state that holds one range of each sequence's slots (``jkv.context_parallel``): rows of
    the tokens its slots hold, ctx.lengths [B] counted from its first slot as in ``attend``. The default suits a
    method whose held rows are its slots, the first ``count`` of them held (dense)."""
    held = self.held_rows(state, layer, jnp.maximum(ctx.lengths, 0))
    return held._replace(count=jnp.minimum(held.count, held.k.shape[2]))

  def splits_tokens(self) -> bool:
    """Whether the method provides ``store_span`` and ``attend`` (or a ``step_span`` of its own): a mesh's ``seq``
    axis may split its tokens."""
    steps = type(self).attend is not CacheMethod.attend or type(self).step_span is not CacheMethod.step_span
    return steps and type(self).store_span is not CacheMethod.store_span

  speculative_rows: ClassVar[int] = 0

  def advance(self, lengths, rows: int):
    return lengths + rows

  def pre_decode(self, state, layer, q, k, v, ctx: StepContext):
    """Attend one unstored row before the first step; returns (out [B, H, 1, g, D], state). Only methods with
    ``speculative_rows`` > 0 are asked."""
    raise NotImplementedError(f"cache method {self.name!r} carries no speculative rows and has no pre-decode pass")

  def end_step(self, state, ctx: StepContext):
    """Once per decode step, after every layer's ``step``; returns the state (module docstring)."""
    del ctx
    return state

  def decode_stats(self, state) -> dict:
    """Statistics gathered while decoding, as Python numbers (module docstring)."""
    return {}

  @abc.abstractmethod
  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    """Bytes held for these lengths (codes, scales, full-precision parts, pools, counters)."""


def allocate(info: ArrayInfo, sharding: Optional[jax.sharding.Sharding] = None):
  """Zeros for one state array in its memory kind, placed by ``sharding`` (default: the first device; a device
  array with no sharding stays uncommitted); a sharded device array is made shard by shard on its devices.

  A host-resident array is made from host zeros: ``jnp.zeros`` placed in host memory (by ``device_put`` or a jitted
  function's out_shardings) is made whole on the device first, a transient the size of the host copy (8 GiB of
  device memory for an 8 GiB ``pinned_host`` array on an H100; SpeCache's 32 GiB host copy at B = 8, 32k did not fit
  beside the weights). Inside a jitted function (a prefill sub-batch's empty state) the zeros are traced and
  ``device_put`` gives them their memory kind; there a GPU's XLA makes zeros moved to host an allocation it does not
  fill (AllocateBuffer: ``benchmarks/host_zeros_in_jit.py`` on an H100), so such an array's elements are undefined
  until written, and no method's output may depend on one it has not written (tests/test_specache.py holds
  SpeCache's with NaN there).
  """
  if sharding is None and info.memory_kind != "device":
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=info.memory_kind)
  if _tracing():
    zeros = jnp.zeros(info.shape, info.dtype)
    return zeros if sharding is None else jax.device_put(zeros, sharding)
  if info.memory_kind == "device":
    if sharding is None:
      return jnp.zeros(info.shape, info.dtype)
    return _sharded_zeros(tuple(info.shape), jnp.dtype(info.dtype), sharding)()
  # From numpy, not make_array_from_callback: its arrays do not carry the host memory space into jit.
  return jax.device_put(np.zeros(info.shape, info.dtype), sharding)


@functools.lru_cache(maxsize=256)
def _sharded_zeros(shape: tuple, dtype, sharding: jax.sharding.Sharding):
  """A jitted zeros whose output is made shard by shard on its devices; one per (shape, dtype, sharding), so a
  cache of the same shapes is not compiled again (a new function each time was: 0.3-0.6 s per cache on 4 CPU
  devices)."""
  return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def _tracing() -> bool:
  """Whether this runs under a jax transformation (jit), where arrays are traced, not made."""
  return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)


def abstract_bytes(abstract) -> HeldBytes:
  """Bytes of every array a state description allocates, device and host apart."""
  infos = jax.tree.leaves(abstract, is_leaf=is_array_info)
  device = sum(i.nbytes for i in infos if i.memory_kind == "device")
  return HeldBytes(device=device, host=sum(i.nbytes for i in infos) - device)


def dense_kv_bytes(spec: CacheSpec, lengths: np.ndarray) -> int:
  """Bytes of an uncompressed cache of these lengths in the model dtype (the baseline every method is held to)."""
  per_token = 2 * spec.num_layers * spec.kv_heads * spec.head_dim * jnp.dtype(spec.dtype).itemsize
  return int(per_token * int(np.sum(lengths)))


@struct.dataclass
class KVCache:
  """What the model carries between calls: the method and attention implementation (static), the method's
  state and per-sequence lengths."""

  method: CacheMethod = struct.field(pytree_node=False)
  spec: CacheSpec = struct.field(pytree_node=False)
  impl: str = struct.field(pytree_node=False)
  state: Any
  lengths: jax.Array  # [B] int32 tokens held per sequence

  @classmethod
  def create(cls, method: CacheMethod, spec: CacheSpec, impl: str = "xla") -> "KVCache":
    if impl not in IMPLS:
      raise ValueError(f"unknown attention implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    method = method.for_impl(spec, impl)
    method.check(spec)
    return cls(method=method, spec=spec, impl=impl, state=method.init(spec),
               lengths=jnp.zeros((spec.batch,), jnp.int32))

  def abstract(self):
    return self.method.abstract(self.spec)

  def allocated_bytes(self) -> HeldBytes:
    """Bytes of every buffer as allocated (capacity, not occupancy), plus the lengths."""
    return abstract_bytes(self.abstract()) + HeldBytes(device=self.lengths.nbytes)

  def held_bytes(self, lengths: Optional[np.ndarray] = None) -> HeldBytes:
    lengths = np.asarray(self.lengths if lengths is None else lengths)
    return self.method.held_bytes(self.spec, self.state, lengths)

  def put_rows(self, start, part: "KVCache") -> "KVCache":
    """This cache with sequences [start, start + part.batch) replaced by ``part`` (in place under donation)."""
    def put(x, y, info):
      axis = info.axes.index("batch")
      return jax.lax.dynamic_update_slice_in_dim(x, y, start, axis)
    state = jax.tree.map(put, self.state, part.state, self.abstract(), is_leaf=is_array_info)
    return self.replace(state=state, lengths=jax.lax.dynamic_update_slice_in_dim(self.lengths, part.lengths, start, 0))
