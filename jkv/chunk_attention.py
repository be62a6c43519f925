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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jkv.attention import block_size, blockwise_partials, merge_partials, normalized_partial

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


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
    return _cudnn_chunk_attention(q, k, v, positions, held, merge_held)
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


def _cudnn_chunk_attention(q, k, v, positions, held: HeldRows, merge_held=None):
  """The chunk's rows over the held rows (no mask but their count) and over themselves (causal), by two calls of
  cuDNN's flash attention in its [batch, heads, tokens, dim] layout, merged by their log-sum-exps."""
  B, H, T, g, D = q.shape
  q_heads = q.transpose(0, 1, 3, 2, 4).reshape(B, H * g, T, D)  # query head h g + j reads KV head h
  real = jnp.maximum(jnp.sum(positions >= 0, axis=1).astype(jnp.int32), 1)  # a chunk of padding: rows unused
  o_past, lse_past = cudnn_attention(q_heads, held.k, held.v, q_lengths=jnp.full((B,), T, jnp.int32),
                                     kv_lengths=held.count, causal=False)
  if merge_held is not None:
    o_past, lse_past = merge_held(o_past.astype(jnp.float32), lse_past)
  o_own, lse_own = cudnn_attention(q_heads, k, v, q_lengths=real, kv_lengths=real, causal=True)
  m = jnp.maximum(lse_past, lse_own)
  w_past, w_own = jnp.exp(lse_past - m), jnp.exp(lse_own - m)
  o = (o_past.astype(jnp.float32) * w_past[..., None] + o_own.astype(jnp.float32) * w_own[..., None])
  o = o / (w_past + w_own)[..., None]
  return o.reshape(B, H, g, T, D).transpose(0, 1, 3, 2, 4).astype(q.dtype)


def cudnn_attention(q, k, v, *, q_lengths, kv_lengths, causal: bool):
  """cuDNN's flash attention in the [batch, heads, tokens, dim] layout with its log-sum-exp in fp32.

  q [B, N, T, D], k and v [B, K, S, D] (N a multiple of K; 16-bit); returns o [B, N, T, D] in q.dtype and the
  natural log-sum-exp of each row's scaled logits [B, N, T] float32. ``jax.nn.dot_product_attention`` rounds that
  log-sum-exp to the output dtype (bf16 is 0.125 apart near 20: a merge weight off by up to 6%) and takes only the
  [batch, tokens, heads, dim] layout (a transpose of every held row), so this calls the function it wraps."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # the wrapped function; no public form keeps fp32
  mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  o, lse = cudnn.dot_product_attention(q, k, v, None, None, q_lengths, kv_lengths, scale=q.shape[-1] ** -0.5,
                                       mask_type=mask, qkv_layout="BNTH", return_residual=True)
  return o, lse.astype(jnp.float32).reshape(q.shape[:3])
