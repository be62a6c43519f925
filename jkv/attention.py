"""Attention among a prompt's own tokens (prefill): cuDNN flash attention on a GPU, the jnp reference elsewhere.

Prefill attention is exact for every method (the cache stores the compressed form afterwards), so it is the
model's concern, not a method's.
"""

import jax
import jax.numpy as jnp

from jkv_kernels.attention_reference import gqa_attention_reference


def prompt_mask(positions):
  """[B, T, T] causal mask among prompt tokens; padding (position < 0) is never a key."""
  valid = positions >= 0
  causal = jnp.tril(jnp.ones((positions.shape[1],) * 2, bool))
  return causal[None] & valid[:, None, :]


def _flash_available(dtype) -> bool:
  return jax.devices()[0].platform == "gpu" and dtype in (jnp.bfloat16, jnp.float16)


def prompt_attention(q, k, v, positions):
  """Causal attention of a right-padded prompt.

  Args:
    q: [B, H, T, g, D]; k, v: [B, H, T, D]; positions: [B, T] int32, -1 for padding.

  Returns:
    [B, H, T, g, D] in q.dtype (rows of padding tokens are unspecified).
  """
  if not _flash_available(q.dtype):
    return gqa_attention_reference(q, k, v, prompt_mask(positions))
  B, H, T, g, D = q.shape
  lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
  out = jax.nn.dot_product_attention(
      q.transpose(0, 2, 1, 3, 4).reshape(B, T, H * g, D), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
      is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      implementation="cudnn")  # XLA's version materializes [B, heads, T, T] logits: 32 GiB at 8k tokens, B=8
  return out.reshape(B, T, H, g, D).transpose(0, 2, 1, 3, 4)
