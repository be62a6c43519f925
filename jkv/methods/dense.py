"""``dense``: the unquantized cache in the model dtype, the baseline every method is compared with."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.attention import causal_mask, decode_attention
from jkv.cache import ArrayInfo, CacheMethod, CacheSpec, HeldBytes, StepContext, dense_kv_bytes
from jkv.cache_arrays import write_at, write_layer
from jkv.chunk_attention import HeldRows
from jkv.methods.registry import register

TOKENS_AXES = ("layers", "batch", "kv_heads", "tokens", "head_dim")


@struct.dataclass
class DenseState:
  k: jax.Array  # [L, B, H, C, D] model dtype
  v: jax.Array  # [L, B, H, C, D] model dtype


def dense_abstract(spec: CacheSpec) -> DenseState:
  info = ArrayInfo((spec.num_layers, spec.batch, spec.kv_heads, spec.capacity, spec.head_dim), spec.dtype,
                   TOKENS_AXES)
  return DenseState(k=info, v=info)


def dense_prefill(state: DenseState, layer, k, v) -> DenseState:
  """Write a prompt k, v [B, H, T, D] at slots [0, T) (padding slots past each length are never read)."""
  return DenseState(k=write_layer(state.k, layer, k), v=write_layer(state.v, layer, v))


def dense_store(state: DenseState, layer, k, v, lengths) -> DenseState:
  """Write rows k, v [B, H, T, D] at slots lengths + [0, T)."""
  return DenseState(k=write_at(state.k, layer, k, lengths, axis=2), v=write_at(state.v, layer, v, lengths, axis=2))


def dense_store_span(state: DenseState, layer, k, v, start) -> DenseState:
  """Write rows k, v [B, H, T, D] at slots start [B] + [0, T), dropping the rows whose slots lie outside
  [0, C): one scatter of T rows per sequence (``write_at``'s slice would be moved back inside, over held rows)."""
  B, _, T, _ = k.shape
  capacity = state.k.shape[3]
  slots = start[:, None] + jnp.arange(T)  # [B, T]
  slots = jnp.where((slots >= 0) & (slots < capacity), slots, capacity)  # negative ones would wrap around
  sequences = jnp.arange(B)[:, None]

  def put(buf, x):  # the advanced indices (sequence, slot) lead the updates: [B, T, H, D]
    return buf.at[layer, sequences, :, slots].set(x.transpose(0, 2, 1, 3).astype(buf.dtype), mode="drop")
  return DenseState(k=put(state.k, k), v=put(state.v, v))


def dense_attention(state: DenseState, layer, q, positions, held, impl: str, *, return_lse: bool = False):
  """q [B, H, T, g, D] over the held slots [0, held [B]), row t seeing those <= positions [B, T]."""
  mask = causal_mask(positions, state.k.shape[3])
  return decode_attention(q, layer, segments=((state.k, state.v, mask),), impl=impl, num_keys=jnp.max(held),
                          return_lse=return_lse)


@register
@dataclasses.dataclass(frozen=True)
class Dense(CacheMethod):
  name = "dense"

  def abstract(self, spec: CacheSpec) -> DenseState:
    return dense_abstract(spec)

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    return dense_prefill(state, layer, k, v)

  def step(self, state, layer, q, k, v, ctx: StepContext):
    state = dense_store(state, layer, k, v, ctx.lengths)
    return dense_attention(state, layer, q, ctx.positions, ctx.lengths + q.shape[2], ctx.impl), state

  def attend(self, state, layer, q, ctx: StepContext):
    return dense_attention(state, layer, q, ctx.positions, ctx.lengths, ctx.impl, return_lse=True)

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    return dense_store_span(state, layer, k, v, ctx.lengths)

  def held_rows(self, state, layer, lengths) -> HeldRows:
    return HeldRows(state.k[layer], state.v[layer], lengths)

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    return dense_store(state, layer, k, v, ctx.lengths)

  def store_spares_held_rows(self) -> bool:
    return True  # a chunk's rows go past the held ones

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    return HeldBytes(device=dense_kv_bytes(spec, lengths))
