"""Where a decode step's time goes on the GPU: a profiler trace of jkv's decode loop, summed per kernel.

A randomly initialized Llama-3-8B-shaped model (as in generate_decode.py), a cache of one method at batch B holding
``--context`` tokens per sequence (the cache's contents do not change the work), and ``--steps`` greedy decode steps
in one jitted ``lax.scan`` with the cache donated, compiled with jkv's MODEL_COMPILER_OPTIONS, as ``jkv.generate``
runs them (``--xla-defaults`` for XLA's own options). The scan is compiled and run
once, then run again under ``jax.profiler.trace``; the device events of that second run are grouped by kernel name
and reported per step beside the step's wall time and its floor (weights + the cache's held bytes at the device
copy rate), so the gap between the two has names.

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

import generate_decode
import specache_decode
from generate_decode import LLAMA3_8B, SMOKE, copy_rate
from jkv import memory
from jkv import params as params_lib
from jkv.attention import choose_impl
from jkv.cache import CacheSpec, KVCache
from jkv.config import ModelConfig
from jkv.methods import make_method
from jkv.model import forward
from jkv.xla_options import MODEL_COMPILER_OPTIONS


METHODS = {**generate_decode.METHODS, **specache_decode.METHODS}  # dense, KIVI-2/4 and the SpeCache variants


def decode_loop(cfg, steps, compiler_options):
  """``steps`` greedy decode steps of every sequence in one scan, the cache donated (jkv.generate's shape).

  tokens [B, r]: each step's rows at positions n, n + 1, ...: r = 1, or 2 for a method with a speculative row
  (the real token and the speculative one; each row's greedy output is the next step's token in that row).
  """
  def run(params, cache, tokens):
    def step(carry, _):
      cache, tokens = carry
      positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
      logits, cache = forward(params, tokens, positions, cache, cfg=cfg)
      return (cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
    (cache, tokens), _ = jax.lax.scan(step, (cache, tokens), None, length=steps)
    return cache, tokens
  return jax.jit(run, donate_argnums=1, compiler_options=compiler_options or None)


def device_events(trace_dir):
  """{line name: [(event name, duration ns), ...]} for every line of the GPU planes of the trace in ``trace_dir``:
  the streams' kernels and copies, and XLA's own summary lines ("XLA Ops", "XLA Modules")."""
  from jax.profiler import ProfileData
  lines = collections.defaultdict(list)
  for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
          lines[line.name] += [(event.name, event.duration_ns) for event in line.events]
  return lines


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
  parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                      help="an XLA option for the decode loop's compilation (repeatable; on top of jkv's "
                           "MODEL_COMPILER_OPTIONS), e.g. xla_gpu_enable_triton_gemm=true")
  parser.add_argument("--xla-defaults", action="store_true",
                      help="compile without jkv.xla_options.MODEL_COMPILER_OPTIONS (XLA's own defaults)")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()

  cfg = ModelConfig(**(SMOKE if args.smoke else LLAMA3_8B))
  batch, context, steps = (2, 64, 4) if args.smoke else (args.batch, args.context, args.steps)
  name, options = METHODS[args.method]
  method = make_method(name, **options)
  multiple = method.capacity_multiple()
  capacity = -(-(context + steps) // multiple) * multiple
  params = params_lib.init_random(cfg, jax.random.key(0))
  cache = KVCache.create(method, CacheSpec.for_model(cfg, batch, capacity), choose_impl())
  cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
  weight_bytes = memory.tree_bytes(params)
  kv_bytes = cache.held_bytes(jnp.full((batch,), context + steps // 2)).device
  rate = 1e10 if args.smoke else copy_rate()
  compiler_options = {} if args.xla_defaults else dict(MODEL_COMPILER_OPTIONS)
  for item in args.compiler_option:
    key, value = item.split("=", 1)
    compiler_options[key] = {"true": True, "false": False}.get(value.lower(), value)
  loop = decode_loop(cfg, steps, compiler_options)
  tokens = jnp.ones((batch, 1 + method.speculative_rows), jnp.int32)

  cache, tokens = jax.block_until_ready(loop(params, cache.replace(lengths=cache.lengths), tokens))  # compile
  walls = []
  for _ in range(3):
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    start = time.perf_counter()
    cache, tokens = jax.block_until_ready(loop(params, cache, tokens))
    walls.append((time.perf_counter() - start) / steps)
  cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      cache, tokens = jax.block_until_ready(loop(params, cache, tokens))
    lines = device_events(trace_dir)

  summaries = ("XLA Ops", "XLA Modules", "Steps", "Source")
  kernels = [e for name, events in lines.items() if not any(s in name for s in summaries) for e in events]
  ops = [e for name, events in lines.items() if "XLA Ops" in name for e in events]
  kernel_ms = sum(ns for _, ns in kernels) / 1e6 / steps
  wall_ms = 1e3 * statistics.median(walls)
  floor_ms = 1e3 * (weight_bytes + kv_bytes) / rate
  print(f"{args.method} B={batch} context={context}: {wall_ms:.2f} ms/step wall, {kernel_ms:.2f} ms/step in kernels, "
        f"floor {floor_ms:.2f} ms ({(weight_bytes + kv_bytes) / 2**30:.2f} GiB at {rate / 1e12:.2f} TB/s)")
  print("device lines:", {name: len(events) for name, events in lines.items()})
  rows, op_rows = summarize(kernels, steps, args.top), summarize(ops, steps, args.top)
  for title, table in (("kernels", rows), ("XLA ops", op_rows)):
    print(f"-- {title}")
    for r in table:
      print(f"{r['us_per_step']:10.1f} µs/step {r['calls_per_step']:7.1f} calls/step  {r['name'][:150]}")
  record = dict(method=args.method, method_config=options, compiler_options=compiler_options, batch=batch, context=context, steps=steps,
                wall_ms_per_step=wall_ms, kernel_ms_per_step=kernel_ms, floor_ms_per_step=floor_ms,
                weight_bytes=weight_bytes, kv_bytes=kv_bytes, copy_rate=rate, kernels=rows, xla_ops=op_rows,
                device_lines={name: len(events) for name, events in lines.items()},
                device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                model="random Llama-3-8B shape" if not args.smoke else "tiny smoke model")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
