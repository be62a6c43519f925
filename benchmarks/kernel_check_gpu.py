"""Is decode kernel v2 correct on the GPU, and how fast is it as the dense decode kernel?

Three parts, about 3-5 minutes on an H100:

1. tests: the kernel test classes compiled on this GPU (pytest ``-k Gpu`` over tests/test_dequant_attention.py and
   tests/test_quantize_pack.py) plus tests/test_quantization.py (the quantizer's bit-exactness under XLA on this
   GPU), in a subprocess; the summary line goes into the results.
2. check: decode_attention against decode_attention_reference at the timed shapes (dense, KIVI-2: store plus
   a 128-token window, and the layouts of the other methods from kernel_decode.py's LAYOUTS: zipcache_pools,
   ott2, specache1), o relative error, max |lse - ref| and, where the layout asks for it (specache1), the token
   mass's relative error, reading layer 1 of a 2-layer stacked cache.
3. timing: one decode step's attention at B=8, 32 query / 8 KV heads, D=128, bf16, one query row, S in
   {4096, 8192, 32768}:
       device_copy        a 1 GiB device-to-device copy (read + written): the bandwidth ceiling
       jkv_dense          decode_attention(q, layer=1, (), ((k, v, mask),)) on a stacked [2, B, Hkv, S, D] cache
                          (the layer read in place), config from the autotune below
       jkv_dense_scan     the same inside lax.scan over 4 layers of a [4, B, Hkv, S, D] cache (the decode step's
                          layer loop; time per layer): would show a per-layer copy if XLA made one
       jkv_kivi2          the store (2-bit, G=32, S - 128 tokens) plus a 128-token window, default tunables
       cudnn_dense        jax.nn.dot_product_attention(implementation="cudnn") on a contiguous [B, S, Hkv, D] copy
   A small autotune over block_s / s_splits / num_warps / num_stages runs for jkv_dense at S=8192 first.
   Each time is the median over repetitions of back-to-back calls (blocked per repetition) after a warm-up;
   compile time is reported apart. GB/s = bytes that must be read (K and V of the valid tokens, q) / time.

    python benchmarks/kernel_check_gpu.py                 # on the GPU; JSON to $OUT/kernel_check_gpu.json if OUT
    python benchmarks/kernel_check_gpu.py --smoke         # tiny shapes, interpret mode, any machine
    python benchmarks/kernel_check_gpu.py --skip-tests --out results.json
"""

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv_kernels import quantization
from jkv_kernels.dequant_attention import QuantizedStore, decode_attention, decode_attention_reference
from kernel_decode import LAYOUTS, Shape, layout_inputs

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUP_SIZE = 32
WINDOW = 128


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a run covers; ``--smoke`` swaps in tiny sizes that interpret mode runs anywhere."""
  batch: int = 8
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  seq_lens: tuple[int, ...] = (4096, 8192, 32768)
  scan_layers: int = 4
  copy_bytes: int = 2**30
  repetitions: int = 30
  calls_per_repetition: int = 10
  autotune_seq_len: int = 8192
  autotune_grid: tuple[tuple[int, int, int, int], ...] = tuple(
      itertools.product((64, 128), (8, 16, 32), (4, 8), (2, 3, 4))) + ((64, 16, 4, 1), (128, 16, 4, 1))
  autotune_budget_s: float = 90.0
  check_seq_len: int = 4096
  interpret: bool = False
  baseline: str = "cudnn"


SMOKE = Settings(batch=2, q_heads=4, kv_heads=2, head_dim=64, seq_lens=(256,), scan_layers=2, copy_bytes=2**20,
                 repetitions=3, calls_per_repetition=2, autotune_seq_len=256,
                 autotune_grid=((32, 2, 4, 1), (64, 4, 4, 2)), autotune_budget_s=60.0, check_seq_len=256,
                 interpret=True, baseline="xla")

# Per-dtype budgets for the check (as in the tests): o's ‖err‖ / ‖ref‖ and max |lse - ref|.
CHECK_TOLERANCE = {"bfloat16": (1e-2, 2e-2)}


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def dense_inputs(settings: Settings, seq_len: int, num_layers: int, seed: int):
  """q [B, Hkv, 1, g, D] and one stacked segment (k, v [L, B, Hkv, S, D] bf16, mask [B, 1, S] all valid)."""
  b, h, d = settings.batch, settings.kv_heads, settings.head_dim
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, h, 1, settings.q_heads // h, d), jnp.bfloat16)
  k = jax.random.normal(kk, (num_layers, b, h, seq_len, d), jnp.bfloat16)
  v = jax.random.normal(kv, (num_layers, b, h, seq_len, d), jnp.bfloat16)
  return q, ((k, v, jnp.ones((b, 1, seq_len), jnp.bool_)),)


def kivi_inputs(settings: Settings, seq_len: int, seed: int):
  """A 2-layer stacked 2-bit KIVI store of capacity S holding S - 128 tokens, plus a 128-token bf16 window."""
  b, h, d, bits = settings.batch, settings.kv_heads, settings.head_dim, 2
  kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, h, 1, settings.q_heads // h, d), jnp.bfloat16)
  quantize = jax.jit(lambda x, axis: quantization.quantize(x, bits=bits, axis=axis, group_size=GROUP_SIZE),
                     static_argnums=1)
  pack = jax.jit(lambda c: quantization.pack(c, bits=bits, axis=-1))
  k_codes, k_scale, k_zero = quantize(jax.random.normal(kk, (2, b, h, d, seq_len), jnp.float32), -1)
  v_codes, v_scale, v_zero = quantize(jax.random.normal(kv, (2, b, h, seq_len, d), jnp.float32), -1)
  store = QuantizedStore(pack(k_codes), k_scale, k_zero, pack(v_codes), v_scale, v_zero,
                         jnp.full((b,), seq_len - WINDOW, jnp.int32), k_bits=bits, v_bits=bits, k_group=GROUP_SIZE,
                         v_group=GROUP_SIZE)
  window = jax.random.normal(kw, (2, b, h, WINDOW, d), jnp.bfloat16)
  return q, (store,), ((window[0], window[1], jnp.ones((b, 1, WINDOW), jnp.bool_)),)


def dense_bytes(settings: Settings, seq_len: int) -> int:
  kv = 2 * settings.batch * settings.kv_heads * seq_len * settings.head_dim * 2
  return kv + settings.batch * settings.q_heads * settings.head_dim * 2


def kivi_bytes(settings: Settings, seq_len: int) -> int:
  tokens = seq_len - WINDOW
  per_head = tokens * settings.head_dim * (2 * 2 / 8 + 2 * 2 * 2 / GROUP_SIZE) + 2 * WINDOW * settings.head_dim * 2
  return int(settings.batch * settings.kv_heads * per_head + settings.batch * settings.q_heads * settings.head_dim * 2)


# ----------------------------------------------------------------------------------------------------------------
# Timing


def time_calls(fn, args, settings: Settings):
  """(median µs per call, compile + first call s): back-to-back calls, blocked once per repetition."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - start
  for _ in range(3):  # warm-up
    jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(settings.repetitions):
    start = time.perf_counter()
    outputs = [fn(*args) for _ in range(settings.calls_per_repetition)]
    jax.block_until_ready(outputs)
    per_call.append((time.perf_counter() - start) / settings.calls_per_repetition)
  return statistics.median(per_call) * 1e6, compile_s


def record(impl, seq_len, median_us, bytes_read, *, config=None, compile_s=None, **extra) -> dict:
  device = jax.devices()[0]
  return {
      "impl": impl, "seq_len": seq_len, "median_us": round(median_us, 2), "bytes_read": int(bytes_read),
      "gbps": round(bytes_read / (median_us * 1e-6) / 1e9, 1), "device": device.device_kind,
      "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "config": config or {}, "compile_s": None if compile_s is None else round(compile_s, 2), **extra,
  }


def copy_rate(settings: Settings) -> dict:
  x = jnp.zeros((settings.copy_bytes // 4,), jnp.uint32)
  median_us, _ = time_calls(jax.jit(lambda a: a + jnp.uint32(1)), (x,), settings)
  return record("device_copy", None, median_us, 2 * x.nbytes)


def dense_fn(config: dict, interpret: bool):
  return jax.jit(lambda q, layer, segments: decode_attention(q, layer, (), segments, interpret=interpret,
                                                             **config))


def dense_scan_fn(config: dict, interpret: bool, num_layers: int):
  """The decode step's layer loop: the stacked cache rides in the carry, each layer reads its slice in place."""
  def step(q, segments):
    def body(carry, layer):
      segments, x = carry
      return (segments, decode_attention(x, layer, (), segments, interpret=interpret, **config)), None
    (_, x), _ = jax.lax.scan(body, (segments, q), jnp.arange(num_layers, dtype=jnp.int32))
    return x
  return jax.jit(step)


def baseline_fn(implementation: str):
  return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation))


def baseline_inputs(q, segments):
  """jax.nn.dot_product_attention's layout, contiguous: q [B, 1, N, D], k and v [B, S, K, D] (layer 1)."""
  (k, v, _), = segments
  b, h, _, g, d = q.shape
  return (q.reshape(b, 1, h * g, d), jnp.swapaxes(k[1], 1, 2), jnp.swapaxes(v[1], 1, 2))


# ----------------------------------------------------------------------------------------------------------------
# Parts


def run_tests(timeout_s: int = 300) -> dict:
  """The GPU test classes (compiled kernels) and the quantizer tests, in a subprocess; returns the summary."""
  command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_quantization.py",
             "tests/test_dequant_attention.py", "tests/test_quantize_pack.py", "-k", "Gpu or test_quantization"]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
  start = time.perf_counter()
  try:
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    output, code = result.stdout + result.stderr, result.returncode
  except subprocess.TimeoutExpired as error:
    output, code = f"timed out after {timeout_s} s\n{error.stdout or ''}", -1
  lines = [line for line in output.splitlines() if line.strip()]
  summary = lines[-1] if lines else "no output"
  failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
  print(f"tests: {summary}")
  for line in failures:
    print(f"  {line}")
  return {"command": " ".join(command[1:]), "returncode": code, "summary": summary, "failures": failures,
          "seconds": round(time.perf_counter() - start, 1)}


def _errors(out, ref):
  """(finite, o relative error, max |lse - ref|, token mass relative error or None) of (o, lse[, mass])."""
  (o, lse, *mass), (ref_o, ref_lse, *ref_mass) = out, ref
  o, ref_o = np.asarray(o, np.float64), np.asarray(ref_o, np.float64)
  got_mass = [np.asarray(m, np.float64) for m in jax.tree.leaves(mass)]
  want_mass = [np.asarray(m, np.float64) for m in jax.tree.leaves(ref_mass)]
  finite = bool(np.all(np.isfinite(o))) and all(np.all(np.isfinite(m)) for m in got_mass)
  mass_err = max((float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)) for g, w in zip(got_mass, want_mass)),
                 default=None)
  return finite, float(np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o)), float(
      np.max(np.abs(np.asarray(lse, np.float64) - np.asarray(ref_lse, np.float64)))), mass_err


def check(settings: Settings, dense_config: dict) -> list[dict]:
  """Kernel vs reference at the check shape: dense (given config and defaults), KIVI-2 and the LAYOUTS of
  kernel_decode.py (default tunables); layer 1 of 2."""
  results = []
  seq_len = settings.check_seq_len
  q, segments = dense_inputs(settings, seq_len, 2, seed=0)
  # A ragged valid length: the last key of each row is masked differently, so the bounds matter.
  lengths = jnp.asarray(np.linspace(1, seq_len, settings.batch).astype(np.int32))
  segments = ((segments[0][0], segments[0][1], jnp.arange(seq_len)[None, None, :] < lengths[:, None, None]),)
  ref = decode_attention_reference(q, 1, (), segments, return_lse=True)
  for name, config in (("dense_tuned", dense_config), ("dense_default", {})):
    out = decode_attention(q, jnp.int32(1), (), segments, return_lse=True, interpret=settings.interpret, **config)
    results.append(_check_record(name, seq_len, config, _errors(out, ref)))
  q, store, window = kivi_inputs(settings, seq_len, seed=1)
  out = decode_attention(q, jnp.int32(1), store, window, return_lse=True, interpret=settings.interpret)
  ref = decode_attention_reference(q, 1, store, window, return_lse=True)
  results.append(_check_record("kivi2_default", seq_len, {}, _errors(out, ref)))
  shape = Shape(settings.batch, seq_len, settings.q_heads, settings.kv_heads, settings.head_dim)
  for name, layout in LAYOUTS.items():
    q, layer, stores, segments = layout_inputs(shape, name, seed=2, quantized_from_data=True, num_layers=2)
    call = dict(layout.call, return_lse=True)
    out = decode_attention(q, layer, stores, segments, interpret=settings.interpret, **call)
    ref = decode_attention_reference(q, layer, stores, segments, **call)
    results.append(_check_record(name, seq_len, dict(layout.call), _errors(out, ref)))
  return results


def _check_record(name, seq_len, config, errors) -> dict:
  finite, o_err, lse_err, mass_err = errors
  o_tol, lse_tol = CHECK_TOLERANCE["bfloat16"]
  ok = finite and o_err <= o_tol and lse_err <= lse_tol and (mass_err is None or mass_err <= o_tol)
  mass = "" if mass_err is None else f", token mass rel err {mass_err:.2e}"
  print(f"check {name:>14} S={seq_len}: o rel err {o_err:.2e}, lse max err {lse_err:.2e}{mass} "
        f"{'ok' if ok else 'FAILED'} {config or ''}")
  return {"name": name, "seq_len": seq_len, "config": config, "finite": finite, "o_rel_err": o_err,
          "lse_max_err": lse_err, "mass_rel_err": mass_err, "ok": ok}


def autotune(settings: Settings) -> tuple[dict, list[dict]]:
  """jkv_dense over the block_s / s_splits / num_warps / num_stages grid at autotune_seq_len; best config first."""
  seq_len = settings.autotune_seq_len
  q, segments = dense_inputs(settings, seq_len, 2, seed=0)
  records, start = [], time.perf_counter()
  for block_s, s_splits, num_warps, num_stages in settings.autotune_grid:
    if time.perf_counter() - start > settings.autotune_budget_s:
      print(f"autotune: budget of {settings.autotune_budget_s:.0f} s spent, stopping")
      break
    config = {"block_s": block_s, "s_splits": s_splits, "num_warps": num_warps, "num_stages": num_stages}
    try:
      median_us, compile_s = time_calls(dense_fn(config, settings.interpret), (q, jnp.int32(1), segments), settings)
    except Exception as error:  # a config the compiler rejects (e.g. out of shared memory) is skipped, not fatal
      print(f"autotune: {config} failed: {type(error).__name__}: {str(error)[:200]}")
      continue
    records.append(record("jkv_dense_autotune", seq_len, median_us, dense_bytes(settings, seq_len), config=config,
                          compile_s=compile_s))
    print(f"autotune: {config} {median_us:8.1f} µs  {records[-1]['gbps']:7.1f} GB/s")
  best = min(records, key=lambda r: r["median_us"])["config"] if records else {}
  return best, records


def sweep(settings: Settings, config: dict) -> list[dict]:
  records = []
  for seq_len in settings.seq_lens:
    q, segments = dense_inputs(settings, seq_len, 2, seed=seq_len)
    nbytes = dense_bytes(settings, seq_len)
    median_us, compile_s = time_calls(dense_fn(config, settings.interpret), (q, jnp.int32(1), segments), settings)
    records.append(record("jkv_dense", seq_len, median_us, nbytes, config=config, compile_s=compile_s))
    base = baseline_inputs(q, segments)
    median_us, compile_s = time_calls(baseline_fn(settings.baseline), base, settings)
    records.append(record(f"{settings.baseline}_dense", seq_len, median_us, nbytes, compile_s=compile_s))
    del base, segments
    q, segments = dense_inputs(settings, seq_len, settings.scan_layers, seed=seq_len)
    median_us, compile_s = time_calls(dense_scan_fn(config, settings.interpret, settings.scan_layers),
                                      (q, segments), settings)
    records.append(record("jkv_dense_scan", seq_len, median_us / settings.scan_layers, nbytes, config=config,
                          compile_s=compile_s, layers=settings.scan_layers))
    del segments
    q, store, window = kivi_inputs(settings, seq_len, seed=seq_len)
    fn = jax.jit(lambda q, layer, store, window: decode_attention(q, layer, store, window,
                                                                  interpret=settings.interpret))
    median_us, compile_s = time_calls(fn, (q, jnp.int32(1), store, window), settings)
    records.append(record("jkv_kivi2", seq_len, median_us, kivi_bytes(settings, seq_len), compile_s=compile_s))
    del store, window
    for r in records[-4:]:
      print(f"{r['impl']:>16} S={seq_len:<6} {r['median_us']:9.1f} µs  {r['gbps']:7.1f} GB/s")
  return records


def table(records: list[dict], copy: dict) -> str:
  impls = [i for i in ("jkv_dense", "jkv_dense_scan", "cudnn_dense", "xla_dense", "jkv_kivi2")
           if any(r["impl"] == i for r in records)]
  cells = {(r["impl"], r["seq_len"]): r for r in records}
  copy_gbps = copy["gbps"]
  lines = [f"copy rate {copy_gbps / 1000:.2f} TB/s on {copy['device']}; cells: µs (fraction of the copy rate)", "",
           "| S | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
  for seq_len in sorted({r["seq_len"] for r in records if r["impl"] in impls}):
    row = [f"{cells[i, seq_len]['median_us']:.1f} ({cells[i, seq_len]['gbps'] / copy_gbps:.0%})"
           if (i, seq_len) in cells else "–" for i in impls]
    lines.append(f"| {seq_len} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (any machine)")
  parser.add_argument("--skip-tests", action="store_true", help="do not run the pytest part")
  parser.add_argument("--no-autotune", action="store_true", help="time the default config only")
  parser.add_argument("--out", type=pathlib.Path, help="results JSON (default: $OUT/kernel_check_gpu.json if OUT)")
  args = parser.parse_args()
  settings = SMOKE if args.smoke else Settings()
  device = jax.devices()[0]
  if device.platform != "gpu" and not settings.interpret:
    raise SystemExit("the full check needs a GPU; use --smoke elsewhere")
  start = time.perf_counter()
  results = {"device": device.device_kind, "jax_version": jax.__version__, "settings": dataclasses.asdict(settings)}
  if not args.skip_tests and not args.smoke:
    results["tests"] = run_tests()
  config, results["autotune"] = ({}, []) if args.no_autotune else autotune(settings)
  results["dense_config"] = config
  print(f"dense config: {config or 'defaults'}")
  results["check"] = check(settings, config)
  copy = copy_rate(settings)
  results["records"] = [copy] + sweep(settings, config)
  results["seconds"] = round(time.perf_counter() - start, 1)
  print(f"\n{table(results['records'], copy)}\n\ntotal {results['seconds']:.0f} s")
  out = args.out or (pathlib.Path(os.environ["OUT"]) / "kernel_check_gpu.json" if os.environ.get("OUT") else None)
  if out:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
  failed = [c["name"] for c in results["check"] if not c["ok"]]
  if failed or results.get("tests", {}).get("returncode", 0) not in (0,):
    raise SystemExit(f"check failed: {failed or results['tests']['summary']}")


if __name__ == "__main__":
  main()
