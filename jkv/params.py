"""Model parameters as registered dataclass pytrees, with one ``abstract`` description of every leaf.

Layers are stacked: every per-layer array has a leading ``num_layers`` axis, so the forward pass scans them.
Conversion (``jkv_convert``) fills this same tree, path by path, from the shapes ``abstract`` gives.
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jkv.config import ModelConfig


@struct.dataclass
class Layers:
  """All decoder layers, stacked along axis 0 (L = num_layers)."""

  attn_norm: jax.Array  # [L, embed]
  # The projections that share an input are one product each (a decode step reads every weight once, and a
  # separate product per matrix cost 0.5 ms of a Llama-3-8B step at B = 8 on an H100: benchmarks/README.md):
  # KV head h's g query heads (query head g h + j), then its key, then its value, so that the heads split with
  # their KV head over a mesh; the MLP's gate, then its up projection.
  qkv: jax.Array  # [L, embed, kv_heads, q_per_kv + 2, head_dim]
  o: jax.Array  # [L, q_heads, head_dim, embed]
  qkv_bias: Optional[jax.Array]  # [L, kv_heads, q_per_kv + 2, head_dim] (Qwen2) or None
  mlp_norm: jax.Array  # [L, embed]
  gate_up: jax.Array  # [L, embed, 2, ffw_size]
  w_down: jax.Array  # [L, ffw_size, embed]


@struct.dataclass
class Params:
  embedding: jax.Array  # [vocab, embed]
  layers: Layers
  final_norm: jax.Array  # [embed]
  lm_head: Optional[jax.Array]  # [embed, vocab], None when tied to the embedding


def abstract(cfg: ModelConfig) -> Params:
  """The parameter tree as ``jax.ShapeDtypeStruct`` leaves: shapes and dtypes written once."""
  L, E, F = cfg.num_layers, cfg.embed, cfg.ffw_size
  Hq, Hkv, g, D = cfg.q_heads, cfg.kv_heads, cfg.q_per_kv, cfg.head_dim
  dt = cfg.jnp_dtype

  def s(*shape):
    return jax.ShapeDtypeStruct(shape, dt)

  layers = Layers(
      attn_norm=s(L, E),
      qkv=s(L, E, Hkv, g + 2, D),
      o=s(L, Hq, D, E),
      qkv_bias=s(L, Hkv, g + 2, D) if cfg.qkv_bias else None,
      mlp_norm=s(L, E),
      gate_up=s(L, E, 2, F),
      w_down=s(L, F, E),
  )
  return Params(
      embedding=s(cfg.vocab_size, E),
      layers=layers,
      final_norm=s(E),
      lm_head=None if cfg.tie_embeddings else s(E, cfg.vocab_size),
  )


# Drawn in the target dtype (an 8B-parameter tree in fp32 first would need twice the memory), each leaf by one
# compiled computation that writes it directly: op by op, a leaf of 7 GiB (gate_up at the Llama-3-8B shape) left
# as many temporaries of its size behind in the allocator's pool, and the largest batch then ran out beside them.
@functools.partial(jax.jit, static_argnums=(2, 3))
def _random_leaf(key, scale, shape, dtype):
  return (scale * jax.random.normal(key, shape, dtype)).astype(dtype)


def init_random(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
  """Random parameters of the right shapes (benchmarks and tests); norms start at one."""
  tree = abstract(cfg)
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  out = [_random_leaf(k, scale, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  params = jax.tree.unflatten(treedef, out)
  ones = lambda a: jnp.ones_like(a)
  return params.replace(
      final_norm=ones(params.final_norm),
      layers=params.layers.replace(attn_norm=ones(params.layers.attn_norm),
                                   mlp_norm=ones(params.layers.mlp_norm)))


def cast(params: Params, dtype) -> Params:
  return jax.tree.map(lambda a: a.astype(dtype), params)
