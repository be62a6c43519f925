"""How fast is fused KIVI decode attention against dense attention and against dequantize-then-attend?

One decode step (one query row), 32 query heads over 8 KV heads, D = 128, bf16, for B in {1, 8, 32} and
L in {4096, 16384, 32768, 65536}:

    device_copy          a large device-to-device copy: the bandwidth ceiling (bytes read + written)
    kivi2_fused          jkv_kernels.dequant_attention.decode_attention, 2-bit keys and values, G = 32,
    kivi4_fused          4-bit; a QuantizedStore holding L - 128 tokens plus a 128-token full-precision
                         residual segment
    dequant_then_attend  decode_attention_reference under jit (the XLA path), same inputs as kivi2_fused
    jkv_dense            the same kernel with no store: the bf16 cache of length L as one segment, all valid,
                         at the dense tunables DENSE_CONFIG (not autotuned here)
    cudnn_dense          jax.nn.dot_product_attention(implementation="cudnn") on a bf16 cache of length L
    xla_dense            the same with implementation="xla"

and, at B = 8 and L <= 32768 only (``Settings.layout_batches``, ``layout_max_seq_len``), the same kernel on the
layouts the other methods hand it (LAYOUTS; L tokens in all, every store full):

    zipcache_pools       ZipCache: a 4-bit pool with 60% of the quantized tokens and a 2-bit pool with 40%, keys
                         in groups of 32 tokens, values per token over all D channels with a value channel scale,
                         per-step holes (5%), plus a 100-token bf16 window
    ott2                 OTT (jkv/methods/ott.py ``Ott._attend``, sizes from its "paper" preset): one 2-bit
                         store, keys in groups of G = 128 tokens, values in groups of min(G, D) channels, with
                         stacked holes (one per pooled token: N + A = 35 per KV head), then two stacked segments
                         in the method's order: the full-precision buffer of G + R = 160 slots (mask [B, T, S])
                         and the pool segment of N + A = 35 slots (the 3-slot outlier pool, then the 32-slot
                         auxiliary pool; per-head mask [B, H, T, S])
    specache1            SpeCache: a 1-bit store with G = 32 and per-step holes (the fetched rows, 64 per head),
                         the 64 fetched bf16 rows (a per-step segment, per-head mask), the 128-token window; two
                         query rows (the step's token and the speculative one, whose token mass the method reads)

The kernel reads a cache stacked over layers at a traced layer index; here every stacked array has one layer (a
leading axis of size 1) and the layer index is 0, so the bytes read are those of one layer's cache.

With ``--orientations``, every fused implementation above (kivi2_fused, kivi4_fused, jkv_dense and the layouts)
is also timed with each tile orientation forced (``decode_attention(tokens_major=False / True)``, rows
``<impl>_rows_major`` and ``<impl>_tokens_major``), in the same run: the measurement behind the kernel's choice.

Before timing, the fused kernel is checked against the reference on the device (the script fails if they
disagree; the kernel with no store too, at DENSE_CONFIG, and every layout the sweep times), and a small autotune over
block_k / k_splits / num_warps at B = 8, L = 32768 picks the configuration the kivi and layout rows then use.
Each time is the median over repetitions of back-to-back calls that rotate through several input sets (so that
the 50 MB L2 does not flatter small sizes), after a warm-up; compile time is reported apart. Results go to
benchmarks/results/kernel_decode_<device>.json; ``--table`` renders them into benchmarks/README.md.

    python benchmarks/kernel_decode.py                      # on the GPU
    python benchmarks/kernel_decode.py --batches 8 --seq-lens 32768 --no-autotune --orientations
    python benchmarks/kernel_decode.py --smoke --out /tmp/x.json   # tiny, interpret mode, any machine
    python benchmarks/kernel_decode.py --table [--out results.json]
"""

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import math
import pathlib
import re
import statistics
import time

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jkv.methods.ott import Ott
from jkv_kernels import quantization
from jkv_kernels.dequant_attention import QuantizedStore, decode_attention, decode_attention_reference
from records import README, kernel_record_key, merge_file, write_readme_section

HERE = pathlib.Path(__file__).resolve().parent
# A rerun replaces the records of the same configuration.
RECORD_KEY = kernel_record_key
L2_BYTES = 50 * 2**20  # H100 L2; input sets rotate through at least twice this
RESIDUAL = 128
GROUP_SIZE = 32
# jkv_dense's tunables: the best of kernel_check_gpu.py's dense autotune on an H100 (B=8, S=8192), recorded in
# results/kernel_check_gpu_nvidia_h100_80gb_hbm3.json.
DENSE_CONFIG = {"block_s": 64, "s_splits": 8, "num_warps": 4, "num_stages": 2}


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  seq_len: int
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  dtype: type = jnp.bfloat16

  @property
  def q_per_kv(self):
    return self.q_heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a run covers; ``--smoke`` swaps in tiny sizes that interpret mode can run anywhere."""
  batches: tuple[int, ...] = (1, 8, 32)
  seq_lens: tuple[int, ...] = (4096, 16384, 32768, 65536)
  q_heads: int = 32
  kv_heads: int = 8
  copy_bytes: int = 2**30
  max_input_sets: int = 32
  repetitions: int = 30
  calls_per_repetition: int = 10
  autotune_shape: tuple[int, int] = (8, 32768)
  autotune_grid: tuple[tuple[int, int, int, int], ...] = tuple(
      itertools.product((32, 64, 128, 256), (8, 16), (4, 8), (1, 2, 3)))
  check_shape: tuple[int, int] = (2, 4096)
  layout_batches: tuple[int, ...] = (8,)  # the LAYOUTS rows run at these batch sizes of the sweep
  layout_max_seq_len: int = 32768
  interpret: bool = False


SMOKE = Settings(batches=(1, 2), seq_lens=(256,), q_heads=8, kv_heads=2, copy_bytes=2**20, max_input_sets=2,
                 repetitions=3, calls_per_repetition=2, autotune_shape=(2, 512),
                 autotune_grid=((64, 2, 4, 1), (128, 4, 4, 2)), check_shape=(2, 256), layout_batches=(2,),
                 interpret=True)


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def store_arrays(key, shape: Shape, capacity: int, *, k_bits: int, v_bits: int, k_group: int, v_group: int,
                 quantized_from_data: bool, num_layers: int = 1, meta_dtype=jnp.float16):
  """The six code and scale arrays of a store of ``capacity`` tokens, stacked over ``num_layers`` layers.

  For timing, codes are random words (every word is valid at any width) and scales random, which is as fast as
  it gets to build. For the correctness check, real keys and values are quantized and packed.
  """
  b, h, d = shape.batch, shape.kv_heads, shape.head_dim
  lead = (num_layers, b, h)
  kk, kv, ks = jax.random.split(key, 3)
  if quantized_from_data:
    k = jax.random.normal(kk, (*lead, d, capacity), jnp.float32)
    v = jax.random.normal(kv, (*lead, capacity, d), jnp.float32)
    k_codes, k_scale, k_zero = quantization.quantize(k, bits=k_bits, axis=4, group_size=k_group,
                                                     meta_dtype=meta_dtype)
    v_codes, v_scale, v_zero = quantization.quantize(v, bits=v_bits, axis=4, group_size=v_group,
                                                     meta_dtype=meta_dtype)
    return (quantization.pack(k_codes, bits=k_bits, axis=4), k_scale, k_zero,
            quantization.pack(v_codes, bits=v_bits, axis=4), v_scale, v_zero)
  k_codes = jax.random.bits(kk, (*lead, d, capacity // (32 // k_bits)), jnp.uint32)
  v_codes = jax.random.bits(kv, (*lead, capacity, d // (32 // v_bits)), jnp.uint32)
  meta = lambda k, s: jax.random.uniform(k, s, meta_dtype, 0.01, 0.1)
  k_scale, k_zero, v_scale, v_zero = (
      meta(k, s) for k, s in zip(jax.random.split(ks, 4), [(*lead, d, capacity // k_group)] * 2
                                 + [(*lead, capacity, d // v_group)] * 2))
  return k_codes, k_scale, k_zero, v_codes, v_scale, v_zero


def kivi_inputs(shape: Shape, bits: int, seed: int, *, quantized_from_data: bool = False):
  """Arguments (q, layer, stores, segments) of decode_attention for a cache of capacity L.

  The store holds length = L - 128 tokens, then one 128-token bf16 residual segment (mask [B, 1, 128] all valid);
  every cache array is stacked over one layer ([1, B, Hkv, ...]) and layer = 0. Codes: ``store_arrays``.
  """
  b, h, length, d = shape.batch, shape.kv_heads, shape.seq_len, shape.head_dim
  kq, ks, kr = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, h, 1, shape.q_per_kv, d), shape.dtype)
  store = QuantizedStore(*store_arrays(ks, shape, length, k_bits=bits, v_bits=bits, k_group=GROUP_SIZE,
                                       v_group=GROUP_SIZE, quantized_from_data=quantized_from_data),
                         length=jnp.full((b,), length - RESIDUAL, jnp.int32), k_bits=bits, v_bits=bits,
                         k_group=GROUP_SIZE, v_group=GROUP_SIZE)
  res_k, res_v = jax.random.normal(kr, (2, 1, b, h, RESIDUAL, d), shape.dtype)
  mask = jnp.ones((b, 1, RESIDUAL), jnp.bool_)
  return (q, jnp.int32(0), (store,), ((res_k, res_v, mask),))


def kivi_bytes(shape: Shape, bits: int) -> int:
  """Bytes a decode step must read: codes and fp16 scale + zero of L - 128 tokens, the bf16 residual, q."""
  tokens = shape.seq_len - RESIDUAL
  per_head = tokens * shape.head_dim * (2 * bits / 8 + 2 * 2 * 2 / GROUP_SIZE) + 2 * RESIDUAL * shape.head_dim * 2
  return int(shape.batch * shape.kv_heads * per_head + shape.batch * shape.q_heads * shape.head_dim * 2)


def jkv_dense_inputs(shape: Shape, seed: int):
  """Arguments (q, layer, (), segments) of decode_attention: the bf16 cache of length L as one stacked segment
  (k, v [1, B, Hkv, L, D], mask [B, 1, L] all valid), layer = 0."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (shape.batch, shape.kv_heads, 1, shape.q_per_kv, shape.head_dim), shape.dtype)
  kv_shape = (1, shape.batch, shape.kv_heads, shape.seq_len, shape.head_dim)
  k, v = jax.random.normal(kk, kv_shape, shape.dtype), jax.random.normal(kv, kv_shape, shape.dtype)
  return q, jnp.int32(0), (), ((k, v, jnp.ones((shape.batch, 1, shape.seq_len), jnp.bool_)),)


def dense_inputs(shape: Shape, seed: int):
  """jax.nn.dot_product_attention layout: q [B, 1, N, D], k and v [B, L, K, D]."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (shape.batch, 1, shape.q_heads, shape.head_dim), shape.dtype)
  kv_shape = (shape.batch, shape.seq_len, shape.kv_heads, shape.head_dim)
  return q, jax.random.normal(kk, kv_shape, shape.dtype), jax.random.normal(kv, kv_shape, shape.dtype)


def dense_bytes(shape: Shape) -> int:
  return 2 * shape.batch * shape.seq_len * shape.kv_heads * shape.head_dim * 2


@dataclasses.dataclass(frozen=True)
class PoolSpec:
  """One quantized store of a layout: its share of the quantized tokens, widths, groupings (v_group None: all D
  channels; a callable: a function of D, as OTT's min(G, D)); ``holes``: None (no holes array), the fraction of
  slots that are holes, or (>= 1) their count per (b, h) (at most half the slots); whether the holes are stacked
  (else per step) and the same for every head (ZipCache's: the MMA-packed store takes them with a head axis of
  1, ``mgpu_decode.method_inputs``); a value channel scale or not."""
  share: float
  k_bits: int
  v_bits: int
  k_group: int
  v_group: Union[int, Callable[[int], int], None] = None
  holes: Optional[float] = None
  stacked_holes: bool = False
  shared_holes: bool = False
  channel_scale: bool = False


@dataclasses.dataclass(frozen=True)
class Layout:
  """A method's decode-attention inputs: quantized stores sharing L - (full-precision tokens), full-precision
  segments (length, stacked, per-head mask) and the query rows T; ``call`` holds extra decode_attention
  arguments the method passes every step."""
  pools: tuple[PoolSpec, ...]
  segments: tuple[tuple[int, bool, bool], ...]
  t_rows: int = 1
  call: tuple[tuple[str, object], ...] = ()


def ott_layout(method: Ott = Ott(**Ott.presets["paper"])) -> Layout:
  """What ``Ott._attend`` hands decode_attention (docs/methods/ott.md): one store of ``bits``-bit keys
  in groups of G tokens and values in groups of ``value_group_for(D)`` channels, whose stacked ``valid`` mask
  (state [L, B, H, C]) has a hole per pooled token (the pool and auxiliary positions, N + A per KV head once the
  pools are full; no mask without a pool); then the stacked full-precision buffer of G + R slots (mask
  [B, T, S]) and, with a pool, the stacked pool segment of N + A slots (per-head mask [B, H, T, S])."""
  bits, G = method.bits, method.group_size
  store = PoolSpec(1.0, bits, bits, G, method.value_group_for, holes=method.pool_slots if method.pool_size else None,
                   stacked_holes=True)
  segments = ((method.window, True, False),) + (((method.pool_slots, True, True),) if method.pool_slots else ())
  return Layout((store,), segments)


LAYOUTS = {
    "zipcache_pools": Layout((PoolSpec(0.6, 4, 4, 32, holes=0.05, shared_holes=True, channel_scale=True),
                              PoolSpec(0.4, 2, 2, 32, holes=0.05, shared_holes=True, channel_scale=True)),
                             ((100, True, False),)),
    "ott2": ott_layout(),  # OTT at the paper preset (G = 128, R = 32, N = 3, A = 32, 2 bits), the earlier default
    "specache1": Layout((PoolSpec(1.0, 1, 1, 32, 32, holes=64),), ((64, False, True), (RESIDUAL, True, False)),
                        t_rows=2, call=(("token_mass_rows", (1,)),)),
}


def layout_inputs(shape: Shape, name: Union[str, Layout], seed: int, *, quantized_from_data: bool = False,
                  num_layers: int = 1):
  """Arguments (q, layer, stores, segments) of decode_attention for LAYOUTS[name] (or the Layout ``name``) with
  L = shape.seq_len tokens.

  Each store's capacity is its share of the quantized tokens (L minus the full-precision ones), rounded up to
  whole key groups and 64 tokens, and every slot is below its length; holes are random (a fraction, or a count
  per (b, h)); channel scales are random in [0.5, 2]; segment masks are all True. Stacked arrays carry
  ``num_layers`` layers and layer = num_layers - 1.
  """
  layout = LAYOUTS[name] if isinstance(name, str) else name
  b, h, d = shape.batch, shape.kv_heads, shape.head_dim
  quantized = shape.seq_len - sum(length for length, _, _ in layout.segments)
  keys = iter(jax.random.split(jax.random.key(seed), 4 * len(layout.pools) + 2 * len(layout.segments) + 1))
  q = jax.random.normal(next(keys), (b, h, layout.t_rows, shape.q_per_kv, d), shape.dtype)
  lead = (num_layers, b, h)
  stores = []
  for pool in layout.pools:
    multiple = max(64, pool.k_group)
    capacity = -(-math.ceil(pool.share * quantized) // multiple) * multiple
    v_group = pool.v_group(d) if callable(pool.v_group) else pool.v_group or d
    arrays = store_arrays(next(keys), shape, capacity, k_bits=pool.k_bits, v_bits=pool.v_bits,
                          k_group=pool.k_group, v_group=v_group, quantized_from_data=quantized_from_data,
                          num_layers=num_layers)
    valid = None
    if pool.holes is not None:
      holes_shape = ((num_layers,) if pool.stacked_holes else ()) + (b, 1 if pool.shared_holes else h, capacity)
      if pool.holes >= 1:  # a count per (b, h), at most half the slots: distinct slots (SpeCache's fetched rows)
        rank = jnp.argsort(jax.random.uniform(next(keys), holes_shape), axis=-1)
        valid = rank >= min(int(pool.holes), capacity // 2)
      else:
        valid = jax.random.uniform(next(keys), holes_shape) >= pool.holes
      valid = jnp.broadcast_to(valid, holes_shape[:-2] + (h, capacity))  # the library layout takes every head's
    channel_scale = None
    if pool.channel_scale:
      channel_scale = jax.random.uniform(next(keys), (*lead, d), jnp.float16, 0.5, 2.0)
    stores.append(QuantizedStore(*arrays, length=jnp.full((b,), capacity, jnp.int32), k_bits=pool.k_bits,
                                 v_bits=pool.v_bits, k_group=pool.k_group, v_group=v_group, valid=valid,
                                 v_channel_scale=channel_scale))
  segments = []
  for length, stacked, per_head in layout.segments:
    kv_shape = ((num_layers,) if stacked else ()) + (b, h, length, d)
    k, v = jax.random.normal(next(keys), (2, *kv_shape), shape.dtype)
    mask = jnp.ones((b, h, layout.t_rows, length) if per_head else (b, layout.t_rows, length), jnp.bool_)
    segments.append((k, v, mask))
  return q, jnp.int32(num_layers - 1), tuple(stores), tuple(segments)


def inputs_bytes(inputs) -> int:
  """Bytes of every array of one input set (one layer): what a decode step reads, every slot being valid."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(inputs)))


def layout_bytes(shape: Shape, name: str) -> int:
  return inputs_bytes(jax.eval_shape(functools.partial(layout_inputs, shape, name, 0)))


# ----------------------------------------------------------------------------------------------------------------
# Timing


def time_calls(fn, input_sets, settings: Settings):
  """(median µs per call, compile + first call s): back-to-back calls rotating input sets, blocked per repetition."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*input_sets[0]))
  compile_s = time.perf_counter() - start
  for inputs in input_sets:  # warm-up: every set once
    jax.block_until_ready(fn(*inputs))
  per_call = []
  calls = itertools.cycle(input_sets)
  for _ in range(settings.repetitions):
    start = time.perf_counter()
    outputs = [fn(*next(calls)) for _ in range(settings.calls_per_repetition)]
    jax.block_until_ready(outputs)
    per_call.append((time.perf_counter() - start) / settings.calls_per_repetition)
  return statistics.median(per_call) * 1e6, compile_s


def input_set_count(set_bytes: int, settings: Settings) -> int:
  """Enough sets that one rotation streams at least twice the L2 size, at most ``settings.max_input_sets``."""
  return int(np.clip(math.ceil(2 * L2_BYTES / max(set_bytes, 1)), 1, settings.max_input_sets))


def fits(device, needed_bytes: int) -> bool:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return not stats or "bytes_limit" not in stats or needed_bytes < 0.8 * stats["bytes_limit"]


def copy_bandwidth(device, settings: Settings) -> dict:
  """A large device-to-device copy: bytes read + written over the median time."""
  x = jnp.zeros((settings.copy_bytes // 4,), jnp.uint32)
  copy = jax.jit(lambda a: a + jnp.uint32(1))  # forces a full read and a full write
  median_us, _ = time_calls(copy, [(x,)], settings)
  return record("device_copy", None, None, median_us, 2 * x.nbytes, device, config={"bytes": x.nbytes})


def record(impl, batch, seq_len, median_us, bytes_read, device, *, config=None, compile_s=None) -> dict:
  return {
      "impl": impl, "batch": batch, "seq_len": seq_len, "median_us": round(median_us, 2),
      "bytes_read": int(bytes_read), "gbps": round(bytes_read / (median_us * 1e-6) / 1e9, 1),
      "device": device.device_kind, "jax_version": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "config": config or {}, "compile_s": None if compile_s is None else round(compile_s, 2),
  }


# ----------------------------------------------------------------------------------------------------------------
# The three parts of a run


def fused(config: dict, interpret: bool):
  """decode_attention under jit, called as fn(q, layer, stores, segments); widths and G come with the stores."""
  return jax.jit(lambda q, layer, stores, segments: decode_attention(q, layer, stores, segments,
                                                                    interpret=interpret, **config))


def layout_config(config: dict, name: str) -> dict:
  """The tunables plus the arguments the layout's method passes every step (e.g. SpeCache's token mass)."""
  return {**config, **dict(LAYOUTS[name].call)}


def timed_layouts(settings: Settings) -> tuple[str, ...]:
  """The LAYOUTS that the sweep times (none when no batch size or length of the run is in their range)."""
  timed = (any(b in settings.layout_batches for b in settings.batches)
           and any(length <= settings.layout_max_seq_len for length in settings.seq_lens))
  return tuple(LAYOUTS) if timed else ()


def check_fused_against_reference(settings: Settings, config: dict, *, dense: bool = False):
  """Fails loudly when the compiled kernel and the XLA reference disagree on real quantized data: KIVI-2 and
  KIVI-4 and every layout the sweep times (each output: o, and the token mass where the layout asks for it).

  With ``dense``, also the kernel with no store (jkv_dense's inputs) at DENSE_CONFIG.
  """
  batch, seq_len = settings.check_shape
  shape = Shape(batch, seq_len, settings.q_heads, settings.kv_heads)
  cases = [(f"{bits}-bit fused", config, kivi_inputs(shape, bits, seed=bits, quantized_from_data=True))
           for bits in (2, 4)]
  cases += [(name, layout_config(config, name), layout_inputs(shape, name, seed=3, quantized_from_data=True))
            for name in timed_layouts(settings)]
  if dense:
    cases.append(("dense (no store)", DENSE_CONFIG, jkv_dense_inputs(shape, seed=0)))
  for name, case_config, inputs in cases:
    out = jax.tree.leaves(fused(case_config, settings.interpret)(*inputs))
    call = {key: value for key, value in case_config.items() if key == "token_mass_rows"}
    ref = jax.tree.leaves(decode_attention_reference(*inputs, **call))
    errors = []
    for got, want in zip(out, ref):
      got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
      error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
      errors.append(float(error) if np.all(np.isfinite(got)) else np.inf)
    if len(out) != len(ref) or not all(error <= 2e-2 for error in errors):
      raise SystemExit(f"{name} kernel {case_config} disagrees with the reference: relative errors {errors}")
    print(f"check: {name} {case_config or 'defaults'} vs reference: relative error "
          f"{', '.join(f'{e:.2e}' for e in errors)}")


def autotune(device, settings: Settings) -> tuple[dict, list[dict]]:
  """Times kivi2_fused over the block_k / k_splits / num_warps / num_stages grid; returns the best config and every record."""
  batch, seq_len = settings.autotune_shape
  shape = Shape(batch, seq_len, settings.q_heads, settings.kv_heads)
  input_sets = [kivi_inputs(shape, 2, seed) for seed in range(input_set_count(kivi_bytes(shape, 2), settings))]
  records = []
  for block_k, k_splits, num_warps, num_stages in settings.autotune_grid:
    config = {"block_k": block_k, "k_splits": k_splits, "num_warps": num_warps, "num_stages": num_stages}
    try:
      median_us, compile_s = time_calls(fused(config, settings.interpret), input_sets, settings)
    except Exception as error:  # a config the compiler rejects (e.g. out of shared memory) is skipped, not fatal
      print(f"autotune: {config} failed: {type(error).__name__}: {str(error)[:200]}")
      continue
    records.append(record("kivi2_fused_autotune", batch, seq_len, median_us, kivi_bytes(shape, 2), device,
                          config=config, compile_s=compile_s))
    print(f"autotune: {config} {median_us:.1f} µs")
  best = min(records, key=lambda r: r["median_us"])
  return best["config"], records


ORIENTED = ("kivi2_fused", "kivi4_fused", "jkv_dense", *LAYOUTS)  # what --orientations times both ways
ORIENTATIONS = {"rows_major": False, "tokens_major": True}


def attention_impls(device, settings: Settings, tuned: dict, orientations: bool = False) -> dict:
  """impl -> (make inputs (shape, seed), bytes read (shape), jitted fn, config); with ``orientations``, every
  impl in ORIENTED also as ``<impl>_rows_major`` and ``<impl>_tokens_major``."""
  kivi = lambda bits: (lambda shape, seed: kivi_inputs(shape, bits, seed), lambda shape: kivi_bytes(shape, bits))
  dense = lambda implementation: jax.jit(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation))
  reference = jax.jit(lambda q, layer, stores, segments: decode_attention_reference(q, layer, stores, segments))
  impls = {
      "kivi2_fused": (*kivi(2), fused(tuned, settings.interpret), tuned),
      "kivi4_fused": (*kivi(4), fused(tuned, settings.interpret), tuned),
      "dequant_then_attend": (*kivi(2), reference, {}),
      "jkv_dense": (jkv_dense_inputs, dense_bytes, fused(DENSE_CONFIG, settings.interpret), DENSE_CONFIG),
      "cudnn_dense": (dense_inputs, dense_bytes, dense("cudnn"), {}),
      "xla_dense": (dense_inputs, dense_bytes, dense("xla"), {}),
  }
  for name in LAYOUTS:
    config = layout_config(tuned, name)
    impls[name] = (lambda shape, seed, name=name: layout_inputs(shape, name, seed),
                   lambda shape, name=name: layout_bytes(shape, name), fused(config, settings.interpret), config)
  if orientations:
    for name in ORIENTED:
      make, nbytes, _, config = impls[name]
      for suffix, tokens_major in ORIENTATIONS.items():
        oriented = {**config, "tokens_major": tokens_major}
        impls[f"{name}_{suffix}"] = (make, nbytes, fused(oriented, settings.interpret), oriented)
  if device.platform != "gpu":  # cuDNN attention exists only on NVIDIA GPUs
    del impls["cudnn_dense"]
  return impls


def sweep(device, settings: Settings, tuned: dict, orientations: bool = False) -> list[dict]:
  records = []
  for batch, seq_len in itertools.product(settings.batches, settings.seq_lens):
    shape = Shape(batch, seq_len, settings.q_heads, settings.kv_heads)
    for impl, (make, nbytes, fn, config) in attention_impls(device, settings, tuned, orientations).items():
      layout = re.sub(r"_(rows|tokens)_major$", "", impl)  # a layout, forced to one orientation or not
      if layout in LAYOUTS and (batch not in settings.layout_batches or seq_len > settings.layout_max_seq_len):
        continue
      set_bytes = nbytes(shape)
      sets = input_set_count(set_bytes, settings)
      # dequant_then_attend materializes uint32 codes and fp32 K and V, then copies them into the concatenation
      # with the residual: about 16 bytes per cached element, for K and for V.
      elements = batch * shape.kv_heads * seq_len * shape.head_dim
      workspace = 2 * 16 * elements if impl == "dequant_then_attend" else 0
      if not fits(device, sets * set_bytes + workspace):
        print(f"skip {impl} B={batch} L={seq_len}: does not fit")
        continue
      try:
        median_us, compile_s = time_calls(fn, [make(shape, seed) for seed in range(sets)], settings)
      except Exception as error:  # e.g. out of memory despite the estimate; keep the rest of the sweep
        print(f"skip {impl} B={batch} L={seq_len}: {type(error).__name__}: {str(error)[:200]}")
        continue
      records.append(record(impl, batch, seq_len, median_us, set_bytes, device, config=config, compile_s=compile_s))
      print(f"{impl:>20} B={batch:<3} L={seq_len:<6} {median_us:9.1f} µs  {records[-1]['gbps']:7.1f} GB/s")
  return records


# ----------------------------------------------------------------------------------------------------------------
# Reporting


def markdown_table(records: list[dict]) -> str:
  """Rows (B, L), one column per implementation, cells 'µs (GB/s)'; the copy rate and the tuned config above."""
  lines = []
  for r in records:
    if r["impl"] == "device_copy":
      lines.append(f"Device copy rate (read + written): {r['gbps'] / 1000:.2f} TB/s on {r['device']}, "
                   f"jax {r['jax_version']}, {r['date'][:10]}.")
  tuned = [r for r in records if r["impl"] == "kivi2_fused_autotune"]
  if tuned:
    best = min(tuned, key=lambda r: r["median_us"])
    lines.append(f"Fused kernel config (autotuned at B={best['batch']}, L={best['seq_len']}): {best['config']}.")
  dense = [r for r in records if r["impl"] == "jkv_dense"]
  if dense:
    lines.append(f"jkv_dense config (the dense autotune of kernel_check_gpu.py on an H100): {dense[0]['config']}.")
  if any(r["impl"] in LAYOUTS for r in records):
    lines.append(f"{', '.join(LAYOUTS)}: the fused kernel on ZipCache's, OTT's and SpeCache's layouts at the fused "
                 f"config (kernel_decode.py's LAYOUTS); GB/s counts every array of the layout.")
  impls = [i for i in ("kivi2_fused", "kivi4_fused", *LAYOUTS, "dequant_then_attend", "jkv_dense", "cudnn_dense",
                       "xla_dense") if any(r["impl"] == i for r in records)]
  cells = {(r["impl"], r["batch"], r["seq_len"]): r for r in records}
  keys = sorted({(r["batch"], r["seq_len"]) for r in records if r["impl"] in impls})
  lines += ["", "| B | L | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
  for batch, seq_len in keys:
    row = [f"{cells[i, batch, seq_len]['median_us']:.1f} µs ({cells[i, batch, seq_len]['gbps']:.0f} GB/s)"
           if (i, batch, seq_len) in cells else "–" for i in impls]
    lines.append(f"| {batch} | {seq_len} | " + " | ".join(row) + " |")
  oriented = [(i, b, n) for i in ORIENTED for b, n in keys
              if all((f"{i}_{suffix}", b, n) in cells for suffix in ORIENTATIONS)]
  if oriented:
    lines += ["", "Tile orientation, forced each way in the same run (`--orientations`); the kernel's own choice "
              "(tokens_major=None) is tokens-major exactly when a store has holes:", "",
              "| impl | B | L | rows-major | tokens-major | tokens / rows |", "|---|---|---|---|---|---|"]
    for impl, batch, seq_len in oriented:
      rows_us, tokens_us = (cells[f"{impl}_{suffix}", batch, seq_len]["median_us"] for suffix in ORIENTATIONS)
      lines.append(f"| {impl} | {batch} | {seq_len} | {rows_us:.1f} µs | {tokens_us:.1f} µs | "
                   f"{tokens_us / rows_us:.2f} |")
  return "\n".join(lines)


def default_out(device) -> pathlib.Path:
  slug = re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")
  return HERE / "results" / f"kernel_decode_{slug}.json"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (any machine)")
  parser.add_argument("--out", type=pathlib.Path, help="results JSON (default: results/kernel_decode_<device>.json)")
  parser.add_argument("--append", action="store_true", help="merge into --out instead of overwriting it")
  parser.add_argument("--batches", type=int, nargs="+", help="override the batch sizes")
  parser.add_argument("--seq-lens", type=int, nargs="+", help="override the sequence lengths")
  parser.add_argument("--no-autotune", action="store_true", help="time the kernel's default config only")
  parser.add_argument("--orientations", action="store_true",
                      help="also time each fused implementation with each tile orientation forced")
  parser.add_argument("--autotune-shape", type=int, nargs=2, metavar=("B", "L"),
                      help="autotune at this batch and sequence length (default 8 32768)")
  parser.add_argument("--autotune-grid", nargs="+", metavar="BK,KS,W,S",
                      help="autotune these block_k,k_splits,num_warps,num_stages configs instead of the grid")
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  device = jax.devices()[0]
  out = args.out or default_out(device)
  if args.table:
    write_readme_section("kernel_decode", markdown_table(json.loads(out.read_text())),
                         "## Decode attention (`kernel_decode.py`)")
    print(f"wrote {README}")
    return
  settings = SMOKE if args.smoke else Settings()
  settings = dataclasses.replace(settings, batches=tuple(args.batches or settings.batches),
                                 seq_lens=tuple(args.seq_lens or settings.seq_lens))
  if args.autotune_shape:
    settings = dataclasses.replace(settings, autotune_shape=tuple(args.autotune_shape))
  if args.autotune_grid:
    grid = tuple(tuple(int(x) for x in item.split(",")) for item in args.autotune_grid)
    if any(len(config) != 4 for config in grid):
      raise SystemExit("--autotune-grid takes block_k,k_splits,num_warps,num_stages per config, e.g. 64,4,4,1")
    settings = dataclasses.replace(settings, autotune_grid=grid)
  if device.platform != "gpu" and not settings.interpret:
    raise SystemExit("the full benchmark needs a GPU; use --smoke elsewhere")

  check_fused_against_reference(settings, {}, dense=True)
  records = [copy_bandwidth(device, settings)]
  tuned = {}
  if not args.no_autotune:
    tuned, tune_records = autotune(device, settings)
    check_fused_against_reference(settings, tuned)
    records += tune_records
  records += sweep(device, settings, tuned, args.orientations)
  if args.append:
    records = merge_file(out, records, RECORD_KEY)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(records, indent=1) + "\n")
  print(f"\nwrote {out}\n\n{markdown_table(records)}")


if __name__ == "__main__":
  main()
