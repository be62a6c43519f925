"""A prompt longer than one process can prefill in the time it has: prefilled in stages, the compressed cache saved
between them (``jkv.saved_cache``), each stage its own process.

One stage is one command (one device call of at most 10 minutes). The document is ``--context`` seeded random
tokens of a randomly initialized Llama-3-8B-shaped model (``generate_decode.LLAMA3_8B``, bf16; both the same in
every process). Stage s of S prefills tokens [b_s, b_s+1) with b_s = context * sqrt(s / S): attention's work over
a prefix grows as its square, so the stages take about the same attention time. Stage 0 prefills its slice and
saves the cache to ``--dir``/stage0; stage s loads stage s-1's cache, continues it with its slice (the
``generate(cache=...)`` continuation: the saved cache's tails, then the slice) and saves; the last stage decodes
``--new-tokens`` instead of saving. A stage removes the cache it loaded once its own is saved, so the disk holds
at most two. The cache directory must survive between stages: on the device tool, issue each stage's call while
the machine is still warm.

Records (one per stage, merged into benchmarks/results/staged_prefill.json; ``--out`` to choose): the stage's
slice, its prefill s and tokens/s, the save and load s and GB/s, compile s; the last stage's record adds the
decode ms/step, its floor (weights plus the cache's held bytes at the copy rate measured in the same process) and
``prefill_s_total``, the stages' prefill seconds summed from the records already in the output file.

    python benchmarks/staged_prefill.py --context 1048576 --stages 2 --stage 0 --dir /tmp/jkv_staged
    python benchmarks/staged_prefill.py --context 1048576 --stages 2 --stage 1 --dir /tmp/jkv_staged
    python benchmarks/staged_prefill.py --smoke      # a tiny model, every stage in one process, any machine
"""

import argparse
import json
import math
import pathlib
import shutil
import tempfile
import time

from generate_decode import LLAMA3_8B, SMOKE, copy_rate, now
from long_context import METHODS
from records import save

HERE = pathlib.Path(__file__).resolve().parent
RECORD_KEY = lambda r: (r["impl"], r["context"], r["stages"], r["stage"], r["device"])


def bounds(context: int, stages: int) -> list:
  """Token offsets b_0 = 0 < ... < b_S = context of the stages' slices: equal attention work, as nearly as whole
  tokens allow."""
  return [round(context * math.sqrt(s / stages)) for s in range(stages + 1)]


def run_stage(label, context, stages, stage, new_tokens, directory, smoke, out) -> dict:
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv import memory
  from jkv import params as params_lib
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  shape = SMOKE if smoke else LLAMA3_8B
  cfg = ModelConfig(**dict(shape, max_position=max(shape["max_position"], context + new_tokens)))
  params = params_lib.init_random(cfg, jax.random.key(0))
  document = np.random.default_rng(0).integers(0, cfg.vocab_size, context).tolist()
  b = bounds(context, stages)
  last = stage == stages - 1
  loaded = None if stage == 0 else directory / f"stage{stage - 1}"
  saved = None if last else directory / f"stage{stage}"
  name, options = METHODS[label]
  t = time.perf_counter()
  res = gen.generate(params, cfg, [document[b[stage]:b[stage + 1]]], method=make_method(name, **options),
                     max_new_tokens=new_tokens if last else 1, eos_ids=(), chunk=min(16, new_tokens),
                     cache=None if loaded is None else str(loaded), save_cache=None if saved is None else str(saved))
  s = res.stats
  record = dict(
      part="staged", impl=label, method_config=s["method_config"], batch=1, context=context, stages=stages,
      stage=stage, tokens_before=b[stage], tokens=b[stage + 1] - b[stage], devices=1,
      device=jax.devices()[0].device_kind, jax_version=jax.__version__, date=now(),
      model="smoke" if smoke else "random Llama-3-8B shape", synthetic_fill=False, prefill_s=s["prefill_s"],
      prefill_tokens_per_s=s["prefill_tokens_per_s"], prefill_chunk=s["prefill_chunk"],
      prefill_calls=s["prefill_calls"], capacity=s["capacity"], kv_bytes=s["kv_bytes"],
      kv_host_bytes=s["kv_host_bytes"], peak_device_bytes=s["peak_device_bytes"], compile_s=s["compile_s"])
  if loaded is not None:
    record.update(load_s=s["cache_loaded"]["load_s"], load_gb_per_s=s["cache_loaded"]["load_gb_per_s"])
    shutil.rmtree(loaded, ignore_errors=True)  # this stage's own cache is saved (or this is the last stage)
  if saved is not None:
    record.update(save_s=s["cache_saved"]["save_s"], save_gb_per_s=s["cache_saved"]["save_gb_per_s"],
                  disk_bytes=s["cache_saved"]["disk_bytes"])
  if last:
    weight_bytes = memory.tree_bytes(params)
    rate = 1e10 if smoke else copy_rate()
    ms = 1e3 * s["decode_s"] / s["decode_steps"]
    floor = 1e3 * (weight_bytes + s["kv_bytes"]) / rate
    earlier = json.loads(out.read_text()) if out is not None and out.exists() else []
    key = lambda r: (r["impl"], r["context"], r["stages"], r["device"])
    before = {r["stage"]: r["prefill_s"] for r in earlier if key(r) == key(record) and r["stage"] < stage}
    record.update(decode_ms_per_step=ms, floor_ms_per_step=floor, ratio_to_floor=ms / floor, new_tokens=new_tokens,
                  copy_rate=rate, weight_bytes=weight_bytes,
                  prefill_s_total=s["prefill_s"] + sum(before.values()) if len(before) == stage else None)
  record["wall_s"] = time.perf_counter() - t
  print(f"{label} stage {stage + 1}/{stages}: tokens {b[stage]}-{b[stage + 1]} prefill {s['prefill_s']:.2f} s "
        f"({s['prefill_tokens_per_s']:.0f} tok/s, chunk {s['prefill_chunk']})"
        + (f", load {record['load_s']:.2f} s" if "load_s" in record else "")
        + (f", save {record['save_s']:.2f} s" if "save_s" in record else "")
        + (f", decode {record['decode_ms_per_step']:.2f} ms/step ({record['ratio_to_floor']:.2f}x the floor), "
           f"prefill in all {record['prefill_s_total'] or float('nan'):.1f} s" if last else ""), flush=True)
  return record


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--context", type=int, default=None, help="document tokens (default 1048576; 1500 with --smoke)")
  p.add_argument("--stages", type=int, default=2, help="2 fit a 1M-token KIVI-2 prompt in two 6-minute "
                 "processes on an H200")
  p.add_argument("--stage", type=int, default=None, help="the stage this process runs (0 first; --smoke: all)")
  p.add_argument("--methods", nargs="+", default=["kivi2_mma"], choices=list(METHODS))
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--dir", type=pathlib.Path, default=None, help="where the stages' caches live between processes")
  p.add_argument("--smoke", action="store_true", help="a tiny model, every stage in this process")
  p.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "staged_prefill.json")
  args = p.parse_args()
  context = args.context or (1500 if args.smoke else 1048576)
  if args.stages < 1 or (args.stage is None and not args.smoke) or not 0 <= (args.stage or 0) < args.stages:
    p.error(f"--stage must be one of 0..{args.stages - 1} (every stage runs in one process only with --smoke)")
  if args.dir is None and not args.smoke:
    p.error("--dir is needed: the caches must outlive this process")
  directory = args.dir or pathlib.Path(tempfile.mkdtemp(prefix="jkv_staged_"))
  for label in args.methods:
    for stage in ([args.stage] if args.stage is not None else range(args.stages)):
      save(args.out, [run_stage(label, context, args.stages, stage, args.new_tokens, directory, args.smoke,
                                args.out)], RECORD_KEY)


if __name__ == "__main__":
  main()
