"""Inner loops for the fused KIVI decode kernel, measured against the library kernel and cuDNN (issue 9).

The library kernel (pallas_kernels/dequant_attention.py) unpacks a block of codes into one tile with a reshape,
and Nsight Compute found it bound by instruction issue at low occupancy (results/ncu_kivi2_fused_b8_l32768_h100.txt).
This script asks whether another inner loop, in Pallas' Triton lowering, does better. Every variant reads one
KIVI store (keys per channel in groups of V = 32 tokens, values per token in groups of 32 channels, fp16 scales),
is checked against ``decode_attention_reference`` on real quantized data with ragged lengths, then timed at B = 8,
L = 32768, 32/8 heads, D = 128, bf16, with the library kernel (store only, its tuned config) and cuDNN's dense
attention in the same run:

- ``lib``: the library's loop reduced to one store (contiguous blocks, reshape unpacking); ``lib_swap`` the same
  with both dots transposed (logits^T = K q^T, o^T += V^T p^T: the large dequantized tile as the left operand).
- group-offset variants: a block of ng key groups is visited by offset within the group; offset ``off`` is the
  tile of ng tokens {g V + off}, whose key words are one strided load and one shift (no reshape), with the
  block's key scale tile as is (softmax does not care about the order of tokens).
  ``rows``: values in the library's layout [C, D/Pv] (strided row loads, channel unpack with a reshape);
  ``tokens``: values packed along tokens [D, C/Pv] like keys, per-token scales folded into p (one dot per channel
  group) and zero-points a rank-1 term; ``tokens_deq``: values packed along tokens, the value tile dequantized
  whole; ``tokens_deq_swap``: that with the dots transposed. ``unroll`` unrolls the loop over offsets.

Commands (GPU; about 4 minutes each; on a CPU only the interpret-mode checks run):

    python benchmarks/kernel_inner_loops.py --variants rows tokens tokens_deq --unroll both
    python benchmarks/kernel_inner_loops.py --variants lib lib_swap tokens_deq_swap tokens_deq
    python benchmarks/kernel_inner_loops.py --table     # renders results/kernel_inner_loops_<device>.json

Findings are in benchmarks/README.md ("Inner loops tried").
"""

import argparse
import datetime
import functools
import itertools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jkv_kernels.attention_reference import MASK_VALUE
from jkv_kernels.dequant_attention import (QuantizedStore, _dot, decode_attention, decode_attention_reference,
                                           triton_compiler_params)
from jkv_kernels import quantization

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from records import save, write_readme_section  # noqa: E402

RECORD_KEY = lambda r: (r["run"], r["impl"], r.get("bits"), r.get("unroll"), str(r.get("config")))
VARIANTS = ("lib", "lib_swap", "rows", "tokens", "tokens_deq", "tokens_deq_swap")
CONFIGS = {  # (ng, splits, num_warps, num_stages)
    "lib": [(64, 16, 4, 1), (64, 16, 8, 1), (128, 16, 4, 1), (128, 16, 8, 1), (64, 8, 4, 2)],
    "group_offset": [(16, 16, 4, 1), (32, 16, 4, 1), (16, 16, 8, 1), (32, 16, 8, 2), (16, 32, 4, 2), (32, 8, 4, 1),
                     (64, 8, 4, 1)],
}

V = 32


def group_offset_kernel(layer_ref, bound_ref, q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, l_ref,
                        m_ref, *, ng, kbits, vbits, gv, blocks_per_split, sm_scale, variant, unroll):
  """Blocks of ng key groups of V tokens, visited by offset within the group (module docstring); one program
  writes the unnormalized partial (o [rows, D], l, m) of its blocks."""
  layer = layer_ref[0]
  rows, D = q_ref.shape
  q = q_ref[...]
  dt = q.dtype
  pk = 32 // kbits  # = 32 // vbits (``attend`` checks): keys and values share the word pattern
  kmask, vmask = jnp.uint32(2**kbits - 1), jnp.uint32(2**vbits - 1)
  bound = bound_ref[0]
  block = ng * V
  first = pl.program_id(2) * blocks_per_split
  n_blocks = jnp.clip((bound + block - 1) // block - first, 0, blocks_per_split)
  ncg = D // gv
  col = lax.broadcasted_iota(jnp.int32, (1, ng), 1) * V

  def block_body(i, carry):
    start = (first + i) * block
    groups = pl.ds(start // V, ng)
    ks = ks_ref[layer, :, groups].astype(jnp.float32)
    kz = kz_ref[layer, :, groups].astype(jnp.float32)

    def sub_body(sub, carry):
      words = pl.ds(start // pk + sub, ng, stride=V // pk)
      kw = kc_ref[layer, :, words]  # [D, ng]
      if variant == "tokens":
        vws = [vc_ref[layer, pl.ds(cg * gv, gv), words] for cg in range(ncg)]  # [gv, ng] each
      elif variant.startswith("tokens_deq"):
        vw = vc_ref[layer, :, words]  # [D, ng]

      def off_body(j, carry):
        o, m, l = carry
        off = sub * pk + j
        shift = (j * kbits).astype(jnp.uint32) if not isinstance(j, int) else jnp.uint32(j * kbits)
        k_hat = (quantization.codes_as_float32((kw >> shift) & kmask) * ks + kz).astype(dt)
        if variant == "tokens_deq_swap":
          s = _dot(k_hat, q, trans_a=True, trans_b=True) * sm_scale  # [ng, rows]
          valid_t = (V * lax.broadcasted_iota(jnp.int32, (ng, 1), 0) + (start + off)) < bound
          m_next = jnp.maximum(m, jnp.max(jnp.where(valid_t, s, MASK_VALUE), axis=0, keepdims=True))
          alpha = jnp.exp(m - m_next)
          p = jnp.where(valid_t, jnp.exp(s - m_next), 0.0)
          tokens = pl.ds(start + off, ng, stride=V)
          sv = jnp.swapaxes(vs_ref[layer, tokens, :].astype(jnp.float32), 0, 1)  # [ncg, ng]
          zv = jnp.swapaxes(vz_ref[layer, tokens, :].astype(jnp.float32), 0, 1)
          sv = jnp.broadcast_to(sv[:, None, :], (ncg, gv, ng)).reshape(D, ng)
          zv = jnp.broadcast_to(zv[:, None, :], (ncg, gv, ng)).reshape(D, ng)
          valid = (col + (start + off)) < bound
          v_hat = jnp.where(valid, quantization.codes_as_float32((vw >> shift) & vmask) * sv + zv, 0.0).astype(dt)
          return o * alpha + _dot(v_hat, p.astype(dt)), m_next, l * alpha + jnp.sum(p, axis=0, keepdims=True)
        s = _dot(q, k_hat) * sm_scale  # [rows, ng]
        valid = (col + (start + off)) < bound  # [1, ng]
        m_next = jnp.maximum(m, jnp.max(jnp.where(valid, s, MASK_VALUE), axis=1))
        alpha = jnp.exp(m - m_next)
        p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        tokens = pl.ds(start + off, ng, stride=V)
        if variant == "rows":
          v_hat = quantization.dequantize_packed_last_axis(
              vc_ref[layer, tokens, :], vs_ref[layer, tokens, :], vz_ref[layer, tokens, :], bits=vbits,
              group_size=gv, dtype=dt)  # [ng, D]
          v_hat = jnp.where(jnp.reshape(valid, (ng, 1)), v_hat, 0)
          o = o * alpha[:, None] + _dot(p.astype(dt), v_hat)
        elif variant == "tokens":
          new = []
          for cg in range(ncg):
            cv = quantization.codes_as_float32((vws[cg] >> shift) & vmask).astype(dt)
            sv = jnp.where(valid, jnp.reshape(vs_ref[layer, tokens, pl.ds(cg, 1)].astype(jnp.float32), (1, ng)), 0.0)
            zv = jnp.where(valid, jnp.reshape(vz_ref[layer, tokens, pl.ds(cg, 1)].astype(jnp.float32), (1, ng)), 0.0)
            o_cg = o[cg] * alpha[:, None] + _dot((p * sv).astype(dt), cv, trans_b=True)
            new.append(o_cg + jnp.sum(p * zv, axis=1)[:, None])
          o = tuple(new)
        else:  # tokens_deq: full dequantization of the value tile [D, ng]
          sv = jnp.swapaxes(vs_ref[layer, tokens, :].astype(jnp.float32), 0, 1)  # [ncg, ng]
          zv = jnp.swapaxes(vz_ref[layer, tokens, :].astype(jnp.float32), 0, 1)
          sv = jnp.broadcast_to(sv[:, None, :], (ncg, gv, ng)).reshape(D, ng)
          zv = jnp.broadcast_to(zv[:, None, :], (ncg, gv, ng)).reshape(D, ng)
          v_hat = jnp.where(valid, quantization.codes_as_float32((vw >> shift) & vmask) * sv + zv, 0.0).astype(dt)
          o = o * alpha[:, None] + _dot(p.astype(dt), v_hat, trans_b=True)
        return o, m_next, l

      if unroll:
        for j in range(pk):
          carry = off_body(j, carry)
        return carry
      return lax.fori_loop(0, pk, off_body, carry)

    return lax.fori_loop(0, V // pk, sub_body, carry)

  if variant == "tokens_deq_swap":
    o, m, l = lax.fori_loop(0, n_blocks, block_body, (
        jnp.zeros((D, rows), jnp.float32), jnp.full((1, rows), MASK_VALUE, jnp.float32),
        jnp.zeros((1, rows), jnp.float32)))
    o_ref[...] = o.T
    l_ref[...] = jnp.reshape(l, (rows,))
    m_ref[...] = jnp.reshape(m, (rows,))
    return
  if variant == "tokens":
    o0 = tuple(jnp.zeros((rows, gv), jnp.float32) for _ in range(ncg))
  else:
    o0 = jnp.zeros((rows, D), jnp.float32)
  o, m, l = lax.fori_loop(0, n_blocks, block_body, (o0, jnp.full((rows,), MASK_VALUE, jnp.float32),
                                                      jnp.zeros((rows,), jnp.float32)))
  if variant == "tokens":
    for cg in range(ncg):
      o_ref[:, pl.ds(cg * gv, gv)] = o[cg]
  else:
    o_ref[...] = o
  l_ref[...] = l
  m_ref[...] = m


def contiguous_kernel(layer_ref, bound_ref, q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, l_ref, m_ref,
               *, block, kbits, vbits, gk, gv, blocks_per_split, sm_scale, swap):
  """The library kernel's loop reduced to one store: contiguous blocks of ``block`` tokens unpacked with the
  library's reshape (``dequantize_packed_last_axis``). swap: logits^T = K q^T and o^T += V^T p^T, the large
  dequantized tile as the dots' left operand, instead of q K^T and p V."""
  layer = layer_ref[0]
  rows, D = q_ref.shape
  q = q_ref[...]
  dt = q.dtype
  pk = 32 // kbits
  bound = bound_ref[0]
  first = pl.program_id(2) * blocks_per_split
  n_blocks = jnp.clip((bound + block - 1) // block - first, 0, blocks_per_split)

  def body(i, carry):
    o, m, l = carry
    start = (first + i) * block
    groups = pl.ds(start // gk, max(1, block // gk))
    k_hat = quantization.dequantize_packed_last_axis(
        kc_ref[layer, :, pl.ds(start // pk, block // pk)], ks_ref[layer, :, groups], kz_ref[layer, :, groups],
        bits=kbits, group_size=gk, dtype=dt)  # [D, block]
    tokens = pl.ds(start, block)
    v_hat = quantization.dequantize_packed_last_axis(
        vc_ref[layer, tokens, :], vs_ref[layer, tokens, :], vz_ref[layer, tokens, :], bits=vbits, group_size=gv,
        dtype=dt)  # [block, D]
    if swap:
      s = _dot(k_hat, q, trans_a=True, trans_b=True) * sm_scale  # [block, rows]
      valid = (start + lax.broadcasted_iota(jnp.int32, (block, 1), 0)) < bound
      m_next = jnp.maximum(m, jnp.max(jnp.where(valid, s, MASK_VALUE), axis=0, keepdims=True))  # [1, rows]
      alpha = jnp.exp(m - m_next)
      p = jnp.where(valid, jnp.exp(s - m_next), 0.0)
      v_hat = jnp.where(valid, v_hat, 0)
      o = o * alpha + _dot(v_hat, p.astype(dt), trans_a=True)  # [D, rows]
      return o, m_next, l * alpha + jnp.sum(p, axis=0, keepdims=True)
    s = _dot(q, k_hat) * sm_scale  # [rows, block]
    valid = (start + lax.broadcasted_iota(jnp.int32, (1, block), 1)) < bound
    m_next = jnp.maximum(m, jnp.max(jnp.where(valid, s, MASK_VALUE), axis=1, keepdims=True))  # [rows, 1]
    alpha = jnp.exp(m - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next), 0.0)
    v_hat = jnp.where(jnp.reshape(valid, (block, 1)), v_hat, 0)
    o = o * alpha + _dot(p.astype(dt), v_hat)
    return o, m_next, l * alpha + jnp.sum(p, axis=1, keepdims=True)

  if swap:
    init = (jnp.zeros((D, rows), jnp.float32), jnp.full((1, rows), MASK_VALUE, jnp.float32),
            jnp.zeros((1, rows), jnp.float32))
  else:
    init = (jnp.zeros((rows, D), jnp.float32), jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
  o, m, l = lax.fori_loop(0, n_blocks, body, init)
  o_ref[...] = o.T if swap else o
  l_ref[...] = jnp.reshape(l, (rows,))
  m_ref[...] = jnp.reshape(m, (rows,))


@functools.partial(jax.jit, static_argnames=["kbits", "vbits", "gv", "ng", "splits", "num_warps", "num_stages",
                                             "variant", "interpret", "unroll"])
def attend(q, layer, kc, ks, kz, vc, vs, vz, length, *, kbits, vbits, gv, ng, splits, num_warps, num_stages,
           variant, interpret=False, unroll=False):
  """One variant's decode attention of q [B, H, 1, g, D] over one store (stacked [1, B, H, ...] arrays, key groups
  of V tokens, values in the variant's layout) holding ``length`` [B] tokens -> o [B, H, 1, g, D].

  ng: key groups per block (group-offset variants) or tokens per block (``lib*``); splits: programs per (b, h).
  """
  if kbits != vbits and not variant.startswith("lib"):
    raise ValueError(f"the group-offset variants read keys and values with one word pattern: kbits {kbits} must "
                     f"equal vbits {vbits}")
  B, H, T, g, D = q.shape
  Lyr = kc.shape[0]
  C = vs.shape[3]
  rows = 16
  n = T * g
  q_rows = jnp.pad(q.reshape(B, H, n, D), ((0, 0), (0, 0), (0, rows - n), (0, 0)))
  lib = variant.startswith("lib")
  block = ng if lib else ng * V
  n_blocks = -(-C // block)
  bps = -(-n_blocks // splits)
  splits = -(-n_blocks // bps)
  bounds = jnp.broadcast_to(jnp.clip(length, 0, C)[:, None, None], (B, H, 1)).astype(jnp.int32)
  whole = lambda a: pl.BlockSpec((Lyr, None, None, *a.shape[3:]), lambda b, h, s: (0, b, h) + (0,) * (a.ndim - 3))
  arrays = [kc, ks, kz, vc, vs, vz]
  o, l, m = pl.pallas_call(
      functools.partial(contiguous_kernel, block=block, kbits=kbits, vbits=vbits, gk=V, gv=gv, blocks_per_split=bps,
                        sm_scale=D**-0.5, swap=variant == "lib_swap") if lib else
      functools.partial(group_offset_kernel, ng=ng, kbits=kbits, vbits=vbits, gv=gv, blocks_per_split=bps,
                        sm_scale=D**-0.5, variant=variant, unroll=unroll),
      grid=(B, H, splits),
      in_specs=[pl.BlockSpec((1,), lambda b, h, s: (0,)),
                pl.BlockSpec((None, None, 1), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((None, None, rows, D), lambda b, h, s: (b, h, 0, 0))] + [whole(a) for a in arrays],
      out_specs=[pl.BlockSpec((None, None, None, rows, D), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((B, H, splits, rows, D), jnp.float32),
                 jax.ShapeDtypeStruct((B, H, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((B, H, splits, rows), jnp.float32)],
      compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), bounds, q_rows, *arrays)
  o, l, m = o[:, :, :, :n], l[:, :, :, :n], m[:, :, :, :n]
  m_all = jnp.max(m, axis=2)
  alpha = jnp.exp(m - m_all[:, :, None])
  l_all = jnp.sum(alpha * l, axis=2)
  o = jnp.sum(alpha[..., None] * o, axis=2) / l_all[..., None]
  return o.reshape(q.shape).astype(q.dtype)


def to_token_packed(v_codes, bits):
  """Value codes [L, B, H, C, D/Pv] packed along channels -> [L, B, H, D, C/Pv] packed along tokens."""
  codes = quantization.unpack(v_codes, bits=bits, axis=4)  # [L, B, H, C, D]
  return quantization.pack(jnp.swapaxes(codes, 3, 4), bits=bits, axis=4)


def make_inputs(B, C, bits, seed, *, data=False, H=8, g=4, D=128, gv=32):
  """(q, k codes, k scale, k zero, v codes, v scale, v zero, length) of one stacked store of C tokens holding
  C - 128. data: real keys and values quantized and packed (for the checks); else random words and scales (as
  fast to build as it gets, and every word is valid at any width)."""
  kq, kk, kv, km = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, H, 1, g, D), jnp.bfloat16)
  lead = (1, B, H)
  if data:
    kc, ks, kz = quantization.quantize(jax.random.normal(kk, (*lead, D, C)), bits=bits, axis=4, group_size=V)
    vc, vs, vz = quantization.quantize(jax.random.normal(kv, (*lead, C, D)), bits=bits, axis=4, group_size=gv)
    kc, vc = quantization.pack(kc, bits=bits, axis=4), quantization.pack(vc, bits=bits, axis=4)
  else:
    kc = jax.random.bits(kk, (*lead, D, C * bits // 32), jnp.uint32)
    vc = jax.random.bits(kv, (*lead, C, D * bits // 32), jnp.uint32)
    meta = lambda k, shape: jax.random.uniform(k, shape, jnp.float16, 0.01, 0.1)
    k1, k2, k3, k4 = jax.random.split(km, 4)
    ks, kz = meta(k1, (*lead, D, C // V)), meta(k2, (*lead, D, C // V))
    vs, vz = meta(k3, (*lead, C, D // gv)), meta(k4, (*lead, C, D // gv))
  return q, kc, ks, kz, vc, vs, vz, jnp.full((B,), C - 128, jnp.int32)


def for_variant(inputs, variant, bits):
  """The inputs with the value codes in the variant's layout."""
  if variant in ("lib", "lib_swap", "rows"):
    return inputs
  return (*inputs[:4], to_token_packed(inputs[4], bits), *inputs[5:])


def median_us(fn, sets, reps=20, calls=10):
  """Median µs per call of back-to-back calls rotating through the input sets (after one warm-up call each)."""
  for inputs in sets:
    jax.block_until_ready(fn(*inputs))
  per_call, rotation = [], itertools.cycle(sets)
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready([fn(*next(rotation)) for _ in range(calls)])
    per_call.append((time.perf_counter() - start) / calls)
  return statistics.median(per_call) * 1e6


def check(variants, unrolls, interpret):
  """Every variant against the reference on real quantized data, two sequences of ragged lengths."""
  for bits in ((2,) if interpret else (2, 4, 1)):
    inputs = make_inputs(2, 1024, bits, 1, data=True, H=2 if interpret else 8)
    q, kc, ks, kz, vc, vs, vz, _ = inputs
    length = jnp.array([1024 - 100, 1024 // 2 + 7], jnp.int32)
    store = QuantizedStore(kc, ks, kz, vc, vs, vz, length, k_bits=bits, v_bits=bits, k_group=V, v_group=32)
    ref = np.asarray(decode_attention_reference(q, 0, (store,)), np.float64)
    for variant, unroll in itertools.product(variants, unrolls):
      args = for_variant((*inputs[:7], length), variant, bits)
      got = np.asarray(attend(args[0], 0, *args[1:], kbits=bits, vbits=bits, gv=32,
                              ng=64 if variant.startswith("lib") else 16, splits=2, num_warps=4, num_stages=1,
                              variant=variant, unroll=unroll, interpret=interpret), np.float64)
      error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
      print(f"check {bits}-bit {variant} unroll={unroll}: relative error {error:.2e}", flush=True)
      if not error < 2e-2:
        raise SystemExit(f"{variant} (unroll={unroll}) disagrees with the reference at {bits} bits: {error}")


def run(variants, unrolls, seconds, out):
  device = jax.devices()[0]
  B, L = 8, 32768
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  base = {"run": stamp, "batch": B, "seq_len": L, "device": device.device_kind, "jax_version": jax.__version__,
          "date": stamp}
  records = []

  def keep(impl, us, **fields):
    records.append({**base, "impl": impl, "median_us": round(us, 2), **fields})
    save(out, records[-1:], RECORD_KEY)
    print(f"{impl} {fields}: {us:.1f} µs", flush=True)

  sets = {bits: [make_inputs(B, L, bits, seed) for seed in range(3)] for bits in (2, 4, 1)}
  dkeys = jax.random.split(jax.random.key(9), 3)
  dense = [(jax.random.normal(dkeys[0], (B, 1, 32, 128), jnp.bfloat16),
            jax.random.normal(jax.random.fold_in(dkeys[1], s), (B, L, 8, 128), jnp.bfloat16),
            jax.random.normal(jax.random.fold_in(dkeys[2], s), (B, L, 8, 128), jnp.bfloat16)) for s in range(3)]
  keep("cudnn_dense", median_us(jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn")),
                                dense))
  library = jax.jit(lambda q, kc, ks, kz, vc, vs, vz, length: decode_attention(
      q, 0, (QuantizedStore(kc, ks, kz, vc, vs, vz, length, k_bits=2, v_bits=2, k_group=V, v_group=32),),
      block_k=64, k_splits=16, num_warps=4, num_stages=1))
  keep("library_kivi2", median_us(library, sets[2]), bits=2)

  best = {}
  deadline = time.perf_counter() + seconds
  for variant, unroll in itertools.product(variants, unrolls):
    for ng, splits, warps, stages in CONFIGS["lib" if variant.startswith("lib") else "group_offset"]:
      if time.perf_counter() > deadline:
        break
      config = dict(ng=ng, splits=splits, num_warps=warps, num_stages=stages)
      fn = jax.jit(functools.partial(attend, kbits=2, vbits=2, gv=32, variant=variant, unroll=unroll, **config))
      call = lambda q, *rest: fn(q, 0, *rest)
      try:
        us = median_us(call, [for_variant(s, variant, 2) for s in sets[2]], reps=10)
      except Exception as error:  # a config the compiler rejects is skipped, not fatal
        print(f"{variant} {config} failed: {type(error).__name__}: {str(error)[:300]}")
        continue
      keep(variant, us, bits=2, unroll=unroll, config=config)
      if (variant, unroll) not in best or us < best[variant, unroll][0]:
        best[variant, unroll] = (us, config)
  for (variant, unroll), (_, config) in sorted(best.items(), key=lambda kv: kv[1][0])[:3]:
    for bits in (4, 1):
      fn = jax.jit(functools.partial(attend, kbits=bits, vbits=bits, gv=32, variant=variant, unroll=unroll, **config))
      call = lambda q, *rest: fn(q, 0, *rest)
      keep(variant, median_us(call, [for_variant(s, variant, bits) for s in sets[bits]]), bits=bits,
           unroll=unroll, config=config)


def markdown_table(records) -> str:
  """Per run: cuDNN and the library kernel, then each variant's best config at each width, as a ratio to both."""
  lines = []
  for run_id in sorted({r["run"] for r in records}):
    rows = [r for r in records if r["run"] == run_id]
    ref = {r["impl"]: r["median_us"] for r in rows if "config" not in r}
    lines += [f"Run {run_id} on {rows[0]['device']}, jax {rows[0]['jax_version']}, B = 8, L = 32768 "
              f"(cuDNN dense {ref['cudnn_dense']:.1f} µs, library KIVI-2 kernel {ref['library_kivi2']:.1f} µs):", "",
              "| variant | unroll | bits | best config (ng, splits, warps, stages) | µs | vs library KIVI-2 | "
              "vs cuDNN |", "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    best = {}
    for r in rows:
      if "config" in r:
        key = (r["impl"], r["unroll"], r["bits"])
        if key not in best or r["median_us"] < best[key]["median_us"]:
          best[key] = r
    for (impl, unroll, bits), r in sorted(best.items(), key=lambda kv: (kv[0][2] != 2, kv[1]["median_us"])):
      c = r["config"]
      lines.append(f"| {impl} | {unroll} | {bits} | {c['ng']}, {c['splits']}, {c['num_warps']}, {c['num_stages']} | "
                   f"{r['median_us']:.1f} | {r['median_us'] / ref['library_kivi2']:.2f}x | "
                   f"{r['median_us'] / ref['cudnn_dense']:.2f}x |")
    lines.append("")
  return "\n".join(lines).rstrip()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
  parser.add_argument("--unroll", choices=["no", "yes", "both"], default="no",
                      help="unroll the loop over offsets (group-offset variants; compiles slowly)")
  parser.add_argument("--seconds", type=float, default=300, help="stop starting new timings after this long")
  parser.add_argument("--out", type=pathlib.Path)
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  slug = jax.devices()[0].device_kind.lower().replace(" ", "_")
  out = args.out or HERE / "results" / f"kernel_inner_loops_{slug}.json"
  if args.table:
    write_readme_section("kernel_inner_loops", markdown_table(json.loads(out.read_text())),
                         "### Inner loops tried (`kernel_inner_loops.py`)")
    return
  unrolls = {"no": (False,), "yes": (True,), "both": (False, True)}[args.unroll]
  interpret = jax.default_backend() != "gpu"
  check(args.variants, (False,) if interpret else unrolls, interpret)
  if not interpret:
    run(args.variants, unrolls, args.seconds, out)


if __name__ == "__main__":
  main()
