"""Prefill once, ask many: a long prompt's cache saved (``jkv.saved_cache``), loaded and continued by a question.

A randomly initialized Llama-3-8B-shaped model (``generate_decode.LLAMA3_8B``, bf16, ``max_position`` raised to the
context), one document of ``--context`` random tokens, for each of ``--methods``:

1. ``jkv.generate.generate([document], save_cache=DIR, max_new_tokens=1)``: the document prefilled and its cache
   saved; recorded: prefill s, the bytes the method holds (device and host), the bytes of the arrays saved (cut to
   the held capacity) and on disk, save s and GB/s (array bytes from the device to synced, checksummed files);
2. ``generate([question], cache=DIR)``: the cache loaded (checksums, read, grown to the capacity, placed) and
   continued by a ``--question``-token prompt, then ``--new-tokens`` decoded; recorded: load s and GB/s, the
   question's prefill s (what a question costs instead of the document's prefill).

DIR is a fresh directory under ``--dir`` (default: the system's temporary directory), removed after each method.
Records are merged into benchmarks/results/saved_cache.json (``--out`` to choose).

    python benchmarks/saved_cache.py --context 131072 --methods kivi2_mma dense specache1
    python benchmarks/saved_cache.py --smoke      # a tiny model, any machine
"""

import argparse
import pathlib
import shutil
import tempfile

from generate_decode import LLAMA3_8B, SMOKE, now
from long_context import METHODS
from records import save

HERE = pathlib.Path(__file__).resolve().parent
RECORD_KEY = lambda r: (r["impl"], r["context"], r["question_tokens"], r["device"])


def run(context, labels, question, new_tokens, directory, smoke):
  """Yields one record per method (a failed one's names its error)."""
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv import params as params_lib
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  shape = SMOKE if smoke else LLAMA3_8B
  cfg = ModelConfig(**dict(shape, max_position=max(shape["max_position"], context + question + new_tokens)))
  params = params_lib.init_random(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  document = rng.integers(0, cfg.vocab_size, context).tolist()
  asked = rng.integers(0, cfg.vocab_size, question).tolist()
  for label in labels:
    name, options = METHODS[label]
    method = make_method(name, **options)
    where = tempfile.mkdtemp(prefix=f"jkv_saved_{label}_", dir=directory)
    try:
      first = gen.generate(params, cfg, [document], method=method, max_new_tokens=1, eos_ids=(),
                           save_cache=f"{where}/cache")
      then = gen.generate(params, cfg, [asked], method=method, max_new_tokens=new_tokens, eos_ids=(),
                          chunk=min(16, new_tokens), cache=f"{where}/cache")
    except (MemoryError, ValueError, RuntimeError) as e:  # recorded (its first line), and the next method runs
      error = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
      print(f"{label}: {error}", flush=True)
      yield dict(impl=label, context=context, question_tokens=question, device=jax.devices()[0].device_kind,
                 jax_version=jax.__version__, date=now(), error=error)
      continue
    finally:
      shutil.rmtree(where, ignore_errors=True)
    saved, loaded = first.stats["cache_saved"], then.stats["cache_loaded"]
    record = dict(
        impl=label, method_config=first.stats["method_config"], batch=1, context=context, question_tokens=question,
        new_tokens=new_tokens, devices=1, device=jax.devices()[0].device_kind, jax_version=jax.__version__,
        date=now(), model="random Llama-3-8B shape" if not smoke else "smoke", prefill_s=first.stats["prefill_s"],
        prefill_chunk=first.stats["prefill_chunk"], held_bytes=saved["held_bytes"],
        held_host_bytes=saved["held_host_bytes"], array_bytes=saved["array_bytes"], disk_bytes=saved["disk_bytes"],
        disk_to_held=saved["disk_bytes"] / (saved["held_bytes"] + saved["held_host_bytes"]),
        save_s=saved["save_s"], save_gb_per_s=saved["save_gb_per_s"], load_s=loaded["load_s"],
        load_gb_per_s=loaded["load_gb_per_s"], question_prefill_s=then.stats["prefill_s"],
        capacity=then.stats["capacity"], peak_device_bytes=then.stats["peak_device_bytes"])
    print(f"{label:>10} {context} tokens: prefill {record['prefill_s']:.2f} s; held "
          f"{(record['held_bytes'] + record['held_host_bytes']) / 2**30:.3f} GiB, arrays "
          f"{record['array_bytes'] / 2**30:.3f} GiB, disk {record['disk_bytes'] / 2**30:.3f} GiB; save "
          f"{record['save_s']:.2f} s ({record['save_gb_per_s']:.2f} GB/s), load {record['load_s']:.2f} s "
          f"({record['load_gb_per_s']:.2f} GB/s); a {question}-token question {record['question_prefill_s']:.3f} s",
          flush=True)
    yield record


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--context", type=int, default=None, help="document tokens (default: 131072; 1024 with --smoke)")
  p.add_argument("--methods", nargs="+", default=["kivi2_mma", "dense", "specache1"], choices=list(METHODS))
  p.add_argument("--question", type=int, default=64, help="tokens of the prompt that continues the saved document")
  p.add_argument("--new-tokens", type=int, default=16)
  p.add_argument("--dir", default=None, help="where the caches are written (default: the temporary directory)")
  p.add_argument("--smoke", action="store_true", help="a tiny model (any machine)")
  p.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "saved_cache.json")
  args = p.parse_args()
  context = args.context or (1024 if args.smoke else 131072)
  for record in run(context, args.methods, args.question, args.new_tokens, args.dir, args.smoke):
    save(args.out, [record], RECORD_KEY)  # each as it comes: a later method's failure keeps the earlier records


if __name__ == "__main__":
  main()
