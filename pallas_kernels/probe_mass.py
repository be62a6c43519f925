"""Probe attention mass at prefill (Pallas, Triton lowering): how much softmax attention each prompt key receives
from a set of probe queries, summed over the probes and the query heads of its KV head (ZipCache's token
saliency, docs/methods/zipcache.md; arXiv:2405.14256), without materializing any probabilities.

Layouts (P probes, g query heads per KV head; the R = P * g probe rows of a KV head are probe-major, r = p * g + i):

    q     [B, Hkv, T, g, D]   the prompt's queries (only the probes' positions are read)
    k     [B, Hkv, T, D]      the prompt's keys
    rows  [B, P] int32        each probe's position; probe p sees keys j <= rows[b, p]
    ok    [B, P] bool         False: padding of the probe list (contributes nothing)
    mass  [B, Hkv, T] f32     sum over real probes p and heads i of softmax_j(q[rows[p], i] . k[j] / sqrt(D))

Why two passes: a key's share of a probe row's attention, exp(s - lse), needs that row's log-sum-exp over all the
keys it sees, and the mass of a key sums over every row that sees it. One pass over (row block, key block) tiles
would either hold a row's probabilities until its lse is known (the [R, T] matrix the kernel exists to avoid) or
add into each key's mass from many programs at once (atomics, a nondeterministic sum). So:

  1. ``_row_lse_kernel``, grid (B, Hkv, R / block_rows): a block of probe rows streams the key blocks up to its
     last position with an online max and sum (flash attention without values) and writes each row's lse.
  2. ``_key_mass_kernel``, grid (B, Hkv, T / block_keys): a block of keys streams the probe-row blocks that can
     see it and sums exp(s - lse) over them; each program owns its keys' mass (deterministic, no atomics).

Both passes compute the same logits (the same dot over the same tiles). The wrapper sorts the probes by position
(real ones ascending, after the padding), so a row block's keys end at its last row's position (pass 1 stops
there) and the blocks that see a key block are a suffix of the row blocks (pass 2 starts at the first one,
found by a binary search in XLA): for probes spread evenly over the prompt, each pass computes about half of the
R x T logits.

Dots take the inputs' dtype (bf16 operands on tensor cores) with fp32 accumulation; fp32 inputs multiply at
HIGHEST precision (Triton would otherwise use TF32). Logits are scaled by 1/sqrt(D) in fp32, as in the reference.
Around the kernels XLA only gathers the probe rows of q (about R x D per KV head), sorts P positions and slices
the padded mass; a head dim that is not a power of two (>= 16) is zero-padded, since Triton tiles must be.
"""

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jkv_kernels.attention_reference import MASK_VALUE, gqa_attention_probs
from jkv_kernels.dequant_attention import triton_compiler_params

PROBE_CHUNK = 32  # probe rows scored together by the reference


def _as_tile_operand(x, dtype, head_dim):
  """x [..., D] in ``dtype`` with D zero-padded to ``head_dim`` (zeros add nothing to a dot); no copy if it is."""
  x = x.astype(dtype)
  pad = head_dim - x.shape[-1]
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _scaled_logits(q, k, sm_scale):
  """[rows, D] x [keys, D] -> [rows, keys] f32 logits: operands in their dtype, fp32 accumulation."""
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
  return logits * sm_scale


def _load_keys(k_ref, start, block_keys, num_keys):
  """Keys [start, start + block_keys) as a [block_keys, D] tile; keys past ``num_keys`` (a ragged last block) load
  as 0 and are never visible to a row (every position is < num_keys)."""
  keys = pl.ds(start, block_keys)
  if num_keys % block_keys == 0:
    return k_ref[keys, :]
  in_range = start + lax.broadcasted_iota(jnp.int32, (block_keys, k_ref.shape[1]), 0) < num_keys
  return plgpu.load(k_ref.at[keys, :], mask=in_range, other=0)


# ----------------------------------------------------------------------------------------------------------------
# Kernels


def _row_lse_kernel(
    q_ref,      # [block_rows, D] probe rows
    pos_ref,    # [block_rows] int32 their positions, ascending (-1: padding, sees nothing)
    k_ref,      # [T_blk, D] every key of the KV head (T_blk: T rounded up to whole key blocks)
    lse_ref,    # [block_rows] f32 out
    *,
    block_keys: int,
    num_keys: int,
    sm_scale: float,
):
  """Pass 1: each row's log-sum-exp of its scaled logits over keys j <= its position (MASK_VALUE for none)."""
  q, pos = q_ref[...], pos_ref[...]
  rows = q.shape[0]
  key = lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
  n_blocks = (jnp.max(pos) + block_keys) // block_keys  # keys [0, the block's last position]

  def body(i, carry):
    m, l = carry
    start = i * block_keys
    logits = _scaled_logits(q, _load_keys(k_ref, start, block_keys, num_keys), sm_scale)
    visible = start + key <= pos[:, None]
    m_next = jnp.maximum(m, jnp.max(jnp.where(visible, logits, MASK_VALUE), axis=1))
    # Zeroed, not just small: a row that sees nothing yet has m_next = MASK_VALUE, and exp(0) would count.
    p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)
    return m_next, l * jnp.exp(m - m_next) + jnp.sum(p, axis=1)

  init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
  m, l = lax.fori_loop(0, n_blocks, body, init)
  seen = l > 0
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)


def _key_mass_kernel(
    first_ref,  # [n_key_blocks] int32: the first row block whose last position reaches each key block
    q_ref,      # [R, D] every probe row of the KV head
    pos_ref,    # [R] int32 their positions, ascending
    lse_ref,    # [R] f32 their log-sum-exp (pass 1)
    k_ref,      # [T_blk, D] every key of the KV head
    mass_ref,   # [block_keys] f32 out
    *,
    block_rows: int,
    num_keys: int,
    sm_scale: float,
):
  """Pass 2: the keys' mass, sum over the rows that see them of exp(scaled logit - the row's lse)."""
  key_block = pl.program_id(2)
  block_keys = mass_ref.shape[0]
  start = key_block * block_keys
  k = _load_keys(k_ref, start, block_keys, num_keys)
  key = start + lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)

  def body(i, acc):
    rows = pl.ds(i * block_rows, block_rows)
    logits = _scaled_logits(q_ref[rows, :], k, sm_scale)
    visible = key <= pos_ref[rows][:, None]
    return acc + jnp.where(visible, jnp.exp(logits - lse_ref[rows][:, None]), 0.0)

  # Summed over rows once, after the loop: the loop body stays elementwise.
  acc = lax.fori_loop(first_ref[key_block], q_ref.shape[0] // block_rows, body,
                      jnp.zeros((block_rows, block_keys), jnp.float32))
  mass_ref[...] = jnp.sum(acc, axis=0)


# ----------------------------------------------------------------------------------------------------------------
# pallas_calls


def _row_lse(q_rows, row_position, k, *, block_rows, block_keys, num_keys, sm_scale, compiler_params, interpret):
  """Pass 1 over grid (B, Hkv, R / block_rows): lse [B, Hkv, R] f32."""
  batch, kv_heads, num_rows, head_dim = q_rows.shape
  keys_blk = pl.cdiv(num_keys, block_keys) * block_keys  # the key axis in whole blocks (loads past T are masked)
  kernel = functools.partial(_row_lse_kernel, block_keys=block_keys, num_keys=num_keys, sm_scale=sm_scale)
  return pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, num_rows // block_rows),
      in_specs=[
          pl.BlockSpec((None, None, block_rows, head_dim), lambda b, h, r: (b, h, r, 0)),  # q_rows
          pl.BlockSpec((None, block_rows), lambda b, h, r: (b, r)),                       # row_position
          pl.BlockSpec((None, None, keys_blk, head_dim), lambda b, h, r: (b, h, 0, 0)),   # k
      ],
      out_specs=pl.BlockSpec((None, None, block_rows), lambda b, h, r: (b, h, r)),        # lse
      out_shape=jax.ShapeDtypeStruct((batch, kv_heads, num_rows), jnp.float32),
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"probe_row_lse_{block_rows=}_{block_keys=}",
  )(q_rows, row_position, k)


def _key_mass(first, q_rows, row_position, lse, k, *, block_rows, block_keys, num_keys, sm_scale, compiler_params,
              interpret):
  """Pass 2 over grid (B, Hkv, T_blk / block_keys): mass [B, Hkv, T_blk] f32."""
  batch, kv_heads, num_rows, head_dim = q_rows.shape
  keys_blk = pl.cdiv(num_keys, block_keys) * block_keys  # the key axis in whole blocks (loads past T are masked)
  kernel = functools.partial(_key_mass_kernel, block_rows=block_rows, num_keys=num_keys, sm_scale=sm_scale)
  return pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, keys_blk // block_keys),
      in_specs=[
          pl.BlockSpec((None, first.shape[1]), lambda b, h, j: (b, 0)),                   # first
          pl.BlockSpec((None, None, num_rows, head_dim), lambda b, h, j: (b, h, 0, 0)),   # q_rows
          pl.BlockSpec((None, num_rows), lambda b, h, j: (b, 0)),                         # row_position
          pl.BlockSpec((None, None, num_rows), lambda b, h, j: (b, h, 0)),                # lse
          pl.BlockSpec((None, None, keys_blk, head_dim), lambda b, h, j: (b, h, 0, 0)),   # k
      ],
      out_specs=pl.BlockSpec((None, None, block_keys), lambda b, h, j: (b, h, j)),        # mass
      out_shape=jax.ShapeDtypeStruct((batch, kv_heads, keys_blk), jnp.float32),
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"probe_key_mass_{block_rows=}_{block_keys=}",
  )(first, q_rows, row_position, lse, k)


# ----------------------------------------------------------------------------------------------------------------
# Public entry


def _check_inputs(q, k, rows, ok, block_rows, block_keys):
  if q.ndim != 5 or k.ndim != 4:
    raise ValueError(f"probe_mass takes q [B, H, T, g, D] and k [B, H, T, D], got q {q.shape} and k {k.shape}")
  B, H, T, _, D = q.shape
  if k.shape != (B, H, T, D):
    raise ValueError(f"probe_mass: k {k.shape} does not match q {q.shape} (expected {(B, H, T, D)})")
  if rows.ndim != 2 or rows.shape[0] != B or ok.shape != rows.shape:
    raise ValueError(f"probe_mass takes rows and ok [B={B}, P], got rows {rows.shape} and ok {ok.shape}")
  if not jnp.issubdtype(rows.dtype, jnp.integer) or ok.dtype != jnp.bool_:
    raise ValueError(f"probe_mass takes integer rows and bool ok, got {rows.dtype} and {ok.dtype}")
  for name, block in (("block_rows", block_rows), ("block_keys", block_keys)):
    if block < 16 or block & (block - 1):
      raise ValueError(f"probe_mass: {name}={block} must be a power of two >= 16 (Triton tiles and dots)")


@functools.partial(jax.jit, static_argnames=("block_rows", "block_keys", "num_warps", "num_stages", "interpret"))
def probe_mass(q, k, rows, ok, *, block_rows: int = 128, block_keys: int = 64, num_warps: int = 4,
               num_stages: int = 2, interpret: bool = False):
  """The attention mass each key receives from the probe rows (two Pallas passes; see the module docstring).

  Args:
    q: [B, H, T, g, D] prompt queries; k: [B, H, T, D] prompt keys (any float dtype; both are promoted to one).
    rows: [B, P] int probe positions in [0, T); ok: [B, P] bool, False for probes that do not count.
    block_rows: probe rows (of the P * g per KV head) per tile; block_keys: keys per tile. Powers of two >= 16,
      clamped to the problem (an H100/H200 default; T and P * g need not be multiples).
    num_warps, num_stages: Triton launch and software-pipelining parameters.
    interpret: run in Pallas interpret mode (CPU tests).

  Returns:
    mass [B, H, T] f32: sum over probes p with ok and query heads i of softmax over keys j <= rows[b, p] of
    q[b, h, rows[b, p], i] . k[b, h, j] / sqrt(D).
  """
  _check_inputs(q, k, rows, ok, block_rows, block_keys)
  B, H, T, g, D = q.shape
  P = rows.shape[1]
  if P == 0 or T == 0:
    return jnp.zeros((B, H, T), jnp.float32)
  dtype = jnp.result_type(q.dtype, k.dtype)
  head_dim = max(16, pl.next_power_of_2(D))
  block_rows = max(16, min(block_rows, pl.next_power_of_2(P * g)))
  block_keys = max(16, min(block_keys, pl.next_power_of_2(T)))
  n_key_blocks = pl.cdiv(T, block_keys)

  # Probes sorted by position, the ones that do not count (position -1) first; padded so that the R = P' * g
  # rows fill whole row blocks. Rows are probe-major (r = p * g + i), so row positions ascend too.
  probe_multiple = block_rows // math.gcd(block_rows, g)
  num_probes = pl.cdiv(P, probe_multiple) * probe_multiple
  position = jnp.where(ok, rows, -1).astype(jnp.int32)
  position = jnp.sort(jnp.pad(position, ((0, 0), (0, num_probes - P)), constant_values=-1), axis=1)
  q_rows = jnp.take_along_axis(q, jnp.maximum(position, 0)[:, None, :, None, None], axis=2)  # [B, H, P', g, D]
  q_rows = q_rows.reshape(B, H, num_probes * g, D)
  row_position = jnp.repeat(position, g, axis=1)  # [B, R]
  q_rows, k = _as_tile_operand(q_rows, dtype, head_dim), _as_tile_operand(k, dtype, head_dim)

  # Row blocks whose last (largest) position is below a key block's start see none of it: pass 2 starts after them.
  block_last = row_position[:, block_rows - 1::block_rows]  # [B, R / block_rows], ascending
  key_block_start = jnp.arange(n_key_blocks, dtype=jnp.int32) * block_keys
  first = jax.vmap(lambda last: jnp.searchsorted(last, key_block_start, side="left"))(block_last).astype(jnp.int32)

  common = dict(block_rows=block_rows, block_keys=block_keys, num_keys=T, sm_scale=D ** -0.5, interpret=interpret,
                compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=num_stages))
  lse = _row_lse(q_rows, row_position, k, **common)
  return _key_mass(first, q_rows, row_position, lse, k, **common)[:, :, :T]


# ----------------------------------------------------------------------------------------------------------------
# Reference


def probe_mass_reference(q, k, rows, ok, *, chunk: int = PROBE_CHUNK):
  """The same mass [B, H, T] f32 in plain jnp (the one attention reference, fp32, exact softmax per row), ``chunk``
  probe rows at a time: at most [B, H, chunk, g, T] probabilities exist at once, never the [B, H, T, T] matrix."""
  B, H, T, g, D = q.shape
  P = rows.shape[1]
  n_chunks = -(-P // chunk)
  pad = n_chunks * chunk - P
  rows = jnp.pad(rows, ((0, 0), (0, pad)))
  ok = jnp.pad(ok, ((0, 0), (0, pad)))
  keys = jnp.arange(T)

  def body(c, mass):
    r = jax.lax.dynamic_slice_in_dim(rows, c * chunk, chunk, axis=1)
    o = jax.lax.dynamic_slice_in_dim(ok, c * chunk, chunk, axis=1)
    qp = jnp.take_along_axis(q, r[:, None, :, None, None], axis=2)  # [B, H, chunk, g, D]
    mask = o[:, :, None] & (keys[None, None, :] <= r[:, :, None])  # [B, chunk, T]
    p, _ = gqa_attention_probs(qp, k, mask)
    return mass + jnp.sum(p, axis=(2, 3))

  return jax.lax.fori_loop(0, n_chunks, body, jnp.zeros((B, H, T), jnp.float32))
