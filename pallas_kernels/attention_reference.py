"""The one attention reference: masked softmax attention with GQA, in plain jnp and fp32.

Every method's reference path and every kernel test ends here. Query heads that share a KV head are a separate
axis (``g``), so K/V are never repeated. Matmuls run at ``precision=HIGHEST``: on a GPU the default fp32 matmul
is TF32 (10 mantissa bits), which is not a reference.
"""

import jax
from jax import lax
import jax.numpy as jnp

# A finite mask value (as in jax's Pallas ops): -inf would turn a fully masked row into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _head_mask(mask):
  """[B, T, S] or [B, Hkv, T, S] -> [B, Hkv or 1, T, 1, S] (broadcasts against [B, Hkv, T, g, S])."""
  if mask.ndim == 3:
    mask = mask[:, None]
  return mask[:, :, :, None, :]


def _softmax_parts(q, k, mask, sm_scale):
  """Unnormalized probabilities p [B, Hkv, T, g, S] (0 at masked keys), their row sums l [B, Hkv, T, g, 1] and
  the log-sum-exp [B, Hkv, T, g] (MASK_VALUE for a row with no valid key)."""
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  mask = _head_mask(mask)
  logits = jnp.einsum("bhtgd,bhsd->bhtgs", q.astype(jnp.float32), k.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
  logits = jnp.where(mask, logits * sm_scale, MASK_VALUE)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  empty = l == 0
  lse = jnp.where(empty, MASK_VALUE, m + jnp.log(jnp.where(empty, 1.0, l)))[..., 0]
  return p, l, lse


def gqa_attention_probs(q, k, mask, *, sm_scale=None):
  """Softmax probabilities of T query rows over S keys, and their log-sum-exp.

  Args:
    q: [B, Hkv, T, g, D] queries.
    k: [B, Hkv, S, D] keys.
    mask: [B, T, S] or [B, Hkv, T, S] bool, True where query row t (of KV head h) may attend key s.
    sm_scale: logit scale, default 1/sqrt(D).

  Returns:
    p [B, Hkv, T, g, S] float32 (0 at masked keys; a row with no valid key is all 0), and
    lse [B, Hkv, T, g] float32: log of the sum of exp of the scaled logits over valid keys (MASK_VALUE where none).
  """
  p, l, lse = _softmax_parts(q, k, mask, sm_scale)
  return p / jnp.maximum(l, jnp.finfo(jnp.float32).tiny), lse


def gqa_attention_reference(q, k, v, mask, *, sm_scale=None, return_lse=False):
  """Softmax attention of T query rows per sequence over S keys.

  Args:
    q: [B, Hkv, T, g, D] queries; g query heads share each KV head.
    k: [B, Hkv, S, D] keys.
    v: [B, Hkv, S, D] values.
    mask: [B, T, S] or [B, Hkv, T, S] bool, True where query row t may attend key s.
    sm_scale: logit scale, default 1/sqrt(D).
    return_lse: also return the log-sum-exp [B, Hkv, T, g] (MASK_VALUE for a row with no valid key).

  Returns:
    [B, Hkv, T, g, D] in q.dtype. A row with no valid key gives zeros, never NaN.
  """
  p, l, lse = _softmax_parts(q, k, mask, sm_scale)
  o = jnp.einsum("bhtgs,bhsd->bhtgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  o = (o / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)).astype(q.dtype)
  return (o, lse) if return_lse else o


def slot_mask(length, valid, layer, start, size, kv_heads):
  """[B, Hkv, size] bool: which of a store's slots [start, start + size) are keys at ``layer``: below ``length``
  [B] and not holes (``valid``: None, or [L, B, Hkv, C] stacked or [B, Hkv, C] bool, False at a hole)."""
  mask = (start + jnp.arange(size))[None, None, :] < length[:, None, None]
  mask = jnp.broadcast_to(mask, (length.shape[0], kv_heads, size))
  if valid is not None:
    valid = valid[layer] if valid.ndim == 4 else valid
    mask = mask & lax.dynamic_slice_in_dim(valid, start, size, axis=2)
  return mask


gqa_attention_reference_jit = jax.jit(gqa_attention_reference, static_argnames=("sm_scale", "return_lse"))
