"""ZipCache's probe scoring at prefill, one layer: the two-pass Pallas kernel against the XLA loop it replaced.

One layer of the random Llama-3-8B shape (8 KV heads, 4 query heads each, D = 128, bf16), a prompt of ``--context``
tokens and ZipCache's default probes (5% recent, 5% random: ``saliency.prefill_probes``): the attention mass each key
receives from the probes (``jkv_kernels.probe_mass``), timed for the XLA loop (``probe_mass_reference``: 32 probe
rows at a time, their probabilities materialized) and for the kernel at each ``--blocks`` setting, with the largest
difference from the XLA result. Records go to ``--out`` (JSON).

    python benchmarks/probe_mass.py --context 131072 --out $OUT/probe_mass.json     # on the GPU
    python benchmarks/probe_mass.py --smoke                                           # any machine (interpret)
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from generate_decode import now
from jkv.methods import saliency
from jkv_kernels.probe_mass import probe_mass, probe_mass_reference


def timed(fn, args, repeats):
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return out, 1e3 * statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--context", type=int, default=131072)
  parser.add_argument("--blocks", nargs="+", default=["128,64,4", "128,128,4", "128,128,8", "64,128,4"],
                      help="kernel settings block_rows,block_keys,num_warps")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--smoke", action="store_true", help="a small prompt, fp32, interpret mode")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  T, H, g, D, dtype = (640, 2, 2, 32, jnp.float32) if args.smoke else (args.context, 8, 4, 128, jnp.bfloat16)
  kq, kk = jax.random.split(jax.random.key(0))
  q = jax.random.normal(kq, (1, H, T, g, D), dtype)
  k = jax.random.normal(kk, (1, H, T, D), dtype)
  rows, ok = saliency.prefill_probes(jax.random.key(1), jnp.asarray([T], jnp.int32), T, 0.05, 0.05)
  base = dict(context=T, kv_heads=H, group=g, head_dim=D, dtype=jnp.dtype(dtype).name, probes=int(ok.sum()),
              device=jax.devices()[0].device_kind, jax_version=jax.__version__, date=now())
  want, xla_ms = timed(jax.jit(probe_mass_reference), (q, k, rows, ok), args.repeats)
  records = [dict(base, impl="xla", ms=xla_ms)]
  print(f"xla loop: {xla_ms:.1f} ms a layer at {T} tokens, {base['probes']} probes", flush=True)
  for setting in args.blocks:
    block_rows, block_keys, num_warps = map(int, setting.split(","))
    fn = jax.jit(lambda q, k, r, o: probe_mass(q, k, r, o, block_rows=block_rows, block_keys=block_keys,
                                               num_warps=num_warps, interpret=args.smoke))
    got, ms = timed(fn, (q, k, rows, ok), args.repeats)
    diff = float(jnp.max(jnp.abs(got - want)) / jnp.max(want))
    records.append(dict(base, impl="pallas", block_rows=block_rows, block_keys=block_keys, num_warps=num_warps,
                        ms=ms, speedup=xla_ms / ms, max_diff_rel=diff))
    print(f"kernel {setting}: {ms:.2f} ms a layer ({xla_ms / ms:.1f}x), max |diff| / max {diff:.2e}", flush=True)
  if args.out:
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  sys.exit(main())
