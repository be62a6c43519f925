"""Device memory: what prefill needs per prompt token, how many prompt tokens one prefill call may take, the
largest batch (or context) a method's cache lets fit on a device, and the one-line error when a batch does not fit.

The cache is allocated at capacity up front (``KVCache.create``), from the method's ``abstract`` description, so
what a batch costs is known before anything runs; prefill activations are bounded by running the batch in
sub-batches of at most ``prefill_token_budget`` prompt tokens (``jkv.generate``). ``guard`` refuses a batch whose
cache cannot fit before it is allocated, has an allocator that grows region by region (XLA's GPU allocator without
preallocation) grow by one region that holds the whole cache (``gather_pool``), and turns a later allocation failure
(XLA's RESOURCE_EXHAUSTED, whose message carries a many-line allocator report) into the same one-line
``DeviceMemoryError``.
"""

import contextlib
import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jkv import sharding
from jkv.cache import CacheMethod, CacheSpec, abstract_bytes, is_array_info
from jkv.config import ModelConfig

# Beyond weights, cache and prefill activations: XLA's workspace, cuDNN/cuBLAS handles, the decode step's own
# temporaries (logits of one token per sequence), and the holes the allocator leaves. Measured on the H100 with
# the cuBLAS decode (jkv.xla_options): at 3 GiB the dense run at the computed largest batch (95 sequences of 4608
# tokens, Llama-3-8B shape) ran out of memory asking for 2.55 GiB more right after prefill; at 95% of it (2.8 GiB
# more headroom) it ran. 6 GiB covers that.
RESERVE_BYTES = 6 << 30

# The smallest prefill chunk planned (``jkv.prefill``): smaller ones leave the tensor cores idle; every method's
# blocks fit in one at its defaults.
MIN_CHUNK = 256

# The chunk a long prompt's plan keeps room for (``longest_context``; a bucket in ``generate.plan_generation``). With
# room for MIN_CHUNK alone, dense's longest prompt on an H100 (429,942 tokens) was planned as 1,680 calls of 256
# tokens and did not finish in 270 s (2026-12-07); 2048 query tokens over 32 heads are 512 of cuDNN's 128-row tiles.
LONG_PROMPT_CHUNK = 2048


def prefill_bytes_per_token(cfg: ModelConfig) -> int:
  """Peak live activation bytes per prompt token within one layer of prefill (an upper estimate).

  Counted in fp32, whatever the model dtype, because that is where the peak is: the fp32 residual stream, its
  normed copy and a temporary, q/k/v and the attention output, the fp32 K/V a method quantizes, and the MLP's
  gate, up and their product (fp32 accumulations). Measured on the H100 at the Llama-3-8B shape: 8.62 GiB of
  temporaries for 8 prompts of 4096 tokens, 276 KB per token, against 287 KB here.
  """
  E, F, D = cfg.embed, cfg.ffw_size, cfg.head_dim
  kv = 2 * cfg.kv_heads * D
  return 4 * (4 * E + 2 * cfg.q_heads * D + 2 * kv + 3 * F)


def device_memory(device=None) -> Optional[dict]:
  """{"limit", "in_use", "peak"} bytes of a device's memory, or None where jax does not report them (CPU)."""
  device = device or jax.local_devices()[0]  # addressable: with several processes devices()[0] may not be
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "bytes_limit" not in stats:
    return None
  return dict(limit=int(stats["bytes_limit"]), in_use=int(stats.get("bytes_in_use", 0)),
              peak=int(stats.get("peak_bytes_in_use", 0)))


def host_memory() -> Optional[dict]:
  """{"limit", "in_use", "peak"} bytes of this machine's memory (``/proc/meminfo``: in use is what is not available;
  no peak), or None where there is no such file. A CPU's device memory: jax reports none for it."""
  try:
    with open("/proc/meminfo") as f:
      kib = {key: int(value.split()[0]) for key, value in (line.split(":", 1) for line in f)}
    return dict(limit=kib["MemTotal"] << 10, in_use=(kib["MemTotal"] - kib["MemAvailable"]) << 10, peak=0)
  except (OSError, KeyError, ValueError):
    return None


def available_memory() -> Optional[dict]:
  """What a cache may take: the first device's memory (``device_memory``), on a CPU the machine's
  (``host_memory``); None where neither is known."""
  return device_memory() or (host_memory() if jax.default_backend() == "cpu" else None)


MEMORY_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # read by XLA when its GPU client starts


def allocator_limit_note() -> str:
  """Where a GPU's memory limit comes from, for the lines that report it: XLA's allocator takes at most 75% of the
  GPU unless told otherwise (docs/long_context.md: what that costs one sequence on an H100). Empty off a GPU, and
  where the fraction was set."""
  if jax.default_backend() != "gpu" or os.environ.get(MEMORY_FRACTION_ENV):
    return ""
  return f" (XLA's limit, 75% of the GPU; {MEMORY_FRACTION_ENV}=0.95 before jax starts raises it)"


PINNED_HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # read by XLA when its GPU client starts


def pinned_host_limit() -> Optional[int]:
  """Bytes of host-resident (``pinned_host``) arrays a GPU process may hold: XLA pins them from one pool of
  ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB (64 unless set before jax starts), at most the machine's memory; None
  off a GPU, where host arrays are ordinary memory (``available_memory`` counts the machine's)."""
  if jax.default_backend() != "gpu":
    return None
  try:
    pool = int(os.environ.get(PINNED_HOST_LIMIT_ENV, "64")) << 30
  except ValueError:
    pool = 64 << 30  # XLA logs the bad value and keeps its default
  host = host_memory()
  return pool if host is None else min(pool, host["limit"])


# Host memory a GPU process uses beside XLA's pinned pool (Python, XLA's compiler, transfers' staging): 8 GiB in the
# SpeCache run of 524,288 tokens on an H200 (benchmarks/results/long_context.json), used 74 GiB with 66 pinned.
HOST_RESERVE_BYTES = 8 << 30


def pinned_pool_take(host_bytes: int, limit: int) -> int:
  """Bytes XLA pins to hold ``host_bytes`` of host-resident arrays in a process that pinned nothing before. Its
  pinned pool grows as the device allocator does (``gather_pool``): a region of the next power of two of 2 MiB that
  holds the array, never past the limit. So a host copy just over a power of two pins twice itself: on an H200,
  SpeCache's 32.004 GiB copy (262,144 tokens) pinned 64 GiB under the default limit of 64, its 64.008 GiB copy
  (524,288 tokens) 66 GiB under a limit of 66 (``free``'s shared column, 2026-11-29)."""
  region = 2 << 20
  while region < host_bytes:
    region *= 2
  return min(region, limit)


def pinned_pool_limit_gib(host_bytes: int) -> int:
  """The ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` that holds ``host_bytes`` of host-resident arrays and pins no more
  than about them (1 GiB over, for transfers' staging): the limit bounds the pool's last region."""
  return -(-host_bytes // 2**30) + 1


def allocator_pool(device=None) -> Optional[dict]:
  """{"limit", "pool", "largest_free"} bytes of a device allocator that grows its pool region by region (XLA's GPU
  allocator with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``): what it may take in all, what it took from the device
  so far, and its largest free block; None where the device does not report them (CPU) or the pool is whole
  (preallocated: one region of the limit from the start)."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "bytes_limit" not in stats or "pool_bytes" not in stats:
    return None
  limit, pool = int(stats["bytes_limit"]), int(stats["pool_bytes"])
  if pool >= limit:
    return None
  return dict(limit=limit, pool=pool, largest_free=int(stats.get("largest_free_block_bytes", 0)))


# XLA's GPU allocator (tsl::BFCAllocator) rounds every allocation up to a multiple of this.
ALLOCATION_GRANULE = 256


def _claim(nbytes: int, device):
  """``nbytes`` (or a little more) of device memory: a placeholder array, to be deleted."""
  return jnp.zeros((-(-nbytes // 4),), jnp.uint32, device=device)


def gather_pool(nbytes: int, devices) -> None:
  """Make a growing allocator's pool hold ``nbytes`` in one free block on each of ``devices`` before a cache of that
  many bytes is allocated there, so that all its arrays fit where ``guard`` counted them.

  Without it, XLA's GPU allocator with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` gives each array too large for its
  free blocks a new region, sized the next power of two of 2 MiB that holds it but never past what is left of its
  limit. The cache of 303 sequences of 4064 tokens of the default model (dense, 52.85 GiB, with 58.85 GiB free of
  59.38 GiB) failed on the H100 asking for 26.42 GiB in ``jit_broadcast_in_dim``, the zeros of its second
  array: by that rule (tests/test_memory_pool.py models it) the weights' regions come to 1 GiB, K gets a 32 GiB
  region, and V, the same size, finds 26.38 GiB left to grow into (the 5.58 GiB free in K's region is no use to it).
  One placeholder of the whole cache grows the pool by one region that holds every array (the next power of two
  past it, or all that is left); deleted before the cache is allocated, it leaves that region free for it. Nothing
  is done where the pool is whole or reports nothing (CPU), where a free block already holds the cache, or where no
  new region could (the allocation then fails as it would have, in ``guard``'s one line); a placeholder that does
  not fit is let go the same way."""
  for device in devices:
    pool = allocator_pool(device)
    if pool is None or nbytes <= pool["largest_free"] or nbytes > pool["limit"] - pool["pool"]:
      continue
    try:
      placeholder = _claim(nbytes, device)
      placeholder.block_until_ready()
    except jax.errors.JaxRuntimeError as e:
      if not is_out_of_memory(e):
        raise
      continue
    placeholder.delete()


def prefill_token_budget(cfg: ModelConfig, device=None, *, state_bytes_per_token: int = 0, fixed_bytes: int = 0,
                         floor_tokens: int = 0) -> int:
  """Prompt tokens one prefill call may process on a device: what half the device's free memory holds of prefill
  activations (the other half a margin for the estimate), but ``floor_tokens`` where they fit the free memory whole;
  2**16 where the device does not report its memory.

  ``floor_tokens``: one whole prompt, which ``largest_batch`` counts beside the cache at its largest batch. Without
  it the plan there found no room for one prompt in half the free memory and prefilled the whole batch in chunks of
  ``MIN_CHUNK`` tokens per sequence: at the 717 sequences of the Llama-3-8B shape that fit one H200, 183,552 tokens
  a call, 49 GiB of activations as ``prefill_bytes_per_token`` counts them, against the 1.1 GiB of one prompt.

  ``fixed_bytes``: what is not allocated yet but will be beside the call (the cache, when planned before it is
  allocated; a chunk's held rows, ``held_rows_bytes``). ``state_bytes_per_token``: what a sub-batch's own cache costs
  per prompt token besides. A prefill call of a sub-batch fills a fresh empty state of its sequences at the cache's
  whole capacity, then writes it into the cache (``jkv.prefill``): a temporary of one sequence's cache per sequence,
  which for short prompts in a long capacity outweighs the activations (dense, the default model, 4064 tokens:
  178 MiB per 64-token prompt, against 2.2 MB of activations)."""
  mem = device_memory(device)
  if mem is None:
    return 1 << 16
  free = mem["limit"] - mem["in_use"] - RESERVE_BYTES - fixed_bytes
  per_token = prefill_bytes_per_token(cfg) + state_bytes_per_token
  tokens = (free // 2) // per_token
  return max(1, floor_tokens if tokens < floor_tokens <= free // per_token else tokens)


def held_rows_bytes(cfg: ModelConfig, batch: int, capacity: int) -> int:
  """Bytes of one chunked-prefill call's held rows (``jkv.chunk_attention.HeldRows``): one layer's keys and values
  of every sequence at capacity, in the model dtype."""
  return 2 * batch * cfg.kv_heads * capacity * cfg.head_dim * jnp.dtype(cfg.jnp_dtype).itemsize


def _abstract(method: CacheMethod, cfg: ModelConfig, batch: int, capacity: int, mesh, max_decode=None):
  """The state a mesh allocates: with a ``seq`` axis its ranges (``CacheSpec.ranges``: ZipCache's pools round to
  them), as ``jkv.context_parallel.SeqShard`` asks for it."""
  spec = CacheSpec.for_model(cfg, batch, capacity, max_decode)
  return method.abstract(dataclasses.replace(spec, ranges=sharding.axis_size(mesh, sharding.SEQ_AXIS)))


def cache_bytes(method: CacheMethod, cfg: ModelConfig, batch: int, capacity: int, mesh=None,
                max_decode: Optional[int] = None) -> int:
  """Device bytes the cache allocates for ``batch`` sequences of ``capacity`` tokens (host arrays excluded), at
  most ``max_decode`` of them decoded after the prompt (``CacheSpec.max_decode``; None: any); with a mesh, what one
  device of it holds (each array split over the mesh axes that shard it)."""
  abstract = _abstract(method, cfg, batch, capacity, mesh, max_decode)
  if mesh is None:
    return abstract_bytes(abstract).device + 4 * batch
  return sharding.local_bytes(abstract, mesh).device + 4 * batch // sharding.axis_size(mesh, "data")


def host_cache_bytes(method: CacheMethod, cfg: ModelConfig, batch: int, capacity: int, mesh=None) -> int:
  """Host bytes the cache allocates (SpeCache's 16-bit copy; 0 for device-only methods), in all for this process:
  with a mesh, one device's share times this process's devices of it (XLA pins them all from one pool)."""
  abstract = _abstract(method, cfg, batch, capacity, mesh)
  if mesh is None:
    return abstract_bytes(abstract).host
  share = sharding.local_bytes(abstract, mesh).host
  if not share or isinstance(mesh, jax.sharding.AbstractMesh):  # planned without devices: all of them this process's
    return share * mesh.size
  return share * sum(d.process_index == jax.process_index() for d in mesh.devices.flat)


def sub_batch_state_per_token(cfg: ModelConfig, method: CacheMethod, capacity: int, width: int, mesh=None) -> int:
  """What a prefill sub-batch's fresh state (``jkv.prefill``) costs one device per prompt token of prompts padded to
  ``width``: one sequence of each data shard at the cache's ``capacity``, its KV heads split over ``model``."""
  return -(-cache_bytes(method, cfg, sharding.axis_size(mesh, "data"), capacity, mesh) // width)


def prefill_call_bytes(cfg: ModelConfig, method: CacheMethod, capacity: int, prompt_tokens: int, mesh=None) -> int:
  """Bytes one device needs beside the cache for the smallest prefill sub-batch of whole prompts: one prompt of
  ``prompt_tokens`` per data shard, so one on each device, its activations counted whole (with ``model`` > 1 an upper
  estimate: the heads and the MLP split, the residual stream does not), and its fresh state. The prefill plan takes
  at least this (``prefill_token_budget``'s ``floor_tokens``)."""
  return prompt_tokens * (prefill_bytes_per_token(cfg) + sub_batch_state_per_token(cfg, method, capacity,
                                                                                    prompt_tokens, mesh))


def _beside_cache(cfg: ModelConfig, method: CacheMethod, capacity: int, prompt_tokens: int, mesh) -> int:
  """What each device needs beside the cache and the weights: ``RESERVE_BYTES`` and one prefill call."""
  return RESERVE_BYTES + prefill_call_bytes(cfg, method, capacity, prompt_tokens, mesh)


def largest_batch(cfg: ModelConfig, method: CacheMethod, capacity: int, prompt_tokens: int, *, device_bytes: int,
                  weight_bytes: int, mesh=None, host_bytes: Optional[int] = None) -> int:
  """The most sequences of ``capacity`` tokens whose cache fits beside the weights, one prefill sub-batch of one
  prompt per device (``prefill_call_bytes``) and ``RESERVE_BYTES``, in ``device_bytes``; 0 when not even one fits.

  With a ``mesh`` (``jkv.sharding``), every device of it holds ``device_bytes``: its share of the cache beside
  ``weight_bytes`` (then its share of the weights: ``sharding.param_bytes_per_device``; whole on each device of a
  data mesh), and the batch is a multiple of the data axis. With ``host_bytes``, their host arrays fit it too."""
  step = sharding.axis_size(mesh, "data")
  free = device_bytes - weight_bytes - _beside_cache(cfg, method, capacity, prompt_tokens, mesh)
  if free <= 0:
    return 0
  per_step = cache_bytes(method, cfg, step, capacity, mesh)  # one sequence per data shard
  batch = max(0, free // per_step) * step
  host_per_step = host_cache_bytes(method, cfg, step, capacity, mesh)
  if host_bytes is not None and host_per_step:
    batch = min(batch, host_bytes // host_per_step * step)
  while batch > 0 and (cache_bytes(method, cfg, batch, capacity, mesh) > free  # exact, in case bytes are not linear
                       or not _host_fits(method, cfg, batch, capacity, mesh, host_bytes)):
    batch -= step
  return int(batch)


def largest_capacity(cfg: ModelConfig, method: CacheMethod, batch: int, prompt_tokens: int, *, device_bytes: int,
                     weight_bytes: int, mesh=None, host_bytes: Optional[int] = None) -> int:
  """The longest capacity (tokens per sequence: prompt plus generated, a multiple of the method's
  ``capacity_multiple``, at most the model's context) at which ``batch`` sequences fit as ``largest_batch``
  counts them, and their host arrays within ``host_bytes`` where given; 0 when not even the shortest does."""
  step = method.capacity_multiple()
  fits = lambda n: (cache_bytes(method, cfg, batch, n * step, mesh) + weight_bytes
                    + _beside_cache(cfg, method, n * step, prompt_tokens, mesh) <= device_bytes
                    and _host_fits(method, cfg, batch, n * step, mesh, host_bytes))
  return _largest(fits, cfg.max_position // step) * step


def _host_fits(method: CacheMethod, cfg: ModelConfig, batch: int, capacity: int, mesh, host_bytes) -> bool:
  return host_bytes is None or host_cache_bytes(method, cfg, batch, capacity, mesh) <= host_bytes


def _largest(fits, hi: int) -> int:
  """The largest n in [0, hi] with ``fits(n)``, for ``fits`` true up to some n and false after (fits(0) is assumed:
  nothing asked); a binary search."""
  lo = 0
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo


def longest_context(cfg: ModelConfig, method: CacheMethod, *, device_bytes: int, weight_bytes: int, mesh=None,
                    host_bytes: Optional[int] = None, limit: int = 1 << 27) -> int:
  """The most tokens one sequence can hold on a device of ``device_bytes`` (each device of ``mesh``) beside
  ``weight_bytes``: its cache at that capacity holding a prompt (a multiple of the method's ``chunk_multiple``;
  a few decoded tokens more fit in ``RESERVE_BYTES``), a chunked prefill's
  held rows (one layer's keys and values in the model dtype, ``held_rows_bytes``), ``RESERVE_BYTES``, and twice the
  activations of a chunk of ``LONG_PROMPT_CHUNK`` tokens (the prefill plan leaves half the free memory to them), with
  its host arrays within ``host_bytes`` where given (``pinned_host_limit``); 0 when not even one chunk fits. The
  model's own context limit is not applied (a random model's RoPE runs at any position; a real checkpoint's
  ``max_position`` still bounds what ``generate`` takes). A binary search up to ``limit`` tokens."""
  step = method.chunk_multiple()
  # The held rows split with the KV heads (model) and with the token slots (seq): each device dequantizes its own.
  shards = sharding.axis_size(mesh, "model") * sharding.axis_size(mesh, sharding.SEQ_AXIS)

  def fits(n: int) -> bool:
    tokens = n * step
    need = (cache_bytes(method, cfg, 1, tokens, mesh, max_decode=0) + held_rows_bytes(cfg, 1, tokens) // shards
            + RESERVE_BYTES + 2 * LONG_PROMPT_CHUNK * prefill_bytes_per_token(cfg))
    return need + weight_bytes <= device_bytes and _host_fits(method, cfg, 1, tokens, mesh, host_bytes)

  return _largest(fits, limit // step) * step


class DeviceMemoryError(MemoryError):
  """A batch whose cache cannot fit the device (or, for host-resident arrays, the host memory XLA pins), refused
  before anything is allocated, or an allocation that failed later (then XLA's error, with its allocator report,
  is the ``__cause__``). The message is one line: what was asked, what it needs, what the device has, and the
  largest batch and context that fit; the numbers are attributes too, for a caller that retries smaller (0 where
  nothing fits)."""

  def __init__(self, message: str, *, need_bytes: int, free_bytes: int, largest_batch: int, largest_capacity: int):
    super().__init__(message)
    self.need_bytes = need_bytes  # the cache's device bytes (per device of a mesh)
    self.free_bytes = free_bytes  # the device's free bytes before the cache was allocated
    self.largest_batch = largest_batch  # sequences of the asked capacity that fit
    self.largest_capacity = largest_capacity  # tokens per sequence at which the asked batch fits


OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory")


def is_out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` is XLA's out-of-memory failure: an allocation at run time, a program too big to compile, or
  one that the compiler's autotuner, wrapping it in its own error, could not find room to try ("Out of memory while
  trying to allocate 5.66GiB", met while compiling prefill on a data mesh of 2 H200s)."""
  return isinstance(error, jax.errors.JaxRuntimeError) and any(word in str(error) for word in OUT_OF_MEMORY)


def out_of_memory_reason(error: BaseException) -> str:
  """XLA's reason in one line: from "Out of memory" (or else the status code) on, in the first line that says it;
  the rest of its message is a many-line allocator report."""
  for line in str(error).splitlines():
    at = min((line.find(word) for word in OUT_OF_MEMORY if word in line), default=-1)
    if at >= 0:
      return line[at:].removeprefix("RESOURCE_EXHAUSTED: ").rstrip(".")
  return str(error).splitlines()[0] if str(error) else type(error).__name__


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class CacheRequest:
  """A batch about to be allocated: ``batch`` sequences of ``capacity`` tokens with ``method``, prompts prefilled
  ``prompt_tokens`` (padded) tokens each, at most ``max_decode`` tokens decoded after them (None: any),
  optionally over a mesh."""

  cfg: ModelConfig
  method: CacheMethod
  batch: int
  capacity: int
  prompt_tokens: int
  mesh: Any = None
  max_decode: Optional[int] = None

  @property
  def spec(self) -> CacheSpec:
    return CacheSpec.for_model(self.cfg, self.batch, self.capacity, self.max_decode)

  @property
  def need_bytes(self) -> int:
    """The cache's device bytes (one device's share on a mesh)."""
    return cache_bytes(self.method, self.cfg, self.batch, self.capacity, self.mesh, self.max_decode)

  @property
  def host_bytes(self) -> int:
    """The cache's host bytes in this process (``host_cache_bytes``)."""
    return host_cache_bytes(self.method, self.cfg, self.batch, self.capacity, self.mesh)

  @property
  def allocation_bytes(self) -> int:
    """What the allocator takes for the cache's device arrays on one device: ``need_bytes`` with each array
    rounded up as XLA's GPU allocator rounds it."""
    return self.need_bytes + ALLOCATION_GRANULE * (len(jax.tree.leaves(self.method.abstract(self.spec),
                                                                       is_leaf=is_array_info)) + 1)

  def devices(self) -> list:
    """This process's devices the cache is allocated on: the mesh's, or the first device."""
    if self.mesh is None:
      return [jax.local_devices()[0]]
    return [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

  def error(self, problem: str, mem: dict, memory_kind: str = "device") -> DeviceMemoryError:
    """``problem`` (in ``memory_kind`` memory), then what the device has and what fits in the memory ``mem``
    (``device_memory``, read before the cache was allocated) and in the pinned host memory (``pinned_host_limit``)."""
    free = mem["limit"] - mem["in_use"]  # the weights, already placed, are in use
    fit = dict(device_bytes=free, weight_bytes=0, mesh=self.mesh, host_bytes=pinned_host_limit())
    batch = largest_batch(self.cfg, self.method, self.capacity, self.prompt_tokens, **fit)
    capacity = largest_capacity(self.cfg, self.method, self.batch, self.prompt_tokens, **fit)
    beside = f"beside a prefill and the {_gib(RESERVE_BYTES)} jkv keeps for XLA's work"
    if batch == 0 and capacity == 0:
      fits = f"not one sequence fits {beside}"
    else:
      fits = f"at most {batch} sequences of {self.capacity} tokens fit, or {self.batch} of {capacity} tokens ({beside})"
    if self.batch == 1:
      fits += f"; one sequence prefilled in chunks holds at most {longest_context(self.cfg, self.method, **fit)} tokens"
    device = ("each device" if self.mesh is not None else "the device") + f" ({jax.local_devices()[0].device_kind})"
    return DeviceMemoryError(
        f"out of {memory_kind} memory: {problem}; {device} has {_gib(free)} free of {_gib(mem['limit'])}"
        f"{allocator_limit_note()}; {fits}",
        need_bytes=self.need_bytes, free_bytes=free, largest_batch=batch, largest_capacity=capacity)

  def __str__(self) -> str:
    return (f"the cache of {self.batch} sequence{'s' if self.batch > 1 else ''} of {self.capacity} tokens with "
            f"{self.method.name} ({_gib(self.need_bytes)})")


def cache_fits(cfg: ModelConfig, method: CacheMethod, batch: int, capacity: int, mesh=None,
               max_decode: Optional[int] = None) -> bool:
  """Whether the cache of ``batch`` sequences of ``capacity`` tokens fits the free memory now (``guard``'s test; on
  a mesh one device's share); True where the memory is not known."""
  mem = available_memory()
  return mem is None or cache_bytes(method, cfg, batch, capacity, mesh, max_decode) <= mem["limit"] - mem["in_use"]


@contextlib.contextmanager
def guard(request: CacheRequest):
  """Around the allocation and use of a cache: refuse the request (``DeviceMemoryError``) when its cache alone
  exceeds the device's free memory, which no prefill sub-batching can help, make a growing allocator's pool ready
  to hold the cache in one block (``gather_pool``), and turn XLA's out-of-memory failure inside into a
  ``DeviceMemoryError`` saying the same. On a CPU the device's memory is the machine's
  (``available_memory``); nothing is checked where neither is known."""
  # Settings that cannot serve this model are their own one-line error, before their cache is sized.
  request.method.check(request.spec)
  mem = available_memory()
  if mem is not None and request.need_bytes > mem["limit"] - mem["in_use"]:
    raise request.error(f"{request} does not fit", mem)
  pinned = pinned_host_limit()
  if mem is not None and pinned is not None and request.host_bytes > pinned:
    raise request.error(f"{request} holds {_gib(request.host_bytes)} in host memory, more than the {_gib(pinned)} "
                        f"XLA pins at most (set {PINNED_HOST_LIMIT_ENV} before jax starts to raise it)", mem,
                        memory_kind="pinned host")
  if mem is not None and pinned is not None and request.host_bytes:
    _check_pinned_take(request, pinned, mem)
  gather_pool(request.allocation_bytes, request.devices())
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if mem is None or not is_out_of_memory(e):
      raise
    raise request.error(f"{request} fit, but XLA ran out beside it ({out_of_memory_reason(e)})", mem) from e


def _check_pinned_take(request: CacheRequest, pinned: int, mem: dict) -> None:
  """Refuse a host copy for which the pinned pool, growing by whole regions (``pinned_pool_take``), would leave the
  process less than ``HOST_RESERVE_BYTES`` of the machine's available memory: the pin would take nearly all of it and
  the process or its neighbours be killed for memory later, not refused."""
  host = host_memory()
  if host is None:
    return
  available = host["limit"] - host["in_use"]
  take = pinned_pool_take(request.host_bytes, pinned)
  if take + HOST_RESERVE_BYTES <= available:
    return
  tight = pinned_pool_limit_gib(request.host_bytes)
  if (tight << 30) + HOST_RESERVE_BYTES <= available:
    advice = f"set {PINNED_HOST_LIMIT_ENV}={tight} before jax starts, a pool that holds the copy and little more"
  else:
    advice = "not even a pool of the copy alone fits"
  raise request.error(
      f"{request} holds {_gib(request.host_bytes)} in host memory, and XLA's pinned pool, which grows by regions "
      f"of powers of two up to its limit of {_gib(pinned)}, would take {_gib(take)} of the {_gib(available)} this "
      f"machine has available, leaving less than the {_gib(HOST_RESERVE_BYTES)} the process needs ({advice})", mem,
      memory_kind="pinned host")


def tree_bytes(tree) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
