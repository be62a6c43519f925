"""What each device of a mesh holds, as planned and as allocated: the weights' shard, the cache's, one
prefill call and the reserve fit the device at the largest batch and one more step of the data axis does not; a
prefill sub-batch on a data mesh writes each device's own sequences (no cache-sized temporaries); XLA running out
of memory on a mesh is the one-line ``DeviceMemoryError``.

Needs 4 devices, fixed when jax is imported: in a process with fewer, one test runs this module again in a process
of its own with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and the others are skipped.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jkv import generate as gen
from jkv import memory, sharding
from jkv import params as params_lib
from jkv import prefill as prefill_lib
from jkv.cache import CacheSpec, KVCache
from jkv.config import ModelConfig
from jkv.methods import make_method

FOUR = jax.device_count() >= 4
on_four = pytest.mark.skipif(not FOUR, reason="needs 4 devices: test_on_four_cpu_devices runs it so")
CFG = ModelConfig("llama", vocab_size=128, embed=64, ffw_size=128, num_layers=2, q_heads=4, kv_heads=2, head_dim=32,
                  max_position=4096)
MESHES = ("data=2", "model=2", "data=2,model=2")
GIB = 1 << 30


@pytest.mark.skipif(FOUR, reason="this process has the devices: the tests below run here")
def test_on_four_cpu_devices():
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                         __file__],
                        env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  assert " passed" in proc.stdout, proc.stdout[-2000:]


def mesh_of(spec):
  sizes = sharding.parse_mesh(spec)
  return sharding.make_mesh(sizes, devices=jax.devices()[:sizes["data"] * sizes["model"]])


def on_device0(tree) -> int:
  """Bytes of ``tree``'s arrays that the first device holds, read from the arrays' shards."""
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


@pytest.fixture(scope="module")
def params():
  return params_lib.init_random(CFG, jax.random.key(0))


@on_four
@pytest.mark.parametrize("spec", MESHES)
def test_the_largest_batch_fits_each_device_as_allocated(params, spec, monkeypatch):
  """At ``largest_batch`` of a device whose size binds: the weights' and the cache's shards as allocated on device 0,
  the prefill call the plan makes (whole prompts, its sub-batch's activations and fresh state on device 0) and the
  reserve fit; one more sequence per data shard's cache does not."""
  mesh, method = mesh_of(spec), make_method("kivi", bits=2, residual=32)
  shards, width, capacity = sharding.axis_size(mesh, "data"), 256, 512
  placed = sharding.shard_params(params, CFG, mesh)
  weights = on_device0(placed)
  assert weights == sharding.param_bytes_per_device(CFG, mesh)
  one_sequence = memory.cache_bytes(method, CFG, 1, capacity)  # the whole of one sequence's state
  device = memory.RESERVE_BYTES + weights + 40 * one_sequence + np.random.default_rng().integers(one_sequence)
  batch = memory.largest_batch(CFG, method, capacity, width, device_bytes=device, weight_bytes=weights, mesh=mesh)
  assert batch > 4 * shards and batch % shards == 0
  monkeypatch.setattr(memory, "device_memory", lambda device_=None: dict(limit=device, in_use=weights, peak=0))
  plan = prefill_lib.plan(CFG, method, [width] * batch, capacity, mesh=mesh)
  assert (plan.chunk, plan.width) == (width, width) and shards <= plan.rows < batch and plan.rows % shards == 0
  spec_ = CacheSpec.for_model(CFG, batch, capacity)
  cache = sharding.create_cache(method, spec_, "xla", mesh)
  part = KVCache.create(cache.method, spec_.with_batch(plan.rows), "xla")  # what _prefill_rows fills per call
  held = on_device0((cache.state, cache.lengths))
  assert held == memory.cache_bytes(method, CFG, batch, capacity, mesh)
  # One device's prefill: its rows / data prompts' activations (counted whole over model: an upper estimate).
  prefill = plan.rows // shards * width * memory.prefill_bytes_per_token(CFG) + on_device0(part.state)
  assert weights + held + prefill + memory.RESERVE_BYTES <= device
  # The least prefill takes (``prefill_call_bytes``: a prompt and a fresh sequence on each device) holds one
  # prompt's fresh state as allocated on device 0, and with it one more sequence per data shard does not fit. (Not
  # the allocated state itself: the estimate rounds per prompt token, and the device's random slack can fall
  # between the two.)
  fresh = on_device0(part.state) * shards // plan.rows
  least = memory.prefill_call_bytes(CFG, method, capacity, width, mesh)
  assert width * memory.prefill_bytes_per_token(CFG) + fresh <= least
  more = memory.cache_bytes(method, CFG, batch + shards, capacity, mesh)
  assert weights + more + least + memory.RESERVE_BYTES > device
  # Each device holds 1 / (data x model) of the cache's codes, but of its per-sequence counters 1 / data.
  whole = memory.cache_bytes(method, CFG, batch, capacity)
  assert whole // (shards * sharding.axis_size(mesh, "model")) <= held <= whole // shards


def prefill_rows_memory(params, spec, batch, rows, width=64, capacity=1024):
  """The compiled prefill call of ``rows`` sequences of a batch on ``spec``'s mesh (or one device): its
  ``memory_analysis`` and the cache's bytes per device."""
  mesh = None if spec is None else mesh_of(spec)
  method = make_method("kivi", bits=2, residual=32)
  prompts = [list(range(1, width + 1))] * batch
  compiled = {}
  with sharding.use_mesh(mesh):
    plan = gen.plan_generation(CFG, method, prompts, max_new_tokens=capacity - width, capacity=capacity,
                               prefill_tokens=rows * width, mesh=mesh)
    run = gen._Generation(params, CFG, method, plan, gen.Greedy(), 0, mesh)
    run.prefills[0].warm(lambda fn, args, static: compiled.setdefault(fn, fn.lower(*args, **static).compile()),
                         run.params, run.cache)
  (program,) = compiled.values()
  assert plan.prefill.rows == rows
  return program.memory_analysis(), memory.cache_bytes(method, CFG, batch, capacity, mesh)


@on_four
@pytest.mark.parametrize("spec", ["data=2", "data=2,model=2"])
def test_a_sub_batch_on_a_data_mesh_needs_one_devices_temporaries(params, spec):
  """A sub-batch of one prompt per data shard needs what one prompt needs on one device, however large the cache: it
  writes each device's own sequences. Written at an offset of the whole batch, the partitioner gathered the cache
  (temporaries of twice each device's cache at data=2)."""
  alone, _ = prefill_rows_memory(params, None, batch=32, rows=1)
  mesh, cache = prefill_rows_memory(params, spec, batch=32, rows=2)
  assert mesh.temp_size_in_bytes <= alone.temp_size_in_bytes * 1.05 < cache
  assert mesh.alias_size_in_bytes >= cache  # the cache written in place


@on_four
def test_sub_batches_on_a_mesh_give_one_devices_tokens(params):
  """Sub-batches of a few sequences of each data shard (the last moved back to overlap) give the tokens of the whole
  batch prefilled at once on one device."""
  rng = np.random.default_rng()
  prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (9, 30, 17, 4, 28, 21)]
  method = make_method("kivi", bits=2, residual=32)
  run = lambda mesh, rows: gen.generate(params, CFG, prompts, method=method, max_new_tokens=6, chunk=6, eos_ids=(),
                                        prefill_tokens=rows * 32, mesh=mesh)
  got = run(mesh_of("data=2,model=2"), 4)  # 2 of each shard's 3 sequences a call: the second call overlaps
  assert got.stats["prefill_sub_batch"] == 4 and got.stats["prefill_calls"] == 2
  assert got.tokens == run(None, 6).tokens


@on_four
def test_xla_out_of_memory_while_compiling_on_a_mesh_is_one_line(params, monkeypatch):
  """The autotuner's failure met on 2 H200s, raised while prefill compiles on a data mesh: one line naming XLA's reason
  and the largest batch that fits each device."""
  free, capacity, batch = 11 * GIB, 512, 8
  monkeypatch.setattr(memory, "available_memory", lambda: dict(limit=12 * GIB, in_use=GIB, peak=0))
  report = "\n".join(f"allocator line {i}" for i in range(20))

  def warm(fn, args, static):
    if fn is prefill_lib._prefill_rows or fn is prefill_lib._prefill_chunk:
      raise jax.errors.JaxRuntimeError("INTERNAL: Failed to autotune: RESOURCE_EXHAUSTED: Out of memory while trying "
                                       f"to allocate 5.66GiB.\n{report}")
  monkeypatch.setattr(gen, "_warm", warm)
  method = make_method("kivi", bits=2, residual=32)
  with pytest.raises(memory.DeviceMemoryError) as e:
    gen.generate(params, CFG, [[3] * 100] * batch, method=method, max_new_tokens=capacity - 128, capacity=capacity,
                 mesh=mesh_of("data=2"))
  err, mesh = e.value, mesh_of("data=2")
  message = str(err)
  assert "\n" not in message and isinstance(e.value.__cause__, jax.errors.JaxRuntimeError)
  assert "XLA ran out beside it (Out of memory while trying to allocate 5.66GiB)" in message
  fits = memory.largest_batch(CFG, method, capacity, 128, device_bytes=free, weight_bytes=0, mesh=mesh)
  assert err.largest_batch == fits > batch and err.free_bytes == free
  assert f"each device ({jax.devices()[0].device_kind}) has 11.00 GiB free" in message
  assert f"at most {fits} sequences of {capacity} tokens fit" in message


def test_out_of_memory_is_recognised_inside_a_wrapping_error():
  wrapped = jax.errors.JaxRuntimeError("INTERNAL: autotuning: Out of memory while trying to allocate 1.00GiB.\nmore")
  assert memory.is_out_of_memory(wrapped) and memory.is_out_of_memory(jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Failed to allocate 8 bytes"))
  assert not memory.is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: a kernel failed"))
  assert not memory.is_out_of_memory(ValueError("Out of memory"))
  assert memory.out_of_memory_reason(wrapped) == "Out of memory while trying to allocate 1.00GiB"
  assert memory.out_of_memory_reason(jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Failed to allocate 8 bytes.\nreport")) == "Failed to allocate 8 bytes"
