"""A prefilled cache on disk: a long document prefilled once, then asked many questions.

``jkv.generate.generate(..., save_cache=DIR)`` writes the cache as prefill leaves it (before any decoding), with the
prompts' token ids; ``generate(..., cache=DIR)`` loads it and feeds the new prompts as the next chunk (the method's
``extend``: the chunk attends what the cache holds, as the method holds it, and is stored after), then decodes. A
method extends a cache from whole chunks (``CacheMethod.chunk_multiple``: KIVI's residual, ZipCache's whole key
groups of both pools), so the cache saved holds each document's whole chunks (``heads``) and the manifest the
document's last tokens, which the saving run and every loading run feed first, before its own. The tokens are
those of one chunked prefill of document + prompt whose chunk boundary falls at the end of the document's whole
chunks (tests/test_saved_cache.py). A cache of one sequence serves a batch of prompts (each continues its own copy).

A saved cache directory::

  jkv_cache.json  {"format": 1, "jkv": version, "model": {"config": ModelConfig fields, "fingerprint": hex},
                   "method": {"name", "settings" as it ran}, "capacity": tokens the arrays are cut to,
                   "seq": devices a sequence's tokens were split over (a mesh's seq axis; 1 without),
                   "lengths": [B] tokens held, "tails": [B] token ids after them (fewer than a chunk),
                   "arrays": {name: {"shape", "dtype", "axes", "memory_kind"}},
                   "held_bytes": {"device", "host"}, "array_bytes": bytes of the arrays,
                   "files": {path: {"bytes", "sha256"}} for every file orbax wrote, "sha256": of the other fields}
  arrays/         orbax PyTree checkpoint (zarr3, uncompressed: CHUNK_BYTES): {"state": the method's state arrays
                  by name, "prompts": [B, T] int32 token ids, right-padded with -1}

Only what is held is written: every array is cut to the shape ``abstract`` gives at the capacity
round_up(longest held, capacity_multiple), a prefix of each axis that grows with the capacity (tokens, key groups,
tiles, pool rows, fetched rows). A prefill of those lengths leaves nothing past it that is read before it is written
again (what lies there is padding, or zeros as allocated). Loading allocates the capacity the new prompts and their
new tokens need and puts each saved array at the front of its grown shape, zeros after: the state a fresh allocation
and that prefill would give.

A cache saved on a mesh's ``seq`` axis holds each array in one device's layout over the whole capacity (every range
in place: token slots, and ZipCache's pool rows, in the order one device holds them), so it loads on any ``seq``
size, none included. Rounded to the saving run's ranges (ZipCache's pools; SpeCache's prefetched rows, a range's
per device, none fetched yet after a prefill), an array may be longer than this run's: it loads where what lies past
this run's shape is zeros, else a one-line error.

Written atomically (``jkv_convert.checkpoint.atomic_directory``), checksummed file by file and as a whole. Loading
refuses, each in one line: a leftover of an interrupted save, a missing or damaged manifest, another model's config,
another batch, another method or settings (as they run here), all before anything is allocated; then weights that
are not the ones saved with (checksums of every weight) and any file whose size or sha256 differs (naming the file).
"""

import dataclasses
import functools
import hashlib
import json
import os
import time
from importlib import metadata
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jkv_convert import checkpoint
from jkv_kernels.host_layer_copy import copy_layer
from jkv import sharding
from jkv.cache import CacheMethod, CacheSpec, KVCache, is_array_info
from jkv.config import ModelConfig
from jkv.prefill import round_up

FORMAT = 2
MARKER = "jkv_cache.json"
ARRAYS = "arrays"
REMEDY = "save the cache again (jkv generate --save-cache)"
COMMAND = "jkv generate --save-cache"
# Arrays are written uncompressed, in chunks of CHUNK_BYTES, into data files of about FILE_BYTES: zstd saved about
# 20% of the bytes, but orbax's default chunk is the whole array, compressed and decompressed on one thread (an
# H200 saved KIVI-2's 3.2 GB at 0.34 GB/s and loaded it at 0.59; on the CPU, 1 GiB read back in 6.9 s compressed in
# one chunk, 1.9 s uncompressed in chunks), and one data file is checksummed on one thread.
CHUNK_BYTES = 64 << 20
FILE_BYTES = 256 << 20


def held_capacity(method: CacheMethod, lengths) -> int:
  """The capacity a saved cache's arrays are cut to: the longest held sequence in whole capacity multiples."""
  return round_up(max(int(np.max(lengths)), 1), method.capacity_multiple())


def heads(method: CacheMethod, lengths) -> list:
  """Tokens of prompts of these lengths that a cache saved after their prefill holds: their whole chunks (the rest
  is fed after the save); a one-line ValueError where a prompt holds none."""
  m = method.chunk_multiple()
  for b, n in enumerate(lengths):
    if n < m:
      raise ValueError(f"prompt {b} has {n} tokens; a saved {method.name} cache holds whole chunks of {m} tokens (its "
                       "blocks), so save a longer prompt")
  return [n // m * m for n in lengths]


def check_target(directory: str) -> None:
  """One-line FileExistsError / PermissionError unless a cache can be saved at ``directory`` (cheap: run it before
  the prefill whose cache it will hold)."""
  checkpoint.check_target(directory, what="saved cache", command=COMMAND)


# ------------------------------------------------------------------------------------------------- save


def save(directory: str, cache: KVCache, cfg: ModelConfig, params, prompts, tails) -> dict:
  """Write ``cache``, as prefill of ``prompts`` (token-id lists, one a sequence) left it, to a new ``directory``, with
  ``tails``: each sequence's next token ids, which a run that loads it feeds first (``heads``).

  Returns what was written: ``directory``, ``array_bytes`` (the arrays cut to the held capacity), ``disk_bytes``
  (every file), ``held_bytes`` and ``held_host_bytes`` (what the method holds for these lengths), ``save_s`` and
  ``save_gb_per_s`` (array bytes over the seconds from the device to the synced files, checksums included; the
  weights' fingerprint apart).
  """
  directory = os.path.abspath(directory)
  check_target(directory)
  fingerprint = model_fingerprint(params)
  t0 = time.perf_counter()
  lengths = np.asarray(sharding.fetch(cache.lengths))
  method = cache.method  # a mesh's PerShard describes and names its inner method's state
  # Split over seq, an array's layout is one device's over the whole capacity (each range in place), rounded to the
  # ranges (ZipCache's pools, SpeCache's fetched rows): a load on any seq size gets it back (module docstring).
  seq = sharding.axis_size(method.mesh if isinstance(method, sharding.PerShard) else None, sharding.SEQ_AXIS)
  capacity = held_capacity(method, lengths)
  abstract = method.abstract(dataclasses.replace(cache.spec, capacity=capacity))
  paths, infos = zip(*jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_array_info)[0])
  names = [jax.tree_util.keystr(path, simple=True, separator=".") for path in paths]
  arrays = dict(zip(names, _prefixes(jax.tree.leaves(cache.state), [i.shape for i in infos])))
  infos = {name: dict(shape=list(i.shape), dtype=str(np.dtype(i.dtype)), axes=list(i.axes),
                      memory_kind=i.memory_kind) for name, i in zip(names, infos)}
  held = cache.held_bytes(lengths)
  with checkpoint.atomic_directory(directory, "saved cache", COMMAND) as partial:
    tree = {"state": _nested(arrays), "prompts": _padded(prompts)}

    def write():
      with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, use_zarr3=True)) as ckptr:
        ckptr.save(os.path.join(partial, ARRAYS), args=ocp.args.PyTreeSave(
            tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree),
            ocdbt_target_data_file_size=FILE_BYTES))
    checkpoint.finished_before_interrupt(write)
    manifest = dict(
        format=FORMAT, jkv=_version(), model=dict(config=_jsonable(dataclasses.asdict(cfg)), fingerprint=fingerprint),
        method=dict(name=method.name, settings=_jsonable(method.settings())), capacity=capacity, seq=seq,
        lengths=lengths.tolist(), tails=[list(map(int, t)) for t in tails], arrays=infos,
        held_bytes=dict(device=held.device, host=held.host), array_bytes=sum(a.nbytes for a in arrays.values()),
        files=checkpoint.file_digests(partial, ARRAYS))
    checkpoint.write_sealed_json(os.path.join(partial, MARKER), manifest)
  seconds = time.perf_counter() - t0
  disk = sum(f["bytes"] for f in manifest["files"].values()) + os.path.getsize(os.path.join(directory, MARKER))
  return dict(directory=directory, array_bytes=manifest["array_bytes"], disk_bytes=disk, held_bytes=held.device,
              held_host_bytes=held.host, save_s=seconds, save_gb_per_s=manifest["array_bytes"] / seconds / 1e9)


def _prefixes(arrays: list, shapes: list) -> list:
  """The front ``shapes`` of ``arrays`` in host memory: device arrays cut on the device in one call (only the
  prefixes cross to the host, and one compilation serves them all), host-resident ones shard by shard
  (``_host_prefix``)."""
  on_device = [i for i, x in enumerate(arrays) if x.sharding.memory_kind in (None, "device")]
  cut = dict(zip(on_device, _cut([arrays[i] for i in on_device], shapes=tuple(tuple(shapes[i]) for i in on_device))))
  return [np.asarray(sharding.fetch(cut[i])) if i in cut else _host_prefix(x, tuple(shapes[i]))
          for i, x in enumerate(arrays)]


def _host_prefix(x: jax.Array, shape: tuple) -> np.ndarray:
  """The front ``shape`` of a host-resident array [L, B, H, C, W] (SpeCache's host copy), gathered from its
  addressable shards. On a GPU each layer of a shard crosses to the device by a Pallas read of the pinned pages
  (``jkv_kernels.host_layer_copy``) and back as a new array: numpy never reads the host array in place, since a
  view of it, while it lives, keeps the array from being donated to the next call ("Donation requested for buffer
  with external reference"), and a whole host-side copy would double the largest array jkv holds. On a CPU the
  shard is read in place and its prefix copied."""
  out, done = np.empty(shape, x.dtype), set()
  for s in x.addressable_shards:
    region = tuple(slice(i.start or 0, min(i.stop or n, m)) for i, n, m in zip(s.index, x.shape, shape))
    key = tuple((r.start, r.stop) for r in region)
    if any(r.start >= r.stop for r in region) or key in done:  # past the prefix, or a replica already read
      continue
    done.add(key)
    local = tuple(r.stop - r.start for r in region)
    if jax.default_backend() == "cpu":
      out[region] = np.asarray(s.data)[tuple(slice(0, n) for n in local)]
      continue
    lengths = jnp.full((s.data.shape[1],), local[3], jnp.int32)
    for layer in range(local[0]):
      out[region][layer] = np.asarray(_cut([copy_layer(s.data, layer, lengths)], shapes=(local[1:],))[0])
  return out


@functools.partial(jax.jit, static_argnames=("shapes",))
def _cut(arrays: list, shapes: tuple) -> list:
  return [x[tuple(slice(0, n) for n in shape)] for x, shape in zip(arrays, shapes)]


def _nested(arrays: dict) -> dict:
  """{"a.b": x} as {"a": {"b": x}}: orbax stores a tree of dicts under the arrays' own names."""
  tree = {}
  for name, x in arrays.items():
    *parents, leaf = name.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = x
  return tree


def _padded(prompts) -> np.ndarray:
  ids = np.full((len(prompts), max(len(p) for p in prompts)), -1, np.int32)
  for b, p in enumerate(prompts):
    ids[b, :len(p)] = p
  return ids


def _jsonable(data: dict) -> dict:
  """``data`` as it reads back from JSON (tuples as lists, dtypes as names), so that saved and current compare."""
  return json.loads(json.dumps(data, default=str))


def _version() -> str:
  try:
    return metadata.version("jkv")
  except metadata.PackageNotFoundError:
    return "unknown"


_MIX = (np.uint32(0x9E3779B1), np.uint32(0x85EBCA77))  # odd constants: each position weighs its element differently


@jax.jit
def _checksums(params):
  """Two position-weighted sums mod 2**32 of every element's bits, per parameter array (uint32 [2]): one read of
  every weight on the device where it lives. One changed element always changes both sums (an odd weight is
  invertible mod 2**32); changes to several elements leave both unchanged only by coincidence."""
  def sums(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)
    position = jnp.arange(bits.shape[0], dtype=jnp.uint32)
    return jnp.stack([jnp.sum(bits * ((position * m) | np.uint32(1)), dtype=jnp.uint32) for m in _MIX])
  return jax.tree.map(sums, params)


def model_fingerprint(params) -> str:
  """sha256 of every parameter array's path, shape, dtype and the checksums of all its values (``_checksums``)."""
  digest = hashlib.sha256()
  for (path, x), sums in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(_checksums(params))):
    digest.update(f"{jax.tree_util.keystr(path)} {tuple(x.shape)} {x.dtype}".encode())
    digest.update(np.asarray(sharding.fetch(sums)).tobytes())
  return digest.hexdigest()


# ------------------------------------------------------------------------------------------------- open and check


@dataclasses.dataclass(frozen=True)
class SavedCache:
  """A saved cache as its manifest describes it (``open_saved``); ``load`` reads its arrays."""

  directory: str
  manifest: dict

  @property
  def lengths(self) -> list:
    """Tokens held per saved sequence."""
    return self.manifest["lengths"]

  def tails(self, batch: int) -> list:
    """The token ids each of ``batch`` sequences feeds before its prompt (``check_batch``'s rule)."""
    tails = self.manifest["tails"]
    return tails * batch if len(tails) == 1 else list(tails)

  def check_batch(self, batch: int) -> list:
    """Tokens held by each of ``batch`` sequences continuing this cache: its own sequences one for one, or its one
    sequence for every prompt; else a one-line ValueError."""
    saved = len(self.lengths)
    if batch != saved and saved != 1:
      raise ValueError(f"saved cache {self.directory} holds {saved} sequences: give {saved} prompts (one to continue "
                       f"each), or save one sequence to continue it with any number of prompts; got {batch}")
    return self.lengths * batch if saved == 1 else list(self.lengths)

  def check_model(self, cfg: ModelConfig) -> None:
    """A one-line ValueError unless ``cfg`` is the config the cache was prefilled with."""
    saved, here = self.manifest["model"]["config"], _jsonable(dataclasses.asdict(cfg))
    for field in sorted(set(saved) | set(here)):
      if saved.get(field) != here.get(field):
        raise ValueError(f"saved cache {self.directory} was prefilled by another model ({field} "
                         f"{_brief(saved.get(field))} there, {_brief(here.get(field))} here)")

  def check_weights(self, params) -> None:
    """A one-line ValueError unless ``params`` have the fingerprint of the weights the cache was prefilled with."""
    if model_fingerprint(params) != self.manifest["model"]["fingerprint"]:
      raise ValueError(f"saved cache {self.directory} was prefilled by other weights of this model's shape (their "
                       "fingerprints differ)")

  def check_method(self, method: CacheMethod) -> None:
    """A one-line ValueError unless ``method`` (as it runs here: ``for_impl`` decided) is the saved one."""
    saved = self.manifest["method"]
    if method.name != saved["name"]:
      raise ValueError(f"saved cache {self.directory} holds a {saved['name']} cache; this run asks for {method.name}")
    here = _jsonable(method.settings())
    differ = [f"{k}={_brief(saved['settings'].get(k))} there, {_brief(here.get(k))} here"
              for k in sorted(set(here) | set(saved["settings"])) if here.get(k) != saved["settings"].get(k)]
    if differ:
      raise ValueError(f"saved cache {self.directory} holds {method.name} with other settings: {'; '.join(differ)}")


def _brief(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."


def open_saved(directory: str) -> SavedCache:
  """The saved cache at ``directory``, its manifest read and its own checksum checked (the arrays' files are checked
  by ``load``); a one-line ValueError / FileNotFoundError naming the file otherwise."""
  directory = os.path.abspath(directory)
  problem = checkpoint.leftover(directory, COMMAND)
  if problem:
    raise ValueError(problem)
  path = os.path.join(directory, MARKER)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no saved cache at {directory}")
  if not os.path.isfile(path):
    raise ValueError(f"{directory} is not a saved jkv cache: {MARKER} is missing (a cache is written whole or not at "
                     f"all; {REMEDY})")
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is damaged ({e}); {REMEDY}") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    found = manifest.get("format") if isinstance(manifest, dict) else None
    raise ValueError(f"{path}: saved-cache format {found!r}, this jkv reads format {FORMAT}; {REMEDY}")
  sealed = manifest.pop("sha256", None)
  if sealed != checkpoint.json_digest(manifest):
    raise ValueError(f"{path} is damaged (checksum mismatch); {REMEDY}")
  return SavedCache(directory, manifest)


# ------------------------------------------------------------------------------------------------- load


def load(saved: SavedCache, params, method: CacheMethod, spec: CacheSpec, impl: str,
         mesh: Optional[jax.sharding.Mesh]) -> tuple[KVCache, list, dict]:
  """The saved cache grown to ``spec`` (its batch the prompts', its capacity at least the saved one), placed as
  ``jkv.sharding.create_cache`` places an empty one, with the token ids each sequence holds and what was read
  (``load_s``, ``load_gb_per_s``: array bytes over the seconds from the checksums to the placed arrays, the
  weights' fingerprint apart).

  The caller checked the model's config, the method and the batch (``check_*``); here the weights and every file.
  Each array is grown in host memory and placed once: no device memory beyond the cache's own."""
  saved.check_weights(params)
  t0 = time.perf_counter()
  checkpoint.verify_files(saved.directory, saved.manifest["files"], REMEDY)
  if jax.process_count() > 1:
    raise ValueError("a saved cache loads in one process; run without --num-processes")
  infos, B = saved.manifest["arrays"], len(saved.lengths)
  as_numpy = ocp.RestoreArgs(restore_type=np.ndarray)
  wanted = {"state": _nested({name: as_numpy for name in infos}), "prompts": as_numpy}
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
    restored = ckptr.restore(os.path.join(saved.directory, ARRAYS), args=ocp.args.PyTreeRestore(restore_args=wanted))
  tiled = lambda x, axis: np.repeat(x, spec.batch, axis=axis) if B == 1 and spec.batch > 1 else x
  cache_method = method if mesh is None else sharding.per_shard(method, mesh, spec)
  cache_method.check(spec)
  abstract = cache_method.abstract(spec)
  placements = (cache_method.shardings(spec) if mesh is not None
                else jax.tree.map(_one_device, abstract, is_leaf=is_array_info))
  leaves = []
  for (path, info), where in zip(jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_array_info)[0],
                                 jax.tree.leaves(placements)):
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    if name not in infos:
      raise ValueError(f"saved cache {saved.directory} has no state array {name}; {REMEDY}")
    x = _leaf(restored["state"], name)
    leaves.append(jax.device_put(_fitted(tiled(x, info.axes.index("batch")), info, name, saved.directory), where))
  state = jax.tree.unflatten(jax.tree.structure(abstract, is_leaf=is_array_info), leaves)
  lengths = tiled(np.asarray(saved.lengths, np.int32), 0)
  placed = jax.device_put(lengths, None if mesh is None else NamedSharding(mesh, P(sharding.DEFAULT_RULES.batch)))
  cache = KVCache(method=cache_method, spec=spec, impl=impl, state=state, lengths=placed)
  prompts = [row[:n].tolist() for row, n in zip(tiled(restored["prompts"], 0), lengths)]
  jax.block_until_ready(cache.state)
  seconds = time.perf_counter() - t0
  array_bytes = saved.manifest["array_bytes"]
  return cache, prompts, dict(directory=saved.directory, load_s=seconds, load_gb_per_s=array_bytes / seconds / 1e9)


def _leaf(tree: dict, name: str) -> np.ndarray:
  for part in name.split("."):
    tree = tree[part]
  return tree


def _one_device(info) -> jax.sharding.Sharding:
  """Where ``jkv.cache.allocate`` puts an array without a mesh: the first device, in the array's memory kind."""
  return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=None if info.memory_kind == "device"
                                           else info.memory_kind)


def _fitted(x: np.ndarray, info, name: str, directory: str) -> np.ndarray:
  """``x`` at the front of an array of ``info``'s shape, zeros after; cut where ``x`` is longer and what lies past
  is zeros (a saving run's ``seq`` ranges rounded it up); a one-line ValueError where it does not fit (a saved cache
  of other sizes than its manifest's settings make)."""
  front = tuple(slice(0, min(n, m)) for n, m in zip(x.shape, info.shape))
  longer = any(n > m for n, m in zip(x.shape, info.shape))
  if (x.dtype != jnp.dtype(info.dtype) or x.ndim != len(info.shape)
      or (longer and np.count_nonzero(x) != np.count_nonzero(x[front]))):
    raise ValueError(f"saved cache {directory}: state array {name} is {x.dtype}{list(x.shape)}, which does not fit "
                     f"this run's {jnp.dtype(info.dtype)}{list(info.shape)}; {REMEDY}")
  if x.shape == tuple(info.shape):
    return x
  out = np.zeros(info.shape, x.dtype)
  out[front] = x[front]
  return out
