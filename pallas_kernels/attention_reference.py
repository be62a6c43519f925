"""The one attention reference: masked softmax attention with GQA, in plain jnp and fp32.

Every method's reference path and every kernel test ends here. Query heads that share a KV head are a separate
axis (``g``), so K/V are never repeated.
"""

import jax
import jax.numpy as jnp

# A finite mask value (as in jax's Pallas ops): -inf would turn a fully masked row into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def gqa_attention_reference(q, k, v, mask, *, sm_scale=None):
  """Softmax attention of T query rows per sequence over S keys.

  Args:
    q: [B, Hkv, T, g, D] queries; g query heads share each KV head.
    k: [B, Hkv, S, D] keys.
    v: [B, Hkv, S, D] values.
    mask: [B, T, S] bool, True where query row t may attend key s.
    sm_scale: logit scale, default 1/sqrt(D).

  Returns:
    [B, Hkv, T, g, D] in q.dtype. A row with no valid key gives zeros, never NaN.
  """
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  logits = jnp.einsum("bhtgd,bhsd->bhtgs", q.astype(jnp.float32), k.astype(jnp.float32))
  logits = jnp.where(mask[:, None, :, None, :], logits * sm_scale, MASK_VALUE)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask[:, None, :, None, :], jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhtgs,bhsd->bhtgd", p, v.astype(jnp.float32))
  return (o / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)).astype(q.dtype)


gqa_attention_reference_jit = jax.jit(gqa_attention_reference, static_argnames=("sm_scale",))
