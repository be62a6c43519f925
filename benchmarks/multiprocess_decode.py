"""Several processes, one GPU each, against one process holding the same GPUs: the same tokens, and decode tokens/s.

The multi-host path (``jax.distributed``, as ``jkv generate --coordinator ... --num-processes ... --process-id ...``)
run on one machine: P processes, each seeing one GPU (``CUDA_VISIBLE_DEVICES``), join one job and generate on one
mesh spanning their devices; then one process that sees the same P GPUs runs the same mesh. Both draw the same
random Llama-3-8B-shaped weights (``sharded_decode.random_params``: each device its own shard) and the same prompts,
decode greedily with end-of-sequence disabled, and time the decode loop with compilation apart (``jkv.generate``).
The record says whether the tokens are equal and the ratio of the two tokens/s.

    python benchmarks/multiprocess_decode.py --processes 2 --mesh data=2 --batch 256
    python benchmarks/multiprocess_decode.py --processes 4 --mesh model=4 --batch 512
    python benchmarks/multiprocess_decode.py --smoke --processes 2 --mesh data=2    # CPU devices, any machine

Records are merged into benchmarks/results/multiprocess_decode_<device>.json (``--out`` to choose).
"""

import argparse
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys

from generate_decode import LLAMA3_8B, SMOKE, device_slug, now
from records import save

HERE = pathlib.Path(__file__).resolve().parent
RECORD_KEY = lambda r: (r["mesh"], r["processes"], r["batch"], r["prompt_len"], r["new_tokens"], r["device"])
METHOD = ("kivi", {"bits": 2})


def generate_once(mesh_spec, smoke, batch, prompt_len, new_tokens, chunk) -> dict:
  """One process's part: generate on the mesh over every process's devices; what process 0 reports."""
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  from sharded_decode import mesh_devices, random_params
  cfg = ModelConfig(**(SMOKE if smoke else LLAMA3_8B))
  mesh, devices = mesh_devices(mesh_spec)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  res = gen.generate(random_params(cfg, mesh), cfg, prompts, method=make_method(METHOD[0], **METHOD[1]),
                     max_new_tokens=new_tokens, eos_ids=(), chunk=chunk, mesh=mesh)
  s = res.stats
  return dict(tokens_sha256=hashlib.sha256(json.dumps(res.tokens).encode()).hexdigest(),
              decode_tokens_per_s=s["decode_tokens_per_s"], decode_ms_per_step=1e3 * s["decode_s"] / s["decode_steps"],
              prefill_s=s["prefill_s"], compile_s=s["compile_s"], kv_bytes=s["kv_bytes"],
              device=devices[0].device_kind, jax_version=jax.__version__, processes=jax.process_count())


def child_main(args) -> None:
  """A process of either run: joins the job when it is one of several, generates, and process 0 prints JSON."""
  if args.num_processes > 1:
    from jkv import sharding
    sharding.initialize_distributed(f"localhost:{args.port}", args.num_processes, args.process_id)
  result = generate_once(args.mesh, args.smoke, args.batch, args.prompt_len, args.new_tokens, args.chunk)
  if args.process_id == 0:
    print("RESULT " + json.dumps(result), flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(argv, processes, devices_each, smoke, timeout) -> dict:
  """Start ``processes`` children of this script, each seeing ``devices_each`` devices of its own; process 0's
  result. A child that fails stops the run with its error's last lines."""
  port = _free_port()
  procs = []
  for i in range(processes):
    env = dict(os.environ)
    if smoke:
      env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=(env.get("XLA_FLAGS", "") +
                                                 f" --xla_force_host_platform_device_count={devices_each}"))
    else:
      env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i * devices_each + d) for d in range(devices_each))
    cmd = [sys.executable, __file__, "--child", "--port", str(port), "--num-processes", str(processes),
           "--process-id", str(i)] + argv
    procs.append(subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  result = None
  for i, p in enumerate(procs):
    out, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
      raise SystemExit(f"process {i} of {processes} exited with {p.returncode}:\n{err[-3000:]}")
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if lines:
      result = json.loads(lines[-1][len("RESULT "):])
  return result


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=2)
  p.add_argument("--mesh", default="data=2", help="a mesh over every process's devices, e.g. data=2 or model=4")
  p.add_argument("--batch", type=int, default=None, help="sequences (default 256; smoke 4)")
  p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 4096; smoke 100)")
  p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; smoke 28)")
  p.add_argument("--chunk", type=int, default=128, help="decode steps per jitted chunk")
  p.add_argument("--smoke", action="store_true", help="a tiny model on CPU devices")
  p.add_argument("--timeout", type=int, default=540, help="seconds each run may take")
  p.add_argument("--out", type=pathlib.Path)
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--port", type=int, help=argparse.SUPPRESS)
  p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  args = p.parse_args()
  args.batch = args.batch or (4 if args.smoke else 256)
  args.prompt_len = args.prompt_len or (100 if args.smoke else 4096)
  args.new_tokens = args.new_tokens or (28 if args.smoke else 256)
  args.chunk = min(args.chunk, args.new_tokens)
  if args.child:
    return child_main(args)
  argv = ["--mesh", args.mesh, "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--new-tokens",
          str(args.new_tokens), "--chunk", str(args.chunk)] + (["--smoke"] if args.smoke else [])
  one = _launch(argv, 1, args.processes, args.smoke, args.timeout)
  print(f"one process, {args.processes} devices, mesh {args.mesh}: {one['decode_tokens_per_s']:.1f} decode tok/s",
        flush=True)
  many = _launch(argv, args.processes, 1, args.smoke, args.timeout)
  print(f"{args.processes} processes, one device each: {many['decode_tokens_per_s']:.1f} decode tok/s", flush=True)
  if many["processes"] != args.processes:
    raise SystemExit(f"the children formed a job of {many['processes']} processes, not {args.processes}")
  record = dict(
      mesh=args.mesh, processes=args.processes, devices=args.processes, batch=args.batch, prompt_len=args.prompt_len,
      new_tokens=args.new_tokens, method="kivi2", same_tokens=one["tokens_sha256"] == many["tokens_sha256"],
      decode_tokens_per_s=many["decode_tokens_per_s"], one_process_decode_tokens_per_s=one["decode_tokens_per_s"],
      ratio_to_one_process=many["decode_tokens_per_s"] / one["decode_tokens_per_s"],
      decode_ms_per_step=many["decode_ms_per_step"], one_process_decode_ms_per_step=one["decode_ms_per_step"],
      prefill_s=many["prefill_s"], one_process_prefill_s=one["prefill_s"], kv_bytes=many["kv_bytes"],
      device=many["device"], jax_version=many["jax_version"], date=now(),
      model="smoke: tiny random model" if args.smoke else "random Llama-3-8B shape")
  print(f"same tokens: {record['same_tokens']}; tokens/s {record['ratio_to_one_process']:.3f}x one process's",
        flush=True)
  out = args.out or HERE / "results" / f"multiprocess_decode_{device_slug(record['device'])}.json"
  if not args.smoke or args.out:
    save(out, [record], RECORD_KEY)
  if not record["same_tokens"]:
    raise SystemExit("the processes generated other tokens than one process")


if __name__ == "__main__":
  sys.exit(main())
