"""Model parameters as registered dataclass pytrees, with one ``abstract`` description of every leaf.

Layers are stacked: every per-layer array has a leading ``num_layers`` axis, so the forward pass scans them.
Conversion (``jkv_convert``) fills this same tree, path by path, from the shapes ``abstract`` gives.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jkv.config import ModelConfig


@struct.dataclass
class Layers:
  """All decoder layers, stacked along axis 0 (L = num_layers)."""

  attn_norm: jax.Array  # [L, embed]
  q: jax.Array  # [L, embed, q_heads, head_dim]
  k: jax.Array  # [L, embed, kv_heads, head_dim]
  v: jax.Array  # [L, embed, kv_heads, head_dim]
  o: jax.Array  # [L, q_heads, head_dim, embed]
  q_bias: Optional[jax.Array]  # [L, q_heads, head_dim] (Qwen2) or None
  k_bias: Optional[jax.Array]  # [L, kv_heads, head_dim] or None
  v_bias: Optional[jax.Array]  # [L, kv_heads, head_dim] or None
  mlp_norm: jax.Array  # [L, embed]
  w_gate: jax.Array  # [L, embed, ffw_size]
  w_up: jax.Array  # [L, embed, ffw_size]
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
  Hq, Hkv, D = cfg.q_heads, cfg.kv_heads, cfg.head_dim
  dt = cfg.jnp_dtype

  def s(*shape):
    return jax.ShapeDtypeStruct(shape, dt)

  layers = Layers(
      attn_norm=s(L, E),
      q=s(L, E, Hq, D),
      k=s(L, E, Hkv, D),
      v=s(L, E, Hkv, D),
      o=s(L, Hq, D, E),
      q_bias=s(L, Hq, D) if cfg.qkv_bias else None,
      k_bias=s(L, Hkv, D) if cfg.qkv_bias else None,
      v_bias=s(L, Hkv, D) if cfg.qkv_bias else None,
      mlp_norm=s(L, E),
      w_gate=s(L, E, F),
      w_up=s(L, E, F),
      w_down=s(L, F, E),
  )
  return Params(
      embedding=s(cfg.vocab_size, E),
      layers=layers,
      final_norm=s(E),
      lm_head=None if cfg.tie_embeddings else s(E, cfg.vocab_size),
  )


def init_random(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
  """Random parameters of the right shapes (benchmarks and tests); norms start at one."""
  tree = abstract(cfg)
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  # Drawn in the target dtype: an 8B-parameter tree in fp32 first would need twice the memory.
  out = [(scale * jax.random.normal(k, x.shape, x.dtype)).astype(x.dtype) for k, x in zip(keys, leaves)]
  params = jax.tree.unflatten(treedef, out)
  ones = lambda a: jnp.ones_like(a)
  return params.replace(
      final_norm=ones(params.final_norm),
      layers=params.layers.replace(attn_norm=ones(params.layers.attn_norm),
                                   mlp_norm=ones(params.layers.mlp_norm)))


def cast(params: Params, dtype) -> Params:
  return jax.tree.map(lambda a: a.astype(dtype), params)
