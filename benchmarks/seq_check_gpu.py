"""Context parallelism on GPUs, checked: one batch's greedy tokens over ``--mesh seq=N`` against one GPU's.

The tests of ``jkv.context_parallel`` run on 4 CPU devices in XLA's attention; on GPUs a ``seq`` axis also runs the
kernels: a chunk's attention over what each device holds (cuDNN per device, the partials merged by their log-sum-
exps across devices) and each decode step's Hopper kernel partials, merged the same way. Here every method at its
defaults generates from the same random weights (2 KV heads, so ``model`` could not split one sequence) with its
prompts prefilled whole and in chunks, once on the first GPU alone and once over ``seq``, on one machine. A step
whose attention merged wrong changes the greedy tokens at once; bf16 rounding that differs by where the devices'
partials meet may flip a near tie late. Reported per run: the generated tokens that agree before the first
difference, of all, and how many distinct tokens the run made (so an agreement is not a constant output's). And the
prompts' last logits after prefill, over ``seq`` against one device's, as the largest difference relative to the
largest logit, beside the same between one device's two attention paths (Pallas/cuDNN and XLA's, the same
attention summed in another order): rounding, the scale a correct merge may differ by. Results into
results/seq_check_<device>.json.

    python benchmarks/seq_check_gpu.py --mesh seq=2          # 2 GPUs (seq=4 on 4)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/seq_check_gpu.py --smoke   # CPU devices
"""

import argparse
import pathlib

from generate_decode import device_slug, now
from records import save

HERE = pathlib.Path(__file__).resolve().parent
METHODS = {"dense": ("dense", {}), "kivi2": ("kivi", {"bits": 2}), "ott": ("ott", {}), "zipcache": ("zipcache", {}),
           "specache1": ("specache", {"bits": 1})}
MODEL = dict(architecture="llama", vocab_size=2048, embed=1024, ffw_size=2048, num_layers=2, q_heads=16, kv_heads=2,
             head_dim=128, max_position=65536, rope_theta=500000.0, dtype="bfloat16")
SMOKE = dict(MODEL, embed=128, ffw_size=256, q_heads=4, head_dim=64, vocab_size=256, dtype="float32")
LENGTHS, SMOKE_LENGTHS = (3000, 1500, 700), (300, 150, 70)
NEW_TOKENS = 24


def agreement(one: list, split: list) -> tuple[int, int]:
  """(generated tokens equal before each sequence's first difference, summed; all generated tokens)."""
  same = 0
  for a, b in zip(one, split):
    same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  return same, sum(len(a) for a in one)


def prefill_logits(params, cfg, prompts, method, mesh, prefill_chunk, impl="auto"):
  """The prompts' last-token logits [B, vocab] float32 after ``generate``'s prefill of them (whole or in chunks)."""
  import numpy as np
  from jkv import generate as gen
  from jkv import prefill as prefill_lib
  from jkv import sharding
  from jkv.cache import CacheSpec
  with sharding.use_mesh(mesh):
    plan = gen.plan_generation(cfg, method, prompts, max_new_tokens=NEW_TOKENS, prefill_chunk=prefill_chunk,
                               attention_impl=impl, mesh=mesh)
    cache = sharding.create_cache(method, CacheSpec.for_model(cfg, len(prompts), plan.capacity), plan.impl, mesh)
    run = prefill_lib.Prefill(plan.prefill, cfg, prefill_lib.pad_prompts(prompts, plan.prefill.width, 0),
                              [len(p) for p in prompts])
    return np.asarray(run(sharding.shard_params(params, cfg, mesh), cache)[0])


def relative(a, b) -> float:
  import numpy as np
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mesh", default="seq=2")
  parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
  parser.add_argument("--chunk", type=int, default=1024, help="the chunked runs' prefill chunk")
  parser.add_argument("--smoke", action="store_true", help="a tiny model (CPU devices)")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv import sharding
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  from jkv.params import init_random

  cfg = ModelConfig(**(SMOKE if args.smoke else MODEL))
  params = jax.jit(lambda key: init_random(cfg, key, scale=0.08))(jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (SMOKE_LENGTHS if args.smoke else LENGTHS)]
  chunk = args.chunk // 8 if args.smoke else args.chunk
  mesh = sharding.make_mesh(args.mesh)
  device = jax.devices()[0].device_kind
  out = args.out or HERE / "results" / f"seq_check_{device_slug(device)}.json"
  for label in args.methods:
    name, settings = METHODS[label]
    for prefill_chunk in (None, chunk):
      run = lambda m: gen.generate(params, cfg, prompts, method=make_method(name, **settings),
                                   max_new_tokens=NEW_TOKENS, eos_ids=(), prefill_chunk=prefill_chunk, mesh=m)
      one, split = run(None), run(mesh)
      same, total = agreement(one.tokens, split.tokens)
      distinct = len({t for seq in one.tokens for t in seq})
      method = make_method(name, **settings)
      logits = prefill_logits(params, cfg, prompts, method, None, prefill_chunk)
      seq_error = relative(prefill_logits(params, cfg, prompts, method, mesh, prefill_chunk), logits)
      impl_error = relative(prefill_logits(params, cfg, prompts, method, None, prefill_chunk, "xla"), logits)
      record = dict(impl=label, method_config=settings, mesh=args.mesh, devices=mesh.devices.size,
                    prompt_lens=[len(p) for p in prompts], prefill_chunk=prefill_chunk,
                    prefill_calls=split.stats["prefill_calls"], attention_impl=split.stats["attention_impl"],
                    new_tokens=NEW_TOKENS, agreeing_tokens=same, prefill_logits_error=seq_error,
                    one_device_xla_logits_error=impl_error,
                    generated_tokens=total, distinct_tokens=distinct,
                    model="smoke" if args.smoke else "random, 2 KV heads", device=device,
                    jax_version=jax.__version__, date=now())
      save(out, [record], lambda r: (r["impl"], r["mesh"], r["prefill_chunk"], r["model"], r["device"]))
      print(f"{label:>10} prefill {'whole' if prefill_chunk is None else f'chunks of {prefill_chunk}':>16} on "
            f"{args.mesh} ({split.stats['prefill_calls']} calls, {split.stats['attention_impl']}): {same}/{total} "
            f"tokens agree with one device's ({distinct} distinct); prefill logits {seq_error:.2e} off one device's "
            f"(its XLA path {impl_error:.2e})", flush=True)


if __name__ == "__main__":
  main()
