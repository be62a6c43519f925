"""Decode attention over a low-bit KIVI store on Hopper tensor cores (Pallas, Mosaic GPU lowering).

The Hopper decode kernel of docs/kernels.md, for one store in the MMA-ready packing (``mma_layout.py``): codes
become fp16 operands in registers with one three-input logic op and one fused multiply-add per two codes (and a
shift per few words), and both products run on warp-level ``mma.sync`` m16n8k16, each warp over its own 16 tokens
of a tile:

    logits^T [16 tokens, N]   = K_hat [16, D] (registers)               @ q^T [D, N] (registers)
    o_w^T    [D channels, N] += V_hat^T [D, the warp's 16 tokens] (registers) @ p^T [16 tokens, N] (registers)

with the query rows of a KV head (T * g <= 16, padded to 8 or 16) as the N side, so K and V are read once per KV
head. No operand comes from shared memory: q's B fragments are loaded once a step (laid out once a program, from
q's rows, so that a warp's loads are contiguous: ``_build_q_fragments``), and p, the warp's own logits after the
softmax, becomes the value product's B fragment with one ``movmatrix`` transpose per 8 x 8 block. Each warp keeps
its own running max, sum and o, so a step waits on no other warp (the warpgroup's ``wgmma`` needed p in shared
memory and a cross-warp max behind barriers every step: docs/experiments.md); the four warps'
partials are merged once, at the end (``_sum_into``, in a fixed order).
A register pair is ``((word >> shift) & mask) | magic``: the code c sits in the mantissa of the fp16 number
M = ``magic`` at a bit worth exactly 1 (``mma_layout.field_plan``, ``magic_half``: M at most 16), so the
pair reads as M + c, and ``(M + c) * scale + (zero - M * scale)`` is one ``fma.rn.f16x2`` with the scale and
folded zero pair (the packing stores z - M s) the thread reads once per tile: c s + z, rounded once. The key group
is per channel (the pair's two channels), the value group per token (the pair's two tokens), so one pair of scale
words serves a pair of codes either way. The store's products run in fp16 whatever the model's type (the packing
holds fp16 scales; q is rounded to fp16, p is fp16).

Grid (Hkv, B, splits): each program walks ``tiles`` tiles of 64 tokens of one (sequence, KV head) through a TMA
pipeline (codes, key scales, value scales in shared memory, ``max_concurrent_steps`` deep), runs an online softmax
per warp over its tokens (rows of the logits, reduced across the warp's lanes), and writes its partial (o, l, m) in
fp32 with m in log2 units; a few jnp lines merge the partials exactly. Tokens at and past ``length[b]`` are
masked; a split whose first token is at or past the length reads nothing (its partial is empty), and a step past
it re-reads a block from L2 and computes nothing, so a cache filled to a fraction of its capacity costs about that
fraction (at the granularity of a step).

A full-precision segment (KIVI's window: the newest tokens, exact) joins the last split's softmax after its share
of the store (the program's merged partial starts it): tiles of 64 of its keys and values go through a second TMA
pipeline, ``segment_depth`` slots deep, into swizzled shared memory and are the A operands of the warpgroup's
``wgmma`` from there (the values transposed), in the segment's own 16-bit type, with a mask per (token, query row)
beside them; rows of the neighbouring head that a tile starts on are masked out.

A store with holes (``MmaStore.valid``) brings a byte per slot (two in one-tile steps: ``hole_dtype``) through the
same pipeline, and each thread masks its tokens' logits with its two slots of a tile. A value channel scale factors
out of the sum over tokens: it multiplies the store's part of o once, as the warps' partials are merged, before a
segment's values join it.

With ``logit_rows`` the kernel also writes out the store's slot weights of those query rows: p as the value
product takes it (fp16) and each warp's running max per step, 2 bytes a slot and query head rather than a 4-byte
logit (through two steps' slots of shared memory, TMA stores per step), and the segment's likewise, from which
``jkv.attention.decode_attention`` makes the token mass of SpeCache's top-k (``slot_probabilities``).

Several stores (ZipCache's pools, each of its own widths) go in one launch: each program reads one store's share,
the programs shared among the stores by their tiles times a tile's time at each width (``pool_splits``).

Scope of this version: stores of 1-, 2-, 4- or 8-bit keys and values (slot weights of one store), at most one
segment, D a multiple of 64, T * g <= 16.
``decode_attention_reference`` on the store the packing came from (and the segment) is the reference.
"""

import functools
import inspect
import math
from typing import Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from jkv_kernels.attention_reference import MASK_VALUE
from jkv_kernels.mma_layout import (META_DTYPE, TILE, THREADS, MmaStore, field_plan, load_vector, magic_half,
                                   register_slots, words_per_thread)

try:  # Mosaic GPU's Python API (jax >= 0.11 is where this kernel is built and measured)
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic import gpu as mgpu
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
except ImportError:  # pragma: no cover - an older jax: the kernel is unavailable, the module still imports
  plgpu = mgpu = None

SHARED_PER_SM = 228 * 1024  # shared memory of a Hopper SM (H100, H200)
STAGES = 2      # the default pipeline depth (mgpu_decode_attention's max_concurrent_steps: measured there)
# Programs of 128 threads an SM runs at once, by registers (64K an SM): 168 a thread allow 3 (ptxas on an H100:
# KIVI-2 140, with a segment 144; KIVI-4 139, 142), fewer where shared memory does not fit (splits count
# on the fit). At B = 8, L = 32768 KIVI-2 takes 6 splits, all 384 programs at once.
PROGRAMS_PER_SM = 3
ROWS = 16       # the most query rows of a KV head; the N of a segment's value product (the smallest swizzle)
# Below the softmax's running max for a row with no valid key yet: exp2(MASK_VALUE - M_FLOOR) is 0, so masked
# logits need no second mask on p, and a split with no valid key leaves (m, l) = (M_FLOOR, 0).
M_FLOOR = MASK_VALUE / 2
LOG2E = 1.4426950408889634


def programs_per_sm(n_rows: int) -> int:
  """The programs an SM is given at once for ``n_rows`` query rows of a KV head (T * g), at most ``PROGRAMS_PER_SM``.
  Measured, not derived (one H200, B = 1, KIVI-2, the kernel alone, ``mgpu_decode.py --kv-heads``): 4 rows run
  best 3 to an SM (L = 262,144, 8 KV heads: 87.0 µs at 392 programs, 101.6 at 528); 8 rows 2 (L = 524,288, 4 KV
  heads: 98.2 µs at 264 programs, 171.8 at 392), though 4 and 8 rows compile to one kernel width; 16 rows 1
  (L = 1,048,576, 2 KV heads: 131.9 µs at 132 programs, 153.3 at 264, 263.5 at 396)."""
  return PROGRAMS_PER_SM if n_rows <= 4 else 2 if n_rows <= 8 else 1


# jax 0.10's plgpu.load takes the index as an argument; 0.11 deprecates it for ``ref.at[...]``.
_LOAD_TAKES_INDEX = (plgpu is not None
                     and inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty)


def _load(ref, **kwargs):
  """``plgpu.load`` of a whole ref, on either jax."""
  return plgpu.load(ref, (), **kwargs) if _LOAD_TAKES_INDEX else plgpu.load(ref, **kwargs)


def available() -> bool:
  """Whether this jax has the Mosaic GPU API the kernel is written against."""
  return plgpu is not None and hasattr(plgpu, "inline_mgpu")


# ----------------------------------------------------------------------------------------------------------------
# Registers from packed words (Mosaic GPU level, inside ``plgpu.inline_mgpu``)


def _i32():
  return ir.IntegerType.get_signless(32)


def _index(value):
  return arith.index_cast(ir.IndexType.get(), value)


def _load_words(ref, start, count, lead=()):
  """``count`` consecutive 32-bit words of a shared-memory ref [..., rows, width] from word ``start`` (an i32
  value) of its flattened last two axes (``lead``: i32 indices of the axes before), as i32 values, in loads of up
  to 16 bytes (never across a row: starts and counts are multiples of 4, widths of 64)."""
  words, vec = [], min(4, count)
  width = mgpu.utils.c(ir.MemRefType(ref.type).shape[-1], _i32())
  for k in range(0, count, vec):
    at = arith.addi(start, mgpu.utils.c(k, _i32()))
    loaded = vector.load(ir.VectorType.get((vec,), _i32()), ref,
                         [*map(_index, lead), _index(arith.divui(at, width)), _index(arith.remui(at, width))])
    words += [vector.extract(loaded, dynamic_position=[], static_position=[i]) for i in range(vec)]
  return words


def _quad_words(ref, base, quad, count, lead=()):
  """The ``count`` meta words of a thread of quad ``quad`` in the block at word ``base`` (i32 values), at
  ``mma_layout.quad_word_position``: 16-byte loads, the four quads of a warp in different banks."""
  words = []
  for chunk in range(count // 4):
    at = arith.addi(base, arith.addi(mgpu.utils.c(16 * chunk, _i32()), arith.muli(quad, mgpu.utils.c(4, _i32()))))
    words += _load_words(ref, at, 4, lead)
  return words


def _dequantized_pair(word, offset, bits, scale, zero):
  """Two fp16 lanes ``code * scale + zero`` from the field at bit ``offset`` of both halves of ``word``: one
  three-input logic op gives M + c in each lane (``mma_layout.magic_half``), one fused multiply-add with the
  packing's z' = z - M s gives (M + c) s + z - M s (one PTX block)."""
  magic = magic_half(offset) * 0x00010001
  mask = (((1 << bits) - 1) << offset) * 0x00010001
  asm = (f"{{ .reg .b32 t, m; mov.b32 m, {magic:#x}; lop3.b32 t, $1, {mask:#x}, m, 0xea;"
         f" fma.rn.f16x2 $0, t, $2, $3; }}")
  pair = llvm.inline_asm(_i32(), [word, scale, zero], asm, "=r,r,r,r")
  return mgpu.utils.bitcast(pair, ir.VectorType.get((2,), ir.F16Type.get()))


def _register_source(words, bits, registers):
  """rho -> (the word holding register rho, shifted as ``field_plan`` says, and the field's offset), for a thread
  of ``registers`` registers in ``register_slots``' places; each shift computed once per word."""
  plan, fields, shifted = field_plan(bits), 16 // bits, {}
  slots = register_slots(bits, registers)

  def source(rho):
    index, (shift, offset) = slots[rho] // fields, plan[slots[rho] % fields]
    if (index, shift) not in shifted:
      word, amount = words[index], mgpu.utils.c(abs(shift), _i32())
      shifted[index, shift] = word if not shift else (arith.shrui if shift > 0 else arith.shli)(word, amount)
    return shifted[index, shift], offset
  return source


def _thread():
  """(warp, lane, index) of this thread within its warpgroup, as i32 values."""
  tau = arith.remui(mgpu.utils.thread_idx(), mgpu.utils.c(THREADS, _i32()))
  return arith.divui(tau, mgpu.utils.c(32, _i32())), arith.remui(tau, mgpu.utils.c(32, _i32())), tau


def _this_threads_code_words(codes_ref, tile, bits, head_dim, tau):
  """The thread's words of tile ``tile`` (static) of a [tiles, rows, width] ref."""
  vec = load_vector(bits, head_dim)
  words = []
  for k0 in range(0, words_per_thread(bits, head_dim), vec):
    start = arith.addi(mgpu.utils.c(k0 * THREADS, _i32()), arith.muli(tau, mgpu.utils.c(vec, _i32())))
    words += _load_words(codes_ref, start, vec, lead=(mgpu.utils.c(tile, _i32()),))
  return words


def _pad_columns(p, rows):
  """A [64, ROWS] WGMMA-layout array of p [64, rows] (rows = 8) and zero columns: a segment's value product's B
  is 16 wide (an MN-major operand takes no narrower swizzle) while the logits and softmax are 8 wide."""
  registers = p.registers
  padded = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((TILE, ROWS)), dtype=object)
  zero = arith.constant(registers.flat[0].type, ir.DenseElementsAttr.get_splat(
      registers.flat[0].type, ir.FloatAttr.get(ir.VectorType(registers.flat[0].type).element_type, 0.0)))
  for j in range(ROWS // 8):
    padded[:, j] = registers[:, 0] if j < rows // 8 else zero
  return mgpu.FragmentedArray(_registers=padded, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)


def _store_columns(ref, x, first, count, *, maxima=False):
  """Columns [first, first + count) of x [64, N] (WGMMA layout) into ``ref``, the pairs each thread holds there
  (columns 8 j + 2 (l % 4), +1 of rows 16 w + l // 4, +8); ``first`` and ``count`` even. ``ref`` [n, W] holds
  [64, count] row-major (n W = 64 count); with ``maxima`` ([4, count]) only row 16 w, as row w: x is the same
  in all of a warp's rows (a warp's column maxima)."""
  warp, lane, _ = _thread()
  c = lambda value: mgpu.utils.c(value, _i32())
  width = ir.MemRefType(ref.type).shape[-1]
  pair_column = arith.muli(arith.remui(lane, c(4)), c(2))
  top_row = warp if maxima else arith.addi(arith.muli(warp, c(16)), arith.divui(lane, c(4)))
  for j in range(x.registers.shape[1]):
    column = arith.addi(pair_column, c(8 * j - first))
    inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, column, c(0)),
                        arith.cmpi(arith.CmpIPredicate.slt, column, c(count)))
    if maxima:
      inside = arith.andi(inside, arith.cmpi(arith.CmpIPredicate.ult, lane, c(4)))
    with mgpu.utils.when(inside):
      for h in range(1 if maxima else 2):
        at = arith.addi(arith.muli(arith.addi(top_row, c(8 * h)), c(count)), column)
        vector.store(_register(x, j, h), ref, [_index(arith.divui(at, c(width))), _index(arith.remui(at, c(width)))])


def logit_columns(t_rows: int, q_per_kv: int, logit_rows, rows: int) -> Optional[tuple[int, int]]:
  """(first, count): the kernel's columns whose slot weights it writes out for query rows ``logit_rows`` (row
  t's heads are columns t g .. t g + g - 1), where they are one run that starts on an even column and whose
  maxima (fp32, a warp's count) fill whole 16-byte TMA rows; else all ``rows`` columns (None without
  ``logit_rows``)."""
  if not logit_rows:
    return None
  if any(not 0 <= t < t_rows for t in logit_rows):
    raise ValueError(f"logit_rows {logit_rows} must be query rows in [0, {t_rows})")
  first, count = min(logit_rows) * q_per_kv, len(set(logit_rows)) * q_per_kv
  contiguous = sorted(set(logit_rows)) == list(range(min(logit_rows), max(logit_rows) + 1))
  return (first, count) if contiguous and first % 2 == 0 and count % 4 == 0 else (0, rows)


def _wgmma_array(pairs, rows_by_cols):
  """A [64, cols] FragmentedArray in the WGMMA layout from its registers ``pairs[(j, h)]``."""
  registers = mgpu.WGMMA_LAYOUT.registers_shape(rows_by_cols)
  regs = np.empty(registers, dtype=object)
  for (j, h), pair in pairs.items():
    regs[0, j, 0, 0, h, 0, 0, 0, 0] = pair
  return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)


def _mma(a, b, c):
  """``mma.sync`` m16n8k16 of fp16 operands with fp32 accumulation: a, b, c lists of 4 i32, 2 i32, 4 f32 values
  (the PTX ISA's fragments) -> the 4 f32 values of c + a @ b."""
  f32 = ir.F32Type.get()
  asm = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
         "{$10,$11,$12,$13};")
  out = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), [*a, *b, *c], asm,
                        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
  return [llvm.extractvalue(f32, out, [k]) for k in range(4)]


def _transposed(pair):
  """``movmatrix`` m8n8 .trans: the warp's 8x8 16-bit matrix held one register a lane (lane l: row l // 4,
  columns 2 (l % 4), + 1) -> its transpose, held the same way."""
  return llvm.inline_asm(_i32(), [pair], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")


def _f32_pair(register):
  """A vector<2xf32> register -> its two f32 values."""
  return [vector.extract(register, dynamic_position=[], static_position=[e]) for e in range(2)]


def _f32_register(values):
  f32 = ir.F32Type.get()
  register = llvm.mlir_undef(ir.VectorType.get((2,), f32))
  for e, value in enumerate(values):
    register = vector.insert(value, register, dynamic_position=[], static_position=[e])
  return register


def _register(x, j, h):
  """Register (column block j, row half h) of a WGMMA-layout array: rows 16 w + l // 4 + 8 h, columns
  8 j + 2 (l % 4), + 1 of warp w's lane l."""
  return x.registers[0, j, 0, 0, h, 0, 0, 0, 0]


def q_word_count(rows: int, head_dim: int) -> int:
  """The words of q a thread holds as ``mma.sync`` B fragments: two per block of 16 channels and of 8 rows."""
  return rows // 8 * head_dim // 16 * 2


def _build_q_fragments(rows_ref, words_ref, *, rows, head_dim):
  """Lane l's B-fragment words of q^T, from q's rows [T g, D] (fp16 or bf16, rounded to fp16) in shared memory
  into ``words_ref`` [words / 4, 128] uint32 in shared memory, where ``_q_fragments`` reads them: word
  2 (jn D / 16 + kappa) + half of lane l holds rows 8 jn + l // 4, channels 16 kappa + 8 half + 2 (l % 4), + 1
  (0 for a row past T g), and lane l's words 4 c .. 4 c + 3 sit at [c, 4 l ..] (a warp's 16-byte load of chunk c
  reads 512 contiguous bytes). Every warp writes the same words, and each thread later reads only its own."""
  _, lane, _ = _thread()
  c = lambda value: mgpu.utils.c(value, _i32())
  n_rows = ir.MemRefType(rows_ref.type).shape[0]
  element = ir.MemRefType(rows_ref.type).element_type
  f16 = ir.F16Type.get()
  row_in_block, channel_in_block = arith.divui(lane, c(4)), arith.muli(arith.remui(lane, c(4)), c(2))
  count = q_word_count(rows, head_dim)
  for chunk in range(count // 4):
    words = []
    for k in range(4):
      word = 4 * chunk + k
      jn, kappa, half = word // (2 * head_dim // 16), word // 2 % (head_dim // 16), word % 2
      row = arith.addi(row_in_block, c(8 * jn))
      inside = arith.cmpi(arith.CmpIPredicate.slt, row, c(n_rows))
      pair = vector.load(ir.VectorType.get((2,), element), rows_ref,
                         [_index(arith.minui(row, c(n_rows - 1))),
                          _index(arith.addi(channel_in_block, c(16 * kappa + 8 * half)))])
      if element != f16:
        wide = arith.extf(ir.VectorType.get((2,), ir.F32Type.get()), pair)
        pair = arith.truncf(ir.VectorType.get((2,), f16), wide)  # round to nearest, as astype does
      words.append(arith.select(inside, mgpu.utils.bitcast(pair, _i32()), c(0)))
    vector_words = llvm.mlir_undef(ir.VectorType.get((4,), _i32()))
    for k, value in enumerate(words):
      vector_words = vector.insert(value, vector_words, dynamic_position=[], static_position=[k])
    vector.store(vector_words, words_ref, [_index(c(chunk)), _index(arith.muli(lane, c(4)))])


def _q_fragments(q_ref, rows, head_dim):
  """The thread's B-fragment words of q^T (``_build_q_fragments``' layout in shared memory) as a [64, 2 words]
  float32 WGMMA-layout array (word 2 (2 j + h) + e in register (j, h), lane e), bit for bit."""
  _, lane, _ = _thread()
  count = q_word_count(rows, head_dim)
  words = []
  for chunk in range(count // 4):
    loaded = vector.load(ir.VectorType.get((4,), _i32()), q_ref,
                         [_index(mgpu.utils.c(chunk, _i32())), _index(arith.muli(lane, mgpu.utils.c(4, _i32())))])
    words += [vector.extract(loaded, dynamic_position=[], static_position=[k]) for k in range(4)]
  f32 = ir.F32Type.get()
  pairs = {(w // 4, w // 2 % 2): _f32_register([arith.bitcast(f32, words[w]), arith.bitcast(f32, words[w + 1])])
           for w in range(0, count, 2)}
  return _wgmma_array(pairs, (TILE, 2 * count))


def _fragment_words(q_frags):
  """Inverse of ``_q_fragments``' packing: the i32 words."""
  words = []
  for j in range(q_frags.registers.shape[1]):
    for h in range(2):
      words += [arith.bitcast(_i32(), x) for x in _f32_pair(_register(q_frags, j, h))]
  return words


def _key_logits(codes_ref, meta_ref, q_frags, *, tile, step_tiles, bits, head_dim, group, rows):
  """Logits^T [64 tokens, rows] of tile ``tile`` of a step (WGMMA layout, which is ``mma.sync``'s C layout per
  warp): each warp's 16 tokens against q^T, its dequantized keys the A operands (the registers of 16 channels),
  q's fragments the B operands, over two accumulators (even and odd blocks of channels) so that half as many
  products wait on each other.

  The step's key scale block holds its groups (G <= 64 * step_tiles) or the one group it lies in."""
  warp, lane, tau = _thread()
  source = _register_source(_this_threads_code_words(codes_ref, tile, bits, head_dim, tau), bits, head_dim // 4)
  # The thread's tokens 64 tile + 16 w + l // 4 (+ 8) lie in one key group; its channel pairs (2 (l % 4) + 8 j, +1),
  # whose scale and zero are its meta words 2 j, 2 j + 1 (quad_word_position: 16 words per block of 64 channels).
  first_token = arith.addi(mgpu.utils.c(TILE * tile, _i32()), arith.muli(warp, mgpu.utils.c(16, _i32())))
  group_in_tile = (arith.divui(first_token, mgpu.utils.c(group, _i32()))
                   if group <= TILE * step_tiles else mgpu.utils.c(0, _i32()))
  meta = _quad_words(meta_ref, mgpu.utils.c(0, _i32()), arith.remui(lane, mgpu.utils.c(4, _i32())),
                     head_dim // 4, lead=(group_in_tile,))
  b = _fragment_words(q_frags)
  zero = arith.constant(ir.F32Type.get(), 0.0)
  chains = {(n, parity): [zero] * 4 for n in range(rows // 8) for parity in range(2)}
  for kappa in range(head_dim // 16):  # register rho = 4 kappa + (0, 1, 2, 3) is A's a0..a3 of the block
    a = [mgpu.utils.bitcast(_dequantized_pair(*source(4 * kappa + r), bits, meta[2 * (2 * kappa + r // 2)],
                                              meta[2 * (2 * kappa + r // 2) + 1]), _i32()) for r in range(4)]
    for n in range(rows // 8):  # each block of 8 rows against the same keys, dequantized once
      word = 2 * (n * head_dim // 16 + kappa)
      chains[n, kappa % 2] = _mma(a, b[word:word + 2], chains[n, kappa % 2])
  pairs = {}
  for n in range(rows // 8):
    c = [arith.addf(x, y) for x, y in zip(chains[n, 0], chains[n, 1])]
    pairs[n, 0], pairs[n, 1] = _f32_register(c[:2]), _f32_register(c[2:])
  return _wgmma_array(pairs, (TILE, rows))


def _value_accumulate(codes_ref, meta_ref, p, o, *, tile, bits, head_dim, group, rows):
  """o + V_hat^T p^T over the 16 tokens of each warp in tile ``tile``: o is the warp's own [D, rows] fp32
  accumulator, (block of 16 channels i, block of 8 rows n) in register (i rows / 8 + n, h) of a [64, 8 D / 16
  rows / 8] WGMMA-layout array (rows 16 i + l // 4 + 8 h); the A operands are the warp's dequantized values, the
  B operands p [64 tokens, rows] fp16 (its WGMMA layout) transposed in registers."""
  warp, lane, tau = _thread()
  source = _register_source(_this_threads_code_words(codes_ref, tile, bits, head_dim, tau), bits, head_dim // 4)
  per_thread = 4 * head_dim // group  # the thread's meta words: k = 4 g + 2 a (scale), + 1 (z')
  meta = _quad_words(meta_ref, arith.muli(warp, mgpu.utils.c(4 * per_thread, _i32())),
                     arith.remui(lane, mgpu.utils.c(4, _i32())), per_thread, lead=(mgpu.utils.c(tile, _i32()),))
  b = {(n, h): _transposed(mgpu.utils.bitcast(_register(p, n, h), _i32())) for n in range(rows // 8) for h in range(2)}
  pairs = {}
  for i in range(head_dim // 16):
    k = 4 * (16 * i // group)
    # register rho = 2 u + h, u = 2 i + a: A's a0..a3 of the block are (u, h) = (2 i, 0), (2 i, 1), (2 i + 1, 0), ...
    a = [mgpu.utils.bitcast(_dequantized_pair(*source(4 * i + r), bits, meta[k + 2 * (r // 2)],
                                              meta[k + 2 * (r // 2) + 1]), _i32()) for r in range(4)]
    for n in range(rows // 8):
      j = i * rows // 8 + n
      c = _mma(a, [b[n, 0], b[n, 1]], _f32_pair(_register(o, j, 0)) + _f32_pair(_register(o, j, 1)))
      pairs[j, 0], pairs[j, 1] = _f32_register(c[:2]), _f32_register(c[2:])
  return _wgmma_array(pairs, o.shape)


def _warp_column_max(x):
  """[64, N] fp32 (WGMMA layout) -> the largest value of each column among the rows of each warp (rows 16 w ..
  16 w + 15), in every one of those rows: the lanes that share l % 4 hold a column's 16 rows."""
  pairs = {}
  for j in range(x.registers.shape[1]):
    m = arith.maximumf(_register(x, j, 0), _register(x, j, 1))
    for distance in (4, 8, 16):
      m = arith.maximumf(m, mgpu.utils.shfl_bfly(m, distance))
    pairs[j, 0] = pairs[j, 1] = m
  return _wgmma_array(pairs, x.shape)


def _tile_columns(x, width):
  """[64, N] (WGMMA layout) -> [64, width], column c holding x's column c % N (registers reused)."""
  n = x.registers.shape[1]
  return _wgmma_array({(j, h): _register(x, j % n, h) for j in range(width // 8) for h in range(2)}, (TILE, width))


def _sum_into(ref, o, channel_scale=None, *, rows):
  """The four warps' o (``_value_accumulate``'s layout) summed into ``ref`` [D, rows] fp32 in shared memory, warp
  0's stored and warps 1, 2, 3 added in turn (a fixed order: the same sum every run), times ``channel_scale`` [D]
  (floating point, in shared memory; None: 1)."""
  warp, lane, _ = _thread()
  c = lambda value: mgpu.utils.c(value, _i32())
  row, column = arith.divui(lane, c(4)), arith.muli(arith.remui(lane, c(4)), c(2))
  at = {}
  for j in range(o.registers.shape[1]):
    i, n = divmod(j, rows // 8)
    for h in range(2):
      at[j, h] = [_index(arith.addi(row, c(16 * i + 8 * h))), _index(arith.addi(column, c(8 * n)))]
  registers = {}
  for (j, h), index in at.items():
    register = _register(o, j, h)
    if channel_scale is not None:
      scale = memref.load(channel_scale, index[:1])
      if scale.type != ir.F32Type.get():
        scale = arith.extf(ir.F32Type.get(), scale)
      register = arith.mulf(register, vector.broadcast(register.type, scale))
    registers[j, h] = register
  for turn in range(4):
    with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.eq, warp, c(turn))):
      for (j, h), index in at.items():
        value = registers[j, h]
        if turn:
          value = arith.addf(vector.load(value.type, ref, index), value)
        vector.store(value, ref, index)
    mgpu.utils.warpgroup_barrier()


def _transpose_in_place(ref):
  """``ref`` [D, rows] fp32 in shared memory (o^T, as the value product accumulates it) rewritten as o [rows, D]
  row-major in the same words: o leaves the kernel in the order XLA merges it and the output projection reads it,
  where a transpose after the merge was a launch of its own in every layer (about 1.2 µs at B = 8)."""
  head_dim, rows = ir.MemRefType(ref.type).shape
  _, _, tau = _thread()
  c = lambda value: mgpu.utils.c(value, _i32())
  flat = [arith.addi(c(k * THREADS), tau) for k in range(head_dim * rows // THREADS)]  # o's words, row-major
  mgpu.utils.warpgroup_barrier()  # o^T is complete
  values = [memref.load(ref, [_index(arith.remui(i, c(head_dim))), _index(arith.divui(i, c(head_dim)))])
            for i in flat]
  mgpu.utils.warpgroup_barrier()  # every thread has read before any writes
  for i, value in zip(flat, values):
    memref.store(value, ref, [_index(arith.divui(i, c(rows))), _index(arith.remui(i, c(rows)))])


# ----------------------------------------------------------------------------------------------------------------
# Kernel


def _partials(layer, q, stores: tuple[MmaStore, ...], segment, *, rows, sm_scale, splits, step_tiles,
              max_concurrent_steps, segment_depth, columns=None):
  """One Mosaic GPU kernel over grid (Hkv, B, S) for q [B, Hkv, T g or rows, D] in fp16 or bf16 (its rows padded
  to ``rows``, 8 or 16, the N of the key product and the width of the softmax, in the kernel or, zeros, already;
  the padded rows' outputs are unspecified) and layer [1] int32 (clamped in the kernel, as each store's lengths
  are: no work around it) over ``stores``, store i in ``splits[i]`` programs of ``step_tiles[i]`` tiles a step (S
  their sum; a program picks its store by its split index: ZipCache's pools in one launch): the fp32 partials
  o [B, Hkv, S, D, N] (holding o [N, D] row-major: ``_transpose_in_place``), l, m [B, Hkv, S, N] (m in log2
  units). ``segment``: None, or ``_segment_inputs``'s (q, k, v, allowed): its tokens join the last split's
  softmax. ``segment_depth``: ``mgpu_decode_partial``'s. ``columns``: None, or (first, count)
  (``logit_columns``): also the store's slot weights of those columns, p = exp2(logit - m) as the value
  product takes it (fp16, [B, Hkv, S * tiles, 64 count / 128, 128]: each tile's [64, count] row-major), and the
  warps' maxima m of each step (fp32 log2 units, [B, Hkv, S * steps, 4, count]: warp w's, of tokens 16 w .. 16 w
  + 15 of every tile of the step); steps the program skips, past the length, are not written. With a segment too,
  its tiles' the same way ([B, Hkv, n, 64 count / 128, 128] and [B, Hkv, n, 4, count], its row max in every warp's
  row), written by the last split's program: row r of tile i is the segment's token 64 i + r - shift."""
  batch, kv_heads, n_rows, head_dim = q.shape
  num_layers = stores[0].k_codes.shape[0]
  if segment is not None:
    segment_shape = segment[1].shape  # k [L, B, Hkv, W, D]
    segment_tiles = (segment[3].shape[2] - 8) // TILE  # allowed [B, Hm, 8 + 64 n, rows]
  # TMA moves at most 256 elements along an axis: every word axis travels as [n / width, width] rows.
  as_rows = lambda a: a.reshape(*a.shape[:-1], -1, min(128, a.shape[-1]))
  # Holes travel as one byte per slot (two in one-tile steps: ``hole_dtype``), [1, B, Hkv or 1, C / 64, 64], through
  # the same pipeline as the codes: each thread reads the slots of its two tokens of a tile. They are cut to this
  # call's layer before they are converted (converting every layer's, in every layer's call, is L times the work),
  # and holes that every head shares are converted once. The channel scale is read as it is stored, at the layer.
  this_layer = lambda x: lax.dynamic_index_in_dim(x, layer[0], keepdims=True) if x.ndim == 4 else x[None]
  store_inputs = [
      (store.length.astype(jnp.int32), *map(as_rows, (store.k_codes, store.k_meta, store.v_codes, store.v_meta)),
       *(() if store.valid is None else (this_layer(store.valid).astype(hole_dtype(step)).reshape(
           1, batch, store.valid.shape[-2], -1, TILE),)),
       *(() if store.v_channel_scale is None else (store.v_channel_scale,)))
      for store, step in zip(stores, step_tiles)]
  offsets = np.cumsum((0,) + tuple(splits))  # store i's programs: splits [offsets[i], offsets[i + 1])
  blocks = tuple(range(head_dim // 64))  # a segment's channel blocks of 64: one value product each
  f32, wgmma_layout = jnp.float32, plgpu.Layout.WGMMA
  array = lambda width: plgpu.ShapeDtypeStruct((TILE, width), f32, layout=wgmma_layout)
  o_width = 8 * head_dim // 16 * rows // 8  # a warp's o [D, rows] in the columns of a [64, o_width] array
  q_words = q_word_count(rows, head_dim)
  build_q_fragments = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(
      lambda ctx, q_rows, words: _build_q_fragments(q_rows, words, rows=rows, head_dim=head_dim))
  q_fragments = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=array(2 * q_words))(
      lambda ctx, ref: _q_fragments(ref, rows, head_dim))
  key_logits = lambda store, step, tile: plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(), plgpu.RefType(), wgmma_layout), return_type=array(rows))(
          lambda ctx, c, m, qf: _key_logits(c, m, qf, tile=tile, step_tiles=step, bits=store.k_bits,
                                            head_dim=head_dim, group=store.k_group, rows=rows))
  value_accumulate = lambda store, tile: plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(), plgpu.RefType(), wgmma_layout, wgmma_layout), return_type=array(o_width))(
          lambda ctx, c, m, p, o: _value_accumulate(c, m, p, o, tile=tile, bits=store.v_bits, head_dim=head_dim,
                                                    group=store.v_group, rows=rows))
  warp_column_max = plgpu.inline_mgpu(arg_types=(wgmma_layout,), return_type=array(rows))(
      lambda ctx, x: _warp_column_max(x))
  along_o = plgpu.inline_mgpu(arg_types=(wgmma_layout,), return_type=array(o_width))(
      lambda ctx, x: _tile_columns(x, o_width))  # [64, rows] per warp and row -> o's columns
  sum_into = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), wgmma_layout))(
      lambda ctx, ref, o: _sum_into(ref, o, rows=rows))
  sum_scaled_into = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), wgmma_layout, plgpu.RefType()))(
      lambda ctx, ref, o, scale: _sum_into(ref, o, scale, rows=rows))
  transpose_in_place = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(lambda ctx, ref: _transpose_in_place(ref))
  # Swizzles of a segment's 16-bit operands in shared memory: q [N, D] and keys [64, D] by rows of D, p [64, 16]
  # and values [64, D] by 16 (a product's two shared-memory operands take one swizzle).
  swizzled = lambda width, name: (lambda sw: (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw)))(
      plgpu.find_swizzle(width * 16, name))
  q_transforms, p_transforms = swizzled(head_dim, "q"), swizzled(ROWS, "p")
  pad_columns = lambda element: plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct((TILE, ROWS), element, layout=plgpu.Layout.WGMMA))(
          lambda ctx, x: _pad_columns(x, rows))
  widen = (lambda x: pad_columns(x.dtype)(x)) if rows < ROWS else (lambda x: x)  # [64, rows] -> [64, ROWS]
  store_columns = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA))(
      lambda ctx, ref, x: _store_columns(ref, x, *columns))
  store_maxima = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WGMMA))(
      lambda ctx, ref, x: _store_columns(ref, x, *columns, maxima=True))
  scale_log2 = sm_scale * LOG2E
  along_tokens = lambda x, width=rows: lax.broadcast_in_dim(x, (TILE, width), [1])

  def softmax_update(s, m_run, l_run):
    """Online softmax over the logits s (a list of [64, rows] in log2 units, masked to MASK_VALUE): p of each,
    the new running max and sum, and the factor alpha [rows] that rescales what came before."""
    m_next = jnp.maximum(m_run, functools.reduce(jnp.maximum, s).max(axis=0))  # one cross-warp reduction
    alpha = jnp.exp2(m_run - m_next)
    p = [jnp.exp2(x - along_tokens(m_next)) for x in s]  # masked: exp2(MASK_VALUE - m_next) = 0 (M_FLOOR)
    l_run = l_run * along_tokens(alpha) + functools.reduce(jnp.add, p)  # summed over tokens after the loop
    return p, m_next, l_run, alpha

  def rescaled(o_blocks, alpha, products):
    """o's blocks times alpha, plus what ``products`` (on the accumulators' refs) adds."""
    o_alpha = widen(along_tokens(alpha))  # o's padded columns stay 0
    return pl.run_state(products)(tuple(plgpu.ACC.init(o * o_alpha) for o in o_blocks))

  def kernel(layer_ref, q_ref, *refs, qr_smem, q_smem, o_smem, l_smem, m_smem, q_barrier, sq_smem=None,
             sp_smem=None, sq_barrier=None, pw_smem=None, mx_smem=None, **scale_scratch):
    store_weights = columns is not None
    segment_weights = store_weights and segment is not None
    outputs = 2 * store_weights + 2 * segment_weights
    pw_ref, mx_ref, *segment_weight_refs = refs[len(refs) - outputs:] if store_weights else (None, None)
    *refs, o_ref, l_ref, m_ref = refs[:len(refs) - outputs]
    store_refs = [refs[int(offset):int(offset) + len(inputs)] for offset, inputs in
                  zip(np.cumsum([0] + [len(inputs) for inputs in store_inputs]), store_inputs)]
    segment_refs = refs[sum(map(len, store_inputs)):]  # q, k, v, allowed (with a segment)
    h, b, split = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("s")
    at = jnp.clip(layer_ref[0], 0, num_layers - 1)
    zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma_layout)
    init = (zeros((TILE, o_width)), plgpu.layout_cast(jnp.full((TILE, rows), M_FLOOR, f32), wgmma_layout),
            zeros((TILE, rows)))

    def read_store(i):
      """Store i's share of this program's split: its partial merged into o_smem, and (m, l)."""
      store, step_tiles_i = stores[i], step_tiles[i]
      length_ref, kc_ref, km_ref, vc_ref, vm_ref, *extra = store_refs[i]
      hole_refs, scale_refs = extra[:int(store.valid is not None)], extra[int(store.valid is not None):]
      cs_smem, cs_barrier = scale_scratch.get(f"cs_smem_{i}"), scale_scratch.get(f"cs_barrier_{i}")
      # Per program, whole steps: no step reaches into the next split's tiles; the last split's may reach past
      # the capacity (TMA fills zeros) and a step past the length: their tokens are masked by the length.
      tiles = split_tiles(store, splits[i], step_tiles_i)
      step_tokens = TILE * step_tiles_i
      k_groups = max(1, step_tokens // store.k_group)  # key groups a step's scale block holds (1 when G >= step)
      seq_len = jnp.clip(length_ref[b], 0, store.capacity)
      first = (split - int(offsets[i])) * tiles
      has_store = first * TILE < seq_len  # a split wholly past the length reads nothing of the store
      # The pipeline's step count is static: steps past the length fetch the split's last block with a token
      # again (from L2, not DRAM) and skip their products, so a cache filled to a fraction of its capacity reads
      # and computes about that fraction. (A step count that stops at the length held 10 more registers in round
      # 11's kernel: 178 against 168 for KIVI-2 on an H100, 2 programs per SM instead of 3.)
      last = (jnp.minimum(seq_len - first * TILE, tiles * TILE) - 1) // step_tokens

      def body(index, *refs_and_carry):
        *step_refs, carry = refs_and_carry
        return lax.cond(index[0] <= last, functools.partial(attend, index, *step_refs), lambda c: c, carry)

      def attend(index, kc, km, vc, vm, *hole_and_carry):
        # A step is ``step_tiles`` tiles and one softmax update over all their tokens, each warp over its own 16
        # tokens of each tile: its own running max and sum per row and its own o, so no step waits on another
        # warp.
        *hole_tiles, (o, m_run, l_run) = hole_and_carry

        @pl.when(index[0] == 0)
        def _():  # q was issued before the pipeline's first loads; its latency overlaps theirs
          plgpu.barrier_wait(q_barrier)
          build_q_fragments(qr_smem, q_smem)

        q_frags = q_fragments(q_smem)
        logits = [key_logits(store, step_tiles_i, t)(kc, km, q_frags) for t in range(step_tiles_i)]
        row = plgpu.broadcasted_iota(jnp.int32, (TILE, rows), 0, layout=wgmma_layout)
        step_start = (first + index[0] * step_tiles_i) * TILE
        valid = [row + (step_start + TILE * t) < seq_len for t in range(step_tiles_i)]
        for hole_tile in hole_tiles:  # the slot bytes of the thread's tokens, along its logits' columns
          valid = [v & (lax.broadcast_in_dim(_load(hole_tile.at[t], layout=wgmma_layout.reduce(1),
                                                   optimized=False), (TILE, rows), [0]) != 0)
                   for t, v in enumerate(valid)]
        s = [jnp.where(v, x * scale_log2, MASK_VALUE) for v, x in zip(valid, logits)]
        m_next = jnp.maximum(m_run, warp_column_max(functools.reduce(jnp.maximum, s)))
        alpha = jnp.exp2(m_run - m_next)
        p = [jnp.exp2(x - m_next) for x in s]  # masked: exp2(MASK_VALUE - m_next) = 0 (M_FLOOR)
        l_run = l_run * alpha + functools.reduce(jnp.add, p)  # summed over the warp's tokens after the loop
        p16 = [x.astype(META_DTYPE) for x in p]
        if store_weights:  # into one of two slots, once the copy out of the step before last has read it
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          pw_slot, mx_slot = pw_smem.at[index[0] % 2], mx_smem.at[index[0] % 2]
          for t in range(step_tiles_i):
            store_columns(pw_slot.at[t], p16[t])
          store_maxima(mx_slot, m_next)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(pw_slot, pw_ref.at[b, h, pl.ds(first + index[0] * step_tiles_i, step_tiles_i)],
                                  commit_group=False)
          plgpu.copy_smem_to_gmem(mx_slot, mx_ref.at[b, h, first // step_tiles_i + index[0]])
        o = o * along_o(alpha)
        for t in range(step_tiles_i):
          o = value_accumulate(store, t)(vc, vm, p16[t], o)
        return o, m_next, l_run

      k_codes, k_meta, v_codes, v_meta = store_inputs[i][1:5]
      block = lambda j: first // step_tiles_i + jnp.minimum(j, last)  # a split starts on a step boundary
      tile_block = lambda j: (block(j), 0, 0)
      pipeline = plgpu.emit_pipeline(
          body,
          grid=(tiles // step_tiles_i,),
          in_specs=[
              plgpu.BlockSpec((step_tiles_i, *k_codes.shape[-2:]), tile_block),          # key codes
              plgpu.BlockSpec((k_groups, *k_meta.shape[-2:]),                            # key scale pairs
                              lambda j: (block(j) * step_tokens // store.k_group // k_groups, 0, 0)),
              plgpu.BlockSpec((step_tiles_i, *v_codes.shape[-2:]), tile_block),          # value codes
              plgpu.BlockSpec((step_tiles_i, *v_meta.shape[-2:]), tile_block),           # value scale pairs
          ] + [plgpu.BlockSpec((step_tiles_i, TILE), lambda j: (block(j), 0))] * len(hole_refs),  # slot bytes
          max_concurrent_steps=max_concurrent_steps,
          init_carry=init)

      @pl.when(has_store)
      def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], qr_smem, q_barrier)
      for cs_ref in scale_refs:  # issued before the pipeline: its latency hides under the store's
        plgpu.copy_gmem_to_smem(cs_ref.at[at, b, h], cs_smem, cs_barrier)
      o, m_run, l_run = lax.cond(
          has_store, lambda: pipeline(kc_ref.at[at, b, h], km_ref.at[at, b, h], vc_ref.at[at, b, h],
                                      vm_ref.at[at, b, h],
                                      *(r.at[0, b, h if r.shape[2] > 1 else 0] for r in hole_refs)),
          lambda: init)
      # The warps' partials merged: each weighted by exp2(its max - the program's), a split with no valid key
      # giving (m, l, o) = (M_FLOOR, 0, 0), the empty partial; a value channel's scale multiplies the store's o.
      m_all = m_run.max(axis=0)
      weight = jnp.exp2(m_run - along_tokens(m_all))
      if scale_refs:
        plgpu.barrier_wait(cs_barrier)
        sum_scaled_into(o_smem, o * along_o(weight), cs_smem)
      else:
        sum_into(o_smem, o * along_o(weight))
      return m_all, (l_run * weight).sum(axis=0)

    def read(i):  # the store of this program's split: its programs are splits [offsets[i], offsets[i + 1])
      if i == len(stores) - 1:
        return read_store(i)
      return lax.cond(split < int(offsets[i + 1]), lambda: read_store(i), lambda: read(i + 1))
    m_all, l_all = read(0)

    def attend_segment(index, k_tile, v_tile, allowed, carry):
      # A tile of the segment's 64 tokens: both products read their A operand from shared memory (the values
      # transposed), in the segment's dtype; ``allowed`` is its mask [64 tokens, rows].
      *o_blocks, m_run, l_run = carry

      @pl.when(index[0] == 0)
      def _():
        plgpu.barrier_wait(sq_barrier)

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, k_tile, sq_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref[...]
      logits = pl.run_scoped(qk, plgpu.ACC((TILE, rows), jnp.float32))
      ok = _load(allowed, layout=plgpu.Layout.WGMMA, optimized=False) != 0
      (p,), m_next, l_run, alpha = softmax_update([jnp.where(ok, logits * scale_log2, MASK_VALUE)], m_run, l_run)
      sp_smem[...] = widen(p.astype(sp_smem.dtype))
      if segment_weights:  # the tile's slot weights as the store's (a few tiles: each waits for the last's copy)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        store_columns(pw_smem.at[0, 0], p.astype(META_DTYPE))
        store_maxima(mx_smem.at[0], along_tokens(m_next))
      plgpu.commit_smem()
      if segment_weights:
        spw_ref, smx_ref = segment_weight_refs
        plgpu.copy_smem_to_gmem(pw_smem.at[0, 0], spw_ref.at[b, h, index[0]], commit_group=False)
        plgpu.copy_smem_to_gmem(mx_smem.at[0], smx_ref.at[b, h, index[0]])

      def pv(acc_refs):
        for m in blocks:
          plgpu.wgmma(acc_refs[m], v_tile.at[:, pl.ds(64 * m, 64)].transpose((1, 0)), sp_smem)
        plgpu.wgmma_wait(0)
      return (*rescaled(o_blocks, alpha, pv), m_next, l_run)

    if segment is not None:  # the last split's program continues the softmax over the segment's tokens
      sq_ref, sk_ref, sv_ref, sa_ref = segment_refs
      # The segment's keys and values travel as [L B Hkv W, D] rows, and a swizzled operand's tiling takes them in
      # groups of 8 rows, which W need not be: tile i starts ``shift`` rows before the segment's token 64 i (the
      # row of 8 its first token lies in), the mask's tile as far before its token 64 i (it has 8 rows of zeros
      # in front), so rows of the previous or next head and zeros past the end are masked out.
      first_row = _segment_first_row(at, b, h, segment_shape)
      shift = first_row % 8
      rows_at = lambda i: (pl.multiple_of(first_row - shift + TILE * i, 8), 0)
      segment_pipeline = lambda carry: plgpu.emit_pipeline(
          attend_segment,
          grid=(segment_tiles,),
          in_specs=[plgpu.BlockSpec((pl.Element(TILE), head_dim), rows_at, transforms=q_transforms),  # keys
                    plgpu.BlockSpec((pl.Element(TILE), head_dim), rows_at, transforms=p_transforms),  # values
                    plgpu.BlockSpec((pl.Element(TILE), rows), lambda i: (8 - shift + TILE * i, 0))],   # mask
          max_concurrent_steps=min(segment_depth, segment_tiles),
          init_carry=carry)(sk_ref, sv_ref, sa_ref.at[b, h if sa_ref.shape[1] > 1 else 0])

      def with_segment():
        plgpu.copy_gmem_to_smem(sq_ref.at[b, h], sq_smem, sq_barrier)
        plgpu.commit_smem()  # every warp's o is in o_smem
        # The store's partial starts the segment's softmax: its o in the accumulators' layout, its sum spread
        # evenly over the 64 rows that are summed at the end (a power of two: exact).
        carry = (*[widen(_load(o_smem.at[pl.ds(64 * i, 64)], layout=wgmma_layout, optimized=False))
                   for i in blocks], m_all, along_tokens(l_all * (1 / TILE)))
        *o_blocks, m_next, l_next = segment_pipeline(carry)
        for i, o_block in enumerate(o_blocks):  # the value product's padded columns are not written
          o_smem[pl.ds(64 * i, 64), :] = o_block[:, :rows] if rows < ROWS else o_block
        return m_next, l_next.sum(axis=0)
      m_all, l_all = lax.cond(split == int(offsets[-1]) - 1, with_segment, lambda: (m_all, l_all))
    transpose_in_place(o_smem)
    l_smem[...] = l_all
    m_smem[...] = m_all
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, split])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[b, h, split])
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)

  programs = int(offsets[-1])
  out_type = (jax.ShapeDtypeStruct((batch, kv_heads, programs, head_dim, rows), jnp.float32),
              jax.ShapeDtypeStruct((batch, kv_heads, programs, rows), jnp.float32),
              jax.ShapeDtypeStruct((batch, kv_heads, programs, rows), jnp.float32))
  if columns is not None:  # one store
    tiles = programs * split_tiles(stores[0], splits[0], step_tiles[0])
    out_type += (jax.ShapeDtypeStruct((batch, kv_heads, tiles, TILE * columns[1] // 128, 128), META_DTYPE),
                 jax.ShapeDtypeStruct((batch, kv_heads, tiles // step_tiles[0], 4, columns[1]), jnp.float32))
    if segment is not None:  # the segment's tiles', likewise (its max is the same in every warp)
      out_type += (
          jax.ShapeDtypeStruct((batch, kv_heads, segment_tiles, TILE * columns[1] // 128, 128), META_DTYPE),
          jax.ShapeDtypeStruct((batch, kv_heads, segment_tiles, 4, columns[1]), jnp.float32))
  scratch = dict(
      qr_smem=plgpu.SMEM((n_rows, head_dim), q.dtype),
      q_smem=plgpu.SMEM((q_words // 4, 128), jnp.uint32),
      o_smem=plgpu.SMEM((head_dim, rows), jnp.float32),
      l_smem=plgpu.SMEM((rows,), jnp.float32),
      m_smem=plgpu.SMEM((rows,), jnp.float32),
      q_barrier=plgpu.Barrier(),
  )
  inputs = (layer, q) + tuple(x for arrays in store_inputs for x in arrays)
  for i, store in enumerate(stores):
    if store.v_channel_scale is not None:
      scratch.update({f"cs_smem_{i}": plgpu.SMEM((head_dim,), store.v_channel_scale.dtype),
                      f"cs_barrier_{i}": plgpu.Barrier()})
  if columns is not None:
    scratch.update(pw_smem=plgpu.SMEM((2, step_tiles[0], TILE * columns[1] // 128, 128), META_DTYPE),
                   mx_smem=plgpu.SMEM((2, 4, columns[1]), jnp.float32))
  if segment is not None:
    segment_dtype = segment[0].dtype
    segment = (segment[0], *(x.reshape(-1, head_dim) for x in segment[1:3]), segment[3])
    scratch.update(sq_smem=plgpu.SMEM((rows, head_dim), segment_dtype, transforms=q_transforms),
                   sp_smem=plgpu.SMEM((TILE, ROWS), segment_dtype, transforms=p_transforms),
                   sq_barrier=plgpu.Barrier())
    inputs += tuple(segment)
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=(kv_heads, batch, programs),
      grid_names=("h", "b", "s"),
      scratch_types=scratch,
      # Pallas's barriers around shared-memory stores and TMA copies stay: by reading none is needed, but dropping
      # them (unsafe_no_auto_barriers) measured no faster in one process on an H100 (docs/experiments.md).
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*inputs)


def _sm_count() -> int:
  return getattr(jax.devices()[0], "core_count", None) or 132  # an H100's SMs where a device does not say


def _split_unit(store: MmaStore, step_tiles: int) -> int:
  """The tiles a split's size is a multiple of: whole steps and whole key groups."""
  return math.lcm(step_tiles, max(1, store.k_group // TILE))


def split_tiles(store: MmaStore, splits: int, step_tiles: int) -> int:
  """Tiles of 64 tokens per split: the capacity's tiles shared among ``splits`` programs, rounded up to whole steps
  and key groups (the last split may hold fewer, and fewer splits may cover the capacity)."""
  unit = _split_unit(store, step_tiles)
  return -(-store.k_codes.shape[3] // (splits * unit)) * unit


def default_splits(store: MmaStore, step_tiles: Optional[int] = None, stages: int = STAGES,
                   sm_count: Optional[int] = None, segment: bool = False, segment_depth: Optional[int] = None,
                   n_rows: int = 1) -> int:
  """The split count ``mgpu_decode_partial`` takes by default at ``step_tiles`` (None: ``default_step_tiles``) for
  ``n_rows`` query rows a KV head: as many as let all of B * Hkv * splits programs run at once (``programs_per_sm``
  per SM, fewer where their shared memory does not fit), at least 1, counted as the splits of ``split_tiles`` that
  cover the capacity. More programs than that wait for a slot, and each pays its pipeline's fill and drain (KIVI-2
  at B = 256, L = 4608 on an H100, the kernel alone: 361.6 µs with 1 split, 412.9 with 2, 469.7 with 4; at B = 8,
  L = 32768, 94.8 with 4, 96.7 with 8, 98.5 with 16). ``segment``: a segment joins the store, ``segment_depth``
  slots deep (None: ``default_segment_depth``)."""
  _, batch, kv_heads, tiles = store.k_codes.shape[:4]
  step_tiles = step_tiles or default_step_tiles(store, stages, segment)
  segment_depth = segment_depth or default_segment_depth(store, step_tiles, stages)
  fit = SHARED_PER_SM // (shared_memory_bytes(store, step_tiles, stages, segment, segment_depth) + 1024)
  slots = (sm_count or _sm_count()) * max(1, min(programs_per_sm(n_rows), fit))
  splits = min(max(1, slots // (batch * kv_heads)), -(-tiles // _split_unit(store, step_tiles)))
  return -(-tiles // split_tiles(store, splits, step_tiles))


# A tile's time by code width, relative to 2 bits: the kernel alone at B = 8, L = 32768 on an H100 took 76.6 µs
# for KIVI-2, 116.2 for KIVI-4 and 75.7 for SpeCache's 1-bit store (profiler traces: the unpack costs per
# code, not per bit); KIVI-8 228.6 µs against KIVI-2's 91.8 in one run (dispatched: near the copy rate).
TILE_COST = {1: 1.0, 2: 1.0, 4: 1.5, 8: 2.5}


def pool_splits(stores, step_tiles, stages: int = STAGES, sm_count: Optional[int] = None, segment: bool = False,
                segment_depth: Optional[int] = None, n_rows: int = 1) -> tuple[int, ...]:
  """Splits of each of several stores read in one launch (``mgpu_decode_partial`` with a tuple of stores): the
  programs that run at once (as ``default_splits`` counts them, by the largest program's shared memory) shared
  in proportion to each store's tiles times a tile's time at its widths (``TILE_COST``), at least one each and at
  most one per step (or key group)."""
  batch, kv_heads = stores[0].k_codes.shape[1:3]
  largest = max(shared_memory_bytes(store, step, stages, segment, segment_depth or 1)
                for store, step in zip(stores, step_tiles))
  slots = (sm_count or _sm_count()) * max(1, min(programs_per_sm(n_rows), SHARED_PER_SM // (largest + 1024)))
  per_head = max(len(stores), slots // (batch * kv_heads))
  work = [store.k_codes.shape[3] * (TILE_COST[store.k_bits] + TILE_COST[store.v_bits]) for store in stores]
  return tuple(min(max(1, round(per_head * w / sum(work))), -(-store.k_codes.shape[3] // _split_unit(store, step)))
               for store, w, step in zip(stores, work, step_tiles))


def default_segment_depth(store: MmaStore, step_tiles: int, stages: int = STAGES) -> int:
  """The slots of a segment's pipeline by default: one where that lets more programs share an SM than two slots
  do (a segment of KIVI's window is two or three tiles, so the second slot hides little), else two."""
  fit = lambda depth: SHARED_PER_SM // (shared_memory_bytes(store, step_tiles, stages, True, depth) + 1024)
  return 1 if fit(1) > fit(2) else 2


def hole_dtype(step_tiles: int):
  """The type holes travel in: a byte per slot, or two where a step's bytes would be fewer than 128, since TMA
  writes each pipeline slot at a 128-byte boundary (one tile's 64 bytes in the second slot: a misaligned address
  on an H100)."""
  return jnp.int8 if step_tiles * TILE >= 128 else jnp.int16


def shared_memory_bytes(store: MmaStore, step_tiles: int, stages: int, segment: bool = False,
                        segment_depth: int = 2) -> int:
  """Shared memory of one program: ``stages`` pipeline slots of a step's codes and scale words (and hole bytes),
  q's rows and fragments and the partials (at the widest N, 16 rows); with a ``segment``, its q and p, and its
  pipeline's ``segment_depth`` slots of a tile of keys, values and mask where they are larger than the store's
  (the two pipelines run one after the other)."""
  word = lambda a: a.shape[-1] * 4  # bytes of one row of a [..., n, W] uint32 array: a tile, or a key group
  step = step_tiles * (word(store.k_codes) + word(store.v_codes) + word(store.v_meta)
                       + (TILE * jnp.dtype(hole_dtype(step_tiles)).itemsize if store.valid is not None else 0))
  step += max(1, TILE * step_tiles // store.k_group) * word(store.k_meta)
  head_dim, half = store.k_meta.shape[-1], jnp.dtype(META_DTYPE).itemsize
  fixed = 2 * ROWS * head_dim * half + head_dim * ROWS * 4 + 2 * ROWS * 4  # q's rows and fragments, o, l, m
  fixed += head_dim * store.v_channel_scale.dtype.itemsize if store.v_channel_scale is not None else 0
  if not segment:
    return stages * step + fixed
  segment_slot = 2 * TILE * head_dim * 2 + TILE * ROWS * 4  # a tile of 16-bit keys and values, its int32 mask
  return max(stages * step, segment_depth * segment_slot) + fixed + (ROWS * head_dim + TILE * ROWS) * 2


def default_step_tiles(store: MmaStore, stages: int = STAGES, segment: bool = False, per_sm: int = 2) -> int:
  """The largest step of 4, 2 or 1 tiles no larger than the tile count that, ``stages`` deep, lets two programs
  share an SM (half of a Hopper SM's 228 KB of shared memory, less 1 KB reserved per block; where a third fits too,
  ``default_splits`` counts on it): one program per SM leaves the loads' latency uncovered (KIVI-2, 4
  tiles in 4 stages, 116 KB: 162 µs at B = 8, L = 32768 against 124 in 3 stages). The step need not divide the
  tile count: a last step past it reads masked tokens (at most 3 tiles more), where a step that divides it could
  be smaller and slower (KIVI-2 at B = 194, L = 4608: 312 µs with 4 tiles a step, 341 with 2, 373 with 1).
  ``segment``: a segment joins the store (``shared_memory_bytes``). ``per_sm``: the programs that must fit an SM
  (several stores in one launch ask for ``PROGRAMS_PER_SM``: their programs share one shared-memory size)."""
  tiles = store.k_codes.shape[3]
  budget = SHARED_PER_SM // per_sm - 1024
  steps = [step for step in (4, 2, 1) if step <= tiles]
  depth = 1 if per_sm > 2 else 2  # a segment's slots (two do not fit three programs whatever the step)
  return next((step for step in steps if shared_memory_bytes(store, step, stages, segment, depth) <= budget),
              steps[-1])


def reads_segment(k, v) -> bool:
  """Whether the kernel reads a segment of keys and values k, v ([L, B, Hkv, W, D] or [B, Hkv, W, D]) in place:
  one 16-bit type, and L * B * Hkv * W (the rows of D it reads them as) a multiple of 8, the rows a swizzled
  operand's tiling takes at once."""
  return (k.dtype in (jnp.float16, jnp.bfloat16) and v.dtype == k.dtype and v.shape == k.shape
          and math.prod(k.shape[:-1]) % 8 == 0)


def _segment_inputs(q_rows, segment, rows):
  """(q [B, Hkv, rows, D], k, v [L, B, Hkv, W, D], allowed [B, 1 or Hkv, 8 + 64 n, rows] int32) of a segment
  (k, v [L, B, Hkv, W, D] or [B, Hkv, W, D], mask [B, T, W] or [B, Hkv, T, W]) for q_rows [B, Hkv, T, g, D]: the
  segment's mask per query row (row t g + j is query t) after 8 masked rows, padded rows and tokens masked, over
  the n tiles the kernel reads."""
  k, v, mask = segment
  if k.ndim == 4:
    k, v = k[None], v[None]
  batch, kv_heads, t_rows, q_per_kv, head_dim = q_rows.shape
  if k.shape[1:3] != (batch, kv_heads) or k.shape[-1] != head_dim or not reads_segment(k, v):
    raise ValueError(f"segment keys {k.shape} {k.dtype} and values {v.shape} {v.dtype} do not fit q "
                     f"{q_rows.shape}: they take one 16-bit type, and L * B * Hkv * W a multiple of 8")
  width = k.shape[3]
  mask = mask[:, None] if mask.ndim == 3 else mask
  if mask.shape[0] != batch or mask.shape[1] not in (1, kv_heads) or mask.shape[2:] != (t_rows, width):
    raise ValueError(f"segment mask {mask.shape} does not fit q {q_rows.shape} and {width} segment tokens")
  allowed = jnp.swapaxes(jnp.repeat(mask, q_per_kv, axis=2), 2, 3).astype(jnp.int32)  # [B, Hm, W, T g]
  tiles = -(-(width + (width % 8 and 7)) // TILE)  # a tile starts up to 7 rows early where W is not a multiple of 8
  allowed = jnp.pad(allowed, ((0, 0), (0, 0), (8, TILE * tiles - width), (0, rows - t_rows * q_per_kv)))
  return _padded_rows(q_rows, rows, k.dtype), k, v, allowed


def _segment_first_row(layer, b, h, shape):
  """The row of a segment's keys and values, read as [L B Hkv W, D] rows (``shape`` [L, B, Hkv, W, D]), where the
  segment of sequence b and KV head h starts at ``layer`` (the store's, clamped; 0 for a segment of one step, not
  stacked); its tiles start ``% 8`` rows early."""
  segment_layers, batch, kv_heads, width, _ = shape
  return ((jnp.minimum(layer, segment_layers - 1) * batch + b) * kv_heads + h) * width


def _padded_rows(q, rows, dtype):
  """q [B, Hkv, T, g, D] as [B, Hkv, rows, D] in ``dtype``: row t g + j is query t's head j, zeros after."""
  batch, kv_heads, t_rows, q_per_kv, head_dim = q.shape
  return jnp.zeros((batch, kv_heads, rows, head_dim), dtype).at[:, :, :t_rows * q_per_kv].set(
      q.reshape(batch, kv_heads, t_rows * q_per_kv, head_dim).astype(dtype))


def _check_store(store: MmaStore, batch: int, kv_heads: int, head_dim: int):
  """One-line errors for a store that does not fit q's [B, Hkv] and D."""
  if store.k_codes.shape[1:3] != (batch, kv_heads):
    raise ValueError(f"store is for [B, Hkv] = {list(store.k_codes.shape[1:3])}, q is for {[batch, kv_heads]}")
  if store.valid is not None and (store.valid.ndim not in (3, 4) or store.valid.shape[-3] != batch
                                  or store.valid.shape[-2] not in (1, kv_heads)
                                  or store.valid.shape[-1] != store.capacity):
    raise ValueError(f"store holes {store.valid.shape} do not fit [L, B, Hkv or 1, C] or [B, Hkv or 1, C] with "
                     f"[B, Hkv, C] = {[batch, kv_heads, store.capacity]}")
  if store.v_channel_scale is not None and (store.v_channel_scale.ndim != 4
                                            or store.v_channel_scale.shape[1:] != (batch, kv_heads, head_dim)):
    raise ValueError(f"value channel scale {store.v_channel_scale.shape} does not fit [L, B, Hkv, D] with "
                     f"[B, Hkv, D] = {[batch, kv_heads, head_dim]}")


@functools.partial(jax.jit, static_argnames=["sm_scale", "splits", "step_tiles", "max_concurrent_steps",
                                             "segment_depth", "logit_rows"])
def mgpu_decode_partial(q, layer, store: MmaStore, *, segment=None, sm_scale: Optional[float] = None,
                        splits: Optional[int] = None, step_tiles: Optional[int] = None,
                        max_concurrent_steps: int = STAGES, segment_depth: Optional[int] = None,
                        logit_rows: tuple[int, ...] = ()):
  """Softmax attention of T query rows per sequence over layer ``layer`` of one MMA-packed store (and a
  full-precision segment), unnormalized: the partial that merges exactly with other passes'
  (``jkv.attention.merge_partials``).

  Args:
    q: [B, Hkv, T, g, D] with T * g <= 16, floating point: the store's products take it rounded to fp16, the
      segment's to the segment's type (bf16 to fp16 is exact for magnitudes in [6.1e-5, 65504]).
    layer: int32 scalar (clamped to [0, L)).
    store: ``MmaStore`` (``mma_layout.pack_mma_store``).
    segment: None, or full-precision keys and values with a mask, attended in the same softmax (KIVI's window):
      (k, v, mask) with k, v [L, B, Hkv, W, D] stacked (read at ``layer``) or [B, Hkv, W, D], one 16-bit type,
      and mask [B, T, W] or [B, Hkv, T, W] bool, True where query row t may attend token w. The last split's
      program reads it after its share of the store, in tiles of 64 tokens. Values at tokens no row attends
      must be finite (the value product multiplies them by p = 0).
    splits: programs per (sequence, KV head) along the tokens, each ``split_tiles`` tiles of 64 tokens (whole
      steps and key groups; the last split may hold fewer, and fewer splits may cover the capacity), at most one
      per step (per key group where a group is longer). None: ``default_splits``.
    step_tiles: tiles of 64 tokens per pipeline step (one softmax update); the last step
      may reach past the capacity (TMA fills zeros; those tokens are masked). None: ``default_step_tiles``.
    max_concurrent_steps: depth of the TMA pipeline (steps in flight). 2, the best or within 3% of the best
      depth at every step on an H100 at B = 194, L = 4608 (a max-batch decode step of Llama-3-8B: KIVI-2 with 4
      tiles 312 µs in 2 stages, 353 in 3, 490 in 4; KIVI-4 434, 534, 532) and within 1% for KIVI-2 at B = 8,
      L = 32768 (125.0 against 123.5 µs in 3 stages; KIVI-4 there: 154 µs, 142 with 1 tile in 2 stages).
    segment_depth: the slots of a segment's pipeline, 1 or 2. None: ``default_segment_depth``.
    logit_rows: query rows t whose store slot weights (and the segment's) it also returns
      (``slot_probabilities`` makes each slot's probability of them: the token mass SpeCache's top-k reads),
      which the kernel writes out through shared memory as it computes them: 2 bytes per slot, query head and row
      more traffic (only those rows' heads where they are one run of columns, ``logit_columns``, else every
      row's; the shared-memory budget of the defaults does not count its two steps' buffer).

  Returns:
    (o [B, Hkv, T, g, D], m, l [B, Hkv, T, g]) float32, natural-log units: o / l is the attention and m + log l
    the log-sum-exp; l = 0 (and o = 0) for a row with no valid key. With ``logit_rows`` then the slot weights
    of those R rows, (p [B, Hkv, C, R, g] fp16, m [B, Hkv, C / 16, R, g] float32, natural-log units): the logit
    sm_scale * q . k of slot c is m[c // 16] + log p[c] (p is the softmax's weight of the slot against the
    running max m of its 16 slots, rounded as the value product takes it); unspecified at the slots that are
    not keys (at and past the length, and holes). With a segment too, its tokens' likewise: (p [B, Hkv, W, R, g]
    fp16, m [B, Hkv, W, R, g] float32), m the running max of token w's tile, p rounded to fp16 (the segment's
    own value product takes it in the segment's type); unspecified at the tokens the mask hides.
  """
  if not available():
    raise RuntimeError("mgpu_decode_attention needs jax's Mosaic GPU API (jax >= 0.11)")
  batch, kv_heads, t_rows, q_per_kv, head_dim = q.shape
  n_rows = t_rows * q_per_kv
  if n_rows > ROWS:
    raise ValueError(f"mgpu_decode_attention takes T * g <= {ROWS} query rows per KV head, got {n_rows}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q is {q.dtype}: the products take it in 16-bit floating point")
  stores = tuple(store) if isinstance(store, (tuple, list)) else (store,)
  for store in stores:
    _check_store(store, batch, kv_heads, head_dim)
  if len({store.k_codes.shape[0] for store in stores}) > 1:
    raise ValueError(f"stores of {[store.k_codes.shape[0] for store in stores]} layers: one layer count")
  if logit_rows and len(stores) > 1:
    raise ValueError("logit_rows takes one store")
  if len(stores) > 1 and splits is not None:
    raise ValueError("several stores take their splits by default (splits=None)")
  if max_concurrent_steps < 1:
    raise ValueError(f"max_concurrent_steps={max_concurrent_steps} must be at least 1")
  if step_tiles is not None and step_tiles < 1:
    raise ValueError(f"step_tiles={step_tiles} must be at least 1")
  if segment is not None and segment[0].shape[-2] == 0:
    segment = None
  per_sm = PROGRAMS_PER_SM if len(stores) > 1 else 2
  steps = tuple(step_tiles or default_step_tiles(store, max_concurrent_steps, segment is not None, per_sm)
                for store in stores)
  if segment_depth not in (None, 1, 2):
    raise ValueError(f"segment_depth={segment_depth} must be 1 or 2")
  segment_depth = segment_depth or min(default_segment_depth(store, step, max_concurrent_steps)
                                       for store, step in zip(stores, steps))
  if len(stores) > 1:
    counts = pool_splits(stores, steps, max_concurrent_steps, segment=segment is not None,
                         segment_depth=segment_depth, n_rows=n_rows)
  elif splits is None:
    counts = (default_splits(stores[0], steps[0], max_concurrent_steps, segment=segment is not None,
                             segment_depth=segment_depth, n_rows=n_rows),)
  else:
    most = -(-stores[0].k_codes.shape[3] // _split_unit(stores[0], steps[0]))
    if not 1 <= splits <= most:
      raise ValueError(f"splits={splits} must be from 1 to {most}: a split holds whole steps of {steps[0]} tiles "
                       f"of {TILE} tokens and whole key groups of {stores[0].k_group}")
    counts = (splits,)
  counts = tuple(-(-store.k_codes.shape[3] // split_tiles(store, count, step))  # those that cover the capacity
                 for store, count, step in zip(stores, counts, steps))
  sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
  # Layer, lengths and q go in as they come (clamped, padded and rounded in the kernel): each small op around the
  # kernel is a launch of its own, a microsecond or two.
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  rows = 8 if n_rows <= 8 else ROWS  # the key product's N and the softmax's width
  q_rows = q.reshape(batch, kv_heads, n_rows, head_dim)
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    q_rows = q_rows.astype(META_DTYPE)
  if segment is not None:
    segment = _segment_inputs(q, segment, rows)
    if segment[0].dtype == q_rows.dtype:  # the segment's padded copy of q serves the store's product too: XLA
      q_rows = segment[0]  # made each copy a launch of its own, and the padded rows' logits are discarded anyway
  columns = logit_columns(t_rows, q_per_kv, logit_rows, rows)
  o, l, m, *weights = _partials(layer, q_rows, stores, segment, rows=rows, sm_scale=sm_scale, splits=counts,
                                step_tiles=steps, max_concurrent_steps=max_concurrent_steps,
                                segment_depth=segment_depth, columns=columns)
  splits = sum(counts)
  # The splits' partials merged exactly in log2 units, split by split: elementwise, so that XLA fuses the merge
  # (and what follows it) into one kernel rather than a reduction per axis.
  o = o.reshape(batch, kv_heads, splits, rows, head_dim)  # the kernel wrote o [rows, D] in o^T's words
  split = lambda x, i: x[:, :, i]
  m_all = functools.reduce(jnp.maximum, [split(m, i) for i in range(splits)])
  alpha = [jnp.exp2(split(m, i) - m_all) for i in range(splits)]
  o = functools.reduce(jnp.add, [a[..., None] * split(o, i) for i, a in enumerate(alpha)])
  l, m = functools.reduce(jnp.add, [a * split(l, i) for i, a in enumerate(alpha)]), m_all
  per_row = lambda x: x[:, :, :n_rows].reshape(q.shape[:-1])
  out = (o[:, :, :n_rows].reshape(q.shape), per_row(m / LOG2E), per_row(l))
  if weights:
    heads = np.array([t * q_per_kv + j for t in logit_rows for j in range(q_per_kv)]) - columns[0]
    if (np.diff(heads) == 1).all():  # a slice, not a gather
      heads = slice(int(heads[0]), int(heads[-1]) + 1)
    p, maxima = weights[:2]  # [B, Hkv, tiles * 64 count / 128, 128], [B, Hkv, steps, 4, count]
    per_16 = jnp.broadcast_to(maxima[:, :, :, None], (batch, kv_heads, maxima.shape[2], steps[0], 4, columns[1]))
    # As written: slot by slot, the heads innermost (a gather of a few slots then reads a few rows of bytes).
    by_slot = lambda x: x[..., heads].reshape(*x.shape[:3], len(logit_rows), q_per_kv)
    slots = lambda x, n: x.reshape(batch, kv_heads, -1, columns[1])[:, :, :n]
    out += ((by_slot(slots(p, stores[0].capacity)), by_slot(slots(per_16, stores[0].capacity // 16)) / LOG2E),)
    if segment is not None:  # token w of the segment is row w + shift of its tiles (``_partials``)
      p, maxima = weights[2:]  # [B, Hkv, n * 64 count / 128, 128], [B, Hkv, n, 4, count]
      width = segment[1].shape[3]
      at = jnp.clip(layer[0], 0, stores[0].k_codes.shape[0] - 1)
      first_row = _segment_first_row(at, np.arange(batch)[:, None], np.arange(kv_heads), segment[1].shape)
      row = (first_row % 8)[..., None, None] + np.arange(width)[:, None]  # [B, Hkv, W, 1]
      p = jnp.take_along_axis(slots(p, None), row, axis=2)
      maxima = jnp.take_along_axis(maxima[:, :, :, 0], row // TILE, axis=2)
      out += ((by_slot(p), by_slot(maxima) / LOG2E),)
  return out


def slot_probabilities(weights, lse):
  """exp(logit - lse) of every slot of ``mgpu_decode_partial``'s slot weights (p [B, Hkv, C, R, g], m [B, Hkv,
  C / 16, R, g]; or a segment's, p and m [B, Hkv, W, R, g]) against the log-sum-exp lse [B, Hkv, R, g] of their
  rows: [B, Hkv, R, g, C or W] float32, unspecified at the slots that are not keys. p exp(m - lse): m is at most
  a max of the row's logits, so nothing overflows."""
  p, m = weights
  scale = jnp.repeat(jnp.exp(m - lse[:, :, None]), p.shape[2] // m.shape[2], axis=2)
  return jnp.moveaxis(p.astype(jnp.float32) * scale, 2, 4)


@functools.partial(jax.jit, static_argnames=["sm_scale", "return_lse", "splits", "step_tiles",
                                             "max_concurrent_steps", "segment_depth"])
def mgpu_decode_attention(q, layer, store: MmaStore, *, segment=None, sm_scale: Optional[float] = None,
                          return_lse: bool = False, splits: Optional[int] = None, step_tiles: Optional[int] = None,
                          max_concurrent_steps: int = STAGES, segment_depth: Optional[int] = None):
  """Softmax attention of T query rows per sequence over layer ``layer`` of one MMA-packed store (and a
  full-precision segment): the partial of ``mgpu_decode_partial`` (same arguments) normalized.

  Returns:
    o [B, Hkv, T, g, D] in q.dtype (0 for a row with no valid key) and, with ``return_lse``, lse [B, Hkv, T, g]
    float32 (MASK_VALUE for a row with no valid key), as ``decode_attention`` returns them.
  """
  o, m, l = mgpu_decode_partial(q, layer, store, segment=segment, sm_scale=sm_scale, splits=splits,
                                step_tiles=step_tiles, max_concurrent_steps=max_concurrent_steps,
                                segment_depth=segment_depth)
  empty = l == 0
  o = (o / jnp.where(empty, 1.0, l)[..., None]).astype(q.dtype)
  if not return_lse:
    return o
  return o, jnp.where(empty, MASK_VALUE, m + jnp.log(jnp.where(empty, 1.0, l)))
