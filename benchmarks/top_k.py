"""SpeCache's per-layer selection on a GPU: ``lax.top_k`` (k = 64) over rows of several lengths and counts, the same
by counting ranks (``jkv.methods.specache.top_k`` with every shape allowed), and
``jkv.methods.specache.top_k_positions`` over a layer's candidates at long contexts, in microseconds per call.

Each figure is one jitted loop of ``--reps`` calls (the scores nudged each time, so none is hoisted), the median of
five runs divided by the calls. Results into results/top_k.json (one record per shape, with the device, jax version
and date).

    python benchmarks/top_k.py
    python benchmarks/top_k.py --smoke      # tiny shapes, any machine
"""

import argparse
import pathlib
import time

from generate_decode import now
from records import save

HERE = pathlib.Path(__file__).resolve().parent
K = 64


def per_call_us(f, x, reps: int) -> float:
  import jax
  import jax.numpy as jnp
  import numpy as np

  @jax.jit
  def loop(x):
    body = lambda i, acc: acc + jnp.sum(f(x + i.astype(x.dtype) * 1e-9))
    return jax.lax.fori_loop(0, reps, body, jnp.int32(0))

  loop(x).block_until_ready()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    loop(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return 1e6 * float(np.median(times)) / reps


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--reps", type=int, default=200)
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "top_k.json")
  args = parser.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jkv.methods.specache import top_k, top_k_positions

  rng = np.random.default_rng(0)
  base = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__, date=now(), k=K)
  cases = [("lax.top_k", rows, n) for rows in (8, 16, 32) for n in (256, 513, 1024, 2048, 2049, 4096, 4098, 16384)]
  cases += [("lax.top_k", rows, n) for rows in (64, 128, 256) for n in (513, 1024, 2048)]
  cases += [("ranks", rows, n) for rows in (8, 16, 32, 64, 128, 256) for n in (513, 1024, 2048)]
  cases += [("top_k_positions", rows, n) for rows in (8, 16) for n in (131136, 524352, 1048640)]
  if args.smoke:
    cases = [("lax.top_k", 8, 256), ("ranks", 8, 256), ("top_k_positions", 8, 4160)]
  fns = {"lax.top_k": lambda y: jax.lax.top_k(y, K)[1], "ranks": lambda y: top_k(y, K, rank_pairs=1 << 62)[1],
         "top_k_positions": lambda y: top_k_positions(y, K)}
  records = []
  for name, rows, n in cases:
    x = jnp.asarray(rng.random((rows, n), np.float32))
    us = per_call_us(fns[name], x, 2 if args.smoke else args.reps)
    records.append(dict(base, function=name, rows=rows, length=n, us_per_call=us))
    print(f"{name:>16} rows={rows:3d} length={n:8d}: {us:7.1f} us", flush=True)
  save(args.out, records, lambda r: (r["function"], r["rows"], r["length"], r["device"]))


if __name__ == "__main__":
  main()
