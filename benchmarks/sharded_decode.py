"""KIVI-2 on several GPUs: the largest batch and the decode tokens/s of ``jkv.generate`` on a device mesh, against
one GPU.

A randomly initialized Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads, D = 128, embed 4096, ffw 14336,
vocab 128256, bf16; the weights drawn where they live, each device its own shard), random prompt tokens, greedy
decoding with end-of-sequence disabled so every step runs, KIVI-2 (G = 32, R = 128). For each mesh: the largest
batch whose cache fits beside each device's share of the weights (``jkv.memory.largest_batch`` with the mesh: the
cache is split over its batch and KV-head axes, the weights over heads and the MLP) at 4096 prompt + 256 new
tokens, then ``generate`` at that batch (so the batch is shown to fit), decode tokens/s with compilation apart, and
the step's floor: each device's weights and its share of the cache once, at the copy rate measured in the run.
One mesh per command (each fits the device tool's 10 minutes):

    --mesh none        one GPU, no mesh (the baseline)
    --mesh model=2     two GPUs, tensor-parallel: half the weights and half of every sequence's KV heads each
    --mesh data=2      two GPUs, data-parallel: the whole weights and half of the sequences each

Records are merged into benchmarks/results/sharded_decode_<device>.json (``--out`` to choose: one file per machine,
as ratios hold only within one); ``--table`` renders a file, with each mesh's batch and tokens/s against its one-GPU
record, into a section of benchmarks/README.md named after the file.

``--profile --batch B``: where a decode step's time goes on each device of the mesh, without prefill: a cache of B
sequences holding ``--prompt-len`` tokens (its contents do not change the work), ``--steps`` decode steps under
``jax.profiler.trace``, device time summed per kernel and per device (benchmarks/profile_decode_step.py's loop and
summary), beside the step's wall time.

    python benchmarks/sharded_decode.py --mesh none && python benchmarks/sharded_decode.py --mesh model=2
    python benchmarks/sharded_decode.py --profile --mesh model=2 --batch 512 --out $OUT/profile_model2.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/sharded_decode.py --smoke --mesh model=2

``--profile --one-shard-of MESH --batch B`` profiles, on one device and with no mesh, the work one device of MESH
does at batch B: B / data sequences of a model with 1 / model of the query and KV heads, the MLP's hidden size and
(where it divides) the vocabulary. Against the mesh's own profile, the difference is what sharding adds (the
tensor-parallel sums, the shard_map boundaries); against ``--mesh none``, what the smaller shapes cost per unit
of work.
"""

import argparse
import dataclasses
import math
import json
import pathlib
import sys

from generate_decode import LLAMA3_8B, SMOKE, copy_rate, device_slug, now
from records import save, write_readme_section

HERE = pathlib.Path(__file__).resolve().parent
RECORD_KEY = lambda r: (r["mesh"], r["prompt_len"], r["new_tokens"])  # a rerun replaces these records
METHOD = ("kivi", {"bits": 2})
SMOKE_DEVICE_BYTES = (6 << 30) + (24 << 20)  # CPU reports no memory: a notional device a few sequences fill


def mesh_devices(spec: str):
  """The mesh of ``spec`` over the first devices it needs (None and one device for "none")."""
  import jax
  from jkv import sharding
  if spec == "none":
    return None, jax.devices()[:1]
  sizes = sharding.parse_mesh(spec)
  n = math.prod(sizes.values())
  if n > jax.device_count():
    raise SystemExit(f"mesh {spec} needs {n} devices; {jax.device_count()} are visible")
  devices = jax.devices()[:n]
  return sharding.make_mesh(sizes, devices=devices), devices


def random_params(cfg, mesh):
  """Random weights made in place: on a mesh each device draws its own shard (an 8B model's 16 GB never sits
  on one device first). The same values with or without a mesh."""
  import jax
  from jkv import params as params_lib
  from jkv import sharding
  init = lambda key: params_lib.init_random(cfg, key)
  if mesh is None:
    return jax.jit(init)(jax.random.key(0))
  return jax.jit(init, out_shardings=sharding.param_shardings(cfg, mesh))(jax.random.key(0))


def run(spec, smoke, *, prompt_len, new_tokens, batch_scale, max_batch, chunk):
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv import memory, sharding
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  cfg = ModelConfig(**(SMOKE if smoke else LLAMA3_8B))
  mesh, devices = mesh_devices(spec)
  rate = 1e10 if smoke else copy_rate()  # on the first device, before the batch takes its memory
  method = make_method(METHOD[0], **METHOD[1])
  capacity = -(-(prompt_len + new_tokens) // method.capacity_multiple()) * method.capacity_multiple()
  limit = (memory.device_memory(devices[0]) or {}).get("limit", SMOKE_DEVICE_BYTES)
  weight_bytes = sharding.param_bytes_per_device(cfg, mesh)
  largest = memory.largest_batch(cfg, method, capacity, prompt_len, device_bytes=limit, weight_bytes=weight_bytes,
                                 mesh=mesh)
  step = sharding.axis_size(mesh, "data")
  batch = max(step, int(largest * batch_scale) // step * step)
  if max_batch:
    batch = min(batch, max_batch)
  print(f"mesh {spec} on {len(devices)} x {devices[0].device_kind}: weights {weight_bytes / 2**30:.2f} GiB per "
        f"device, largest batch {largest} at {prompt_len} + {new_tokens} tokens ({limit / 2**30:.1f} GiB per "
        f"device); running {batch}", flush=True)
  params = random_params(cfg, mesh)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  res = gen.generate(params, cfg, prompts, method=method, max_new_tokens=new_tokens, eos_ids=(), chunk=chunk,
                     mesh=mesh)
  s = res.stats
  peaks = [(memory.device_memory(d) or {}).get("peak") for d in devices]
  # The floor: a step reads each device's weights and its share of the cache (every mesh axis splits the cache).
  floor_ms = 1e3 * (weight_bytes + s["kv_bytes"] / len(devices)) / rate
  record = dict(
      mesh=spec, devices=len(devices), method="kivi2", method_config=dataclasses.asdict(method), batch=batch,
      computed_largest_batch=largest, prompt_len=prompt_len, new_tokens=new_tokens, capacity=capacity,
      decode_tokens_per_s=s["decode_tokens_per_s"], decode_ms_per_step=1e3 * s["decode_s"] / s["decode_steps"],
      decode_chunk_s=s["decode_chunk_s"],  # chunk steps each: a longer first chunk is a cost of first runs
      floor_ms_per_step=floor_ms, copy_rate=rate,
      prefill_s=s["prefill_s"], prefill_sub_batch=s["prefill_sub_batch"], compile_s=s["compile_s"],
      compiles=s["compiles"],
      kv_bytes=s["kv_bytes"], allocated_kv_bytes=s["allocated_kv_bytes"], dense_kv_bytes=s["dense_kv_bytes"],
      weight_bytes_per_device=weight_bytes, device_limit_bytes=limit, peak_device_bytes=peaks,
      attention_impl=s["attention_impl"], device=devices[0].device_kind, jax_version=jax.__version__, date=now(),
      model="random Llama-3-8B shape" if not smoke else "smoke: tiny random model")
  per_chunk = ", ".join(f"{1e3 * t / chunk:.2f}" for t in s["decode_chunk_s"])
  print(f"mesh {spec}: B={batch} {record['decode_ms_per_step']:.2f} ms/step (floor {floor_ms:.2f}; chunk by chunk "
        f"{per_chunk}), {s['decode_tokens_per_s']:.1f} decode tok/s, prefill {s['prefill_s']:.1f} s (sub-batch "
        f"{s['prefill_sub_batch']}), compile {s['compile_s']:.1f} s, kv {s['kv_bytes'] / 2**30:.2f} GiB", flush=True)
  return record


def one_shard_config(cfg, spec: str):
  """The model one device of mesh ``spec`` holds: heads, MLP and (where it divides) vocabulary split over
  ``model``."""
  from jkv import sharding
  m = sharding.parse_mesh(spec)["model"]
  if cfg.kv_heads % m:
    raise SystemExit(f"model={m} does not divide the {cfg.kv_heads} KV heads")
  vocab = cfg.vocab_size // m if cfg.vocab_size % m == 0 else cfg.vocab_size
  return dataclasses.replace(cfg, q_heads=cfg.q_heads // m, kv_heads=cfg.kv_heads // m,
                             ffw_size=cfg.ffw_size // m, vocab_size=vocab)


def profile(spec, smoke, *, batch, context, steps, one_shard_of=None, top=25):
  """Device time per kernel and per device of ``steps`` decode steps at ``batch`` (module docstring); with
  ``one_shard_of``, one device's share of that mesh on one device."""
  import jax
  from profile_decode_step import kernel_events, summarize, trace_decode
  from jkv import sharding
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  cfg = ModelConfig(**(SMOKE if smoke else LLAMA3_8B))
  mesh, devices = mesh_devices(spec)
  if one_shard_of:
    if mesh is not None:
      raise SystemExit("--one-shard-of runs on one device: leave --mesh at none")
    cfg = one_shard_config(cfg, one_shard_of)
    data = sharding.parse_mesh(one_shard_of)["data"]
    if batch % data:
      raise SystemExit(f"a batch of {batch} does not split over data={data}")
    batch //= data
  method = make_method(METHOD[0], **METHOD[1])
  traced = trace_decode(random_params(cfg, mesh), cfg, method, batch=batch, context=context, steps=steps, mesh=mesh)
  record = dict(mesh=spec, one_shard_of=one_shard_of, devices=len(devices), batch=batch, context=context,
                steps=steps, wall_ms_per_step=traced["wall_ms"], q_heads=cfg.q_heads, kv_heads=cfg.kv_heads,
                kv_bytes=traced["cache"].held_bytes().device, device=devices[0].device_kind,
                jax_version=jax.__version__, date=now(), per_device={})
  share = f" (one device's share of {one_shard_of})" if one_shard_of else ""
  print(f"mesh {spec}{share} B={batch} context={context}: {traced['wall_ms']:.2f} ms/step wall", flush=True)
  for name, lines in sorted(traced["planes"].items()):
    events = kernel_events(lines)
    rows = summarize(events, steps, top)
    busy = sum(ns for _, ns in events) / 1e6 / steps
    record["per_device"][name] = dict(kernel_ms_per_step=busy, kernels=rows)
    print(f"-- {name}: {busy:.2f} ms/step in kernels")
    for r in rows:
      print(f"{r['us_per_step']:10.1f} µs/step {r['calls_per_step']:7.1f} calls/step  {r['name'][:140]}")
  return record


def markdown_table(records) -> str:
  """Each record's row, its batch and tokens/s against the latest one-GPU record of the same device and lengths.
  The "measured" column says when: a ratio between records of different days may compare different versions of
  the code."""
  setting = lambda r: (r["device"], r["prompt_len"], r["new_tokens"])
  ones = {setting(r): r for r in sorted((r for r in records if r["mesh"] == "none"), key=lambda r: r["date"])}
  lines = ["| mesh | GPUs | largest batch | batch run | decode tokens/s | ms/step | x floor | largest batch vs 1 GPU | "
           "tokens/s vs 1 GPU | prefill s | peak GiB per GPU | device | measured (UTC) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
  for r in records:
    base = ones.get(setting(r))
    ratio = lambda k: f"{r[k] / base[k]:.2f}x" if base else "–"
    peak = max((p for p in r["peak_device_bytes"] if p is not None), default=None)
    floor = r.get("floor_ms_per_step")
    lines.append(f"| {r['mesh']} | {r['devices']} | {r['computed_largest_batch']} | {r['batch']} | "
                 f"{r['decode_tokens_per_s']:.1f} | {r['decode_ms_per_step']:.2f} | "
                 f"{'–' if floor is None else format(r['decode_ms_per_step'] / floor, '.2f')} | "
                 f"{ratio('computed_largest_batch')} | {ratio('decode_tokens_per_s')} | {r['prefill_s']:.1f} | "
                 f"{'–' if peak is None else format(peak / 2**30, '.1f')} | {r['device']} | "
                 f"{r['date'][:16].replace('T', ' ')} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mesh", default="none", help="none, or a mesh spec such as model=2 or data=2")
  parser.add_argument("--smoke", action="store_true", help="a tiny model (CPU with forced devices)")
  parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 4096; smoke 100)")
  parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; smoke 28)")
  parser.add_argument("--batch-scale", type=float, default=1.0, help="run at this fraction of the largest batch")
  parser.add_argument("--max-batch", type=int, default=None, help="run at most this batch (smoke default 4)")
  parser.add_argument("--chunk", type=int, default=128, help="decode steps per jitted chunk")
  parser.add_argument("--profile", action="store_true", help="trace --steps decode steps at --batch instead")
  parser.add_argument("--batch", type=int, default=256, help="--profile: sequences in the cache")
  parser.add_argument("--steps", type=int, default=8, help="--profile: decode steps traced")
  parser.add_argument("--one-shard-of", default=None,
                      help="--profile: one device's share of this mesh at --batch, on one device (no mesh)")
  parser.add_argument("--out", type=pathlib.Path, help="JSON to merge the record into (--profile: to write)")
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  if args.table:  # one section per results file: each machine's rows against its own one-GPU row
    write_readme_section(args.out.stem, markdown_table(json.loads(args.out.read_text())),
                         f"## KIVI-2 on several GPUs (`sharded_decode.py`, `{args.out.name}`)")
    return
  prompt_len = args.prompt_len or (100 if args.smoke else 4096)
  if args.profile:
    record = profile(args.mesh, args.smoke, batch=args.batch, context=prompt_len, steps=args.steps,
                     one_shard_of=args.one_shard_of)
    if args.out:
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(record, indent=1) + "\n")
    return
  new_tokens = args.new_tokens or (28 if args.smoke else 256)
  max_batch = args.max_batch or (4 if args.smoke else None)
  record = run(args.mesh, args.smoke, prompt_len=prompt_len, new_tokens=new_tokens, batch_scale=args.batch_scale,
               max_batch=max_batch, chunk=min(args.chunk, new_tokens))
  name = f"sharded_decode_{device_slug(record['device'])}{'_smoke' if args.smoke else ''}.json"
  out = args.out or HERE / "results" / name
  records = save(out, [record], RECORD_KEY)
  print(markdown_table(records))


if __name__ == "__main__":
  sys.exit(main())
