"""Decode tokens/s of ``jkv.generate`` with an 8k-token context: KIVI-2 against dense.

A randomly initialized Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads, D = 128, embed 4096,
ffw 14336, vocab 128256, bf16), batch 8, prompts of ``--prompt-len`` random tokens, ``--new-tokens`` greedy
tokens with end-of-sequence disabled so every step runs. Each method runs twice; the second call's stats are
reported (it compiles nothing; the first call's compile seconds are recorded apart). Results go to
benchmarks/results/generate_decode_<device>.json; ``--table`` renders them into benchmarks/README.md.

    python benchmarks/generate_decode.py                      # on the GPU
    python benchmarks/generate_decode.py --smoke              # a tiny model, any machine
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import re

import jax
import numpy as np

from jkv import generate as gen
from jkv import params as params_lib
from jkv.cache import make_method
from jkv.config import ModelConfig

HERE = pathlib.Path(__file__).resolve().parent
README = HERE / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- generate_decode:begin -->", "<!-- generate_decode:end -->"

LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=128256, embed=4096, ffw_size=14336, num_layers=32,
                        q_heads=32, kv_heads=8, head_dim=128, max_position=131072, rope_theta=500000.0,
                        dtype="bfloat16")
SMOKE = dataclasses.replace(LLAMA3_8B, vocab_size=512, embed=128, ffw_size=256, num_layers=2, q_heads=4,
                            kv_heads=2, head_dim=64, dtype="float32")

METHODS = {"dense": ("dense", {}), "kivi2": ("kivi", {"bits": 2}), "kivi4": ("kivi", {"bits": 4})}


def device_slug(device) -> str:
  return re.sub(r"[^a-z0-9]+", "_", device.device_kind.lower()).strip("_")


def run(cfg, batch, prompt_len, new_tokens, methods, seed=0):
  params = params_lib.init_random(cfg, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  device = jax.devices()[0]
  records = []
  for label in methods:
    name, options = METHODS[label]
    method = make_method(name, **options)
    first = gen.generate(params, cfg, prompts, method=method, max_new_tokens=new_tokens, eos_ids=(),
                         chunk=new_tokens)
    res = gen.generate(params, cfg, prompts, method=method, max_new_tokens=new_tokens, eos_ids=(),
                       chunk=new_tokens)
    s = res.stats
    records.append(dict(
        impl=f"generate_{label}", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
        context=prompt_len + new_tokens, decode_tokens_per_s=s["decode_tokens_per_s"],
        decode_ms_per_step=1e3 * s["decode_s"] / (new_tokens - 1), prefill_s=s["prefill_s"],
        compile_s_first_call=first.stats["compile_s"], compiles_second_call=s["compiles"],
        kv_bytes=s["kv_bytes"], dense_kv_bytes=s["dense_kv_bytes"], method_config=dataclasses.asdict(method),
        device=device.device_kind, jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model="random Llama-3-8B shape" if cfg.num_layers == 32 else "smoke", dtype=cfg.dtype))
    print(f"{label:>6}: {s['decode_tokens_per_s']:9.1f} tokens/s  prefill {s['prefill_s']:.2f} s  "
          f"kv {s['kv_bytes'] / 2**30:.2f} GiB (dense {s['dense_kv_bytes'] / 2**30:.2f} GiB)", flush=True)
  return records


def markdown_table(records) -> str:
  lines = ["| impl | batch | context | decode tokens/s | ms/step | prefill s | KV GiB | dense KV GiB | device |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in records:
    lines.append(f"| {r['impl']} | {r['batch']} | {r['context']} | {r['decode_tokens_per_s']:.1f} | "
                 f"{r['decode_ms_per_step']:.2f} | {r['prefill_s']:.2f} | {r['kv_bytes'] / 2**30:.2f} | "
                 f"{r['dense_kv_bytes'] / 2**30:.2f} | {r['device']} |")
  return "\n".join(lines)


def write_readme_table(records, readme=README):
  text = readme.read_text() if readme.exists() else ""
  block = f"{TABLE_BEGIN}\n{markdown_table(records)}\n{TABLE_END}"
  if TABLE_BEGIN in text:
    text = re.sub(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END), lambda _: block, text, flags=re.S)
  else:
    text += f"\n## Generate: decode tokens/s\n\n{block}\n"
  readme.write_text(text)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="a tiny model (any machine)")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=8064)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--methods", nargs="+", default=["dense", "kivi2"], choices=sorted(METHODS))
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  out = args.out or HERE / "results" / f"generate_decode_{device_slug(jax.devices()[0])}.json"
  if args.table:
    write_readme_table(json.loads(out.read_text()))
    return
  if args.smoke:
    records = run(SMOKE, 2, 100, 16, args.methods)
  else:
    records = run(LLAMA3_8B, args.batch, args.prompt_len, args.new_tokens, args.methods)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(records, indent=1))
  print(markdown_table(records))


if __name__ == "__main__":
  main()
