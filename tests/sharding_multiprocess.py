"""One process of a multi-process run (tests/test_sharding.py starts two): joins the job through the CLI's flags,
generates on a data=2 x model=2 mesh spanning both processes' CPU devices, then on one of its own devices alone (the
reference, compiled as the mesh's programs were), and prints both as JSON.

    python tests/sharding_multiprocess.py PROCESS_ID PORT    (with 2 forced CPU devices per process)
"""

import argparse
import json
import sys

from jkv import cli
from jkv.config import ModelConfig

TINY = ModelConfig("llama", vocab_size=128, embed=96, ffw_size=160, num_layers=2, q_heads=6, kv_heads=2,
                   head_dim=64, max_position=2048)


def tiny_params():
  """Random weights of TINY, the same in every process (one seed, CPU arithmetic)."""
  import jax
  from jkv.params import init_random
  return init_random(TINY, jax.random.key(0), scale=0.15)


def tiny_prompts():
  import numpy as np
  rng = np.random.default_rng(5)
  return [rng.integers(2, TINY.vocab_size, n).tolist() for n in (5, 30, 17, 28)]


def main(process_id: int, port: int) -> None:
  args = argparse.Namespace(coordinator=f"localhost:{port}", num_processes=2, process_id=process_id,
                            mesh="data=2,model=2")
  mesh = cli.mesh_from_args(args)  # jax.distributed first: nothing touched jax's devices before

  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv.methods import make_method

  assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
  params = jax.tree.map(np.asarray, tiny_params())  # every process holds the same values; each places its shards
  run = lambda params, mesh: gen.generate(params, TINY, tiny_prompts(), max_new_tokens=10, chunk=10, eos_ids=(),
                                          method=make_method("kivi", bits=2, residual=32), attention_impl="xla",
                                          mesh=mesh)
  res = run(params, mesh)
  device = jax.local_devices()[0]
  with jax.default_device(device):
    one = run(jax.device_put(params, device), None)
  print("TOKENS " + json.dumps(dict(process=jax.process_index(), tokens=res.tokens, mesh=res.stats["mesh"],
                                    kv_bytes=res.stats["kv_bytes"], one_device_tokens=one.tokens,
                                    one_device_kv_bytes=one.stats["kv_bytes"])), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
