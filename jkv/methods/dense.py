"""``dense``: the unquantized cache in the model dtype, the baseline every method is compared with."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.cache import CacheMethod, CacheSpec, dense_kv_bytes, register
from jkv_kernels.attention_reference import gqa_attention_reference


@struct.dataclass
class DenseState:
  k: jax.Array  # [L, B, H, C, D] model dtype
  v: jax.Array  # [L, B, H, C, D] model dtype


def write_tokens(buf, layer, x, start):
  """Write x [B, H, T, D] into buf [L, B, H, C, D] at layer ``layer``, slots start[b] + [0, T) per sequence."""
  def one(b_buf, b_x, b_start):  # b_buf [L, H, C, D], b_x [H, T, D]
    return jax.lax.dynamic_update_slice(b_buf, b_x[None].astype(b_buf.dtype), (layer, 0, b_start, 0))
  return jax.vmap(one, in_axes=(1, 0, 0), out_axes=1)(buf, x, start)


def causal_mask(q_positions, num_keys):
  """[B, T, S] bool: key slot s is visible to query row t iff s <= q_positions[b, t]."""
  return jnp.arange(num_keys)[None, None, :] <= q_positions[:, :, None]


@register
@dataclasses.dataclass(frozen=True)
class Dense(CacheMethod):
  name = "dense"

  def init(self, spec: CacheSpec) -> DenseState:
    shape = (spec.num_layers, spec.batch, spec.kv_heads, spec.capacity, spec.head_dim)
    return DenseState(k=jnp.zeros(shape, spec.dtype), v=jnp.zeros(shape, spec.dtype))

  def prefill(self, state, layer, k, v, q, lengths):
    del q, lengths  # padding slots past a sequence's length are never read
    zero = jnp.zeros((k.shape[0],), jnp.int32)
    return DenseState(k=write_tokens(state.k, layer, k, zero), v=write_tokens(state.v, layer, v, zero))

  def append(self, state, layer, k, v, q, lengths):
    del q
    return DenseState(k=write_tokens(state.k, layer, k, lengths), v=write_tokens(state.v, layer, v, lengths))

  def attend(self, state, layer, q, q_positions, lengths):
    del lengths  # q_positions already bound every row to the cached tokens
    k, v = state.k[layer], state.v[layer]
    return gqa_attention_reference(q, k, v, causal_mask(q_positions, k.shape[2]))

  def kv_bytes(self, spec: CacheSpec, lengths: np.ndarray) -> int:
    return dense_kv_bytes(spec, lengths)
