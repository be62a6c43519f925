"""The Mosaic GPU kernel (mgpu_decode_attention) against the Triton kernel and cuDNN, in one run on one GPU.

Checks first, then times, one decode step (one query row), 32 query heads over 8 KV heads, D = 128, bf16:

    check        mgpu_decode_attention on pack_mma_store(store) against decode_attention_reference on the store,
                 real quantized data (keys and values drawn normal, quantized by the library's quantizer),
                 ragged lengths; KIVI-1/2/4/8 and mixed widths, key groups of 32 and 128, bf16 and fp16; relative
                 error of o and lse (fails the run above 2e-2, like kernel_decode.py's check)
    mgpu_kivi2   the new kernel, 2-bit keys and values, G = 32, every slot valid (length = L); at B = 8, L = 32768
                 also a cache filled to L / 4 (config "fill": 0.25)
    mgpu_kivi4   4-bit
    mgpu_kivi8   8-bit
    mgpu_kivi2_window   KIVI's whole attention call: ``jkv.attention.decode_attention`` (impl "pallas") over the
    mgpu_kivi4_window   packed store and a window of 129 exact bf16 tokens (KIVI's R + 1), as a decode step of
                 KIVI with ``mma=True`` runs it (the window read by the same kernel, or, in a build before round
                 11, by the Triton kernel and merged in XLA)
    triton_kivi2 decode_attention (the Triton kernel) on the same store in the library's layout, no residual
    triton_kivi4   segment: the same tokens and codes as the mgpu rows
    triton_kivi8
    xla_kivi2    jkv's XLA path (``jkv.attention.decode_attention``, impl "xla": the store dequantized a block at a
                 time, where the Pallas kernels do not run) on the same store
    mgpu_ott2    OTT's whole attention call at its defaults (2 bits, G = 16, Gv = 32, R = 32, N = 8, A = 32;
                 ``kernel_decode.ott_layout``): ``jkv.attention.decode_attention`` (impl "pallas") over the store
                 MMA-packed with its holes (the buffer of G + R tokens read by the same kernel, the pool segment by
                 the Triton kernel, merged exactly), as a decode step of OTT with ``mma=True`` runs it
    triton_ott2  the same call on the store in the library's layout: the Triton kernel over all of it
    mgpu_specache1   SpeCache's attention call (``kernel_decode.LAYOUTS["specache1"]``: a 1-bit store with 64
    triton_specache1   holes per KV head, the 64 fetched rows, a 128-token window, two query rows and the token
                 mass of the speculative one), on the MMA-packed store (the kernel writes its logits out for the
                 mass) and on the library layout
    mgpu_zipcache    ZipCache's (``kernel_decode.LAYOUTS["zipcache_pools"]``: a 4-bit pool of 60% of the tokens
    triton_zipcache    and a 2-bit pool of 40%, holes and a value channel scale, a 100-token window; no probe)
    cudnn_dense  jax.nn.dot_product_attention(implementation="cudnn") on a bf16 cache of length L
    device_copy  a large device-to-device copy (bytes read + written): the bandwidth ceiling

at B in {1, 8, 64} and L in {4096, 32768}, and at B = 8, L = 32768 (``--variants-at``) the new kernel's step and
pipeline depth (``--variants``, every one ``--repeats`` times in turn, each repeat kept: ``variants_table``).
Timing is kernel_decode.py's (median of back-to-back calls rotating input sets past the L2). With
``--in-program N`` each row is also timed as N calls inside one compiled program (``in_program``: none folded,
hoisted or dropped), as a decode step calls attention once per layer: no dispatch of its own and no gap between
executables (``in_program_table``). Results go to
benchmarks/results/mgpu_decode_<device>.json (under $OUT too on the device machine); ``--table`` prints the table.

    python benchmarks/mgpu_decode.py              # on an H100
    python benchmarks/mgpu_decode.py --check-only
    python benchmarks/mgpu_decode.py --batches 8 --seq-lens 32768 --no-variants \\
        --out benchmarks/results/mgpu_changes/<n>_before_<change>.json     # a round's A/B (then _after_)
    python benchmarks/mgpu_decode.py --rounds                         # the rounds' table
    python benchmarks/mgpu_decode.py --batches 8 --seq-lens 32768 --no-variants --trace   # kernel against glue
    python benchmarks/mgpu_decode.py --batches 8 64 --seq-lens 32768 4096 --no-variants --in-program 20

A round's A/B is better taken with benchmarks/mgpu_ab.py, which alternates the two builds process by process.
"""

import argparse
import dataclasses
import functools
import json
import pathlib
import re
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jkv import attention as jkv_attention
from jkv_kernels.dequant_attention import QuantizedStore, decode_attention, decode_attention_reference
from jkv_kernels.mgpu_decode_attention import (STAGES, default_splits, default_step_tiles, mgpu_decode_attention,
                                               shared_memory_bytes)
from jkv_kernels.mma_layout import MmaStore, pack_mma_store
from jkv.methods.ott import Ott
from kernel_decode import (L2_BYTES, LAYOUTS, Settings, Shape, copy_bandwidth, dense_bytes, dense_inputs,
                           input_set_count, inputs_bytes, layout_inputs, ott_layout, record, store_arrays, time_calls)
from records import kernel_record_key, save

HERE = pathlib.Path(__file__).resolve().parent
RECORD_KEY = kernel_record_key
CHECKS = (  # k_bits, v_bits, k_group, v_group, dtype, step_tiles
    (2, 2, 32, 32, jnp.bfloat16, 1), (2, 2, 32, 32, jnp.bfloat16, 2), (2, 2, 32, 32, jnp.bfloat16, 4),
    (4, 4, 32, 32, jnp.bfloat16, 2), (1, 1, 32, 32, jnp.bfloat16, 2), (4, 2, 128, 32, jnp.bfloat16, 1),
    (4, 2, 128, 32, jnp.bfloat16, 4), (2, 2, 32, 32, jnp.float16, 2), (2, 4, 64, 64, jnp.float16, 2),
    (8, 8, 32, 32, jnp.bfloat16, 2), (8, 4, 128, 32, jnp.float16, 2))
VARIANTS = tuple((step_tiles, stages) for step_tiles in (4, 2, 1) for stages in (2, 3, 4))  # at B = 8, L = 32768


def store(key, shape: Shape, *, k_bits, v_bits, k_group, v_group, meta_dtype, lengths, from_data: bool):
  """A QuantizedStore of capacity L (kernel_decode.store_arrays: quantized normal data, or random words and
  scales for timing) with the given lengths."""
  arrays = store_arrays(key, shape, shape.seq_len, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group,
                        quantized_from_data=from_data, meta_dtype=meta_dtype)
  return QuantizedStore(*arrays, jnp.asarray(lengths, jnp.int32), k_bits, v_bits, k_group, v_group)


def relative_error(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(batch=3, seq_len=4096, q_heads=32, kv_heads=8) -> list[dict]:
  """Every CHECKS case against the reference; lengths full, ragged (not a multiple of 64) and short."""
  results = []
  lengths = [seq_len, seq_len - 77, 1000][:batch]
  for index, (k_bits, v_bits, k_group, v_group, dtype, step_tiles) in enumerate(CHECKS):
    shape = Shape(batch, seq_len, q_heads, kv_heads, dtype=dtype)
    kq, ks = jax.random.split(jax.random.key(100 + index))
    q = jax.random.normal(kq, (batch, kv_heads, 1, shape.q_per_kv, shape.head_dim), dtype)
    s = store(ks, shape, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group, meta_dtype=dtype,
              lengths=lengths, from_data=True)
    name = f"{k_bits}x{v_bits}bit G{k_group}x{v_group} {jnp.dtype(dtype).name} step_tiles={step_tiles}"
    try:
      o, lse = mgpu_decode_attention(q, 0, pack_mma_store(s), return_lse=True, step_tiles=step_tiles)
      o_ref, lse_ref = decode_attention_reference(q, 0, (s,), (), return_lse=True)
      errors = {"o": relative_error(o, o_ref), "lse": relative_error(lse, lse_ref)}
    except Exception as error:  # keep checking the other cases; the run fails at the end
      traceback.print_exc()
      errors = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    ok = "error" not in errors and all(e <= 2e-2 for e in errors.values())
    print(f"check {name}: {errors} {'ok' if ok else 'FAILED'}")
    results.append({"case": name, "errors": errors, "ok": ok})
  return results


def bytes_read(shape: Shape, bits: int, group: int = 32) -> int:
  """Codes and 16-bit scale + zero of keys (per G tokens) and values (per G channels), and q."""
  per_head = shape.seq_len * shape.head_dim * (2 * bits / 8 + 2 * 2 * 2 / group)
  return int(shape.batch * shape.kv_heads * per_head + shape.batch * shape.q_heads * shape.head_dim * 2)


def window_bytes(shape: Shape) -> int:
  """Bytes of KIVI's window that ``window_inputs`` gives: WINDOW bf16 keys and values per (sequence, KV head)."""
  return shape.batch * shape.kv_heads * WINDOW * shape.head_dim * 2 * 2


def timing_inputs(shape: Shape, bits: int, seed: int, *, packed: bool = True, fill: float = 1.0):
  """(q, store) for timing: random words and scales, G = 32, the first ``fill`` of the slots valid (every slot by
  default); the store MMA-packed or not."""
  kq, ks = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (shape.batch, shape.kv_heads, 1, shape.q_per_kv, shape.head_dim), shape.dtype)
  s = store(ks, shape, k_bits=bits, v_bits=bits, k_group=32, v_group=32, meta_dtype=shape.dtype,
            lengths=[int(shape.seq_len * fill)] * shape.batch, from_data=False)
  return q, (jax.block_until_ready(pack_in_slices(s)) if packed else s)


_pack = jax.jit(pack_mma_store)


def pack_in_slices(store: QuantizedStore, sequences: int = 8) -> MmaStore:
  """``pack_mma_store`` compiled, ``sequences`` at a time where there are more: its unpacked codes take 4 bytes
  each (8 GiB at B = 64, L = 32768, beside the inputs on an 80 GB card). Up to ``sequences`` op by op, as every
  earlier round's inputs were made: ZipCache's call took 3.3 µs longer in one program on inputs packed by the
  compiled function (same kernel, same values; recorded in af12dcf)."""
  batch = store.length.shape[0]
  if batch <= sequences:
    return pack_mma_store(store)
  batch_axis = lambda name, x: 0 if name == "length" else x.ndim - 3 if name == "valid" else 1
  arrays = lambda s: {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if isinstance(getattr(s, f.name),
                                                                                              jax.Array)}
  cut = lambda start: dataclasses.replace(store, **{
      name: lax.slice_in_dim(x, start, min(start + sequences, batch), axis=batch_axis(name, x))
      for name, x in arrays(store).items()})
  parts = [_pack(cut(start)) for start in range(0, batch, sequences)]
  return dataclasses.replace(parts[0], **{
      name: jnp.concatenate([arrays(part)[name] for part in parts], axis=batch_axis(name, x))
      for name, x in arrays(parts[0]).items()})


IMPLS = ("mgpu_kivi2", "triton_kivi2", "xla_kivi2", "mgpu_kivi4", "triton_kivi4", "mgpu_kivi8", "triton_kivi8",
         "cudnn_dense", "mgpu_kivi2_window", "mgpu_kivi4_window", "mgpu_ott2", "triton_ott2", "mgpu_specache1",
         "triton_specache1", "mgpu_zipcache", "triton_zipcache")
METHOD_LAYOUTS = {"ott2": ott_layout(Ott()), "specache1": LAYOUTS["specache1"],  # OTT at its defaults
                  "zipcache": LAYOUTS["zipcache_pools"]}


def method_inputs(shape: Shape, name: str, seed: int, packed: bool):
  """(q, stores, segments) of a method's attention call (``METHOD_LAYOUTS``, ``kernel_decode.layout_inputs``:
  random codes and holes, every slot below the length), the stores MMA-packed or not."""
  q, _, stores, segments = layout_inputs(shape, METHOD_LAYOUTS[name], seed)
  if packed:  # holes every head shares (ZipCache's) go in once, as the method hands them over
    stores = tuple(dataclasses.replace(pack_in_slices(store), valid=store.valid[..., :1, :])
                   if pool.shared_holes else pack_in_slices(store)
                   for store, pool in zip(stores, METHOD_LAYOUTS[name].pools))
  return q, jax.block_until_ready(stores), segments
WINDOW = 129  # KIVI's window at its defaults: R = 128 exact tokens and the newest (lambda = 1)


def window_inputs(shape: Shape, bits: int, seed: int, *, packed: bool = True):
  """(q, store, window) for timing KIVI's attention call: ``timing_inputs``'s store (packed or not) and a window
  of WINDOW random bf16 keys and values per (sequence, KV head), every token valid, stacked over one layer."""
  q, packed = timing_inputs(shape, bits, seed, packed=packed)
  kk, kv = jax.random.split(jax.random.key(seed + 1000))
  ring = (1, shape.batch, shape.kv_heads, WINDOW, shape.head_dim)
  return (q, packed, (jax.random.normal(kk, ring, shape.dtype), jax.random.normal(kv, ring, shape.dtype),
                      jnp.ones((shape.batch, 1, WINDOW), bool)))


def traced_kernels(fn, input_sets, calls: int = 20) -> list[dict]:
  """The device kernels of ``calls`` back-to-back calls of ``fn`` (rotating ``input_sets``) under the profiler:
  [{name, us_per_call, calls_per_call}] by total time, so a wall time splits into the kernel and what XLA runs
  around it (padding q, merging the splits' partials)."""
  from profile_decode_step import device_events, kernel_events, summarize  # imports generate's benchmark: lazily
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      jax.block_until_ready([fn(*input_sets[i % len(input_sets)]) for i in range(calls)])
    planes = device_events(trace_dir)
  events = [e for lines in planes.values() for e in kernel_events(lines)]
  return [dict(name=row["name"], us_per_call=round(row["us_per_step"], 2),
               calls_per_call=round(row["calls_per_step"], 2)) for row in summarize(events, calls, top=12)]


def in_program(fn, calls: int):
  """``fn`` (q first) called ``calls`` times in one jitted ``lax.scan``: each call's q plus 1e-30 times the sum of
  every output of the call before, so XLA can neither fold the calls into one, nor hoist them out of the loop, nor
  drop an output no later call would read (SpeCache's token mass), and each waits for the one before, as a decode
  step's layers do. (The sums read each output once, as its consumer would.)"""
  def program(q, *rest):
    def call(carry, _):
      outputs = jax.tree.leaves(fn(q + (carry * 1e-30).astype(q.dtype), *rest))
      total = sum(jnp.sum(x, dtype=jnp.float32) for x in outputs)
      return jnp.where(jnp.isfinite(total), total, 0.0), None  # unwritten logits may be anything
    return lax.scan(call, jnp.float32(0), None, length=calls)[0]
  return jax.jit(program)


def timing(device, settings: Settings, batches, seq_lens, variants: bool = True, impls=IMPLS,
           repeats: int = 1, variants_at: tuple = (8, 32768), trace: bool = False,
           splits_sweep: tuple = (), program_calls: int = 0, kv_heads: int = 8) -> list[dict]:
  """Time ``impls`` (every one by default) at each batch and length; with ``variants`` the kernel's steps and
  depths, KIVI-2 and KIVI-4 in turn, the whole sweep ``repeats`` times (config "repeat": machines drift within a
  run by more than neighbouring variants differ); with ``trace`` each default row also records its device
  kernels (``traced_kernels``); with ``splits_sweep`` the kernel at each of those split counts (default step and
  depth), KIVI-2 and KIVI-4 in turn, at every batch and length, ``repeats`` times (``splits_table``). With
  ``kv_heads`` other than 8 (32 query heads over them: 16 query rows a KV head at 2) the records say so in their
  config."""
  records = []
  mgpu = lambda **kw: jax.jit(lambda q, s: mgpu_decode_attention(q, 0, s, **kw))
  triton = jax.jit(lambda q, s: decode_attention(q, 0, (s,), ()))
  xla = jax.jit(lambda q, s: jkv_attention.decode_attention(q, 0, stores=(s,), impl="xla"))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  kivi_call = jax.jit(lambda q, s, w: jkv_attention.decode_attention(q, 0, stores=(s,), segments=(w,), impl="pallas"))
  method_call = lambda name: jax.jit(lambda q, stores, segments: jkv_attention.decode_attention(
      q, 0, stores=stores, segments=segments, impl="pallas", **dict(METHOD_LAYOUTS[name].call)))

  inputs = lambda shape, bits, seed, packed: timing_inputs(shape, bits, seed, packed=packed)

  def run(impl, fn, make, nbytes, shape, config):
    if impl not in impls:
      return
    config = config if shape.kv_heads == 8 else {**config, "kv_heads": shape.kv_heads}
    sets = input_set_count(nbytes, settings)
    try:
      input_sets = [make(seed) for seed in range(sets)]
      median_us, compile_s = time_calls(fn, input_sets, settings)
    except Exception as error:
      print(f"skip {impl} B={shape.batch} L={shape.seq_len} {config}: {type(error).__name__}: {str(error)[:300]}")
      return
    records.append(record(impl, shape.batch, shape.seq_len, median_us, nbytes, device, config=config,
                          compile_s=compile_s))
    print(f"{impl:>14} B={shape.batch:<3} L={shape.seq_len:<6} {config} {median_us:9.1f} µs "
          f"{records[-1]['gbps']:7.1f} GB/s")
    if program_calls and not config.keys() - {"splits"} and nbytes >= 2 * L2_BYTES:
      program_us, _ = time_calls(in_program(fn, program_calls), input_sets[:1], settings)
      records.append(record(impl, shape.batch, shape.seq_len, program_us / program_calls, nbytes, device,
                            config={**config, "in_program": program_calls}))
      print(f"{impl:>14} B={shape.batch:<3} L={shape.seq_len:<6} in one program {program_us / program_calls:9.1f} µs")
    if trace and set(config) <= {"splits", "sweep", "repeat", "kv_heads"}:
      records[-1]["kernels"] = traced_kernels(fn, input_sets)
      for row in records[-1]["kernels"]:
        print(f"{'':>16}{row['us_per_call']:9.2f} µs  x{row['calls_per_call']:<4} {row['name'][:90]}")

  for batch in batches:
    for seq_len in seq_lens:
      shape = Shape(batch, seq_len, kv_heads=kv_heads)
      for bits in (2, 4, 8):
        nbytes = bytes_read(shape, bits)
        run(f"mgpu_kivi{bits}", mgpu(), functools.partial(lambda seed, b=bits: inputs(shape, b, seed, True)),
            nbytes, shape, {"splits": _default_splits(shape, bits)})
        run(f"triton_kivi{bits}", triton, functools.partial(lambda seed, b=bits: inputs(shape, b, seed, False)),
            nbytes, shape, {})
        run(f"mgpu_kivi{bits}_window", kivi_call, functools.partial(lambda seed, b=bits: window_inputs(shape, b, seed)),
            nbytes + window_bytes(shape), shape, {"splits": _default_splits(shape, bits)})
      run("xla_kivi2", xla, lambda seed: inputs(shape, 2, seed, False), bytes_read(shape, 2), shape, {})
      run("cudnn_dense", cudnn, lambda seed: dense_inputs(shape, seed), dense_bytes(shape), shape, {})
      for name in METHOD_LAYOUTS:
        nbytes = inputs_bytes(jax.eval_shape(lambda: method_inputs(shape, name, 0, False)))
        for impl, packed in ((f"mgpu_{name}", True), (f"triton_{name}", False)):
          make = functools.partial(lambda seed, n=name, p=packed: method_inputs(shape, n, seed, p))
          run(impl, method_call(name), make, nbytes, shape, {})
      if (batch, seq_len) == (8, 32768):  # a cache filled to a quarter of its capacity: splits past it read nothing
        splits = _default_splits(shape, 2)
        run("mgpu_kivi2", mgpu(), lambda seed: timing_inputs(shape, 2, seed, fill=0.25), bytes_read(shape, 2) // 4,
            shape, {"splits": splits, "fill": 0.25})
      for repeat in range(repeats if splits_sweep else 0):
        for splits in splits_sweep:
          for bits in (2, 4):
            run(f"mgpu_kivi{bits}", mgpu(splits=splits),
                functools.partial(lambda seed, b=bits: inputs(shape, b, seed, True)), bytes_read(shape, bits),
                shape, {"splits": splits, "sweep": "splits", "repeat": repeat})
      if variants and (batch, seq_len) == tuple(variants_at):
        for repeat in range(repeats):
          for step_tiles, stages in VARIANTS:
            for bits in (2, 4):
              splits = _default_splits(shape, bits, step_tiles)
              run(f"mgpu_kivi{bits}", mgpu(splits=splits, step_tiles=step_tiles, max_concurrent_steps=stages),
                  functools.partial(lambda seed, b=bits: inputs(shape, b, seed, True)), bytes_read(shape, bits),
                  shape, {"splits": splits, "step_tiles": step_tiles, "stages": stages, "repeat": repeat})
  return records


def at_defaults(record) -> bool:
  """A record of the kernel at its defaults on a full cache (not a variant or a partial fill; issue_blocks and
  pallas_barriers name options timed on 2026-11-26 and since removed, whose records the results keep)."""
  return not ({"stages", "fill", "sweep", "issue_blocks", "pallas_barriers", "in_program", "kv_heads"}
              & set(record["config"]))


def in_program_table(records: list[dict]) -> str:
  """Each row timed both ways (``--in-program``): per dispatched call and per call inside one program, with the
  ratio of cuDNN's to it each way."""
  dispatched = {(r["impl"], r["batch"], r["seq_len"]): r["median_us"] for r in records if r["batch"] and at_defaults(r)}
  inside = {(r["impl"], r["batch"], r["seq_len"]): (r["median_us"], r["config"]["in_program"]) for r in records
            if "in_program" in r["config"]}
  lines = ["| B | L | impl | dispatched call | in one program (calls) | cuDNN / it, dispatched | cuDNN / it, in one "
           "program |", "|---|---|---|---|---|---|---|"]
  for impl, batch, seq_len in sorted(inside, key=lambda k: (k[1], k[2], IMPLS.index(k[0]))):
    us, calls = inside[impl, batch, seq_len]
    call, dense_call = (dispatched.get((i, batch, seq_len)) for i in (impl, "cudnn_dense"))
    dense_inside = inside.get(("cudnn_dense", batch, seq_len), (None,))[0]
    shown = lambda x: "–" if x is None else f"{x:.1f} µs"
    over = lambda a, b: "–" if None in (a, b) else f"{a / b:.2f}x"
    lines.append(f"| {batch} | {seq_len} | {impl} | {shown(call)} | {shown(us)} ({calls}) | "
                 f"{over(dense_call, call)} | {over(dense_inside, us)} |")
  return "\n".join(lines)


def splits_table(records: list[dict]) -> str:
  """The kernel at each split count swept (``--splits``): the median over repeats and the range, the programs it
  launches (B * Hkv * splits), and the default's count."""
  found = {}
  for r in records:
    if r["impl"].startswith("mgpu_kivi") and r["config"].get("sweep") == "splits":
      key = (r["batch"], r["seq_len"], r["config"].get("kv_heads", 8), int(r["impl"][-1]), r["config"]["splits"])
      found.setdefault(key, []).append(r["median_us"])
  lines = ["| B | L | KV heads | KIVI | splits | programs | median over repeats | range | repeats |",
           "|---|---|---|---|---|---|---|---|---|"]
  for batch, seq_len, kv_heads, bits, splits in sorted(found):
    times = found[batch, seq_len, kv_heads, bits, splits]
    shape = Shape(batch, seq_len, kv_heads=kv_heads)
    mark = " (default)" if splits == _default_splits(shape, bits) else ""
    programs = batch * kv_heads * splits
    lines.append(f"| {batch} | {seq_len} | {kv_heads} | {bits}-bit | {splits}{mark} | {programs} | "
                 f"{np.median(times):.1f} µs | {min(times):.1f}-{max(times):.1f} µs | {len(times)} |")
  return "\n".join(lines)


def variants_table(records: list[dict]) -> str:
  """Step and depth at each shape swept: the median over repeats (and the range), the shared memory a program
  holds, and which the kernel picks by default (``default_step_tiles``, ``STAGES``)."""
  found = {}
  for r in records:
    if r["impl"].startswith("mgpu_kivi") and "step_tiles" in r["config"]:
      found.setdefault((r["batch"], r["seq_len"], int(r["impl"][-1]), r["config"]["step_tiles"],
                        r["config"]["stages"]), []).append(r["median_us"])
  lines = ["| B | L | KIVI | step_tiles | stages | shared memory | median over repeats | range | repeats |",
           "|---|---|---|---|---|---|---|---|---|"]
  for batch, seq_len in sorted({key[:2] for key in found}):
    for bits in (2, 4):
      packed = _abstract_mma_store(Shape(batch, seq_len), bits)
      default = (default_step_tiles(packed), STAGES)
      for step_tiles, stages in VARIANTS:
        times = found.get((batch, seq_len, bits, step_tiles, stages))
        if not times:
          continue
        mark = " (default)" if (step_tiles, stages) == default else ""
        lines.append(f"| {batch} | {seq_len} | {bits}-bit | {step_tiles} | {stages}{mark} | "
                     f"{shared_memory_bytes(packed, step_tiles, stages) / 1024:.0f} KB | {np.median(times):.1f} µs | "
                     f"{min(times):.1f}-{max(times):.1f} µs | {len(times)} |")
  return "\n".join(lines)


def _default_splits(shape: Shape, bits: int, step_tiles=None) -> int:
  """The kernel's split count at ``shape`` (one query row, g = q_per_kv rows a KV head); a round's before build
  (``mgpu_ab.py``) may be one from before the split count took the rows, or from before round 9, whose
  ``default_splits`` took (batch, kv_heads, units of whole steps)."""
  for call in (lambda: default_splits(_abstract_mma_store(shape, bits), step_tiles, n_rows=shape.q_per_kv),
               lambda: default_splits(_abstract_mma_store(shape, bits), step_tiles)):
    try:
      return call()
    except TypeError:
      pass
  return default_splits(shape.batch, shape.kv_heads, shape.seq_len // 64 // (step_tiles or 4))


def _abstract_mma_store(shape: Shape, bits: int) -> MmaStore:
  """The shapes of ``timing_inputs``'s packed store (G = 32), without building it."""
  return jax.eval_shape(lambda: pack_mma_store(store(jax.random.key(0), shape, k_bits=bits, v_bits=bits, k_group=32,
                                                     v_group=32, meta_dtype=shape.dtype, lengths=[1] * shape.batch,
                                                     from_data=False)))


def table(records: list[dict]) -> str:
  cells = {(r["impl"], r["batch"], r["seq_len"]): r for r in records if at_defaults(r)}
  keys = sorted({(r["batch"], r["seq_len"]) for r in records if r["batch"]})
  impls = IMPLS
  ratios = ("mgpu_kivi2", "mgpu_kivi4", "mgpu_kivi8", "mgpu_ott2", "mgpu_specache1", "mgpu_zipcache")
  lines = ["| B | L | " + " | ".join(impls) + "".join(f" | cuDNN / {i}" for i in ratios) + " |",
           "|---|---|" + "---|" * (len(impls) + len(ratios))]
  for batch, seq_len in keys:
    get = lambda i: cells.get((i, batch, seq_len))
    row = [f"{get(i)['median_us']:.1f} µs ({get(i)['gbps']:.0f} GB/s)" if get(i) else "–" for i in impls]
    ratio = lambda i: (f"{get('cudnn_dense')['median_us'] / get(i)['median_us']:.2f}x"
                       if get(i) and get("cudnn_dense") else "–")
    lines.append(f"| {batch} | {seq_len} | " + " | ".join(row + [ratio(i) for i in ratios]) + " |")
  return "\n".join(lines)


def rounds_table(directory: pathlib.Path) -> str:
  """One row per round of kernel work and shape: ``<n>_before_<change>.json`` and ``<n>_after_<change>.json``, the
  build before the change and after it on one machine (two runs minutes apart in rounds 1-4, ``mgpu_ab.py`` from
  round 5), at B = 8, L = 32768 and, from round 7, at a largest-batch decode step (B = 256, L = 4608)."""
  @functools.cache
  def records(path):
    return json.loads(path.read_text())

  def cell(path, impl, batch, seq_len):
    found = [r for r in records(path) if r["impl"] == impl and r["batch"] == batch
             and r["seq_len"] == seq_len and at_defaults(r)]
    return found[0] if found else None

  impls = ("mgpu_kivi2", "mgpu_kivi4", "mgpu_kivi2_window", "mgpu_kivi4_window")
  names = ("KIVI-2", "KIVI-4", "KIVI-2 + window", "KIVI-4 + window")
  lines = ["| round | change | B | L | " + " | ".join(f"{n} before | {n} after" for n in names)
           + " | cuDNN (after's run) | cuDNN / KIVI-2 after | device |", "|---|---|---|---|" + "---|" * 11]
  for after in sorted(directory.glob("*_after_*.json"), key=lambda p: int(p.name.split("_")[0])):
    number, change = after.stem.split("_after_")
    before = after.with_name(f"{number}_before_{change}.json")
    shapes = lambda path: {(r["batch"], r["seq_len"]) for r in records(path) if r["impl"] in impls}
    for batch, seq_len in sorted(shapes(before) & shapes(after)):
      us = lambda path, impl: (cell(path, impl, batch, seq_len) or {}).get("median_us")
      shown = lambda value: "–" if value is None else f"{value:.1f} µs"
      k2, dense = us(after, "mgpu_kivi2"), us(after, "cudnn_dense")
      device = next(cell(after, i, batch, seq_len)["device"] for i in ("cudnn_dense", *impls)
                    if cell(after, i, batch, seq_len))
      lines.append(f"| {number} | {change.replace('_', ' ')} | {batch} | {seq_len} | "
                   + " | ".join(f"{shown(us(before, i))} | {shown(us(after, i))}" for i in impls)
                   + f" | {shown(dense)} | {'–' if None in (k2, dense) else f'{dense / k2:.2f}x'} | {device} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check-only", action="store_true")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 32768])
  parser.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                      help="time the kernel's steps and depths at B = 8, L = 32768")
  parser.add_argument("--repeats", type=int, default=1, help="times to run the variants' sweep, in turn")
  parser.add_argument("--variants-at", type=int, nargs=2, default=[8, 32768], metavar=("B", "L"),
                      help="the batch and length of the variants' sweep (one of --batches x --seq-lens)")
  parser.add_argument("--splits", type=int, nargs="+", default=[],
                      help="also time the kernel at these split counts at every batch and length (--repeats times)")
  parser.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS, help="time only these")
  parser.add_argument("--kv-heads", type=int, default=8, help="KV heads of the 32 query heads (2: 16 rows a head)")
  parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                      help="check the kernel against the reference first (a failed check fails the run)")
  parser.add_argument("--trace", action="store_true",
                      help="also record each default row's device kernels under the profiler (kernel against XLA's)")
  parser.add_argument("--in-program", type=int, default=0, metavar="N",
                      help="also time each default row as N calls inside one compiled program (lax.scan)")
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
  parser.add_argument("--rounds", action="store_true", help="print the table of results/mgpu_changes and exit")
  args = parser.parse_args()
  device = jax.devices()[0]
  slug = re.sub(r"[^a-z0-9]+", "_", device.device_kind.lower()).strip("_")
  out = args.out or HERE / "results" / f"mgpu_decode_{slug}.json"
  if args.rounds:
    print(rounds_table(HERE / "results" / "mgpu_changes"))
    return
  if args.table:
    records = json.loads(out.read_text())
    print("\n\n".join((table(records), variants_table(records), splits_table(records), in_program_table(records))))
    return
  checks = check() if args.check or args.check_only else []
  records = [{"impl": "check", "batch": None, "seq_len": None, "config": {}, "device": device.device_kind,
              "jax_version": jax.__version__, "results": checks}] if checks else []
  if not args.check_only:
    settings = Settings()
    records.append(copy_bandwidth(device, settings))
    records += timing(device, settings, args.batches, args.seq_lens, args.variants, args.impls, args.repeats,
                      args.variants_at, args.trace, tuple(args.splits), args.in_program, args.kv_heads)
  records = save(out, records, RECORD_KEY)
  print("\n" + "\n\n".join((table(records), variants_table(records), splits_table(records),
                              in_program_table(records))))
  if not all(c["ok"] for c in checks):
    raise SystemExit("mgpu_decode_attention disagrees with the reference (see the check lines)")


if __name__ == "__main__":
  main()
