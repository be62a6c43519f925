"""Attention of one prompt chunk (chunked prefill): the chunk's rows over every token a method holds of the earlier
chunks, as it holds them, plus the chunk itself, causally and exactly. ``CacheMethod.extend`` calls it.

A chunk has many query rows per KV head (C tokens times the GQA group), so unlike decode it is bound by the
tensor cores, not by the store's bytes: a chunk of 8192 tokens over 1M held tokens does about 21 x C FLOP per
byte of a 2-bit store. So the method hands its held tokens over as 16-bit rows (``HeldRows``: a transient of one
layer, its store dequantized once per chunk), and on a GPU cuDNN's flash attention runs over them, with the
chunk's own causal part as a second call; the two merge exactly by their log-sum-exps. Elsewhere (a CPU, a GPU
without cuDNN's path, the interpret tests) the same two parts run as XLA's block-by-block online softmax.

The held rows are every held token once, in any order (attention over the past is a sum over its tokens), so
rows [0, count) of each sequence are keys for every head and row of the chunk: no per-head mask, which is what
lets cuDNN read them with a key length alone.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jkv.attention import block_size, blockwise_partials, cudnn_attention, merge_partials, normalized_partial
from jkv_kernels.attention_reference import MASK_VALUE

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
HELD_PARTS = 8  # held rows in at most this many bulk sizes (``held_attention``)


class HeldRows(NamedTuple):
  """What a method holds of one layer, as its attention reads it.

  k, v: [B, H, S, D] in the model dtype: rows [0, count) are every held token's key and value once (dequantized
  where the method stores them quantized), in any order; rows past ``count`` are not keys.
  count: [B] int32.
  """

  k: jax.Array
  v: jax.Array
  count: jax.Array


def chunk_attention(q, k, v, positions, held: HeldRows, *, impl: str, block: int = 512, merge_held=None):
  """Attention of a prompt chunk over the held rows and, causally, itself.

  Args:
    q: [B, H, T, g, D] the chunk's queries; k, v [B, H, T, D] its keys and values (post-RoPE).
    positions: [B, T] int32: the rows' positions, -1 past a prompt's end (such rows are not keys; their output is
      unspecified).
    held: the method's held rows (``HeldRows``).
    impl: "pallas" (a GPU: cuDNN's flash attention where the dtype is 16-bit) or anything else (XLA).
    block: keys per step of the XLA path.
    merge_held: optional ``(o, lse) -> (o, lse)``, applied to the rows' attention over the held rows (o [..., D]
      float32 normalized, lse [...] float32; the leading axes in any order, batch first) before the chunk's own
      part joins it: where other devices hold the rest of the sequence, it merges theirs in
      (``jkv.context_parallel``).

  Returns:
    [B, H, T, g, D] in q.dtype.
  """
  if impl == "pallas" and q.dtype in CUDNN_DTYPES and held.k.dtype == q.dtype:
    return _cudnn_chunk_attention(q, k, v, held, merge_held)
  B, H, T, g, D = q.shape
  S = held.k.shape[2]
  past_block = block_size(S, block)
  past = blockwise_partials(
      q, lambda s: _rows(held, s, past_block),
      lambda s: ((s + jnp.arange(past_block))[None, :] < held.count[:, None])[:, None, None, :],
      None, S // past_block, past_block)
  if merge_held is not None:
    past = normalized_partial(*merge_held(*merge_partials([past])))
  chunk_block = block_size(T, block)
  real = positions >= 0
  causal = (jnp.arange(T)[None, :, None] >= jnp.arange(T)[None, None, :]) & real[:, None, :]  # [B, T, T]
  own = blockwise_partials(
      q, lambda s: tuple(jax.lax.dynamic_slice_in_dim(x, s, chunk_block, axis=2).astype(jnp.float32) for x in (k, v)),
      lambda s: jax.lax.dynamic_slice_in_dim(causal, s, chunk_block, axis=2)[:, None],
      None, T // chunk_block, chunk_block)
  o, _ = merge_partials([past, own])
  return o.astype(q.dtype)


def _rows(held: HeldRows, start, size: int):
  return tuple(jax.lax.dynamic_slice_in_dim(x, start, size, axis=2).astype(jnp.float32) for x in (held.k, held.v))


def _cudnn_chunk_attention(q, k, v, held: HeldRows, merge_held=None):
  """The chunk's rows over the held rows (``held_attention``) and over themselves (causal), by cuDNN's flash
  attention in its [batch, heads, tokens, dim] layout, merged by their log-sum-exps.

  The chunk's own part takes no lengths: a prompt's padding follows its tokens, so a real row's causal keys are
  all real (a padding row's output is unspecified), and cuDNN's padding mask costs (``held_attention``)."""
  B, H, T, g, D = q.shape
  q_heads = q.transpose(0, 1, 3, 2, 4).reshape(B, H * g, T, D)  # query head h g + j reads KV head h
  past = held_attention(q_heads, held, cudnn_attention)
  if merge_held is not None:
    past = merge_held(*past)
  own = cudnn_attention(q_heads, k, v, causal=True)
  o, _ = merge_partials([normalized_partial(*past), normalized_partial(*own)])
  return o.reshape(B, H, g, T, D).transpose(0, 1, 3, 2, 4).astype(q.dtype)


def held_steps(rows: int, parts: int = HELD_PARTS) -> tuple[int, int]:
  """(step, n): held rows are read as a bulk of the first s * step rows, s in [0, n], with no mask, then the rest
  by key lengths. ``step`` is about rows / parts, a whole number of 128-row tiles (at least one)."""
  step = max(1, -(-rows // (parts * 128))) * 128
  return step, rows // step


def held_attention(q, held: HeldRows, attend):
  """q [B, N, T, D] over the held rows (k, v [B, K, S, D], rows [0, count) keys): (o [B, N, T, D] float32
  normalized, lse [B, N, T] float32; o = 0 and lse = MASK_VALUE for a sequence that holds no row).

  ``attend(q, k, v, causal=False, kv_lengths=None)`` -> (o, lse) is one flash-attention call. cuDNN's key lengths
  (its padding mask) cost it 8% over 128k keys and 14% over 1M (``benchmarks/attention_core.py``), so the rows
  every sequence holds in whole steps go in one call without a mask and only the rest (less than a step per
  sequence, more where a batch is ragged) by lengths: one branch of a ``lax.switch`` per bulk size, each of
  static shapes."""
  S = held.k.shape[2]
  step, n = held_steps(S)

  def bulk_then_rest(s: int):
    bulk = s * step
    parts = []
    if bulk:
      parts.append(normalized_partial(*attend(q, held.k[:, :, :bulk], held.v[:, :, :bulk], causal=False)))
    if bulk < S:
      rest = held.count - bulk
      o, lse = attend(q, held.k[:, :, bulk:], held.v[:, :, bulk:], causal=False, kv_lengths=jnp.maximum(rest, 1))
      some = (rest > 0)[:, None, None]
      parts.append(normalized_partial(jnp.where(some[..., None], o, 0.0), jnp.where(some, lse, MASK_VALUE)))
    return merge_partials(parts)

  bulk_steps = jnp.minimum(jnp.min(held.count) // step, n)
  return jax.lax.switch(bulk_steps, [functools.partial(bulk_then_rest, s) for s in range(n + 1)])
