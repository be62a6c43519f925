"""Running on a device mesh: JAX's own SPMD (a ``Mesh`` with named axes, ``NamedSharding``, ``shard_map``).

The mesh has two axes, ``data`` (sequences of the batch) and ``model`` (tensor parallelism), and a third, ``seq``,
where one sequence's tokens are split over devices (context parallelism: ``jkv.context_parallel``). Every array is
placed by the logical names of its axes (``ShardingRules``: ``batch`` -> data; ``q_heads``, ``kv_heads`` and
``ffw`` -> model; a cache's ``tokens`` -> seq; the rest whole), as jax-llm-examples do:

- parameters: attention tensor-parallel over heads (q, k, v over their heads, o over its input heads), the MLP
  over its hidden size, the embedding and LM head over the vocabulary where it divides; norms replicated;
- every cache array over its ``batch`` and ``kv_heads`` axes, from the method's own ``abstract`` description
  (codes, scales, pools, rings, counters, host-resident copies alike), its memory kind kept, so a
  ``pinned_host`` array is sharded in host memory.

``create_cache`` wraps the method in ``PerShard``: every cache call the model makes (prefill, pre-decode, step)
runs through ``shard_map`` on each device's own sequences and KV heads. A (sequence, KV head) pair is what every
method's arithmetic is independent over, so the method's code, its Pallas kernels (quantize-pack, the fused
dequant-attention, SpeCache's host gather) and its state updates run unchanged on local shapes, and no cache
array is ever gathered. Everything outside the cache (projections, MLP, logits, sampling) is left to jit's
partitioner, steered by the parameter and cache shardings.

Multi-host: ``initialize_distributed`` starts ``jax.distributed`` (one process per host, or several processes on
one machine); the mesh then spans every process's devices and each process runs the same program.
"""

import contextlib
import dataclasses
import functools
from typing import Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jkv.cache import CacheMethod, CacheSpec, HeldBytes, KVCache, StepContext, allocate, is_array_info
from jkv.chunk_attention import HeldRows
from jkv.config import ModelConfig
from jkv.params import Layers, Params
from jkv.params import abstract as param_shapes

MESH_AXES = ("data", "model")  # the axes of every mesh
SEQ_AXIS = "seq"  # context parallelism (jkv.context_parallel): a mesh has it only where its size is > 1
AXES = MESH_AXES + (SEQ_AXIS,)  # every axis a mesh spec may name, in the device grid's order


# ------------------------------------------------------------------------------------------------- compatibility
# One place for the APIs that moved between the jax versions jkv runs on (0.10 on CPU CI, 0.11 on the GPU
# machine, 0.12 on Colab).

def shard_map(f, *, mesh, in_specs, out_specs):
  """``jax.shard_map`` without the replication check: a ``pallas_call`` carries no varying-axes types, and every
  spec here is written from the arrays' logical axes anyway."""
  if hasattr(jax, "shard_map"):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  from jax.experimental.shard_map import shard_map as legacy  # jax < 0.7
  return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def use_mesh(mesh: Optional[Mesh]):
  """Context in which ``mesh`` is jax's current mesh (jit traces see it; arrays created eagerly land replicated
  on it); a no-op for None."""
  if mesh is None:
    return contextlib.nullcontext()
  if hasattr(jax, "set_mesh"):
    return jax.set_mesh(mesh)
  return jax.sharding.use_mesh(mesh)


def current_mesh():
  """The mesh of the enclosing ``use_mesh`` as jit sees it while tracing, or None: none set, or a trivial one of
  one device, or inside a ``shard_map`` body (its axes are manual: the code there already runs per shard)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or not mesh.axis_names or mesh.size == 1:
    return None
  manual = getattr(jax.sharding.AxisType, "Manual", None)
  if manual is not None and any(t == manual for t in getattr(mesh, "axis_types", ())):
    return None
  return mesh


# ------------------------------------------------------------------------------------------------- the mesh

def parse_mesh(text: str) -> dict:
  """``"data=2,model=4"`` -> {"data": 2, "model": 4}; an axis left out has size 1 (``seq`` is listed only where it
  is > 1: ``"seq=4"`` -> {"data": 1, "model": 1, "seq": 4}). One-line ValueErrors name the problem (syntax,
  unknown or repeated axis, a size that is not a positive integer)."""
  sizes = {}
  items = [item.strip() for item in str(text).split(",")]
  if not any(items):
    raise ValueError(f"empty mesh spec; write it as data=N,model=M (axes: {', '.join(AXES)})")
  for item in items:
    name, eq, value = item.partition("=")
    name = name.strip()
    if not eq or not name:
      raise ValueError(f"mesh spec {text!r}: expected axis=size, got {item!r} (e.g. data=2,model=4)")
    if name not in AXES:
      raise ValueError(f"mesh spec {text!r}: unknown axis {name!r}; the axes are {', '.join(AXES)}")
    if name in sizes:
      raise ValueError(f"mesh spec {text!r}: axis {name!r} is given twice")
    try:
      size = int(value.strip())
    except ValueError:
      raise ValueError(f"mesh spec {text!r}: size of {name!r} must be an integer, got {value.strip()!r}") from None
    if size < 1:
      raise ValueError(f"mesh spec {text!r}: size of {name!r} must be >= 1, got {size}")
    sizes[name] = size
  return _mesh_sizes(sizes)


def _mesh_sizes(sizes: Mapping[str, int]) -> dict:
  """Every axis of ``MESH_AXES`` (size 1 where left out), then ``seq`` where it is > 1."""
  sizes = dict(sizes)
  out = {axis: sizes.get(axis, 1) for axis in MESH_AXES}
  if sizes.get(SEQ_AXIS, 1) != 1:
    out[SEQ_AXIS] = sizes[SEQ_AXIS]
  return out


def mesh_label(mesh: Optional[Mesh]) -> str:
  """``data=2,model=4`` (None without a mesh)."""
  if mesh is None:
    return None
  return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def make_mesh(shape: Union[str, Mapping[str, int], Mesh, None], devices: Optional[Sequence] = None) -> Optional[Mesh]:
  """A (data, model) mesh over ``devices`` (default: every device jax sees, across all processes), with a third
  axis ``seq`` where its size is > 1 (one sequence's tokens split over devices: ``jkv.context_parallel``).

  ``shape`` is a spec string (``"data=2,model=4"``), a dict of axis sizes, a ready ``Mesh`` (returned as it is)
  or None (no mesh). The sizes must multiply to the number of devices: a mesh over fewer devices is made by
  passing them (``devices=jax.devices()[:2]``), or by hiding the others (``CUDA_VISIBLE_DEVICES``).
  """
  if shape is None or isinstance(shape, Mesh):
    return shape
  sizes = parse_mesh(shape) if isinstance(shape, str) else dict(shape)
  unknown = sorted(set(sizes) - set(AXES))
  if unknown:
    raise ValueError(f"unknown mesh axis {unknown[0]!r}; the axes are {', '.join(AXES)}")
  sizes = {axis: int(size) for axis, size in _mesh_sizes(sizes).items()}
  if min(sizes.values()) < 1:
    raise ValueError(f"mesh axis sizes must be >= 1, got {sizes}")
  devices = list(jax.devices() if devices is None else devices)
  need = int(np.prod(list(sizes.values())))
  label = ",".join(f"{a}={s}" for a, s in sizes.items())
  if need != len(devices):
    platform = devices[0].platform if devices else "?"
    if platform == "cpu":
      hint = f"; XLA_FLAGS=--xla_force_host_platform_device_count={need} makes {need} CPU devices"
    else:
      hint = "; hide the others with CUDA_VISIBLE_DEVICES" if need < len(devices) else ""
    raise ValueError(f"mesh {label} needs {need} devices ({' x '.join(sizes)}), but {len(devices)} {platform} "
                     f"device{'s are' if len(devices) != 1 else ' is'} visible{hint}")
  grid = np.asarray(devices, dtype=object).reshape(list(sizes.values()))
  return Mesh(grid, tuple(sizes))


def axis_size(mesh: Optional[Mesh], axis: str) -> int:
  return 1 if mesh is None or axis not in mesh.shape else int(mesh.shape[axis])


def check_mesh(mesh: Optional[Mesh], cfg: ModelConfig, batch: Optional[int] = None) -> None:
  """One-line ValueError unless the model's heads split over ``model`` and the batch over ``data``."""
  if mesh is None:
    return
  _check_split(mesh, cfg.kv_heads, cfg.q_heads, batch)


def _check_split(mesh, kv_heads: int, q_heads: int, batch: Optional[int]) -> None:
  m, d = axis_size(mesh, "model"), axis_size(mesh, "data")
  # Query heads are g per KV head, grouped by KV head: they split with the KV heads (q_heads = g * kv_heads).
  if kv_heads % m:
    raise ValueError(f"mesh {mesh_label(mesh)}: the model's {kv_heads} KV heads ({q_heads} query heads) do not "
                     f"split over model={m} (the model axis must divide the KV-head count)")
  if batch is not None and batch % d:
    raise ValueError(f"mesh {mesh_label(mesh)}: a batch of {batch} sequences does not split over data={d} "
                     f"(give a multiple of {d})")


# ------------------------------------------------------------------------------------------------- rules

@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis name -> mesh axis (None: not sharded). Names not listed are not sharded."""

  batch: Optional[str] = "data"
  kv_heads: Optional[str] = "model"
  q_heads: Optional[str] = "model"
  ffw: Optional[str] = "model"
  vocab: Optional[str] = "model"
  tokens: Optional[str] = SEQ_AXIS  # a cache's token slots: contiguous ranges of every sequence, one per device
  token_groups: Optional[str] = SEQ_AXIS  # groups of a cache's token slots (KIVI's key groups), split as the slots
  tiles: Optional[str] = SEQ_AXIS  # tiles of a cache's token slots (the MMA packing), split as the slots

  def mesh_axis(self, name: str) -> Optional[str]:
    return getattr(self, name, None) if name in _RULE_NAMES else None


_RULE_NAMES = frozenset(f.name for f in dataclasses.fields(ShardingRules))
DEFAULT_RULES = ShardingRules()


def logical_to_spec(axes: Sequence[str], mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, shape=None,
                    strict: bool = True) -> P:
  """The PartitionSpec of an array whose dimensions are named ``axes``.

  A mesh axis may shard one dimension only (two would be a collision: a ValueError). With ``shape``, a dimension
  that the mesh axis does not divide is an error when ``strict``, or stays whole otherwise (parameters such as a
  vocabulary of odd size)."""
  used, spec = {}, []
  for i, name in enumerate(axes):
    axis = rules.mesh_axis(name)
    if axis is None or axis not in mesh.shape or mesh.shape[axis] == 1:
      spec.append(None)
      continue
    if axis in used:
      raise ValueError(f"logical axes {tuple(axes)}: {used[axis]!r} and {name!r} both map to mesh axis {axis!r}")
    if shape is not None and shape[i] % mesh.shape[axis]:
      if strict:
        raise ValueError(f"axis {name!r} of size {shape[i]} does not split over {axis}={mesh.shape[axis]}")
      spec.append(None)
      continue
    used[axis] = name
    spec.append(axis)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def state_specs(abstract, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """The PartitionSpec of every array of a state description (``CacheMethod.abstract``), in its tree."""
  return jax.tree.map(lambda i: logical_to_spec(i.axes, mesh, rules, i.shape), abstract, is_leaf=is_array_info)


def state_shardings(abstract, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """A ``NamedSharding`` for every array of a state description, in its memory kind (``pinned_host`` arrays are
  sharded in host memory)."""
  return jax.tree.map(lambda i: NamedSharding(mesh, logical_to_spec(i.axes, mesh, rules, i.shape),
                                              memory_kind=i.memory_kind), abstract, is_leaf=is_array_info)


def local_bytes(abstract, mesh: Optional[Mesh], rules: ShardingRules = DEFAULT_RULES) -> HeldBytes:
  """Bytes one device holds of a state description: each array divided by the mesh axes that shard it. A size
  they do not divide counts its largest part (the memory plans search capacities one block apart, which a ``seq``
  axis need not divide; ``generate`` rounds the capacity it allocates to one it does)."""
  device = host = 0
  for info in jax.tree.leaves(abstract, is_leaf=is_array_info):
    n = info.nbytes
    if mesh is not None:
      spec = tuple(logical_to_spec(info.axes, mesh, rules)) + (None,) * len(info.shape)
      shard = [-(-size // (1 if axis is None else mesh.shape[axis])) for size, axis in zip(info.shape, spec)]
      n = int(np.prod(shard, dtype=np.int64)) * jax.numpy.dtype(info.dtype).itemsize
    if info.memory_kind == "device":
      device += n
    else:
      host += n
  return HeldBytes(device=device, host=host)


# ------------------------------------------------------------------------------------------------- parameters

def param_axes(cfg: ModelConfig) -> Params:
  """The logical axis names of every parameter, in the parameter tree (``jkv.params.abstract``'s shapes)."""
  per_layer = lambda *names: ("layers",) + names
  return Params(
      embedding=("vocab", "embed"),
      layers=Layers(
          attn_norm=per_layer("embed"),
          qkv=per_layer("embed", "kv_heads", "qkv", "head_dim"),  # a KV head's queries, key and value together
          o=per_layer("q_heads", "head_dim", "embed"),
          qkv_bias=per_layer("kv_heads", "qkv", "head_dim") if cfg.qkv_bias else None,
          mlp_norm=per_layer("embed"),
          gate_up=per_layer("embed", "gate_up", "ffw"),
          w_down=per_layer("ffw", "embed"),
      ),
      final_norm=("embed",),
      lm_head=None if cfg.tie_embeddings else ("embed", "vocab"),
  )


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Params:
  """A ``NamedSharding`` per parameter: heads and the MLP hidden size over ``model`` (checked by ``check_mesh``),
  the vocabulary over ``model`` where it divides (else whole)."""
  check_mesh(mesh, cfg)
  shapes = param_shapes(cfg)
  return jax.tree.map(lambda axes, s: NamedSharding(mesh, logical_to_spec(axes, mesh, rules, s.shape, strict=False)),
                      param_axes(cfg), shapes, is_leaf=_is_axes)


def shard_params(params: Params, cfg: ModelConfig, mesh: Optional[Mesh], rules: ShardingRules = DEFAULT_RULES):
  """The parameters placed on the mesh (unchanged without one). Already placed arrays are not copied again."""
  if mesh is None:
    return params
  shardings = param_shardings(cfg, mesh, rules)
  return jax.tree.map(_place, params, shardings)


def param_bytes_per_device(cfg: ModelConfig, mesh: Optional[Mesh], rules: ShardingRules = DEFAULT_RULES) -> int:
  """Bytes of the parameters one device holds under ``param_shardings``."""
  shapes = param_shapes(cfg)
  if mesh is None:
    return int(sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes)))
  shardings = param_shardings(cfg, mesh, rules)
  return int(sum(int(np.prod(sh.shard_shape(s.shape))) * s.dtype.itemsize
                 for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings))))


def _place(x, sharding):
  if getattr(x, "sharding", None) == sharding:
    return x
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.jit(lambda a: a, out_shardings=sharding)(x)
  if jax.process_count() > 1:
    # Every process holds the same full value (each loaded the same checkpoint): each puts its own devices'
    # pieces, so no process needs the others' memory.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.device_put(x, sharding)


# ------------------------------------------------------------------------------------------------- the cache

@dataclasses.dataclass(frozen=True)
class PerShard(CacheMethod):
  """``inner`` run on a mesh: its state sharded by its logical axes, every cache call run per shard.

  Frozen and hashable (the mesh is), so it is static under jit like any method; the model reaches it through the
  cache interface alone. Settings, bytes and statistics are the inner method's.
  """

  inner: CacheMethod
  mesh: Mesh
  spec: CacheSpec  # the cache it was made for: only its state's axis names are used, the same at any batch size
  rules: ShardingRules = DEFAULT_RULES

  @property
  def name(self) -> str:
    return self.inner.name

  @property
  def speculative_rows(self) -> int:
    return self.inner.speculative_rows

  def check(self, spec: CacheSpec) -> None:
    self.inner.check(spec)
    _check_split(self.mesh, spec.kv_heads, spec.kv_heads * spec.q_per_kv, spec.batch)

  def settings(self) -> dict:
    return self.inner.settings()

  def for_impl(self, spec: CacheSpec, impl: str) -> "PerShard":
    return dataclasses.replace(self, inner=self.inner.for_impl(spec, impl))

  def capacity_multiple(self) -> int:
    return self.inner.capacity_multiple()

  def chunk_multiple(self) -> int:
    return self.inner.chunk_multiple()

  def range_multiple(self) -> int:
    return self.inner.range_multiple()

  def abstract(self, spec: CacheSpec):
    return self.inner.abstract(spec)

  def shardings(self, spec: CacheSpec):
    return state_shardings(self.abstract(spec), self.mesh, self.rules)

  def init(self, spec: CacheSpec):
    """Zeros made where they live: each device allocates its own shard (the whole cache may not fit on one)."""
    return jax.tree.map(allocate, self.abstract(spec), self.shardings(spec), is_leaf=is_array_info)

  # Cache calls: q [B, H, T, g, D] and k, v [B, H, T, D] split over (batch, KV heads), like the state; ctx's
  # lengths and positions over batch; the layer index whole.

  def _specs(self):
    return state_specs(self.abstract(self.spec), self.mesh, self.rules)

  def _heads(self, ndim: int) -> P:
    return P(*(self.rules.batch, self.rules.kv_heads) + (None,) * (ndim - 2))

  def _per_shard(self, fn, args, in_specs, out_specs, ctx: StepContext):
    """fn(*args, ctx) run per shard through ``shard_map``: args split by in_specs, ctx's lengths and positions over
    batch, the result joined by out_specs."""
    impl, rows = ctx.impl, P(self.rules.batch)

    def body(*shard_args):
      *shard_args, lengths, positions = shard_args
      return fn(*shard_args, StepContext(lengths=lengths, positions=positions, impl=impl))

    run = shard_map(body, mesh=self.mesh, in_specs=(*in_specs, rows, rows), out_specs=out_specs)
    return run(*args, ctx.lengths, ctx.positions)

  def _layer_call(self, fn, state, layer, q, k, v, ctx: StepContext, returns_out: bool):
    state_spec = self._specs()
    out_specs = (self._heads(q.ndim), state_spec) if returns_out else state_spec
    in_specs = (state_spec, P(), self._heads(q.ndim), self._heads(k.ndim), self._heads(v.ndim))
    return self._per_shard(fn, (state, layer, q, k, v), in_specs, out_specs, ctx)

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self.inner.prefill, state, layer, q, k, v, ctx, returns_out=False)

  def step(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self.inner.step, state, layer, q, k, v, ctx, returns_out=True)

  def extend(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self.inner.extend, state, layer, q, k, v, ctx, returns_out=True)

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self.inner.store_chunk, state, layer, q, k, v, ctx, returns_out=False)

  def store_spares_held_rows(self) -> bool:
    return self.inner.store_spares_held_rows()

  def attend(self, state, layer, q, ctx: StepContext):
    heads = self._heads(q.ndim)
    return self._per_shard(self.inner.attend, (state, layer, q), (self._specs(), P(), heads),
                           (heads, self._heads(q.ndim - 1)), ctx)

  def attended(self, state, layer, q, lse, ctx: StepContext):
    return self._per_shard(self.inner.attended, (state, layer, q, lse),
                           (self._specs(), P(), self._heads(q.ndim), self._heads(lse.ndim)), self._specs(), ctx)

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self.inner.store_span, state, layer, q, k, v, ctx, returns_out=False)

  def step_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    step_span = lambda *args: self.inner.step_span(*args, merge)
    return self._layer_call(step_span, state, layer, q, k, v, ctx, returns_out=True)

  def pre_decode_span(self, state, layer, q, k, v, ctx: StepContext, merge):
    pre_decode_span = lambda *args: self.inner.pre_decode_span(*args, merge)
    return self._layer_call(pre_decode_span, state, layer, q, k, v, ctx, returns_out=True)

  def splits_tokens(self) -> bool:
    return self.inner.splits_tokens()

  def held_rows(self, state, layer, lengths) -> HeldRows:
    heads, rows = self._heads(4), P(self.rules.batch)
    run = shard_map(lambda s, i, n: tuple(self.inner.held_rows(s, i, n)), mesh=self.mesh,
                    in_specs=(self._specs(), P(), rows), out_specs=(heads, heads, rows))
    return HeldRows(*run(state, layer, lengths))

  def held_span(self, state, layer, ctx: StepContext) -> HeldRows:
    heads = self._heads(4)
    return self._per_shard(self.inner.held_span, (state, layer), (self._specs(), P()),
                           HeldRows(heads, heads, P(self.rules.batch)), ctx)

  def pre_decode(self, state, layer, q, k, v, ctx: StepContext):
    return self._layer_call(self.inner.pre_decode, state, layer, q, k, v, ctx, returns_out=True)

  def end_step(self, state, ctx: StepContext):
    return self._per_shard(self.inner.end_step, (state,), (self._specs(),), self._specs(), ctx)

  def advance(self, lengths, rows: int):
    return self.inner.advance(lengths, rows)

  def decode_stats(self, state) -> dict:
    return self.inner.decode_stats(self._readable(state))

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    return self.inner.held_bytes(spec, self._readable(state), lengths)

  def _readable(self, state):
    """The state as the host reads it for statistics and byte counts: across processes, the per-sequence counters
    (axes within layers and batch) gathered to every process; the rest stays where it is, unread."""
    if state is None or jax.process_count() == 1:
      return state
    counters = lambda info, x: fetch(x) if set(info.axes) <= {"layers", "batch"} else x
    return jax.tree.map(counters, self.inner.abstract(self.spec), state, is_leaf=is_array_info)


def create_cache(method: CacheMethod, spec: CacheSpec, impl: str, mesh: Optional[Mesh],
                 rules: ShardingRules = DEFAULT_RULES) -> KVCache:
  """``KVCache.create`` on a mesh: the method wrapped in ``PerShard`` (``context_parallel.SeqShard`` on a mesh with
  a ``seq`` axis), every array allocated in its shards, the lengths split over ``data``. Without a mesh,
  ``KVCache.create`` itself."""
  if mesh is None:
    return KVCache.create(method, spec, impl)
  cache = KVCache.create(per_shard(method, mesh, spec, rules), spec, impl)
  return cache.replace(lengths=jax.device_put(cache.lengths, NamedSharding(mesh, P(rules.batch))))


def per_shard(method: CacheMethod, mesh: Mesh, spec: CacheSpec, rules: ShardingRules = DEFAULT_RULES) -> "PerShard":
  """``method`` wrapped to run per shard of ``mesh``: ``PerShard``, or ``context_parallel.SeqShard`` on a mesh
  with a ``seq`` axis."""
  from jkv.context_parallel import SeqShard  # here: it builds on PerShard
  return (SeqShard if axis_size(mesh, SEQ_AXIS) > 1 else PerShard)(method, mesh, spec, rules)


def under_mesh(fn):
  """Decorator: ``fn(..., mesh=...)`` runs inside ``use_mesh(mesh)``; ``mesh`` may be a spec string, a dict of
  axis sizes, a ``Mesh`` or None, and reaches ``fn`` as a ``Mesh`` (or None)."""

  @functools.wraps(fn)
  def wrapper(*args, mesh=None, **kwargs):
    mesh = make_mesh(mesh)
    with use_mesh(mesh):
      return fn(*args, mesh=mesh, **kwargs)
  return wrapper


def batch_rows(rows: int, batch: int, mesh: Optional[Mesh]) -> int:
  """A prefill sub-batch of at most ``rows`` sequences (at least one per data shard) that splits over ``data``."""
  d = axis_size(mesh, "data")
  return max(d, min(batch, rows) // d * d)


def rows(tree, mesh: Optional[Mesh]):
  """The small arrays generate carries between jitted calls (tokens, flags, counters [B, ...]; keys) in one fixed
  placement: per-sequence arrays split over ``data``, scalars whole. Without it each call's outputs come back in
  whatever layout the partitioner chose, and the next call compiles again for it. Identity without a mesh."""
  if mesh is None:
    return tree
  d = axis_size(mesh, "data")
  # Across processes they are read on the host after every call (tokens, end flags): whole on every device there.
  whole = jax.process_count() > 1

  def place(x):
    split = x.ndim > 0 and x.shape[0] % d == 0 and not whole
    return _place(x, NamedSharding(mesh, P("data") if split and d > 1 else P()))
  return jax.tree.map(place, tree)


def cache_mesh(cache: KVCache) -> Optional[Mesh]:
  """The mesh a cache was made on (``create_cache``), or None."""
  return cache.method.mesh if isinstance(cache.method, PerShard) else None


def data_shards(cache: KVCache) -> int:
  """How many parts the cache's sequences are split into (its mesh's ``data`` axis; 1 without a mesh)."""
  mesh = cache_mesh(cache)
  return 1 if mesh is None else axis_size(mesh, cache.method.rules.batch)


def put_rows(cache: KVCache, start, part: KVCache) -> KVCache:
  """``cache.put_rows(start, part)`` where each data shard holds its own sequences: every device writes its slice of
  ``part`` at ``start`` within its own slice of the cache, so ``start`` counts within a shard and the sub-batch is
  ``part.batch / data`` sequences of each shard (``jkv.prefill.sub_batch``). The partitioner, given a write at a
  traced offset of a sharded axis, gathers every array of the cache whole on every device (all-gather, update,
  slice back): on a ``data`` mesh that is the whole cache's bytes of temporaries per device."""
  if data_shards(cache) == 1:
    return cache.put_rows(start, part)
  method = cache.method
  state_spec, part_spec = (state_specs(method.inner.abstract(c.spec), method.mesh, method.rules) for c in (cache, part))
  rows = P(method.rules.batch)

  def body(state, lengths, part_state, part_lengths, start):
    local = cache.replace(state=state, lengths=lengths).put_rows(start, part.replace(state=part_state,
                                                                                   lengths=part_lengths))
    return local.state, local.lengths

  run = shard_map(body, mesh=method.mesh, in_specs=(state_spec, rows, part_spec, rows, P()),
                  out_specs=(state_spec, rows))
  state, lengths = run(cache.state, cache.lengths, part.state, part.lengths, start)
  return cache.replace(state=state, lengths=lengths)


def vocab_lookup(table, tokens):
  """``table[tokens]`` ([V, E] by [B, T] -> [B, T, E]) inside a jitted call under a mesh whose ``model`` axis splits
  the vocabulary (``param_shardings``): each shard reads its own rows of the tokens (zeros for the others') and one
  all-reduce of [B, T, E] sums them. XLA's partitioner gathered the whole table on every device for that lookup
  instead, on a GPU, every decode step: 1 GiB for Llama-3-8B's embedding, about 2 ms of each B = 1 step on
  ``model=2`` (2 H200s; it did not on CPU devices). None where no mesh splits the vocabulary: a plain gather."""
  mesh = current_mesh()
  parts = axis_size(mesh, "model")
  if parts == 1 or table.shape[0] % parts:
    return None
  rows = P("data") if tokens.shape[0] % axis_size(mesh, "data") == 0 else P()

  def local(part, ids):
    n = part.shape[0]
    i = ids - jax.lax.axis_index("model") * n
    mine = ((i >= 0) & (i < n))[..., None]
    return jax.lax.psum(jax.numpy.where(mine, part[jax.numpy.clip(i, 0, n - 1)], 0), "model")

  return shard_map(local, mesh=mesh, in_specs=(P("model"), rows), out_specs=rows)(table, tokens)


_WARMED_MESHES = set()


def warm_collectives(mesh: Optional[Mesh]) -> None:
  """One tiny all-reduce over each axis of ``mesh`` with more than one device, once per mesh and process. A GPU's
  NCCL communicator for a group of devices is built at the first collective run over it: generate's compile phase
  calls this so that the cost is not timed as prefill or decode. On 2 H200s at ``seq=2``, whose prefill runs no
  collective, it had made the first decode chunk 0.64 s longer than the next (743 against 105 ms for 16 steps)."""
  if mesh is None or mesh in _WARMED_MESHES:
    return
  jax.block_until_ready([axis_total(mesh, axis) for axis in mesh.axis_names if mesh.shape[axis] > 1])
  _WARMED_MESHES.add(mesh)


def axis_total(mesh: Mesh, axis: str):
  """A 1 from every device summed over ``axis`` by one all-reduce: the axis's size (a float32 scalar)."""
  total = shard_map(functools.partial(jax.lax.psum, axis_name=axis), mesh=mesh, in_specs=P(), out_specs=P())
  return jax.jit(total)(np.float32(1))


def splits(mesh, batch: int, kv_heads: int) -> bool:
  """Whether ``batch`` sequences and ``kv_heads`` heads split evenly over the mesh's data and model axes."""
  return batch % axis_size(mesh, "data") == 0 and kv_heads % axis_size(mesh, "model") == 0


def round_batch(batch: int, mesh: Optional[Mesh]) -> int:
  """``batch`` rounded up to a multiple of the mesh's data axis (evaluations pad their batches to it)."""
  d = axis_size(mesh, "data")
  return -(-batch // d) * d


# ------------------------------------------------------------------------------------------------- several processes

def initialize_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
  """Join a multi-process jax job (one process per host, or several on one machine): every process calls this
  first, with the same coordinator (process 0's ``host:port``) and its own ``process_id``; ``jax.devices()`` then
  lists every process's devices and a mesh spans them. Each process runs the same program on the same inputs (the
  same prompts, the same checkpoint) and holds only its own devices' shards. On CPU the processes' collectives
  run over gloo."""
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process id {process_id} is outside [0, {num_processes})")
  if jax.config.jax_cpu_collectives_implementation in (None, "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def fetch(x) -> np.ndarray:
  """``np.asarray(x)``, also for an array split across processes (gathered to every process: small arrays only,
  such as the generated tokens)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
