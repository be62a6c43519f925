"""End-to-end decode speed of ``jkv.generate`` on a Llama-3-8B-shaped model, against its bandwidth floor.

A randomly initialized Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads, D = 128, embed 4096, ffw 14336,
vocab 128256, bf16), random prompt tokens, greedy decoding with end-of-sequence disabled so every step runs.
Compilation happens before timing and is reported apart (``jkv.generate`` does that itself). Parts, each one
command (so each fits the device tool's 10 minutes):

    --part b8        batch 8, 8064-token prompts + 128 new tokens (8k context): dense, KIVI-2, KIVI-4 in the library
                     layout (the Triton kernel) and with the store in the Hopper kernel's packing (``_mma``: KIVI's
                     default on a Hopper GPU), each beside
                     its floor, the bytes one step must read (weights + the cache's held bytes) at the device copy
                     rate measured in the same run
    --part maxbatch  4096-token prompts + 512 new tokens: dense and KIVI-2 (both layouts; ``--methods kivi4_mma`` for
                     KIVI-4) at the largest batch their caches allow
                     on this device (``jkv.memory.largest_batch``), and the decode tokens/s each reaches there
    --part hf        the outside reference: transformers (torch, static cache, SDPA) generating with a dense cache
                     at batch 8, 8k context, on the same shape (its own process, so JAX holds no GPU memory)

Records are merged into benchmarks/results/generate_decode_<device>.json (``--out`` to choose); ``--table``
renders them into benchmarks/README.md.

    python benchmarks/generate_decode.py --part b8          # on the GPU
    python benchmarks/generate_decode.py --smoke            # a tiny model, any machine
"""

import argparse
import datetime
import json
import pathlib
import re
import statistics
import sys
import time

from records import save, write_readme_section

HERE = pathlib.Path(__file__).resolve().parent
LLAMA3_8B = dict(architecture="llama", vocab_size=128256, embed=4096, ffw_size=14336, num_layers=32, q_heads=32,
                 kv_heads=8, head_dim=128, max_position=131072, rope_theta=500000.0, dtype="bfloat16")
SMOKE = dict(LLAMA3_8B, vocab_size=512, embed=128, ffw_size=256, num_layers=2, q_heads=4, kv_heads=2, head_dim=64,
             dtype="float32")
RECORD_KEY = lambda r: (r["impl"], r["batch"], r["context"])  # a rerun replaces these records
# kivi2 / kivi4: the library layout, read by the Triton kernel (KIVI's default packs for the Hopper kernel where it
# runs, so the rows name the layout they ran rather than follow the default); _mma: the store in the Hopper
# kernel's packing (mgpu_decode_attention on a Hopper GPU, XLA elsewhere).
METHODS = {"dense": ("dense", {}), "kivi2": ("kivi", {"bits": 2, "mma": False}),
           "kivi4": ("kivi", {"bits": 4, "mma": False}),
           "kivi2_mma": ("kivi", {"bits": 2, "mma": True}), "kivi4_mma": ("kivi", {"bits": 4, "mma": True})}
LABELS = {"b8": ("dense", "kivi2", "kivi4", "kivi2_mma", "kivi4_mma"), "maxbatch": ("dense", "kivi2", "kivi2_mma")}


def now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_slug(kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")


# ------------------------------------------------------------------------------------------------- jkv


def median_ms(fn, *args, repeats=20) -> float:
  """Median wall time of ``fn(*args)`` in ms, its outputs ready, over ``repeats`` calls after one warm-up call."""
  import jax
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def copy_rate() -> float:
  """Bytes read + written per second by a 4 GiB elementwise pass (the ceiling every floor below uses)."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((1 << 31,), jnp.bfloat16)
  rate = 2 * x.nbytes / (median_ms(jax.jit(lambda x: x + 1), x, repeats=10) / 1e3)
  x.delete()  # 4 GiB the batch runs below need
  return rate


def read_rate() -> float:
  """Bytes read per second by a 4 GiB reduction: a tighter floor for a decode step, which reads far more than it
  writes, than ``copy_rate``."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((1 << 31,), jnp.bfloat16)
  rate = x.nbytes / (median_ms(jax.jit(jnp.max), x, repeats=10) / 1e3)
  x.delete()
  return rate


def run_jkv(cfg, label, batch, prompt_len, new_tokens, *, rate, params, weight_bytes, chunk=64):
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv.methods import make_method
  name, options = METHODS[label]
  method = make_method(name, **options)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  res = gen.generate(params, cfg, prompts, method=method, max_new_tokens=new_tokens, eos_ids=(), chunk=chunk)
  s = res.stats
  ms_per_step = 1e3 * s["decode_s"] / s["decode_steps"]
  # What one step must read: every weight once, and the cache as held at the middle of the decode.
  floor_ms = 1e3 * (weight_bytes + s["kv_bytes"]) / rate
  record = dict(
      impl=f"jkv_{label}", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
      context=prompt_len + new_tokens, decode_tokens_per_s=s["decode_tokens_per_s"], decode_ms_per_step=ms_per_step,
      floor_ms_per_step=floor_ms, ratio_to_floor=ms_per_step / floor_ms, prefill_s=s["prefill_s"],
      prefill_sub_batch=s["prefill_sub_batch"], compile_s=s["compile_s"], kv_bytes=s["kv_bytes"],
      dense_kv_bytes=s["dense_kv_bytes"], allocated_kv_bytes=s["allocated_kv_bytes"],
      peak_device_bytes=s["peak_device_bytes"], weight_bytes=weight_bytes, copy_rate=rate,
      attention_impl=s["attention_impl"], method_config=s["method_config"],
      device=jax.devices()[0].device_kind, jax_version=jax.__version__, date=now(), model="random Llama-3-8B shape")
  print(f"{record['impl']:>10} B={batch:<4} {ms_per_step:8.2f} ms/step (floor {floor_ms:.2f}, "
        f"{record['ratio_to_floor']:.2f}x) {s['decode_tokens_per_s']:9.1f} tok/s  prefill {s['prefill_s']:.1f} s "
        f"(sub-batch {s['prefill_sub_batch']})  kv {s['kv_bytes'] / 2**30:.2f} GiB", flush=True)
  return record


def jkv_part(part, smoke, scale=1.0, labels=None):
  import jax
  from jkv import memory
  from jkv import params as params_lib
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  cfg = ModelConfig(**(SMOKE if smoke else LLAMA3_8B))
  params = params_lib.init_random(cfg, jax.random.key(0))
  weight_bytes = memory.tree_bytes(params)
  rate = copy_rate() if not smoke else 1e10
  print(f"copy rate {rate / 1e12:.2f} TB/s; weights {weight_bytes / 2**30:.2f} GiB", flush=True)
  records = []
  if part == "b8":
    batch, prompt_len, new = (2, 100, 16) if smoke else (8, 8064, 128)
    for label in labels or LABELS[part]:
      records.append(run_jkv(cfg, label, batch, prompt_len, new, rate=rate, params=params, weight_bytes=weight_bytes))
  elif part == "maxbatch":
    prompt_len, new = (100, 28) if smoke else (4096, 512)
    limit = (memory.device_memory() or {}).get("limit", 8 << 30)
    for label in labels or LABELS[part]:
      name, options = METHODS[label]
      method = make_method(name, **options)
      capacity = -(-(prompt_len + new) // method.capacity_multiple()) * method.capacity_multiple()
      largest = memory.largest_batch(cfg, method, capacity, prompt_len, device_bytes=limit, weight_bytes=weight_bytes)
      batch = min(largest, 3) if smoke else max(1, int(largest * scale))
      print(f"{label}: largest batch {largest} at {prompt_len} + {new} tokens ({limit / 2**30:.1f} GiB device), "
            f"running {batch}", flush=True)
      record = run_jkv(cfg, label, batch, prompt_len, new, rate=rate, params=params, weight_bytes=weight_bytes,
                       chunk=128)
      record["computed_largest_batch"] = largest
      record["device_limit_bytes"] = limit
      records.append(record)
  return records


# ------------------------------------------------------------------------------------------------- transformers


def hf_part(smoke):
  """transformers' generate with a static cache and SDPA, batch 8, 8k context, decode ms/step from two runs."""
  import torch
  import transformers
  shape = SMOKE if smoke else LLAMA3_8B
  config = transformers.LlamaConfig(
      vocab_size=shape["vocab_size"], hidden_size=shape["embed"], intermediate_size=shape["ffw_size"],
      num_hidden_layers=shape["num_layers"], num_attention_heads=shape["q_heads"],
      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=16384,
      rope_theta=shape["rope_theta"], attn_implementation="sdpa")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
  batch, prompt_len, new = (2, 100, 16) if smoke else (8, 8064, 128)
  ids = torch.randint(0, shape["vocab_size"], (batch, prompt_len), device=device)

  def run(n):
    if device == "cuda":
      torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, cache_implementation="static", pad_token_id=0)
    if device == "cuda":
      torch.cuda.synchronize()
    assert out.shape[1] == prompt_len + n
    return time.perf_counter() - t

  run(2)  # warm-up: kernels, allocator, static cache
  prefill = statistics.median(run(1) for _ in range(2))
  total = run(new)
  ms = 1e3 * (total - prefill) / (new - 1)
  record = dict(impl="transformers_dense_static_sdpa", batch=batch, prompt_len=prompt_len, new_tokens=new,
                context=prompt_len + new, decode_ms_per_step=ms, decode_tokens_per_s=batch * 1e3 / ms,
                prefill_s=prefill, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                torch_version=torch.__version__, transformers_version=transformers.__version__, date=now(),
                model="random Llama-3-8B shape")
  print(f"transformers: {ms:.2f} ms/step, {record['decode_tokens_per_s']:.1f} tok/s, prefill {prefill:.1f} s",
        flush=True)
  return [record]


# ------------------------------------------------------------------------------------------------- results


def markdown_table(records) -> str:
  lines = ["| impl | batch | context | ms/step | floor ms/step | x floor | decode tokens/s | prefill s | KV GiB | "
           "dense KV GiB | device | measured (UTC) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
  fmt = lambda r, k, f: format(r[k], f) if r.get(k) is not None else "–"
  for r in records:
    gib = lambda k: f"{r[k] / 2**30:.2f}" if r.get(k) is not None else "–"
    lines.append(f"| {r['impl']} | {r['batch']} | {r['context']} | {fmt(r, 'decode_ms_per_step', '.2f')} | "
                 f"{fmt(r, 'floor_ms_per_step', '.2f')} | {fmt(r, 'ratio_to_floor', '.2f')} | "
                 f"{fmt(r, 'decode_tokens_per_s', '.1f')} | {fmt(r, 'prefill_s', '.1f')} | {gib('kv_bytes')} | "
                 f"{gib('dense_kv_bytes')} | {r['device']} | {r.get('date', '–')[:16].replace('T', ' ')} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--part", choices=["b8", "maxbatch", "hf"], default="b8")
  parser.add_argument("--smoke", action="store_true", help="a tiny model (any machine)")
  parser.add_argument("--batch-scale", type=float, default=1.0,
                      help="maxbatch: run at this fraction of the computed largest batch")
  parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), help="run only these (default: the part's)")
  parser.add_argument("--out", type=pathlib.Path, help="JSON to merge the records into")
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  if args.table:
    write_readme_section("generate_decode", markdown_table(json.loads(args.out.read_text())),
                         "## Generate: decode tokens/s")
    return
  records = (hf_part(args.smoke) if args.part == "hf"
             else jkv_part(args.part, args.smoke, args.batch_scale, args.methods))
  out = args.out or HERE / "results" / f"generate_decode_{device_slug(records[0]['device'])}.json"
  save(out, records, RECORD_KEY)
  print(markdown_table(records))


if __name__ == "__main__":
  sys.exit(main())
