"""One long sequence on one GPU: chunked prefill's attention, prefill tokens/s and decode ms/step against its floor.

A randomly initialized Llama-3-8B-shaped model (``generate_decode.LLAMA3_8B``, bf16) with its ``max_position``
raised to the context asked (RoPE is defined at any position; a real checkpoint keeps its own limit), random prompt
tokens, greedy decoding with end-of-sequence disabled. Parts, each one command within a 10-minute device call:

    --part kernel    the chunk's attention (``jkv.chunk_attention``: cuDNN over the held rows, then the chunk causally,
                     merged) at C = ``--chunk`` query tokens over ``--contexts`` held tokens, in TFLOP/s, beside a
                     KIVI-2 store's held rows (the dequantization of one layer, the transient each chunk builds) and a
                     correctness check against the XLA path on a smaller shape
    --part prefill   ``jkv.generate`` on one prompt of ``--context`` tokens for each of ``--methods``: prefill s and
                     tokens/s (with the plan it chose: whole, or the chunk), decode ms/step against the floor (every
                     weight and the cache's held bytes once, at the copy rate measured in the same run), peak memory;
                     ``--profile`` traces the run and records the kernels that take its device time (prefill is most
                     of it), into results/long_context_profile.json unless ``--out`` says otherwise; ``--mesh``
                     and ``--kv-heads`` as decode's (a prompt over ``seq``: each chunk's attention merged across the
                     devices' ranges), the floor per device
    --part decode    B = 1 decode at each of ``--contexts`` tokens (0: the longest the method holds on this device,
                     ``jkv.memory.longest_context``) for each of ``--methods``, over a synthetic fill: the cache is
                     allocated holding that many tokens without a prefill (records say ``synthetic_fill``), so
                     lengths no 10-minute prefill reaches are measured; generate's own decode loop, ms/step against
                     the floor, and the kernels that take the step's time (ZipCache's pools are filled by setting their
                     counters as a prefill of that length leaves them: ``ZipCache.synthetic_fill``).
                     ``--mesh model=N``: one sequence over N GPUs, its KV heads (and the weights) split; ``seq=N``:
                     its tokens split (context parallelism); the longest context and the floor per device.
                     ``--kv-heads 2``: a model with fewer KV heads than GPUs, where ``model`` stops and ``seq`` serves

With more than one method or context (prefill, decode), each runs in a process of its own, so a record's peak
device memory is its own run's.

Records are merged into benchmarks/results/long_context.json (``--out`` to choose); ``--table`` renders them into
benchmarks/README.md.

    python benchmarks/long_context.py --part kernel --contexts 131072 1048576
    python benchmarks/long_context.py --part prefill --context 131072 --methods kivi2_mma dense
    python benchmarks/long_context.py --part decode --contexts 131072 1048576 0 --methods kivi2_mma dense
    python benchmarks/long_context.py --part decode --contexts 1048576 0 --methods kivi2_mma --mesh model=4
    python benchmarks/long_context.py --part decode --contexts 0 --methods kivi2_mma --kv-heads 2 --mesh seq=4
    python benchmarks/long_context.py --part prefill --smoke      # a tiny model, any machine
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from generate_decode import LLAMA3_8B, SMOKE, copy_rate, median_ms, now, read_rate
from records import save, write_readme_section

HERE = pathlib.Path(__file__).resolve().parent
METHODS = {"dense": ("dense", {}), "kivi2_mma": ("kivi", {"bits": 2, "mma": True}),
           "kivi4_mma": ("kivi", {"bits": 4, "mma": True}), "kivi2": ("kivi", {"bits": 2, "mma": False}),
           "ott2": ("ott", {}), "ott2_triton": ("ott", {"mma": False}), "zipcache": ("zipcache", {}),
           "specache1": ("specache", {"bits": 1, "exact_chunks": False}),
           "specache1_exact": ("specache", {"bits": 1, "exact_chunks": True}),
           # Without the hit-rate statistic: one token-mass row a step instead of two.
           "specache1_no_hit_rate": ("specache", {"bits": 1, "exact_chunks": False, "hit_rate": False})}
RECORD_KEY = lambda r: (r["part"], r["impl"], r["batch"], r["context"], r.get("prefill_chunk_asked"),
                        r.get("prefill_tokens_asked"), r.get("context_asked"), r["device"],
                        r.get("mesh"), r.get("kv_heads"), r.get("memory_fraction"))


def _base(part, impl, batch, context, mesh=None):
  import jax
  from jkv import memory
  devices = 1 if mesh is None else mesh.devices.size
  # XLA's allocator takes the fraction of the GPU this names (75% when unset): it bounds the plans and the longest.
  return dict(part=part, impl=impl, batch=batch, context=context, devices=devices,
              mesh=None if mesh is None else ",".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1),
              device=jax.devices()[0].device_kind, memory_fraction=os.environ.get(memory.MEMORY_FRACTION_ENV),
              jax_version=jax.__version__, date=now(), model="random Llama-3-8B shape", synthetic_fill=False)


# ------------------------------------------------------------------------------------------------- kernel


def kernel_part(contexts, chunk, smoke):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jkv.cache import CacheSpec
  from jkv.chunk_attention import HeldRows, chunk_attention
  from jkv.methods import make_method
  H, g, D = (2, 2, 64) if smoke else (8, 4, 128)
  impl = "xla" if smoke else "pallas"
  dtype = jnp.bfloat16
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)

  # Correctness where both paths fit: cuDNN's against XLA's on the same inputs.
  S0, T0 = 2048, 512
  q, k, v = normal(1, H, T0, g, D), normal(1, H, T0, D), normal(1, H, T0, D)
  held = HeldRows(normal(1, H, S0, D), normal(1, H, S0, D), jnp.asarray([S0 - 77], jnp.int32))
  positions = jnp.asarray(S0 - 77 + np.arange(T0), jnp.int32)[None]
  fast = jax.jit(chunk_attention, static_argnames=("impl",))(q, k, v, positions, held, impl=impl)
  ref = jax.jit(chunk_attention, static_argnames=("impl",))(q, k, v, positions, held, impl="xla")
  error = float(jnp.linalg.norm((fast - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
  print(f"check: {impl} against xla, relative error {error:.2e}", flush=True)

  records = []
  kivi = make_method("kivi", bits=2, mma=not smoke)
  for S in contexts:
    C = min(chunk, S)
    q, k, v = normal(1, H, C, g, D), normal(1, H, C, D), normal(1, H, C, D)
    held = HeldRows(normal(1, H, S, D), normal(1, H, S, D), jnp.asarray([S], jnp.int32))
    positions = jnp.asarray(S + np.arange(C), jnp.int32)[None]
    attend = jax.jit(lambda q, k, v, p, h: chunk_attention(q, k, v, p, h, impl=impl))
    ms = median_ms(attend, q, k, v, positions, held, repeats=5)
    flops = 4 * C * g * H * D * (S + C / 2)
    # A quarter of the buffer held (the early chunks of a prompt, in a buffer at capacity): is the rest skipped?
    quarter = held._replace(count=jnp.asarray([S // 4], jnp.int32))
    quarter_ms = median_ms(attend, q, k, v, positions, quarter, repeats=5)
    del held, quarter
    # One layer of a KIVI-2 store at S tokens (random codes, like any store's bytes), dequantized into held rows.
    spec = CacheSpec(1, 1, S, H, D, g, dtype)
    kivi_run = kivi.for_impl(spec, impl)
    state = jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 2**16, x.shape), x.dtype)
                         if jnp.issubdtype(x.dtype, jnp.integer) else jnp.asarray(0.01 * rng.normal(size=x.shape),
                                                                                    x.dtype),
                         kivi_run.init(spec))
    rows = jax.jit(lambda s, n: kivi_run.held_rows(s, 0, n))
    held_ms = median_ms(rows, state, jnp.asarray([S], jnp.int32), repeats=5)
    del state
    record = dict(_base("kernel", "chunk_attention_cudnn" if impl == "pallas" else "chunk_attention_xla", 1, S),
                  chunk=C, heads=H * g, kv_heads=H, head_dim=D, ms=ms, tflops=flops / ms / 1e9,
                  kivi2_held_rows_ms=held_ms, quarter_held_ms=quarter_ms, check_relative_error=error)
    print(f"S={S:>8} C={C}: chunk attention {ms:8.2f} ms ({record['tflops']:.0f} TFLOP/s); KIVI-2 held rows "
          f"{held_ms:.2f} ms ({100 * held_ms / ms:.1f}% of it); a quarter held {quarter_ms:.2f} ms", flush=True)
    records.append(record)
  return records


# ------------------------------------------------------------------------------------------------- prefill


def one_sequence_over(mesh_spec, cfg, part):
  """(mesh, its devices, random weights placed on it, each device's weight bytes, the shards of one sequence's
  cache) for one sequence over ``mesh_spec`` ("none": one GPU): each device holds its share of the weights (split
  over "model") and of the cache (its KV heads split over "model", its tokens over "seq"); a data axis is refused."""
  from sharded_decode import mesh_devices, random_params
  from jkv import sharding
  mesh, devices = mesh_devices(mesh_spec)
  if sharding.axis_size(mesh, "data") > 1:
    raise SystemExit(f"long_context.py --part {part} runs one sequence: a data axis has nothing to split")
  shards = sharding.axis_size(mesh, "model") * sharding.axis_size(mesh, "seq")
  return mesh, devices, random_params(cfg, mesh), sharding.param_bytes_per_device(cfg, mesh), shards


def prefill_part(context, labels, new_tokens, prefill_chunk, prefill_tokens, smoke, profile=False, mesh_spec="none",
                 kv_heads=None):
  import contextlib
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv import memory
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  shape = SMOKE if smoke else LLAMA3_8B
  asked = context
  # Random weights: RoPE runs at any position, so the longest (0) needs no limit known before the device is.
  cfg = ModelConfig(**dict(shape, max_position=max(shape["max_position"], context + new_tokens) if asked else 1 << 27,
                           **({"kv_heads": kv_heads} if kv_heads else {})))
  pool = size_pinned_pool(cfg, labels, lambda m: asked and gen.plan_capacity(cfg, m, [asked], new_tokens,
                                                                              min(16, new_tokens)))
  mesh, _, params, weight_bytes, shards = one_sequence_over(mesh_spec, cfg, "prefill")
  rate = 1e10 if smoke else copy_rate()
  print(f"copy rate {rate / 1e12:.2f} TB/s; weights {weight_bytes / 2**30:.2f} GiB", flush=True)
  records = []
  for label in labels:
    name, options = METHODS[label]
    # The longest prompt the method holds on this device, as `jkv info` reports it; a real prompt of that length.
    context = asked or memory.longest_context(cfg, make_method(name, **options), weight_bytes=weight_bytes,
                                              device_bytes=memory.device_memory()["limit"], mesh=mesh)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, context).tolist()
    fewer_heads = {"kv_heads": kv_heads, "model": f"random Llama-3-8B shape, {kv_heads} KV heads"} if kv_heads else {}
    base = dict(_base("prefill", label, 1, context, mesh), **({} if asked else {"context_asked": "longest"}),
                **fewer_heads)
    t = time.perf_counter()
    trace_dir = tempfile.TemporaryDirectory()
    try:
      with jax.profiler.trace(trace_dir.name) if profile else contextlib.nullcontext():
        res = gen.generate(params, cfg, [prompt], method=make_method(name, **options), max_new_tokens=new_tokens,
                           eos_ids=(), chunk=min(16, new_tokens), prefill_chunk=prefill_chunk,
                           prefill_tokens=prefill_tokens, mesh=mesh)
    except (MemoryError, ValueError) as e:  # the one-line errors: recorded, the next method runs
      print(f"{label}: {type(e).__name__}: {e}", flush=True)
      records.append(dict(base, error=f"{type(e).__name__}: {e}",
                          prefill_chunk_asked=prefill_chunk, prefill_tokens_asked=prefill_tokens))
      continue
    s = res.stats
    ms = 1e3 * s["decode_s"] / s["decode_steps"]
    floor = 1e3 * (weight_bytes + s["kv_bytes"] / shards) / rate
    record = dict(
        base, method_config=s["method_config"], prefill_s=s["prefill_s"],
        prefill_tokens_per_s=s["prefill_tokens_per_s"], prefill_chunk=s["prefill_chunk"],
        prefill_calls=s["prefill_calls"], prefill_chunk_asked=prefill_chunk, prefill_tokens_asked=prefill_tokens,
        decode_ms_per_step=ms, floor_ms_per_step=floor, ratio_to_floor=ms / floor, new_tokens=new_tokens,
        decode_chunk_s=s["decode_chunk_s"],  # 16 steps each: a longer first chunk is a cost of first runs
        kv_bytes=s["kv_bytes"], kv_host_bytes=s["kv_host_bytes"], dense_kv_bytes=s["dense_kv_bytes"],
        pinned_pool_limit_gb=pool,
        capacity=s["capacity"], peak_device_bytes=s["peak_device_bytes"], compile_s=s["compile_s"],
        weight_bytes=weight_bytes, copy_rate=rate, wall_s=time.perf_counter() - t)
    if profile:
      record.update(profiled=True, top_kernels=top_kernels(trace_dir.name))
      print("\n".join(f"  {k['ms']:9.1f} ms {k['calls']:6.0f} calls  {k['name'][:90]}" for k in record["top_kernels"]),
            flush=True)
    trace_dir.cleanup()
    print(f"{label:>10} {context} tokens: prefill {s['prefill_s']:.2f} s ({s['prefill_tokens_per_s']:.0f} tok/s, "
          f"chunk {s['prefill_chunk']}, {s['prefill_calls']} calls), decode {ms:.2f} ms/step (floor {floor:.2f}, "
          f"{ms / floor:.2f}x), kv {s['kv_bytes'] / 2**30:.2f} GiB, peak "
          f"{(s['peak_device_bytes'] or 0) / 2**30:.1f} GiB, compile {s['compile_s']:.0f} s", flush=True)
    records.append(record)
  return records


def size_pinned_pool(cfg, labels, capacity):
  """The pinned pool's limit (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, set here before the GPU client starts unless
  the caller set it) for the largest host copy of ``labels``, each of one sequence of ``capacity(method)`` tokens
  (None: not known before the device is): one that holds it and little more (``jkv.memory.pinned_pool_limit_gib``),
  since the pool grows by regions of powers of two up to its limit and a 64.008 GiB copy under a limit of 112 pinned
  112. Returns the limit in force, or None without a host copy."""
  import os
  from jkv import memory
  from jkv.methods import make_method
  host = 0
  for label in labels:
    name, options = METHODS[label]
    method = make_method(name, **options)
    tokens = capacity(method)
    host = max(host, memory.host_cache_bytes(method, cfg, 1, tokens) if tokens else 0)
  if not host:
    return None
  return int(os.environ.setdefault(memory.PINNED_HOST_LIMIT_ENV, str(memory.pinned_pool_limit_gib(host))))


def top_kernels(trace_dir, top=25) -> list:
  """The ``top`` kernels of a traced generate call by their summed device time: rows {name, ms, calls}. Generate
  compiles ahead of time, so the trace holds one prefill and the decode steps, nothing run twice."""
  from profile_decode_step import device_events, kernel_events, summarize
  planes = device_events(trace_dir)
  rows = summarize(kernel_events({n: e for plane in planes.values() for n, e in plane.items()}), 1, top)
  return [dict(name=r["name"], ms=r["us_per_step"] / 1e3, calls=r["calls_per_step"]) for r in rows]


# ------------------------------------------------------------------------------------------------- decode


def decode_part(contexts, labels, steps, smoke, mesh_spec="none", kv_heads=None):
  import jax.numpy as jnp
  from profile_decode_step import kernel_events, summarize, trace_decode
  from jkv import memory
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  from jkv.prefill import round_up
  shape = SMOKE if smoke else LLAMA3_8B
  # Random weights: RoPE runs at any position. Fewer KV heads than devices is the case for the seq axis.
  cfg = ModelConfig(**dict(shape, max_position=1 << 27, **({"kv_heads": kv_heads} if kv_heads else {})))
  # The longest context (0) is known only from the device's memory: the pool keeps its limit for it.
  asked = max(contexts)
  pool = size_pinned_pool(cfg, labels, lambda m: asked and round_up(asked + steps, m.capacity_multiple()))
  # The floor and the longest context are per device.
  mesh, devices, params, weight_bytes, shards = one_sequence_over(mesh_spec, cfg, "decode")
  rate, reads = (1e10, 1e10) if smoke else (copy_rate(), read_rate())
  # A smoke run's "longest" fits 8 MiB of cache beside the reserve and a long prompt's chunk: a CPU has no device
  # memory to ask.
  chunk_bytes = 2 * memory.LONG_PROMPT_CHUNK * memory.prefill_bytes_per_token(cfg)
  device_bytes = (memory.RESERVE_BYTES + weight_bytes + chunk_bytes + (8 << 20) if smoke
                  else memory.device_memory()["limit"])
  print(f"copy rate {rate / 1e12:.2f} TB/s, read rate {reads / 1e12:.2f} TB/s; weights {weight_bytes / 2**30:.2f} "
        "GiB", flush=True)
  records = []
  for label in labels:
    name, options = METHODS[label]
    method = make_method(name, **options)
    for asked in contexts:
      context = asked or memory.longest_context(cfg, method, device_bytes=device_bytes, weight_bytes=weight_bytes,
                                                mesh=mesh)
      base = dict(_base("decode", label, 1, context, mesh), context_asked=asked or "longest", synthetic_fill=True,
                  device_limit_bytes=device_bytes)
      if kv_heads:
        base.update(kv_heads=kv_heads, model=f"random Llama-3-8B shape, {kv_heads} KV heads")
      try:
        traced = trace_decode(params, cfg, method, batch=1, context=context, steps=steps, mesh=mesh)
      except (MemoryError, ValueError) as e:
        print(f"{label} {context}: {type(e).__name__}: {e}", flush=True)
        records.append(dict(base, error=f"{type(e).__name__}: {e}"))
        continue
      kv = traced["cache"].held_bytes(jnp.full((1,), context + steps // 2))
      per_device = weight_bytes + kv.device / shards
      ms, floor, read_floor = traced["wall_ms"], 1e3 * per_device / rate, 1e3 * per_device / reads
      kernels = summarize(kernel_events({n: e for plane in traced["planes"].values() for n, e in plane.items()}),
                          steps, 6)
      peak = max((d.memory_stats() or {}).get("peak_bytes_in_use") or 0 for d in devices) or None
      records.append(dict(base, method_config=options, decode_ms_per_step=ms, floor_ms_per_step=floor,
                          ratio_to_floor=ms / floor, read_floor_ms_per_step=read_floor, read_rate=reads,
                          ratio_to_read_floor=ms / read_floor, steps=steps, kv_bytes=kv.device,
                          kv_bytes_per_device=kv.device / shards, kv_host_bytes=kv.host, peak_device_bytes=peak,
                          weight_bytes=weight_bytes, copy_rate=rate, pinned_pool_limit_gb=pool,
                          top_kernels=kernels))
      print(f"{label:>10} {context} tokens (synthetic fill): decode {ms:.2f} ms/step (floor {floor:.2f}, "
            f"{ms / floor:.2f}x; at the read rate {read_floor:.2f}, {ms / read_floor:.2f}x), "
            f"kv {kv.device / 2**30:.2f} GiB; "
            + ", ".join(f"{k['name'][:40]} {k['us_per_step'] / 1e3:.2f} ms" for k in kernels[:3]), flush=True)
      del traced
  return records


def in_own_processes(argv, part, labels, contexts) -> list:
  """The records of one child process per (method, context): this script again with one of each, so each record's
  peak device memory is its own run's (a process's peak only grows). Returns the records and a line per child that
  failed (the others' records are kept: a 524k run that fails must not lose the 128k one before it)."""
  records, failed = [], []
  for label in labels:
    for context in contexts:
      with tempfile.TemporaryDirectory() as tmp:
        one = pathlib.Path(tmp, "records.json")
        flag = "--contexts" if part == "decode" else "--context"
        done = subprocess.run([sys.executable, __file__, *argv, "--methods", label, flag, str(context),
                               "--records-to", str(one)])
        if done.returncode != 0 or not one.exists():
          failed.append(f"long_context.py: the {label} run at {context} tokens exited with {done.returncode}")
          continue
        records += json.loads(one.read_text())
  return records, failed


# ------------------------------------------------------------------------------------------------- results


def markdown_table(records) -> str:
  fmt = lambda r, k, f: format(r[k], f) if r.get(k) is not None else "–"
  gib = lambda r, k: f"{r[k] / 2**30:.2f}" if r.get(k) is not None else "–"
  lines = ["| part | impl | context | prefill s | prefill tok/s | chunk | decode ms/step | floor | x floor | KV GiB | "
           "peak GiB | result | device | date |", "|" + " --- |" * 14]
  for r in records:
    if r["part"] == "kernel":
      result = (f"{r['ms']:.1f} ms, {r['tflops']:.0f} TFLOP/s (C={r['chunk']}); held rows "
                f"{r['kivi2_held_rows_ms']:.2f} ms")
    longest = ("" if r.get("context_asked") != "longest" else
               ", the longest" + (f" at {r['memory_fraction']} of the GPU" if r.get("memory_fraction") else ""))
    if r["part"] == "decode":
      result = r.get("error", "synthetic fill" + longest
                     + (f"; {r['ratio_to_read_floor']:.2f}x the read-rate floor" if "ratio_to_read_floor" in r else ""))
    elif r["part"] == "prefill":
      result = r.get("error", "ran" + longest)
    impl = (r["impl"] + (f" on {r['mesh']}" if r.get("mesh") else "")
            + (f", {r['kv_heads']} KV heads" if r.get("kv_heads") else ""))
    lines.append(f"| {r['part']} | {impl} | {r['context']} | {fmt(r, 'prefill_s', '.2f')} | "
                 f"{fmt(r, 'prefill_tokens_per_s', '.0f')} | {r.get('prefill_chunk') or '–'} | "
                 f"{fmt(r, 'decode_ms_per_step', '.2f')} | {fmt(r, 'floor_ms_per_step', '.2f')} | "
                 f"{fmt(r, 'ratio_to_floor', '.2f')} | {gib(r, 'kv_bytes')} | {gib(r, 'peak_device_bytes')} | "
                 f"{result} | {r['device']} | {r['date'][:10]} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--part", choices=["kernel", "prefill", "decode"], default="prefill")
  parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576],
                      help="kernel: held tokens; decode: tokens held (0: the longest that fits)")
  parser.add_argument("--chunk", type=int, default=8192, help="kernel: the chunk's tokens")
  parser.add_argument("--context", type=int, default=131072,
                      help="prefill: the prompt's tokens (0: the longest the method holds on this device)")
  parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=["kivi2_mma", "dense"])
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--steps", type=int, default=16, help="decode: steps timed per call")
  parser.add_argument("--mesh", default="none", help="prefill, decode: a mesh of GPUs, e.g. model=4 (KV heads "
                      "split) or seq=2 (tokens split)")
  parser.add_argument("--kv-heads", type=int, help="prefill, decode: the model's KV heads (default the shape's 8)")
  parser.add_argument("--prefill-chunk", type=int, help="prefill: chunk size (default: the plan's)")
  parser.add_argument("--prefill-tokens", type=int, help="prefill: prompt tokens per call (default: the plan's)")
  parser.add_argument("--profile", action="store_true", help="prefill: trace the run, record its top kernels")
  parser.add_argument("--smoke", action="store_true", help="a tiny model, small shapes (any machine)")
  parser.add_argument("--out", type=pathlib.Path,
                      help="JSON to merge the records into (default: results/long_context.json; none with --smoke)")
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  parser.add_argument("--records-to", type=pathlib.Path, help=argparse.SUPPRESS)  # a child: its records, unmerged
  args = parser.parse_args()
  name = "long_context_profile.json" if args.profile else "long_context.json"
  out = args.out or (None if args.smoke else HERE / "results" / name)
  if args.table:
    write_readme_section("long_context", markdown_table(json.loads(out.read_text())),
                         "## Long context: one sequence")
    return
  failed = []
  runs = len(args.methods) * (len(args.contexts) if args.part == "decode" else 1)
  if args.part != "kernel" and runs > 1 and not args.smoke and args.records_to is None:
    argv = ["--part", args.part, "--new-tokens", str(args.new_tokens), "--steps", str(args.steps), "--mesh", args.mesh]
    argv += [f"--{k}={v}" for k, v in (("prefill-chunk", args.prefill_chunk), ("prefill-tokens", args.prefill_tokens),
                                       ("kv-heads", args.kv_heads))
             if v is not None] + ["--profile"] * args.profile
    records, failed = in_own_processes(argv, args.part, args.methods,
                                       args.contexts if args.part == "decode" else [args.context])
  elif args.part == "kernel":
    records = kernel_part([1024, 4096] if args.smoke else args.contexts, 256 if args.smoke else args.chunk,
                          args.smoke)
  elif args.part == "decode":
    records = decode_part([64, 0] if args.smoke else args.contexts, args.methods, 4 if args.smoke else args.steps,
                          args.smoke, args.mesh, args.kv_heads)
  else:
    records = prefill_part(1500 if args.smoke else args.context, args.methods, 4 if args.smoke else args.new_tokens,
                           args.prefill_chunk, args.prefill_tokens, args.smoke, args.profile, args.mesh,
                           args.kv_heads)
  if args.records_to is not None:
    args.records_to.write_text(json.dumps(records))
    return
  if out is not None:
    save(out, records, RECORD_KEY)
  print(markdown_table(records))
  if failed:
    raise SystemExit("\n".join(failed))


if __name__ == "__main__":
  sys.exit(main())
