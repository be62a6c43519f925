"""Does a prompt chunk's extend copy whole cache arrays? The compiled chunk of every method, counted and timed.

A chunk reads what the cache holds of a layer (``held_rows``) and writes the chunk into the same arrays
(``store_chunk``). Read first, nothing in the data orders the in-place write after the read, and XLA keeps the
read's operand intact by copying the whole [L, ...] array, every layer of every chunk: gigabytes a layer at 128k
tokens, in host memory for SpeCache's exact copy. Where a method's store leaves its held rows as they were
(``CacheMethod.store_spares_held_rows``: dense, SpeCache with ``exact_chunks``), ``extend`` stores first. This
compiles a chunk of ``--chunk`` tokens over ``--layers`` layers of one sequence holding ``--held`` tokens, through
``extend`` and through the read-first form (held rows, attention, store), and reports for each the copies in the
compiled program whose shape is a whole state array's, and the median time of a call.

    python benchmarks/chunk_copies.py --out $OUT/chunk_copies.json      # on the GPU
    python benchmarks/chunk_copies.py --smoke                            # any machine
"""

import argparse
import collections
import json
import pathlib
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from generate_decode import now
from jkv import generate as gen
from jkv import sharding
from jkv.attention import choose_impl
from jkv.cache import CacheSpec, StepContext, is_array_info
from jkv.chunk_attention import chunk_attention
from jkv.methods import make_method

METHODS = {"dense": ("dense", {}), "kivi2": ("kivi", {"bits": 2}), "ott2": ("ott", {}), "zipcache": ("zipcache", {}),
           "specache1": ("specache", {"bits": 1, "exact_chunks": False}),
           "specache1_exact": ("specache", {"bits": 1, "exact_chunks": True})}


def unordered_extend(method, state, layer, q, k, v, ctx):
  """The read-first form of ``CacheMethod.extend``: held rows, attention, then the store."""
  held = method.held_rows(state, layer, ctx.lengths)
  return chunk_attention(q, k, v, ctx.positions, held, impl=ctx.impl), method.store_chunk(state, layer, q, k, v, ctx)


def whole_array_copies(hlo: str, shapes) -> collections.Counter:
  """{shape: count} of the ``copy`` instructions of a compiled module whose result has one of ``shapes``."""
  found = collections.Counter()
  for m in re.finditer(r"= (\w+)\[([\d,]*)\]\S* copy\(", hlo):
    shape = tuple(int(d) for d in m.group(2).split(",") if d)
    if shape in shapes:
      found[f"{m.group(1)}{list(shape)}"] += 1
  return found


def measure(label, args, impl):
  name, options = METHODS[label]
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  method = make_method(name, **options)
  whole = method.chunk_multiple()  # chunks start and end on the method's blocks
  T, held = whole * max(1, args.chunk // whole), whole * (args.held // whole)
  spec = CacheSpec(args.layers, 1, held + 2 * T, args.kv_heads, args.head_dim, args.group, dtype)
  cache = gen.committed(sharding.create_cache(method, spec, impl, None))
  method = cache.method
  shapes = {tuple(a.shape) for a in jax.tree.leaves(cache.abstract(), is_leaf=is_array_info) if len(a.shape) > 3}
  key = jax.random.split(jax.random.key(0), 3)
  H, G, D = args.kv_heads, args.group, args.head_dim
  q = jax.random.normal(key[0], (1, H, T, G, D), dtype)
  k, v = (jax.random.normal(key[i], (1, H, T, D), dtype) for i in (1, 2))
  lengths = jnp.full((1,), held, jnp.int32)
  # The cache "holds" ``held`` tokens without a prefill: its lengths say so (the work does not depend on contents).
  state = cache.state
  rows = {}
  for form, extend in (("extend", method.extend), ("unordered", lambda *a: unordered_extend(method, *a))):
    def chunk(state, q, k, v, lengths):
      ctx = StepContext(lengths=lengths, positions=lengths[:, None] + jnp.arange(T)[None], impl=impl)
      for layer in range(args.layers):
        o, state = extend(state, layer, q, k, v, ctx)
        # The next layer's rows come from this layer's output, as in the model (so its store waits for this read).
        q, k, v = q + o, k + o[:, :, :, 0], v + o[:, :, :, -1]
      return jnp.sum(q.astype(jnp.float32)), state

    fn = jax.jit(chunk, donate_argnums=0)
    compiled = fn.lower(state, q, k, v, lengths).compile()
    copies = whole_array_copies(compiled.as_text(), shapes)
    times = []
    for _ in range(args.repeats + 1):
      start = time.perf_counter()
      out, state = compiled(state, q, k, v, lengths)
      jax.block_until_ready((out, state))
      times.append(time.perf_counter() - start)
    rows[form] = dict(whole_array_copies=dict(copies), ms=1e3 * statistics.median(times[1:]))
    print(f"{label:>16} {form:>9}: {sum(copies.values())} whole-array copies {dict(copies)}, "
          f"{rows[form]['ms']:.1f} ms a chunk", flush=True)
  return dict(impl=label, method_config=options, attention_impl=impl, layers=args.layers, held=held, chunk=T,
              kv_heads=H, group=G, head_dim=D, dtype=jnp.dtype(dtype).name, **rows,
              device=jax.devices()[0].device_kind, jax_version=jax.__version__, date=now())


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--held", type=int, default=32768, help="tokens the cache holds before the chunk")
  parser.add_argument("--chunk", type=int, default=4096)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--smoke", action="store_true", help="small shapes, fp32 (any machine)")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  if args.smoke:
    args.layers, args.held, args.chunk, args.kv_heads, args.head_dim, args.repeats = 2, 640, 320, 2, 64, 1
  impl = choose_impl()
  records = [measure(label, args, impl) for label in args.methods]
  if args.out:
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  sys.exit(main())
