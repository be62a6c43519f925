"""Context parallelism: one sequence's cache split by tokens over the devices of a mesh's ``seq`` axis.

Device i of ``seq`` (n devices) holds slots [i C/n, (i + 1) C/n) of every sequence's C token slots, as the method
holds a cache of that many tokens: its state's ``tokens`` axis is split over ``seq`` (``ShardingRules.tokens``), so
each device allocates C/n slots, and ``SeqShard`` runs every cache call per shard through ``shard_map`` in the
shard's own frame (lengths and positions less the range's first slot).

- A row is stored by the device whose range holds its position: the method's ``store_span`` drops rows outside
  its slots, so a decode row goes to one device and a prompt chunk that straddles two ranges to both, and the
  others' state is not touched (no copy of the cache moves between devices).
- Decode: every device attends the new rows over the slots it holds (``attend``: partial o and its log-sum-exp in
  fp32), and the partials merge exactly, max-shifted by their log-sum-exps (``jkv.attention.merge_partials``),
  after one all-gather over ``seq`` per layer of o [B, H, T, g, D] and lse [B, H, T, g].
- Prefill: each device computes the prompt's attention for the rows of its range, over every key before them and
  causally over its own (``prompt_attention_by_ranges``; where n does not divide the prompt, and off cuDNN's path,
  every device all of it), and stores the rows its range holds. A prompt chunk (``extend``, chunked prefill)
  attends every device's held rows, merged the same way (``chunk_attention``'s ``merge_held``), and then itself,
  causally and exactly.

Every call gets ctx in the frame of the device's state (lengths and positions less its first slot, which
``ctx.first_slot`` gives, so a method can count a position the whole sequence's way) and a chunk reads the
device's held rows through ``held_span``; a method whose other token axes are split too finds its range's start
with ``range_start``. A step's state is updated from the merged log-sum-exp by ``attended`` (default: unchanged).

A range is a whole number of the method's ``range_multiple`` slots. Methods opt in by providing ``store_span`` and
``attend`` or a ``step_span`` of their own (``CacheMethod.splits_tokens``): dense, whose slots are its tokens; KIVI,
whose quantized store (either layout) is split by ranges (a range is whole key blocks and tiles, so a flush writes
one device's store) while its residual rings, a sequence's newest tokens wherever they fall, are held by every
device alike and attended by the first range's (``Kivi.attend``); fakequant, whose groups a range holds whole; and
OTT, whose store (either layout) and hole mask are split as KIVI's store (a range is whole tiles of 64 slots, to
which its store rounds, so a block event writes one device's store) while its buffer and outlier pools are held by
every device alike: each device runs every block's competition on the rows it holds of the buffer or the prompt, so
the pools are one device's, and the first range's device attends them (``Ott.attend``); and ZipCache (either
layout), whose two pools are not laid out by position (each prompt, chunk and window appends its rows in saliency's
split), so their rows are split into ranges as the slots are (``CacheSpec.ranges`` sizes them to n ranges of whole
key groups) while its window, scores and channel scale are held by every device alike: every device scores and
splits every prompt, chunk and window alike and writes the pool rows of its range, so the pools are one device's;
the first range's device attends the window, and after a step's merge each device weighs the window by the step's
probabilities from the merged log-sum-exp (``CacheMethod.attended``); and SpeCache (every setting; either layout),
whose low-bit copy is a KIVI cache split as KIVI's and whose host copy is split by range (each device writes and
reads only its range's rows), while the fetched positions are the same on every device: each makes holes of and
attends those its range holds, the first range's device the window less all of them. Its step needs more than the
merged log-sum-exp, so it runs its own ``step_span`` and ``pre_decode_span`` per device, given the merge
(``CacheMethod``; the default ``step_span`` is ``store_span``, ``attend``, the merge and ``attended``): each device
weighs its per-head token mass by the merged probabilities and takes its top k, and the top k of every device's
(``top_k_across_seq``, one all-gather over ``seq``) is the selection, the same on every device; its non-speculative
baseline and its repair attend twice, each pass merged, the first selecting as a speculative step does. A mesh with
``seq`` > 1 and any other method is refused up front (``check``).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jkv.attention import merge_partials, normalized_partial
from jkv.cache import CacheMethod, CacheSpec, StepContext
from jkv.chunk_attention import HeldRows, chunk_attention
from jkv.sharding import SEQ_AXIS, P, PerShard, axis_size, mesh_label, shard_map
from jkv_kernels.attention_reference import MASK_VALUE


def seq_devices(mesh) -> int:
  """Devices one sequence's tokens are split over (the mesh's ``seq`` axis; 1 without one)."""
  return axis_size(mesh, SEQ_AXIS)


def check(method: CacheMethod, mesh) -> None:
  """One-line ValueError where the mesh splits tokens over ``seq`` and the method cannot be split so."""
  if seq_devices(mesh) == 1:
    return
  if not method.splits_tokens():
    raise ValueError(f"cache method {method.name!r} cannot split a sequence's tokens over devices (mesh "
                     f"{mesh_label(mesh)}); on a seq axis dense, kivi, fakequant, ott, zipcache "
                     "and specache run: use data and model axes for it")


def split_capacity(capacity: int, method: CacheMethod, mesh, requested=None) -> int:
  """``capacity`` rounded up so that it splits into ``seq`` equal ranges of whole ``range_multiple``s (and stays
  a whole number of ``chunk_multiple``s); a ``requested`` capacity that ``seq`` does not divide is a one-line
  ValueError."""
  n = seq_devices(mesh)
  if n == 1:
    return capacity
  if requested is not None and requested % n:
    raise ValueError(f"capacity {requested} does not split over seq={n} (give a multiple of {n})")
  multiple = math.lcm(n * method.range_multiple(), method.chunk_multiple())
  return -(-capacity // multiple) * multiple


def range_start(size: int):
  """Inside ``SeqShard``'s calls: the first index of this device's range of an axis split over ``seq`` into ranges of
  ``size`` entries (int32 scalar)."""
  return jax.lax.axis_index(SEQ_AXIS) * size


def prompt_attention_by_ranges(q, k, v, positions, mesh, *, impl: str):
  """A whole prompt's causal attention over the mesh's ``seq`` axis (n devices), split by rows: device i computes
  the rows of its range [i T/n, (i + 1) T/n), over every key before the range (``chunk_attention``'s held rows:
  the whole k and v, of which the first i T/n count) and causally over its own, where the alternative is every
  device computing every row. Device i does (2i + 1) / n^2 of the whole work, so the last one's (2n - 1) / n^2
  bounds the call: 3/4 on seq=2, 7/16 on seq=4.

  q [B, H, T, g, D], k and v [B, H, T, D] (post-RoPE, whole on every device of ``seq``), positions [B, T] int32
  (-1 for padding, which follows a prompt's tokens: a real row's earlier keys are all real); n divides T, the data
  axis B and the model axis H. ``impl`` as ``chunk_attention``'s. Returns [B, H, T, g, D] in q.dtype, its rows split
  over ``seq`` (padding rows unspecified)."""
  rows = q.shape[2] // axis_size(mesh, SEQ_AXIS)

  def per_device(q, k, v, positions):
    start = range_start(rows)
    own = lambda x: jax.lax.dynamic_slice_in_dim(x, start, rows, axis=2)
    held = HeldRows(k, v, jnp.full(q.shape[:1], start, jnp.int32))
    return chunk_attention(q, own(k), own(v), positions, held, impl=impl)

  by_rows, whole = P("data", "model", SEQ_AXIS), P("data", "model")
  run = shard_map(per_device, mesh=mesh, in_specs=(by_rows, whole, whole, P("data", SEQ_AXIS)), out_specs=by_rows)
  return run(q, k, v, positions)


def top_k_across_seq(values, positions, k: int):
  """The k largest of every ``seq`` device's values [..., m] float32 (inside ``shard_map``) and their positions
  [..., m] int32, after one all-gather over ``seq``: (values, positions) [..., k], the same on every device, and the
  number of devices."""
  every = jax.lax.all_gather((values, positions), SEQ_AXIS)  # [n, ..., m] each
  n = every[0].shape[0]
  values, positions = (jnp.moveaxis(x, 0, -2).reshape(x.shape[1:-1] + (-1,)) for x in every)
  best, j = jax.lax.top_k(values, k)
  return best, jnp.take_along_axis(positions, j, axis=-1), n


def merge_across_seq(o, lse, seen=None):
  """The exact merge of every ``seq`` device's attention partial (inside ``shard_map``): o [B, ..., D] normalized,
  lse [B, ...] float32 (MASK_VALUE for a row that saw nothing, whose o is then 0), both over the device's own rows.
  ``seen`` [B]: whether the device held any row of each sequence (a partial of none is dropped whatever a kernel
  wrote for it). Returns (o float32, lse), the same on every device of ``seq``."""
  o = o.astype(jnp.float32)
  if seen is not None:
    seen = seen.reshape(seen.shape + (1,) * (lse.ndim - 1))
    o, lse = jnp.where(seen[..., None], o, 0.0), jnp.where(seen, lse, MASK_VALUE)
  every_o, every_lse = jax.lax.all_gather((o, lse), SEQ_AXIS)
  return merge_partials([normalized_partial(every_o[i], every_lse[i]) for i in range(every_o.shape[0])])


@dataclasses.dataclass(frozen=True)
class SeqShard(PerShard):
  """``PerShard`` on a mesh with a ``seq`` axis: each device holds a contiguous range of every sequence's token slots
  (module docstring), besides its share of the sequences (``data``) and KV heads (``model``)."""

  def check(self, spec: CacheSpec) -> None:
    check(self.inner, self.mesh)
    super().check(spec)
    n = seq_devices(self.mesh)
    if spec.capacity % (n * self.inner.range_multiple()):
      raise ValueError(f"a cache of {spec.capacity} tokens does not split over seq={n} into whole blocks of "
                       f"{self.inner.range_multiple()} (method {self.inner.name!r})")

  def abstract(self, spec: CacheSpec):
    return self.inner.abstract(dataclasses.replace(spec, ranges=seq_devices(self.mesh)))

  @property
  def _range(self) -> int:
    """Token slots of each device."""
    return self.spec.capacity // seq_devices(self.mesh)

  # The bodies below run per shard (inside shard_map), on the device's own slots.

  def _first_slot(self):
    return range_start(self._range)

  def _local(self, ctx: StepContext) -> StepContext:
    """ctx in the frame of this device's state: lengths and positions counted from its range's first slot."""
    first = self._first_slot()
    return ctx.replace(lengths=ctx.lengths - first, positions=ctx.positions - first, first_slot=first)

  def _store(self, state, layer, q, k, v, ctx: StepContext):
    """Rows at global slots ctx.lengths + [0, T), those of this device's range stored."""
    return self.inner.store_span(state, layer, q, k, v, self._local(ctx))

  def _step(self, state, layer, q, k, v, ctx: StepContext):
    return self.inner.step_span(state, layer, q, k, v, self._local(ctx), merge_across_seq)

  def _pre_decode(self, state, layer, q, k, v, ctx: StepContext):
    return self.inner.pre_decode_span(state, layer, q, k, v, self._local(ctx), merge_across_seq)

  def _extend(self, state, layer, q, k, v, ctx: StepContext):
    store_first = self.inner.store_spares_held_rows()  # (CacheMethod.extend's order)
    if store_first:
      state = self._store(state, layer, q, k, v, ctx)
    held = self.inner.held_span(state, layer, self._local(ctx))
    out = chunk_attention(q, k, v, ctx.positions, held, impl=ctx.impl,
                          merge_held=functools.partial(merge_across_seq, seen=held.count > 0))
    if not store_first:
      state = self._store(state, layer, q, k, v, ctx)
    return out, state

  # Cache calls.

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    at_zero = ctx.replace(lengths=jnp.zeros_like(ctx.lengths))  # the prompt's rows at slots [0, T)
    return self._layer_call(self._store, state, layer, q, k, v, at_zero, returns_out=False)

  def step(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self._step, state, layer, q, k, v, ctx, returns_out=True)

  def extend(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self._extend, state, layer, q, k, v, ctx, returns_out=True)

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self._store, state, layer, q, k, v, ctx, returns_out=False)

  def pre_decode(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self._pre_decode, state, layer, q, k, v, ctx, returns_out=True)

  def end_step(self, state, ctx: StepContext):
    end_step = lambda state, ctx: self.inner.end_step(state, self._local(ctx))
    return self._per_shard(end_step, (state,), (self._specs(),), self._specs(), ctx)

  def _per_device_only(self, call: str):
    raise NotImplementedError(f"{call} of a cache split over {SEQ_AXIS} runs per device, inside SeqShard's calls")

  def held_rows(self, state, layer, lengths):
    self._per_device_only("held_rows")

  def held_span(self, state, layer, ctx: StepContext):
    self._per_device_only("held_span")

  def attend(self, state, layer, q, ctx: StepContext):
    self._per_device_only("attend")

  def attended(self, state, layer, q, lse, ctx: StepContext):
    self._per_device_only("attended")

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    self._per_device_only("store_span")

  def step_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    self._per_device_only("step_span")

  def pre_decode_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    self._per_device_only("pre_decode_span")
