"""Do a layer's projections that share an input run faster as one product over concatenated weights? The q, k, v
projections and the MLP's gate and up of a Llama-3-8B-shaped decode step (32 layers, embed 4096, 32 query heads
and 8 KV heads of 128, ffw 14336, bf16), scanned over stacked weights as jkv's model does and compiled with its
options (``jkv.xla_options``), two ways:

    separate  q, k, v [E, H, D] and gate, up [E, F]: five products a layer
    fused     qkv [E, Hkv, g + 2, D] and gate_up [E, 2, F]: two products a layer, the same bytes

each timed against the bytes it must read at the copy rate, at B = 8 and at B = 307 (KIVI-2's largest batch).

    python benchmarks/fused_projections.py      # on the GPU; prints a table, JSON to $OUT if set
"""

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from generate_decode import LLAMA3_8B, copy_rate, median_ms
from jkv.xla_options import MODEL_COMPILER_OPTIONS

L, E, HKV, D, F = (LLAMA3_8B[k] for k in ("num_layers", "embed", "kv_heads", "head_dim", "ffw_size"))
G = LLAMA3_8B["q_heads"] // HKV


def dot(x, w):
  return jnp.einsum("be,e...->b...", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def separate_layer(x, w):
  q, k, v, gate, up = w
  attn = dot(x, q).reshape(x.shape[0], -1)[:, :E] + dot(x, k).reshape(x.shape[0], -1).sum(1, keepdims=True) \
      + dot(x, v).reshape(x.shape[0], -1).sum(1, keepdims=True)
  return attn + (jax.nn.silu(dot(x, gate)) * dot(x, up))[:, :E]


def fused_layer(x, w):
  qkv, gate_up = w
  y = dot(x, qkv)  # [B, Hkv, g + 2, D]
  q, k, v = y[:, :, :G], y[:, :, G], y[:, :, G + 1]
  attn = q.reshape(x.shape[0], -1)[:, :E] + k.reshape(x.shape[0], -1).sum(1, keepdims=True) \
      + v.reshape(x.shape[0], -1).sum(1, keepdims=True)
  h = dot(x, gate_up)  # [B, 2, F]
  return attn + (jax.nn.silu(h[:, 0]) * h[:, 1])[:, :E]


def scanned(layer):
  return jax.jit(lambda x, ws: jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0],
                 compiler_options=MODEL_COMPILER_OPTIONS)


def main():
  keys = iter(jax.random.split(jax.random.key(0), 8))
  normal = lambda *shape: jax.random.normal(next(keys), (L, *shape), jnp.bfloat16) * 0.01
  separate = (normal(E, HKV * G, D), normal(E, HKV, D), normal(E, HKV, D), normal(E, F), normal(E, F))
  fused = (jnp.concatenate([separate[0].reshape(L, E, HKV, G, D), separate[1][:, :, :, None],
                            separate[2][:, :, :, None]], axis=3),
           jnp.stack(separate[3:], axis=2))
  weight_bytes = sum(w.nbytes for w in separate)
  rate = copy_rate()
  floor = weight_bytes / rate
  records = []
  print(f"copy rate {rate / 1e12:.2f} TB/s; q, k, v, gate, up weights {weight_bytes / 2**30:.2f} GiB; "
        f"floor {1e3 * floor:.2f} ms")
  for batch in (8, 307):
    x = jax.random.normal(next(keys), (batch, E), jnp.bfloat16)
    # Alternated, twice each: the copy rate moves a few percent from one timing to the next.
    ms = {"separate": [], "fused": []}
    for _ in range(2):
      ms["separate"].append(median_ms(scanned(separate_layer), x, separate))
      ms["fused"].append(median_ms(scanned(fused_layer), x, fused))
    for name, values in ms.items():
      t = statistics.median(values)
      print(f"B={batch:<4} {name:>9}: {t:7.3f} ms  ({t / 1e3 / floor:.2f}x the floor)  runs {values}")
      records.append(dict(batch=batch, layout=name, ms=t, runs=values, ratio_to_floor=t / 1e3 / floor))
  if os.environ.get("OUT"):
    record = dict(rate=rate, weight_bytes=weight_bytes, floor_ms=1e3 * floor, records=records,
                  device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    open(os.path.join(os.environ["OUT"], "fused_projections.json"), "w").write(json.dumps(record, indent=1))


if __name__ == "__main__":
  main()
