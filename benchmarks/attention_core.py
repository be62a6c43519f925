"""Flash-attention cores on this GPU at chunked prefill's shapes (32 query / 8 KV heads, D = 128, one sequence):
cuDNN's by layout, mask and log-sum-exp output, jkv's ``chunk_attention`` (what a chunk runs), and jax's Mosaic GPU
kernel (``jax.experimental.pallas.ops.gpu.attention_mgpu``, float16 only in jax 0.11), in TFLOP/s.

A chunk of chunked prefill attends a long held past (no mask) and then itself (causal); cuDNN is where that time
goes (``long_context.py --profile``). Each figure is the median of ``--reps`` calls after a warm-up; FLOPs count the
two products, 4 Tq Tk D per query head, halved where causal. The outputs of every variant are checked against the
first's. Results into results/attention_core.json.

    python benchmarks/attention_core.py
    python benchmarks/attention_core.py --smoke      # tiny shapes, any machine (the XLA path)
    python benchmarks/attention_core.py --table      # render the results into benchmarks/README.md
"""

import argparse
import functools
import pathlib

from generate_decode import median_ms, now
from records import save, write_readme_section

HERE = pathlib.Path(__file__).resolve().parent
HEADS, KV_HEADS, D = 32, 8, 128


def cudnn_variants():
  """name -> f(q, k, v, causal) over [B, T, N, D] inputs: cuDNN's call in each layout, with and without a padding
  mask (lengths) and the log-sum-exp output that ``chunk_attention`` merges by."""
  import jax.numpy as jnp
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  def call(q, k, v, causal, layout, lengths, lse):
    if layout == "BNTH":
      q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # outside the timed call: inputs arrive so
    B, T, S = q.shape[0], q.shape[1 if layout == "BTNH" else 2], k.shape[1 if layout == "BTNH" else 2]
    mask = {(False, False): cudnn.MaskType.NO_MASK, (False, True): cudnn.MaskType.CAUSAL,
            (True, False): cudnn.MaskType.PADDING, (True, True): cudnn.MaskType.PADDING_CAUSAL}[lengths, causal]
    seqlens = (jnp.full((B,), T, jnp.int32), jnp.full((B,), S, jnp.int32)) if lengths else (None, None)
    return q, k, v, lambda q, k, v: cudnn.dot_product_attention(
        q, k, v, None, None, *seqlens, scale=D ** -0.5, mask_type=mask, qkv_layout=layout, return_residual=lse)

  return {f"cudnn_{layout}{'_lengths' if lengths else ''}{'_lse' if lse else ''}":
          functools.partial(call, layout=layout, lengths=lengths, lse=lse)
          for layout in ("BTNH", "BNTH") for lengths in (False, True) for lse in (False, True)}


def markdown_table(records) -> str:
  rows = ["| shape (Tq x Tk) | causal | impl | ms | TFLOP/s | device | date |", "| --- | --- | --- | ---: | ---: | --- | --- |"]
  for r in sorted(records, key=lambda r: (r["device"], r["causal"], r["tk"], r["tq"], -r["tflops"])):
    rows.append(f"| {r['tq']} x {r['tk']} | {'yes' if r['causal'] else 'no'} | {r['impl']} | {r['ms']:.2f} | "
                f"{r['tflops']:.0f} | {r['device']} | {r['date'][:10]} |")
  return "\n".join(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", nargs="+", default=["8192x131072", "8192x1048576", "16384x16384c"],
                      help="Tq x Tk, a trailing c for causal")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--smoke", action="store_true")
  parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "attention_core.json")
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  if args.table:
    import json
    write_readme_section("attention_core", markdown_table(json.loads(args.out.read_text())),
                         "## Flash-attention cores at chunked prefill's shapes (`attention_core.py`)")
    return

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jkv.chunk_attention import HeldRows, chunk_attention

  kind = jax.devices()[0].device_kind
  shapes = ["256x1024", "256x256c"] if args.smoke else args.shapes
  records = []
  for shape in shapes:
    causal = shape.endswith("c")
    Tq, Tk = map(int, shape.rstrip("c").split("x"))
    flops = 4 * Tq * Tk * D * HEADS // (2 if causal else 1)
    rng = np.random.default_rng(Tq + Tk)
    normal = lambda *s, dtype=jnp.bfloat16: jnp.asarray(rng.normal(size=s), dtype)
    q, k, v = normal(1, Tq, HEADS, D), normal(1, Tk, KV_HEADS, D), normal(1, Tk, KV_HEADS, D)
    runs = {}
    if not args.smoke:
      for name, variant in cudnn_variants().items():
        qi, ki, vi, f = variant(q, k, v, causal)
        f = jax.jit(f)
        o = f(qi, ki, vi)
        o = (o[0] if isinstance(o, tuple) else o)
        runs[name] = (median_ms(f, qi, ki, vi, repeats=args.reps), o if name.startswith("cudnn_BTNH") else
                      o.transpose(0, 2, 1, 3))
    if not causal:  # what a chunk runs: its queries over held rows (and itself, causally, after them)
      impl = "xla" if args.smoke else "pallas"
      g = HEADS // KV_HEADS
      q5 = q.reshape(1, Tq, KV_HEADS, g, D).transpose(0, 2, 1, 3, 4)  # [B, H, T, g, D]: query head h g + j
      held = HeldRows(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.asarray([Tk], jnp.int32))
      own_k, own_v = normal(1, KV_HEADS, Tq, D), normal(1, KV_HEADS, Tq, D)
      positions = jnp.asarray(Tk + np.arange(Tq), jnp.int32)[None]
      f = jax.jit(lambda q5, kk, vv, p, h: chunk_attention(q5, kk, vv, p, h, impl=impl))
      own_flops = 4 * Tq * Tq * D * HEADS // 2
      ms = median_ms(f, q5, own_k, own_v, positions, held, repeats=args.reps)
      runs["chunk_attention"] = (ms, None)
      print(f"chunk_attention {shape}: {ms:.2f} ms, {(flops + own_flops) / ms / 1e9:.0f} TFLOP/s with its own "
            f"causal part ({own_flops / flops:.1%} more)", flush=True)
      records.append(dict(impl="chunk_attention", tq=Tq, tk=Tk, causal=causal, ms=ms,
                          tflops=(flops + own_flops) / ms / 1e9, device=kind, jax=jax.__version__, date=now()))
    if not args.smoke:
      from jax.experimental.pallas.ops.gpu import attention_mgpu
      half = [x.astype(jnp.float16) for x in (q * D ** -0.5, k, v)]  # the kernel does not scale the logits
      for block_kv in (128, 64):
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=causal)
        f = jax.jit(functools.partial(attention_mgpu.attention, config=config))
        runs[f"mgpu_fp16_bkv{block_kv}"] = (median_ms(f, *half, repeats=args.reps), f(*half))
    reference = next((o for _, o in runs.values() if o is not None), None)
    for name, (ms, o) in runs.items():
      if name == "chunk_attention":
        continue
      error = float(jnp.max(jnp.abs(o.astype(jnp.float32) - reference.astype(jnp.float32))))
      print(f"{name} {shape}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s, max difference {error:.3g}", flush=True)
      records.append(dict(impl=name, tq=Tq, tk=Tk, causal=causal, ms=ms, tflops=flops / ms / 1e9,
                          max_difference=error, device=kind, jax=jax.__version__, date=now()))
  if not args.smoke:
    save(args.out, records, lambda r: (r["impl"], r["tq"], r["tk"], r["causal"], r["device"]))


if __name__ == "__main__":
  main()
