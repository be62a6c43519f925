"""SpeCache decode on a Llama-3-8B-shaped model at batch 8 and 32k context: device KV bytes against dense, decode
step time against KIVI-2 and dense, and the next step's rows fetched during the step (prefetch) or at use time.

A randomly initialized Llama-3-8B-shaped model (as in generate_decode.py: 32 layers, 32 query / 8 KV heads,
D = 128, bf16), random prompts, greedy decoding with end-of-sequence disabled. Step times come from
``jkv.generate`` (compilation and prefill excluded). A random model's attention says nothing about quality, so the
timed SpeCache runs leave the hit-rate statistic off (it costs one more top-k per layer and step). Parts, each
one command (each fits the device tool's 10 minutes):

    --part check     the host boundary on this device, at the step's shapes: memory kinds; the Pallas gather
                     kernel reading a pinned_host operand inside jit (bit-exact against the same gather on a
                     device copy, at offsets past 2**31; its time for one layer's rows); whether the XLA host
                     gather (the CPU path) compiles here; the row-by-row host copy (the path for GPUs without
                     the kernel); the in-place host row write; lax.top_k over one layer's candidates
    --part step      B = 8, 32k context, the methods named by --methods (default: dense kivi2 specache1
                     specache1_sync), one record each: ms/step, device and host KV bytes, compression

Step times are ``jkv.generate``'s ``decode_s`` over the steps it ran (``decode_steps``); SpeCache's pre-decode
pass (once per generation, before the first step) is timed apart and recorded as ``pre_decode_s``. Dense needs
the preallocated pool above: with on-demand allocation (XLA_PYTHON_CLIENT_PREALLOCATE=false) its two 16 GiB cache
arrays did not find a free block on the H100 after the random weights' initialization (out of memory with about
47 GiB in use). Each record names the XLA_PYTHON_CLIENT_* settings it ran under; ``peak_device_bytes`` is the
process's peak so far (the methods run one after another in one process).

Methods: dense; kivi2 (KIVI-2, G = 32, R = 128); specache1 (1-bit, G = 64, R = 64, k = 64, prefetch: the rows
for step t + 1 are fetched during step t into a device buffer); specache1_sync (the same, rows fetched at use
time, on the step's critical path); specache1_nospec (the non-speculative baseline, ``speculate=False``: one
row, the real row's own top k fetched inside the layer and attended in a second pass); specache2 (2-bit,
G = 64); specache1_repair (each step checks the previous guess and gives a sequence that missed the
fetch-then-recompute pass, under ``lax.cond``: on a random model's near-uniform attention some sequence of the
batch misses nearly every step, so this times the repair's worst case) and specache1_repair_k128 (the same, 128
rows fetched: a quality candidate). A failure is recorded with its first line and the next method runs.

    python benchmarks/specache_decode.py --part check                          # on the GPU
    XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
        python benchmarks/specache_decode.py --part step --methods dense kivi2 specache1 specache1_sync
    python benchmarks/specache_decode.py --smoke                               # a tiny model, any machine
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from generate_decode import LLAMA3_8B, SMOKE, device_slug, median_ms, now  # noqa: E402
from records import save  # noqa: E402

RECORD_KEY = lambda r: (r["part"], r.get("impl"), r.get("probe"), r["device"])  # a rerun replaces these records
SPECACHE = dict(group_size=64, residual=64, fetch_rows=64, hit_rate=False)
METHODS = {
    "dense": ("dense", {}),
    "kivi2": ("kivi", {"bits": 2}),
    "specache1": ("specache", dict(SPECACHE, bits=1)),
    "specache1_sync": ("specache", dict(SPECACHE, bits=1, prefetch=False)),
    "specache1_nospec": ("specache", dict(SPECACHE, bits=1, speculate=False)),
    "specache1_k0": ("specache", dict(SPECACHE, bits=1, fetch_rows=0)),  # no rows fetched: the low-bit copy alone
    "specache2": ("specache", dict(SPECACHE, bits=2)),
    "specache1_repair": ("specache", dict(SPECACHE, bits=1, repair=True)),
    "specache1_repair_k128": ("specache", dict(SPECACHE, bits=1, repair=True, fetch_rows=128)),
}
DEFAULT_METHODS = ("dense", "kivi2", "specache1", "specache1_sync")


def _first_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


# ------------------------------------------------------------------------------------------------- check


def check_part(smoke):
  """One record per probe of the host boundary (see the module docstring)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jkv.methods.specache import gather_host_rows_one_by_one, gather_rows_pallas, host_write_rows, to_device, to_host
  device = jax.devices()[0]
  shape = SMOKE if smoke else LLAMA3_8B
  # 8 layers of B = 8, 32k rows of 256 values: 4.3e9 elements, so reading the last layer needs offsets past 2**31
  # (the whole 32-layer host copy is 17e9 elements).
  layers, batch, heads, capacity, width, k = (2, 2, 2, 512, 2 * shape["head_dim"], 16) if smoke else (
      8, 8, shape["kv_heads"], 32768, 2 * shape["head_dim"], 64)
  dtype = jnp.float32 if smoke else jnp.bfloat16
  base = dict(part="check", device=device.device_kind, jax_version=jax.__version__, date=now(),
              memory_kinds=[m.kind for m in device.addressable_memories()])
  host_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  kv_dev = jax.random.normal(jax.random.key(0), (layers, batch, heads, capacity, width), dtype)
  kv_host = jax.device_put(kv_dev, host_sharding)
  idx = jax.random.randint(jax.random.key(1), (batch, heads, k), 0, capacity, jnp.int32)
  layer = jnp.int32(layers - 1)  # the gathers take rows of several layers from it: here one, [1, B, H, k]
  want = np.asarray(jnp.take_along_axis(kv_dev[layers - 1], idx[..., None], axis=2))
  rows_bytes = batch * heads * k * width * jnp.dtype(dtype).itemsize
  records = []

  def probe(name, fn, *args, expect=None, nbytes=None):
    record = dict(base, probe=name)
    try:
      out = jax.jit(fn)(*args)
      if expect is not None:
        record["bit_exact"] = bool(np.array_equal(np.asarray(out), expect))
      record["ms"] = median_ms(jax.jit(fn), *args)
      if nbytes:
        record["gb_per_s"] = nbytes / record["ms"] / 1e6
      record["out_memory_kind"] = out.sharding.memory_kind
    except Exception as e:  # noqa: BLE001 (a probe that fails is a result)
      record["error"] = _first_line(e)
    print(json.dumps(record), flush=True)
    records.append(record)

  interpret = device.platform != "gpu"
  pallas_gather = lambda x, i: gather_rows_pallas(x, layer, i[None], interpret=interpret)[0]
  probe("pallas_gather_pinned_host", pallas_gather, kv_host, idx, expect=want, nbytes=rows_bytes)
  probe("pallas_gather_device", pallas_gather, kv_dev, idx, expect=want, nbytes=rows_bytes)
  # The CPU path's form (a gather in host memory with host-resident indices): does XLA take it on this device?
  flat = lambda i: (((layers - 1) * batch + jnp.arange(batch)[:, None, None]) * heads
                    + jnp.arange(heads)[None, :, None]) * capacity + i
  probe("xla_host_gather", lambda x, i: to_device(jnp.take(x.reshape(-1, width), to_host(flat(i)), axis=0,
                                                           mode="clip")), kv_host, idx, expect=want, nbytes=rows_bytes)
  probe("host_rows_one_by_one", lambda x, i: gather_host_rows_one_by_one(x, layer, i[None])[0], kv_host, idx,
        expect=want, nbytes=rows_bytes)
  probe("xla_device_gather", lambda x, i: jnp.take_along_axis(x[layer], i[..., None], axis=2), kv_dev, idx,
        expect=want, nbytes=rows_bytes)
  row = jnp.ones((layers, batch, heads, 1, width), dtype)  # every layer's row of each sequence, as a step writes
  positions = jnp.arange(batch, dtype=jnp.int32) * 7
  write = jax.jit(host_write_rows, donate_argnums=0, out_shardings=host_sharding)
  record = dict(base, probe="host_write_rows_in_place")
  try:
    out = write(kv_host, row, positions)
    record["row_written"] = bool(np.all(np.asarray(out[layers - 1, 1, :, 7]) == 1))
    times = []
    for _ in range(10):
      t = time.perf_counter()
      out = write(out, row, positions)
      out.block_until_ready()
      times.append(time.perf_counter() - t)
    record["ms"] = 1e3 * statistics.median(times)
    record["out_memory_kind"] = out.sharding.memory_kind
  except Exception as e:  # noqa: BLE001
    record["error"] = _first_line(e)
  print(json.dumps(record), flush=True)
  records.append(record)
  scores = jax.random.uniform(jax.random.key(2), (batch, heads, capacity), jnp.float32)
  probe("top_k_one_layer", lambda s: jax.lax.top_k(s, k)[1], scores)
  return records


# ------------------------------------------------------------------------------------------------- step


def run_method(cfg, label, batch, prompt_len, new_tokens, params, chunk):
  import jax
  import numpy as np
  from jkv import generate as gen
  from jkv.methods import make_method
  name, options = METHODS[label]
  method = make_method(name, **options)
  record = dict(part="step", impl=f"jkv_{label}", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                context=prompt_len + new_tokens, method_config=dataclasses.asdict(method),
                device=jax.devices()[0].device_kind, jax_version=jax.__version__, date=now(),
                xla_client_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("XLA_PYTHON_CLIENT")},
                model="random Llama-3-8B shape")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  try:
    res = gen.generate(params, cfg, prompts, method=method, max_new_tokens=new_tokens, eos_ids=(), chunk=chunk)
  except Exception as e:  # noqa: BLE001 (recorded; the next method runs)
    record["error"] = _first_line(e)
    print(f"{record['impl']:>16} failed: {record['error']}", flush=True)
    return record
  s = res.stats
  ms = 1e3 * s["decode_s"] / s["decode_steps"]
  record.update(decode_ms_per_step=ms, decode_tokens_per_s=s["decode_tokens_per_s"], prefill_s=s["prefill_s"],
                pre_decode_s=s["pre_decode_s"], decode_steps=s["decode_steps"],
                compile_s=s["compile_s"], kv_bytes=s["kv_bytes"], kv_host_bytes=s["kv_host_bytes"],
                dense_kv_bytes=s["dense_kv_bytes"], compression=s["dense_kv_bytes"] / s["kv_bytes"],
                allocated_kv_bytes=s["allocated_kv_bytes"], allocated_kv_host_bytes=s["allocated_kv_host_bytes"],
                peak_device_bytes=s["peak_device_bytes"], attention_impl=s["attention_impl"],
                method_config=s["method_config"], method_stats=s["method_stats"])  # as it ran (KIVI's mma decided)
  print(f"{record['impl']:>16} B={batch} {ms:8.2f} ms/step  device KV {s['kv_bytes'] / 2**30:.3f} GiB "
        f"({record['compression']:.2f}x smaller than dense)  host KV {s['kv_host_bytes'] / 2**30:.2f} GiB  "
        f"prefill {s['prefill_s']:.1f} s  pre-decode {1e3 * s['pre_decode_s']:.1f} ms", flush=True)
  return record


def step_part(labels, smoke):
  import jax
  from jkv import params as params_lib
  from jkv.config import ModelConfig
  cfg = ModelConfig(**(SMOKE if smoke else LLAMA3_8B))
  params = params_lib.init_random(cfg, jax.random.key(0))
  batch, prompt_len, new, chunk = (2, 200, 16, 8) if smoke else (8, 32768 - 64, 64, 32)
  records = [run_method(cfg, label, batch, prompt_len, new, params, chunk) for label in labels]
  by = {r["impl"]: r for r in records if "decode_ms_per_step" in r}
  for r in records:  # ratios against whichever baselines ran in this command
    for base in ("dense", "kivi2"):
      if f"jkv_{base}" in by and "decode_ms_per_step" in r:
        r[f"step_vs_{base}"] = r["decode_ms_per_step"] / by[f"jkv_{base}"]["decode_ms_per_step"]
  return records


# ------------------------------------------------------------------------------------------------- results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--part", choices=["check", "step"], default="step")
  parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(DEFAULT_METHODS))
  parser.add_argument("--smoke", action="store_true", help="a tiny model (any machine)")
  parser.add_argument("--out", type=pathlib.Path, help="JSON to merge the records into")
  args = parser.parse_args()
  records = check_part(args.smoke) if args.part == "check" else step_part(args.methods, args.smoke)
  out = args.out or HERE / "results" / f"specache_decode_{device_slug(records[0]['device'])}.json"
  save(out, records, RECORD_KEY)


if __name__ == "__main__":
  sys.exit(main())
