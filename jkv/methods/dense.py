"""``dense``: the unquantized cache in the model dtype, the baseline every method is compared with."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.cache import CacheMethod, CacheSpec, dense_kv_bytes, register, write_at
from jkv_kernels.attention_reference import gqa_attention_reference


@struct.dataclass
class DenseState:
  k: jax.Array  # [L, B, H, C, D] model dtype
  v: jax.Array  # [L, B, H, C, D] model dtype


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
    return DenseState(k=write_at(state.k, layer, k, zero, axis=2), v=write_at(state.v, layer, v, zero, axis=2))

  def append(self, state, layer, k, v, q, lengths):
    del q
    return DenseState(k=write_at(state.k, layer, k, lengths, axis=2), v=write_at(state.v, layer, v, lengths, axis=2))

  def attend(self, state, layer, q, q_positions, lengths):
    del lengths  # q_positions already bound every row to the cached tokens
    k, v = state.k[layer], state.v[layer]
    return gqa_attention_reference(q, k, v, causal_mask(q_positions, k.shape[2]))

  def kv_bytes(self, spec: CacheSpec, lengths: np.ndarray) -> int:
    return dense_kv_bytes(spec, lengths)
