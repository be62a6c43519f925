"""The largest batch and context jkv's out-of-memory line advises must really allocate and run.

On the H100 (benchmarks/results/robustness_gpu_nvidia_h100_80gb_hbm3.md, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``)
the advised 303 sequences of 4064 tokens (dense, the default model: 52.85 GiB with 58.85 GiB free) failed asking
for 26.42 GiB in ``jit_broadcast_in_dim``: the zeros that allocate the cache's second array, not a copy inside
prefill or decode. XLA's GPU allocator, growing its pool region by region, gave K a 32 GiB region, and what was left
of its limit could not hold V. ``jkv.memory.gather_pool`` grows the pool by one region that holds the whole cache
first. Here that allocator's growth rule is modelled (``GrowingPool``, after tsl::BFCAllocator::Extend) with the H100's
limit, and jkv's own guard, advice and placeholder run against it; the compiled prefill and decode are held to keep
the cache in place (no temporary the size of a cache array), which on the CPU they already do.
"""

import dataclasses
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import generate as gen
from jkv import memory
from jkv import params as params_lib
from jkv import prefill as prefill_lib
from jkv import sharding
from jkv.cache import CacheSpec, KVCache, is_array_info
from jkv.config import ModelConfig
from jkv.methods import make_method
from jkv.sampling import Greedy
from tests.conftest import random_prompts

GIB = 2**30
GATHER_POOL = memory.gather_pool
H100_LIMIT = 63763906560  # bytes_limit in the H100 run (75% of 80 GB, XLA's default fraction)
# The default model's shape (SmolLM2-135M), written out so nothing is loaded: only shapes are used here.
SMOLLM2 = ModelConfig("llama", vocab_size=49152, embed=576, ffw_size=1536, num_layers=30, q_heads=9, kv_heads=3,
                      head_dim=64, max_position=8192, tie_embeddings=True)


class GrowingPool:
  """XLA's GPU allocator (xla/tsl/framework/bfc_allocator.cc) with ``allow_growth`` (no preallocation), as far as
  where arrays can go: sizes rounded up to 256 bytes; an array goes to the smallest free chunk that holds it, else
  ``Extend`` adds a region of ``curr`` bytes (2 MiB at first, doubled until it holds the array, or doubled after a
  region it held anyway), but never more than ``limit`` less the regions taken; chunks never span regions; a freed
  chunk merges with its free neighbours in its region."""

  GRANULE = 256

  def __init__(self, limit):
    self.limit, self.pool, self.curr, self.regions = limit, 0, 2 << 20, []  # a region: a list of [bytes, in use]

  def stats(self):
    free = [c[0] for r in self.regions for c in r if not c[1]]
    return dict(limit=self.limit, pool=self.pool, largest_free=max(free, default=0))

  def in_use(self):
    return sum(c[0] for r in self.regions for c in r if c[1])

  def _best(self, n):
    fits = [(c[0], r, i) for r in self.regions for i, c in enumerate(r) if not c[1] and c[0] >= n]
    return min(fits, key=lambda f: f[0], default=None)

  def _extend(self, n):
    available = (self.limit - self.pool) // self.GRANULE * self.GRANULE
    if n > available:
      return False
    grew = False
    while n > self.curr:
      self.curr, grew = self.curr * 2, True
    size = min(self.curr, available)
    if not grew:
      self.curr *= 2
    self.pool += size
    self.regions.append([[size, False]])
    return True

  def alloc(self, nbytes):
    """A handle, or None: out of memory."""
    n = -(-max(nbytes, 1) // self.GRANULE) * self.GRANULE
    best = self._best(n) or (self._extend(n) and self._best(n))
    if not best:
      return None
    size, region, i = best
    region[i] = [n, True]
    if size > n:
      region.insert(i + 1, [size - n, False])
    return region, i

  def free(self, handle):
    region, i = handle
    region[i][1] = False
    for j in (i + 1, i):
      if 0 < j < len(region) and not region[j][1] and not region[j - 1][1]:
        region[j - 1][0] += region[j][0]
        del region[j]


class Placeholder:
  """What ``memory._claim`` returns, on the modelled allocator."""

  def __init__(self, pool, nbytes):
    self.pool, self.handle = pool, pool.alloc(nbytes)
    if self.handle is None:
      raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {nbytes} bytes.")

  def block_until_ready(self):
    return self

  def delete(self):
    self.pool.free(self.handle)


def on_the_modelled_h100(monkeypatch, gather=True):
  """A growing pool of the H100's limit holding the default model's fp32 weights, seen by jkv.memory."""
  pool = GrowingPool(H100_LIMIT)
  for leaf in jax.tree.leaves(params_lib.abstract(SMOLLM2)):
    assert pool.alloc(leaf.size * leaf.dtype.itemsize) is not None
  monkeypatch.setattr(memory, "available_memory",
                      lambda: dict(limit=pool.limit, in_use=pool.in_use(), peak=pool.in_use()))
  monkeypatch.setattr(memory, "allocator_pool", lambda device=None: pool.stats())
  monkeypatch.setattr(memory, "_claim", lambda nbytes, device: Placeholder(pool, nbytes))
  monkeypatch.setattr(memory, "gather_pool", GATHER_POOL if gather else lambda nbytes, devices: None)
  return pool


def allocate_in(pool, request):
  """The cache's device arrays, in the order KVCache.create allocates them (then the lengths), inside jkv's guard:
  whether every one found room."""
  with memory.guard(request):
    spec = CacheSpec.for_model(request.cfg, request.batch, request.capacity)
    infos = jax.tree.leaves(request.method.abstract(spec), is_leaf=is_array_info)
    return all(pool.alloc(n) is not None for n in [i.nbytes for i in infos] + [4 * request.batch])


@pytest.mark.parametrize("name, options, prompts", [("dense", {}, 1024), ("kivi", dict(bits=2), 4096)])
def test_the_advised_batch_and_context_allocate_in_a_growing_pool(name, options, prompts, monkeypatch):
  """A command that once ran out of memory (1024 prompts of 64 padded tokens, 4000 new tokens; 4096 prompts for
  KIVI-2, whose cache of 1024 fits) is refused; the largest batch and the longest context the refusal names then
  allocate on the modelled H100."""
  method = make_method(name, **options)
  pool = on_the_modelled_h100(monkeypatch)
  capacity = gen.plan_capacity(SMOLLM2, method, [40], 4000, 32)
  with pytest.raises(memory.DeviceMemoryError) as e:
    allocate_in(pool, memory.CacheRequest(SMOLLM2, method, prompts, capacity, 64))
  advice = e.value
  assert advice.largest_batch > 0 and advice.largest_capacity >= 64
  for batch, cap in ((advice.largest_batch, capacity), (prompts, advice.largest_capacity)):
    pool = on_the_modelled_h100(monkeypatch)
    stranded = pool.pool - pool.in_use()  # free in the weights' regions: no use to a large array
    assert allocate_in(pool, memory.CacheRequest(SMOLLM2, method, batch, cap, 64)), (batch, cap)
    # Beside the cache, XLA's work finds one free block of the reserve the advice kept, less what the weights'
    # regions strand (the advice's prefill term covers the arrays' rounding).
    assert pool.stats()["largest_free"] >= memory.RESERVE_BYTES - stranded


def test_without_gathering_the_advised_dense_cache_fails_as_on_the_h100(monkeypatch):
  """The H100's failure, reproduced by the model: the weights' regions come to 1 GiB, K (26.42 GiB) gets a 32 GiB
  region, and V finds 26.38 GiB left to grow into."""
  method = make_method("dense")
  pool = on_the_modelled_h100(monkeypatch, gather=False)
  assert pool.pool == GIB
  request = memory.CacheRequest(SMOLLM2, method, 303, 4064, 64)
  assert f"{memory.cache_bytes(method, SMOLLM2, 303, 4064) / 2 / GIB:.2f}" == "26.42"
  assert not allocate_in(pool, request)
  assert pool.pool == 33 * GIB  # the weights' regions and K's; V's region was refused
  assert allocate_in(on_the_modelled_h100(monkeypatch), request)  # gathered first, it fits


# ------------------------------------------------------------------------------------- gather_pool on its own


def recording_claims(monkeypatch):
  claims = []
  real = memory._claim

  def claim(nbytes, device):
    claims.append(real(nbytes, device))
    return claims[-1]
  monkeypatch.setattr(memory, "_claim", claim)
  return claims


@pytest.mark.parametrize("pool, claimed", [
    (None, False),  # CPU, or a preallocated pool: nothing to gather
    (dict(limit=10 * GIB, pool=GIB, largest_free=(1 << 19)), True),
    (dict(limit=10 * GIB, pool=GIB, largest_free=2 * (1 << 20)), False),  # a free block holds it already
    (dict(limit=GIB + (1 << 19), pool=GIB, largest_free=0), False),  # no region of it could grow: left to fail
])
def test_gather_pool_claims_a_placeholder_only_where_it_helps(pool, claimed, monkeypatch):
  monkeypatch.setattr(memory, "allocator_pool", lambda device=None: pool)
  claims = recording_claims(monkeypatch)
  memory.gather_pool(1 << 20, jax.local_devices()[:1])
  assert len(claims) == claimed
  if claimed:
    assert claims[0].nbytes >= 1 << 20 and claims[0].is_deleted()


def test_a_placeholder_that_does_not_fit_is_let_go(monkeypatch):
  monkeypatch.setattr(memory, "allocator_pool", lambda device=None: dict(limit=10 * GIB, pool=GIB, largest_free=0))
  oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00MiB.")
  monkeypatch.setattr(memory, "_claim", lambda nbytes, device: (_ for _ in ()).throw(oom))
  memory.gather_pool(1 << 20, jax.local_devices()[:1])  # no error: the cache's own allocation will say
  monkeypatch.setattr(memory, "_claim", lambda nbytes, device: (_ for _ in ()).throw(
      jax.errors.JaxRuntimeError("INTERNAL: not memory")))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    memory.gather_pool(1 << 20, jax.local_devices()[:1])


def test_generate_gathers_the_pool_before_it_allocates_the_cache(tiny_llama, monkeypatch):
  _, m = tiny_llama
  monkeypatch.setattr(memory, "allocator_pool", lambda device=None: dict(limit=64 * GIB, pool=GIB, largest_free=0))
  claims = recording_claims(monkeypatch)
  created = []
  real_create = sharding.create_cache

  def create_cache(method, spec, impl, mesh):
    assert claims and all(c.is_deleted() for c in claims), "the cache was allocated before the pool was gathered"
    created.append(real_create(method, spec, impl, mesh))
    return created[-1]
  monkeypatch.setattr(sharding, "create_cache", create_cache)
  method = make_method("kivi", bits=2, residual=32)
  out = gen.generate(m.params, m.config, random_prompts(m.config.vocab_size, [5, 9]), method=method,
                     max_new_tokens=3)
  assert len(created) == 1 and len(claims) == 1
  assert claims[0].nbytes >= out.stats["allocated_kv_bytes"] + 4 * 2  # the arrays and the lengths


# ------------------------------------------------------------------------- the compiled prefill and decode step


def compiled_decode_step(cfg, cache, batch: int, speculative_rows: int = 0):
  """``jkv.generate``'s decode chunk (two greedy steps) compiled for an abstract cache and the abstract weights."""
  S, flags = jax.ShapeDtypeStruct, jax.ShapeDtypeStruct((batch,), bool)
  return gen._decode_chunk.lower(params_lib.abstract(cfg), cache, S((batch,), jnp.int32),
                                 S((batch, speculative_rows), jnp.int32), flags, flags, S((batch, 2), jnp.int32),
                                 jax.random.key(0), S((1,), jnp.int32), S((), jnp.int32), cfg=cfg, sampler=Greedy(),
                                 steps=2).compile()


@pytest.mark.parametrize("name, options", [("dense", {}), ("kivi", dict(bits=2))])
def test_compiled_prefill_and_decode_hold_no_copy_of_the_cache(name, options):
  """Compiled for the default model's shape (nothing is allocated): the donated cache is the output, in place
  (aliased bytes = the cache's), and the temporaries stay below what one layer can need beside the cache -- the
  layer's weights (the layer scan may copy its slice of the stacked weights), the activations of the call's tokens
  (``prefill_bytes_per_token``, plus fp32 logits and a sampling temporary per token), every cache array's slice
  of one layer twice (read and written) and one attention block -- which is below the largest cache array: a copy
  of one would not pass."""
  cfg, B, C, rows, T = SMOLLM2, 16, 4096, 1, 64
  method = make_method(name, **options)
  cache = jax.eval_shape(lambda: KVCache.create(method, CacheSpec.for_model(cfg, B, C), "xla"))
  leaves = [x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)]
  cache_bytes = sum(leaves)
  params = params_lib.abstract(cfg)
  layer_weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params.layers)) // cfg.num_layers

  # The XLA attention path's block of up to 512 cached tokens: its keys and values dequantized and its logits, fp32
  # (on the GPU XLA keeps these apart where the CPU fuses them).
  block = 4 * 512 * B * cfg.kv_heads * (2 * cfg.head_dim + cfg.q_per_kv)

  def bound(tokens, sequences, fresh):
    return (layer_weights + memory.prefill_bytes_per_token(cfg) * tokens + 2 * 4 * cfg.vocab_size * sequences
            + 2 * cache_bytes // cfg.num_layers + block + fresh)
  # A prefill call of ``rows`` sequences fills a fresh state of theirs (rows / B of the cache), then writes it in.
  prefill_bound, decode_bound = bound(rows * T, rows, rows * cache_bytes // B), bound(B, B, 0)
  assert max(prefill_bound, decode_bound) < max(leaves)

  S = jax.ShapeDtypeStruct
  prefill = prefill_lib._prefill_rows.lower(params, S((rows, T), jnp.int32), S((rows,), jnp.int32), cache,
                                            S((), jnp.int32), cfg=cfg).compile().memory_analysis()
  decode = compiled_decode_step(cfg, cache, B).memory_analysis()
  for what, analysis, limit in (("prefill", prefill, prefill_bound), ("decode", decode, decode_bound)):
    assert analysis.alias_size_in_bytes == cache_bytes, what
    assert analysis.temp_size_in_bytes < limit, (what, analysis.temp_size_in_bytes, limit)


@pytest.mark.parametrize("name, options", [
    ("kivi", dict(bits=2)), ("kivi", dict(bits=2, mma=True)), ("zipcache", {}), ("dense", {}),
    pytest.param("ott", dict(bits=2), marks=pytest.mark.xfail(jax.default_backend() == "cpu", strict=True, reason=(
        "XLA on the CPU copies OTT's two stacked window arrays twice per layer and step (the GPU's compiled step "
        "does not: seen on an H200); without the block event's read of the window rows (which the arriving "
        "token's write then replaces) the copies go, but an optimization barrier, or ordering the write after "
        "the event's conditional, did not remove them: not yet pinned down")))])
def test_the_compiled_decode_step_copies_no_cache_array(name, options):
  """The optimized program of the decode step (the default model's shape, compiled for this machine) holds no
  copy instruction the size of a whole stacked cache array. The methods that flush only the sequences that are due
  (KIVI, ZipCache, SpeCache) read those sequences' slices of a stacked array; mapped over the array's batch axis,
  that read made XLA copy the whole array, every layer, into a batch-major layout on each flush (3 copies a step
  for KIVI-2, 12 for ZipCache, on the CPU), which the temporaries' size does not show: the copy lands in the
  donated buffer."""
  cfg, B, C = SMOLLM2, 16, 4096
  method = make_method(name, **options)
  cache = jax.eval_shape(lambda: KVCache.create(method, CacheSpec.for_model(cfg, B, C), "xla"))
  text = compiled_decode_step(cfg, cache, B, method.speculative_rows).as_text()
  # The arrays that grow with the context (at this shape, every cache array of a MiB or more).
  sizes = {x.size for x in jax.tree.leaves(cache)
           if x.shape[:1] == (cfg.num_layers,) and x.size * x.dtype.itemsize >= 2**20}
  copies = [m.group(0) for m in re.finditer(r"\w+\[([\d,]+)\]\S* copy\(", text)]
  whole = [c for c in copies if math.prod(int(d) for d in c[c.index("[") + 1:c.index("]")].split(",")) in sizes]
  assert copies and not whole, whole  # copies of smaller arrays there are


def test_the_default_prefill_sub_batch_counts_its_own_fresh_state(tiny_llama, monkeypatch):
  """With the device's memory known, where the whole batch's activations do not fit, the prefill sub-batch is what
  half the free memory beside the cache holds of each sequence's activations and its fresh state at the cache's
  capacity (``prefill_token_budget``), not of activations alone. The plan is made before the cache is allocated,
  so the device reports the cache's bytes as free and the budget takes them out."""
  _, m = tiny_llama
  cfg, method, prompts = m.config, make_method("dense"), random_prompts(m.config.vocab_size, [9] * 200)
  new_tokens = 1000 - 9 - 32
  cap = gen.plan_capacity(cfg, method, [9], new_tokens, 32)
  per_sequence = 16 * memory.prefill_bytes_per_token(cfg) + memory.cache_bytes(method, cfg, 1, cap)
  need = memory.cache_bytes(method, cfg, len(prompts), cap)
  assert 200 * 16 * memory.prefill_bytes_per_token(cfg) > 10 * per_sequence  # the whole batch does not fit
  monkeypatch.setattr(memory, "RESERVE_BYTES", 0)
  monkeypatch.setattr(memory, "device_memory", lambda device=None: dict(
      limit=GIB + need + 21 * per_sequence, in_use=GIB, peak=GIB))  # half holds 10.5 sequences
  # Every token ends a sequence: the sub-batch is planned and prefill runs as asked, then no decode step runs.
  out = gen.generate(m.params, cfg, prompts, method=method, max_new_tokens=new_tokens, eos_ids=range(cfg.vocab_size))
  assert out.stats["prefill_sub_batch"] == 10 and out.stats["decode_steps"] == 0


def test_a_host_copy_past_the_pinned_pool_is_refused_in_one_line_and_bounds_the_advice(monkeypatch):
  """SpeCache's 16-bit host copy against the host memory XLA pins (``pinned_host_limit``, a pool one byte short of
  the request here): the guard refuses before allocating, in one line naming the variable that raises the pool;
  the largest batch and the longest context it advises are the largest whose host copy fits (brute force)."""
  method = make_method("specache")
  request = memory.CacheRequest(SMOLLM2, method, batch=4, capacity=4096, prompt_tokens=4000)
  pool = request.host_bytes - 1
  assert request.host_bytes > 0
  monkeypatch.setattr(memory, "available_memory", lambda: dict(limit=1 << 50, in_use=0, peak=0))
  monkeypatch.setattr(memory, "gather_pool", lambda nbytes, devices: None)
  monkeypatch.setattr(memory, "pinned_host_limit", lambda: pool)
  with pytest.raises(memory.DeviceMemoryError) as e:
    with memory.guard(request):
      pass
  text = str(e.value)
  assert "\n" not in text and text.startswith("out of pinned host memory") and memory.PINNED_HOST_LIMIT_ENV in text
  host = lambda batch, capacity: memory.host_cache_bytes(method, SMOLLM2, batch, capacity)
  batch = e.value.largest_batch
  assert host(batch, 4096) <= pool < host(batch + 1, 4096) and batch == 3
  free = dict(device_bytes=1 << 50, weight_bytes=0)
  longest = memory.longest_context(SMOLLM2, method, host_bytes=pool, **free)
  step = method.chunk_multiple()
  assert host(1, longest) <= pool < host(1, longest + step)
  assert memory.longest_context(SMOLLM2, method, **free) > longest  # the device alone would hold more
  monkeypatch.setattr(memory, "pinned_host_limit", lambda: request.host_bytes)
  with memory.guard(request):  # exactly the pool: allowed
    pass


def test_the_pinned_pool_is_xlas_variable_on_a_gpu_only(monkeypatch):
  monkeypatch.setenv(memory.PINNED_HOST_LIMIT_ENV, "3")
  assert memory.pinned_host_limit() is None  # CPU: host arrays are ordinary memory
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert memory.pinned_host_limit() == min(3 * GIB, memory.host_memory()["limit"])
  monkeypatch.delenv(memory.PINNED_HOST_LIMIT_ENV)
  assert memory.pinned_host_limit() == min(64 * GIB, memory.host_memory()["limit"])


def test_the_pinned_pool_takes_the_region_xlas_allocator_grows_for_a_host_copy():
  """``pinned_pool_take`` against the allocator model above, from an empty pool, for random copy sizes (just over and
  under powers of two among them) and limits: up to twice the copy, never past the limit; and the limit
  ``pinned_pool_limit_gib`` advises holds the copy with at most 2 GiB pinned beyond it."""
  rng = np.random.default_rng(0)
  sizes = [int(x) for x in rng.integers(1 << 20, 100 * GIB, 20)] + [32 * GIB + 2**22, 64 * GIB, 64 * GIB + 2**23]
  for size in sizes:
    for limit in (64 * GIB, 112 * GIB, 200 * GIB):
      pool = GrowingPool(limit)
      if pool.alloc(size) is None:
        assert size > limit
        continue
      assert memory.pinned_pool_take(size, limit) == pool.pool
    tight = GrowingPool(memory.pinned_pool_limit_gib(size) * GIB)
    assert tight.alloc(size) is not None and tight.pool - size <= 2 * GIB


def test_a_host_copy_whose_pool_would_leave_the_machine_too_little_is_refused_naming_the_limit_to_set(monkeypatch):
  """Measured on an H200: a 64.008 GiB host copy under a limit of 112 GiB pins 112 (``pinned_pool_take``). With
  the machine's available memory below that plus ``HOST_RESERVE_BYTES``, the guard refuses in one line that names
  the limit which holds the copy; with not even that room, it says so; with room, it allows."""
  method = make_method("specache")
  cfg = dataclasses.replace(SMOLLM2, max_position=1 << 20)
  request = memory.CacheRequest(cfg, method, batch=2, capacity=200704, prompt_tokens=200000)
  copy = request.host_bytes  # 8.6 GiB: the pool's region is 16, the limit to advise 10
  limit = 4 * copy  # the pool's region for the copy: twice it (a power of two past it), below the limit
  take = memory.pinned_pool_take(copy, limit)
  assert copy < take <= 2 * copy
  monkeypatch.setattr(memory, "available_memory", lambda: dict(limit=1 << 50, in_use=0, peak=0))
  monkeypatch.setattr(memory, "gather_pool", lambda nbytes, devices: None)
  monkeypatch.setattr(memory, "pinned_host_limit", lambda: limit)
  tight = memory.pinned_pool_limit_gib(copy)

  def guard_with(available):
    monkeypatch.setattr(memory, "host_memory", lambda: dict(limit=1 << 50, in_use=(1 << 50) - available, peak=0))
    with memory.guard(request):
      pass

  reserve = memory.HOST_RESERVE_BYTES
  guard_with(take + reserve)  # just enough: allowed
  with pytest.raises(memory.DeviceMemoryError) as e:
    guard_with(take + reserve - 1)
  text = str(e.value)
  assert "\n" not in text and text.startswith("out of pinned host memory")
  assert f"{memory.PINNED_HOST_LIMIT_ENV}={tight} " in text
  with pytest.raises(memory.DeviceMemoryError) as e:
    guard_with((tight << 30) + reserve - 1)
  assert "not even a pool of the copy alone fits" in str(e.value)


@pytest.mark.parametrize("lengths, prefill_chunk, saved", [
    ([700, 301], None, False), ([1000, 301], 600, False), ([1000], 96, True), ([40, 7], None, True)])
def test_the_jkv_commands_pool_estimate_holds_the_host_copy_generate_allocates(tiny_llama, tmp_path, lengths,
                                                                               prefill_chunk, saved):
  """What ``jkv generate`` sizes the pinned pool by, before any device (``cli._host_copy_bytes``), against the host
  copy of the capacity ``generate`` plans for the same prompts: whole, in chunks whose width passes the prompt's
  bucket, and continuing a saved cache (of one sequence, whose tokens come first). At least that copy, and at
  most about what a chunk-multiple allowance per chunk adds."""
  from jkv import cli
  _, m = tiny_llama
  method = make_method("specache", bits=1, residual=32, fetch_rows=8)
  cache = None
  if saved:
    cache = str(tmp_path / "doc.cache")
    gen.generate(m.params, m.config, random_prompts(m.config.vocab_size, [500], seed=4), method=method,
                 max_new_tokens=1, save_cache=cache)
  ids = random_prompts(m.config.vocab_size, lengths, seed=3)
  argv = ["generate", "--method", "specache", "--max-new-tokens", "5", "x"]
  argv += ["--prefill-chunk", str(prefill_chunk)] if prefill_chunk else []
  argv += ["--cache", cache] if cache else []
  estimate = cli._host_copy_bytes(m.config, method, ids, cli.build_parser().parse_args(argv))
  plan = gen.plan_generation(m.config, method, ids, max_new_tokens=5, prefill_chunk=prefill_chunk, cache=cache)
  allocated = memory.host_cache_bytes(method, m.config, len(ids), plan.capacity)
  per_token = memory.host_cache_bytes(method, m.config, len(ids), 1)
  assert allocated <= estimate <= allocated + (2 * max(lengths) + 66 * method.chunk_multiple()) * per_token


def test_the_jkv_command_sizes_the_pinned_pool_before_the_gpu_client_starts_and_keeps_the_users(monkeypatch):
  """At the program's start 90% of the machine's memory; with the cache's host copy known before any device, a
  pool that holds it and little more; nothing once the GPU client has started, and never over the user's value."""
  from jax._src import xla_bridge
  from jkv import cli
  assert cli.PINNED_HOST_LIMIT_ENV == memory.PINNED_HOST_LIMIT_ENV
  env = memory.PINNED_HOST_LIMIT_ENV
  monkeypatch.setattr(cli, "_pool_limit_set", None)
  monkeypatch.delenv(env, raising=False)
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  cli.size_pinned_host_pool()
  assert os.environ[env] == str(int(0.9 * total) >> 30)
  copy = 33 * GIB + 5
  cli.size_pinned_host_pool(copy)  # in this process the backend has started: too late
  assert os.environ[env] == str(int(0.9 * total) >> 30)
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  cli.size_pinned_host_pool(0)  # no host copy: the start's pool stays
  assert os.environ[env] == str(int(0.9 * total) >> 30)
  cli.size_pinned_host_pool(copy)
  assert os.environ[env] == str(memory.pinned_pool_limit_gib(copy)) == "35"
  monkeypatch.setenv(env, "7")  # the user's, after jkv's
  cli.size_pinned_host_pool()
  cli.size_pinned_host_pool(copy)
  assert os.environ[env] == "7"
