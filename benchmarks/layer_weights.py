"""Does reading each layer's weights out of stacked [L, ...] arrays cost a copy? The MLP of a Llama-3-8B-shaped
decode step (32 layers, embed 4096, ffw 14336, bf16, 8 tokens) three ways, each timed against the bytes it must
read at the copy rate:

    scan      lax.scan over stacked weights (as jkv's model does): XLA slices each layer's weights
    unrolled  a Python loop over the same stacked weights (static slices)
    separate  a Python loop over 32 separate per-layer arrays (no slicing at all)

    python benchmarks/layer_weights.py          # on the GPU; prints a table, JSON to $OUT if set
"""

import json
import os

import jax
import jax.numpy as jnp

from generate_decode import copy_rate, median_ms

L, E, F, B = 32, 4096, 14336, 8


def mlp(x, w_gate, w_up, w_down):
  h = jax.nn.silu(x @ w_gate) * (x @ w_up)
  return x + h @ w_down


def main():
  key = jax.random.key(0)
  ws = [jax.random.normal(k, shape, jnp.bfloat16) * 0.01
        for k, shape in zip(jax.random.split(key, 3), [(L, E, F), (L, E, F), (L, F, E)])]
  x = jax.random.normal(key, (B, E), jnp.bfloat16)
  rate = copy_rate()
  weight_bytes = sum(w.nbytes for w in ws)

  scan = jax.jit(lambda x, g, u, d: jax.lax.scan(lambda x, w: (mlp(x, *w), None), x, (g, u, d))[0])

  @jax.jit
  def unrolled(x, g, u, d):
    for i in range(L):
      x = mlp(x, g[i], u[i], d[i])
    return x

  separate_ws = [[w[i] for i in range(L)] for w in ws]
  jax.block_until_ready(separate_ws)

  @jax.jit
  def separate(x, gs, us, ds):
    for g, u, d in zip(gs, us, ds):
      x = mlp(x, g, u, d)
    return x

  timed = lambda fn, *args: median_ms(fn, *args) / 1e3
  rows = {"scan": timed(scan, x, *ws), "unrolled": timed(unrolled, x, *ws), "separate": timed(separate, x, *separate_ws)}
  floor = weight_bytes / rate
  print(f"copy rate {rate / 1e12:.2f} TB/s; MLP weights {weight_bytes / 2**30:.2f} GiB; floor {1e3 * floor:.2f} ms")
  for name, t in rows.items():
    print(f"{name:>9}: {1e3 * t:7.2f} ms  ({t / floor:.2f}x the floor)")
  if os.environ.get("OUT"):
    record = dict(rate=rate, weight_bytes=weight_bytes, ms={k: 1e3 * v for k, v in rows.items()},
                  device=jax.devices()[0].device_kind, jax_version=jax.__version__)
    open(os.path.join(os.environ["OUT"], "layer_weights.json"), "w").write(json.dumps(record, indent=1))


if __name__ == "__main__":
  main()
