"""Where a decode step's time goes on the GPU: a profiler trace of jkv's decode loop, summed per kernel.

A randomly initialized Llama-3-8B-shaped model (as in generate_decode.py), a cache of one method at batch B holding
``--context`` tokens per sequence (the cache's contents do not change the work; ZipCache's pool counters set as a
prefill of that length leaves them, ``ZipCache.synthetic_fill``), and ``--steps`` greedy decode steps
run by ``jkv.generate``'s own decode chunk (``jkv.generate._decode_chunk``: one ``lax.scan``, the cache donated; a
method with a speculative row steps [real, speculative] rows after its pre-decode pass), compiled with jkv's
MODEL_COMPILER_OPTIONS (``--xla-defaults`` for XLA's own options). The cache and every argument are built and
committed as generate builds them (``jkv.sharding.create_cache``, ``jkv.generate.committed``), so a method's
host-resident arrays (SpeCache's 16-bit copy, ``pinned_host``) stay in host memory; the script checks that the
compiled step takes and returns each cache array in the memory kind its abstract state declares. The chunk is
compiled once and run, then run again under ``jax.profiler.trace``; the device events of that second run are
grouped by kernel name and reported per step beside the step's wall time and its floor (weights + the cache's held
bytes at the device copy rate), so the gap between the two has names.

    python benchmarks/profile_decode_step.py --method dense --out $OUT/profile_dense.json   # on the GPU
    python benchmarks/profile_decode_step.py --method specache1 --context 32704 --out $OUT/profile_specache1.json
    python benchmarks/profile_decode_step.py --smoke                                         # any machine
"""

import argparse
import collections
import datetime
import glob
import json
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import generate_decode
import specache_decode
from generate_decode import LLAMA3_8B, SMOKE, copy_rate
from jkv import context_parallel
from jkv import generate as gen
from jkv import memory
from jkv import params as params_lib
from jkv import sharding
from jkv.attention import choose_impl
from jkv.cache import CacheSpec, is_array_info
from jkv.config import ModelConfig
from jkv.methods import make_method
from jkv.methods.zipcache import ZipCache
from jkv.sampling import Greedy
from jkv.xla_options import MODEL_COMPILER_OPTIONS


METHODS = {**generate_decode.METHODS, **specache_decode.METHODS,  # dense, KIVI-2/4, the SpeCache variants
           "zipcache": ("zipcache", {})}


def compile_step(args, cfg, steps, compiler_options, xla_defaults):
  """jkv.generate's decode chunk (``_decode_chunk``: ``steps`` greedy steps in one scan, the cache donated; tokens
  [B] and, for a speculative method, its speculative tokens [B, 1], as generate feeds them) compiled ahead of time
  for ``args``. Calling the result runs that one executable: an argument placed otherwise than at compilation (its
  memory kind, whether it is committed) is an error, never a second, different compilation.

  ``compiler_options`` are added to (or override) the MODEL_COMPILER_OPTIONS the chunk is jitted with;
  ``xla_defaults`` jits the same function again without those (options can be overridden at compilation, not
  removed).
  """
  fn = gen._decode_chunk
  if xla_defaults:
    fn = jax.jit(fn.__wrapped__, static_argnames=("cfg", "sampler", "steps"), donate_argnames=("cache",))
  return fn.lower(*args, cfg=cfg, sampler=Greedy(), steps=steps).compile(compiler_options or None)


def check_memory_kinds(cache, step):
  """{memory kind: [state array names]} of the cache as its method's abstract state declares it; raises unless
  every array as passed, as the compiled ``step`` takes it and as it returns it lives in that kind. A host-resident
  array (SpeCache's 16-bit copy, 32 GiB at B=8, 32k) that lands on the device takes its whole size there, twice
  when its donated input and its output cannot share a buffer."""
  declared = jax.tree_util.tree_flatten_with_path(cache.abstract(), is_leaf=is_array_info)[0]
  seen = dict(passed=[x.sharding for x in jax.tree.leaves(cache.state)],
              taken=jax.tree.leaves(step.input_shardings[0][1].state),
              returned=jax.tree.leaves(step.output_shardings[0].state))
  kinds = collections.defaultdict(list)
  for i, (path, info) in enumerate(declared):
    name = jax.tree_util.keystr(path).lstrip(".")
    kinds[info.memory_kind].append(name)
    for where, shardings in seen.items():
      if shardings[i].memory_kind != info.memory_kind:
        raise RuntimeError(f"cache array {name} is {where} in {shardings[i].memory_kind} memory; its method "
                           f"declares {info.memory_kind}")
  return dict(kinds)


def device_events(trace_dir):
  """{device plane: {line name: [(event name, duration ns), ...]}} of the GPU planes of the trace in ``trace_dir``:
  each device's streams of kernels and copies, and XLA's own summary lines ("XLA Ops", "XLA Modules")."""
  from jax.profiler import ProfileData
  planes = collections.defaultdict(lambda: collections.defaultdict(list))
  for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
          planes[plane.name][line.name] += [(event.name, event.duration_ns) for event in line.events]
  return planes


SUMMARY_LINES = ("XLA Ops", "XLA Modules", "Steps", "Source")


def kernel_events(lines):
  """The kernel and copy events of one device's lines (its streams), without XLA's summary lines."""
  return [e for name, events in lines.items() if not any(s in name for s in SUMMARY_LINES) for e in events]


def trace_decode(params, cfg, method, *, batch, context, steps, mesh=None, compiler_options=None, xla_defaults=False):
  """``steps`` decode steps of jkv.generate's decode chunk over a cache of ``batch`` sequences holding ``context``
  tokens, on ``mesh`` (None: one device), built, placed and committed as generate does it (the cache by
  ``sharding.create_cache``, the per-sequence arguments by ``sharding.rows``; a speculative method's pre-decode
  pass first). Compiled once, run once, timed three times, then traced.

  Returns dict(wall_ms: median wall time per step, planes: ``device_events`` of the traced run, cache: the cache
  after it, kinds: ``check_memory_kinds``, hlo: the compiled chunk's optimized HLO text, when called).
  """
  capacity = context_parallel.split_capacity(gen.round_up(context + steps, method.capacity_multiple()), method, mesh)
  with sharding.use_mesh(mesh):
    # Sized as generate sizes a cache that decodes ``steps`` tokens after its prompts (``CacheSpec.max_decode``).
    cache = sharding.create_cache(method, CacheSpec.for_model(cfg, batch, capacity, steps), choose_impl(), mesh)
    params, cache = gen.committed((params, cache))
    where = cache.lengths.sharding

    def filled(cache):
      """The cache holding ``context`` tokens of each sequence again, so that every run decodes the same steps: its
      lengths (donated with it), and ZipCache's pool counters (``ZipCache.synthetic_fill``: its pools are laid out
      by counters of its own, not by the lengths)."""
      if isinstance(method, ZipCache):
        state = method.synthetic_fill(cache.state, np.full((batch,), context))
        cache = cache.replace(state=jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), state, cache.state))
      return cache.replace(lengths=jax.device_put(jnp.full((batch,), context, jnp.int32), where))
    cache = filled(cache)
    first, no, counts, rng, eos, pad = sharding.rows(gen.committed((
        jnp.ones((batch,), jnp.int32), jnp.zeros((batch,), bool), jnp.zeros((batch, 2), jnp.int32),
        jax.random.key(0), jnp.asarray((-1,), jnp.int32), jnp.int32(0))), mesh)  # eos -1: every step runs
    # spec [B, S]: a speculative method's pre-decode pass (SpeCache's first top-k and fetch) gives its first
    # speculative tokens, as in generate; [B, 0] for the others.
    spec, cache = gen.speculative_start(params, cfg, cache, first)
    spec = sharding.rows(spec, mesh)
    decode_args = lambda cache, last, spec: (params, cache, last, spec, no, no, counts, rng, eos, pad)
    step = compile_step(decode_args(cache, first, spec), cfg, steps, compiler_options, xla_defaults)
    kinds = check_memory_kinds(cache, step)

    def run(cache, last, spec):
      cache, last, spec = jax.block_until_ready(step(*decode_args(cache, last, spec)))[:3]
      # Placed as the step takes them (a mesh's partitioner may return another placement), as generate does.
      return cache, *sharding.rows((last, spec), mesh)

    cache, last, spec = run(cache, first, spec)  # first run
    walls = []
    for _ in range(3):
      start = time.perf_counter()
      cache, last, spec = run(filled(cache), last, spec)
      walls.append((time.perf_counter() - start) / steps)
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        cache, last, spec = run(filled(cache), last, spec)
      planes = device_events(trace_dir)
  return dict(wall_ms=1e3 * statistics.median(walls), planes=planes, cache=cache, kinds=kinds, hlo=step.as_text)


def summarize(events, steps, top):
  """Rows {name, us_per_step, calls_per_step} for the ``top`` names by total time."""
  totals, counts = collections.defaultdict(int), collections.Counter()
  for name, ns in events:
    totals[name] += ns
    counts[name] += 1
  return [dict(name=name, us_per_step=ns / 1e3 / steps, calls_per_step=counts[name] / steps)
          for name, ns in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--method", choices=sorted(METHODS), default="dense")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--context", type=int, default=8192)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--top", type=int, default=30)
  parser.add_argument("--smoke", action="store_true", help="a tiny model (any machine)")
  parser.add_argument("--kv-heads", type=int, help="the model's KV heads (default the shape's)")
  parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                      help="an XLA option for the decode loop's compilation (repeatable; on top of jkv's "
                           "MODEL_COMPILER_OPTIONS), e.g. xla_gpu_enable_triton_gemm=true")
  parser.add_argument("--xla-defaults", action="store_true",
                      help="compile without jkv.xla_options.MODEL_COMPILER_OPTIONS (XLA's own defaults)")
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--hlo", type=pathlib.Path, help="also write the compiled chunk's optimized HLO here (the "
                      "fusions the trace names)")
  args = parser.parse_args()

  shape = SMOKE if args.smoke else LLAMA3_8B
  cfg = ModelConfig(**dict(shape, **({"kv_heads": args.kv_heads} if args.kv_heads else {})))
  batch, context, steps = (2, 64, 4) if args.smoke else (args.batch, args.context, args.steps)
  name, options = METHODS[args.method]
  method = make_method(name, **options)
  params = params_lib.init_random(cfg, jax.random.key(0))
  weight_bytes = memory.tree_bytes(params)
  rate = 1e10 if args.smoke else copy_rate()
  compiler_options = {} if args.xla_defaults else dict(MODEL_COMPILER_OPTIONS)
  extra = {}
  for item in args.compiler_option:
    key, value = item.split("=", 1)
    extra[key] = {"true": True, "false": False}.get(value.lower(), value)
  compiler_options.update(extra)
  traced = trace_decode(params, cfg, method, batch=batch, context=context, steps=steps, compiler_options=extra,
                        xla_defaults=args.xla_defaults)
  kinds = traced["kinds"]
  if args.hlo:
    args.hlo.parent.mkdir(parents=True, exist_ok=True)
    args.hlo.write_text(traced["hlo"]())
  print("cache memory kinds (declared, passed, taken and returned by the step):",
        {kind: names if kind != "device" else f"{len(names)} arrays" for kind, names in kinds.items()})
  kv = traced["cache"].held_bytes(jnp.full((batch,), context + steps // 2))
  kv_bytes = kv.device  # the floor's: a step reads of the host copy only the rows it fetches

  # Device memory the process reached (a host-resident array copied to the device would show here whole).
  stats = jax.devices()[0].memory_stats() or {}
  device_peak = stats.get("peak_bytes_in_use")
  lines = {name: events for plane in traced["planes"].values() for name, events in plane.items()}  # one GPU
  kernels = kernel_events(lines)
  ops = [e for name, events in lines.items() if "XLA Ops" in name for e in events]
  kernel_ms = sum(ns for _, ns in kernels) / 1e6 / steps
  wall_ms = traced["wall_ms"]
  floor_ms = 1e3 * (weight_bytes + kv_bytes) / rate
  print(f"{args.method} B={batch} context={context}: {wall_ms:.2f} ms/step wall, {kernel_ms:.2f} ms/step in kernels, "
        f"floor {floor_ms:.2f} ms ({(weight_bytes + kv_bytes) / 2**30:.2f} GiB at {rate / 1e12:.2f} TB/s)")
  if device_peak is not None:
    print(f"device memory peak {device_peak / 2**30:.2f} GiB (weights {weight_bytes / 2**30:.2f} GiB, "
          f"device KV {kv_bytes / 2**30:.2f} GiB, host KV {kv.host / 2**30:.2f} GiB)")
  print("device lines:", {name: len(events) for name, events in lines.items()})
  rows, op_rows = summarize(kernels, steps, args.top), summarize(ops, steps, args.top)
  for title, table in (("kernels", rows), ("XLA ops", op_rows)):
    print(f"-- {title}")
    for r in table:
      print(f"{r['us_per_step']:10.1f} µs/step {r['calls_per_step']:7.1f} calls/step  {r['name'][:150]}")
  record = dict(method=args.method, kv_heads=cfg.kv_heads, method_config=options, compiler_options=compiler_options,
                batch=batch, context=context, steps=steps,
                wall_ms_per_step=wall_ms, kernel_ms_per_step=kernel_ms, floor_ms_per_step=floor_ms,
                weight_bytes=weight_bytes, kv_bytes=kv_bytes, kv_host_bytes=kv.host, cache_memory_kinds=kinds,
                device_peak_bytes=device_peak,
                copy_rate=rate, kernels=rows, xla_ops=op_rows,
                device_lines={name: len(events) for name, events in lines.items()},
                device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                model="random Llama-3-8B shape" if not args.smoke else "tiny smoke model")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
