"""Write the optimized HLO of one jitted decode chunk (Llama-3-8B shape, B=8, 8k cache) for a method, or of one
chunked-prefill call (``--extend``: B=1, a 16k chunk, a 128k cache), and list its largest buffers: what the
compiled step copies, fuses or writes in place.

    python benchmarks/decode_step_hlo.py dense /tmp/dense_hlo.txt
    python benchmarks/decode_step_hlo.py specache:bits=1,fetch_rows=64 /tmp/specache_hlo.txt
    python benchmarks/decode_step_hlo.py kivi /tmp/kivi_extend_hlo.txt --extend

The method is a spec as ``jkv compare`` takes it (NAME or NAME:OPTION=VALUE,...; plain ``kivi`` is KIVI-2).
"""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jkv import generate as gen
from jkv import params as params_lib
from jkv import prefill as prefill_lib
from jkv.attention import choose_impl
from jkv.cache import CacheSpec, KVCache
from jkv.config import ModelConfig
from jkv.evaluation.compare import MethodSpec
from jkv.sampling import Greedy

SIZES = {"f32": 4, "bf16": 2, "f16": 2, "u32": 4, "s32": 4, "pred": 1, "u8": 1, "s8": 1}


def main(method_spec, out, extend=False):
  batch, capacity = (1, 131072 + 16384) if extend else (8, 8320)
  cfg = ModelConfig(architecture="llama", vocab_size=128256, embed=4096, ffw_size=14336, num_layers=32, q_heads=32,
                    kv_heads=8, head_dim=128, max_position=131072, dtype="bfloat16")
  params = jax.eval_shape(lambda: params_lib.init_random(cfg, jax.random.key(0)))
  method = MethodSpec.parse("kivi:bits=2" if method_spec == "kivi" else method_spec).method()
  # A real cache (zeros), not shapes: a traced shape carries no memory kind, and SpeCache's host copy needs one.
  cache = KVCache.create(method, CacheSpec.for_model(cfg, batch, capacity), choose_impl())
  no = jax.ShapeDtypeStruct((batch,), bool)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  args = (params, cache, i32(batch), i32(batch, method.speculative_rows), no, no, i32(batch, 2),
          jax.eval_shape(lambda: jax.random.key(0)), jnp.asarray([1]), jnp.int32(0))
  if extend:
    chunk = 16384
    args = (params, i32(batch, chunk), jnp.int32(chunk), i32(batch), jax.ShapeDtypeStruct((batch, cfg.vocab_size),
                                                                                          jnp.float32), cache)
    compiled = prefill_lib._prefill_chunk.lower(*args, cfg=cfg, first=False).compile()
  else:
    compiled = gen._decode_chunk.lower(*args, cfg=cfg, sampler=Greedy(), steps=1).compile()
  text = compiled.as_text()
  open(out, "w").write(text)
  big = []
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\(", line)
    if m and m.group(2) in SIZES:
      n = int(np.prod([int(d) for d in m.group(3).split(",") if d])) * SIZES[m.group(2)]
      if n >= 64 << 20:
        big.append((n, m.group(4), line.strip()[:160]))
  for n, op, line in sorted(big, reverse=True)[:25]:
    print(f"{n / 2**20:9.1f} MiB {op:>20} {line}")
  print(compiled.memory_analysis())


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], extend="--extend" in sys.argv[3:])
