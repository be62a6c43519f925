"""The Llama-family decoder as pure functions: ``forward(params, tokens, positions, cache) -> (logits, cache)``.

Layers are stacked and run with ``jax.lax.scan``; the KV cache rides in the scan carry and each cache operation
gets the layer index, so compile time does not grow with depth and cache updates stay in place.
"""

import functools

import jax
import jax.numpy as jnp

from jkv.attention import prompt_attention, prompt_mask
from jkv.cache import KVCache, StepContext
from jkv.config import ModelConfig
from jkv.params import Params
from jkv.xla_options import MODEL_COMPILER_OPTIONS
from jkv_kernels.attention_reference import gqa_attention_reference


def rms_norm(x, weight, eps):
  """HF order: normalize in fp32, cast to the weights' dtype, then scale."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * normed.astype(weight.dtype)


def rope_frequencies(cfg: ModelConfig):
  """[D/2] fp32 inverse frequencies, with Llama-3 scaling when the config has it."""
  d = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  rs = cfg.rope_scaling
  if rs is None:
    return inv_freq
  wavelen = 2 * jnp.pi / inv_freq
  low_wavelen = rs.original_max_position / rs.low_freq_factor
  high_wavelen = rs.original_max_position / rs.high_freq_factor
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
  smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
  smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x, positions, inv_freq):
  """Rotate-half RoPE (the HF layout). x: [B, T, heads, D]; positions: [B, T] int32."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def _precision(x):
  """fp32 models compute in fp32: on a GPU XLA's default would run their matmuls in TF32 (10-bit mantissas)."""
  return jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def _einsum32(subscripts, x, w, out_dtype=jnp.float32):
  """An einsum accumulated in fp32 and returned in ``out_dtype`` (fp32 unless said); x's leading axes are [B, T]."""
  lone = x.shape[0] * x.shape[1] == 1 and x.dtype != jnp.float32
  if lone:
    # XLA drops a lone row's unit axes, and its vector-matrix product has no 16-bit-in, fp32-out form: it converts
    # the whole weight matrix to fp32 on every call, so a B = 1 decode step read its weights at a quarter of the
    # copy rate (H200: 0.72 TB/s against 2.8 with two rows). A second row keeps the matrix product.
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
  out = jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype, precision=_precision(x))
  return out[:, :1] if lone else out


def _matmul(subscripts, x, w):
  """An einsum accumulated in fp32 (what careful bf16 inference does), returned in the activation dtype."""
  return _einsum32(subscripts, x, w).astype(x.dtype)


def _into_residual(subscripts, x, w):
  """x @ w in fp32, for the residual stream. Where ``model`` splits the contraction (the heads of the attention's
  output product, the MLP's hidden size), each device's partial product is summed across devices in x's dtype, as
  Megatron and vLLM sum them: the two all-reduces of every layer move half fp32's bytes, [B, T, E] each."""
  from jkv import sharding  # here, as jkv.attention imports it: jkv.sharding imports the cache module
  split = sharding.axis_size(sharding.current_mesh(), "model") > 1
  return _einsum32(subscripts, x, w, x.dtype if split else jnp.float32).astype(jnp.float32)


def _qkv(layer, h, positions, cfg):
  """Projections (one product) and RoPE. Returns q [B, H, T, g, D], k and v [B, H, T, D]."""
  qkv = _matmul("bte,ehgd->bthgd", h, layer.qkv)
  if cfg.qkv_bias:
    qkv = qkv + layer.qkv_bias
  B, T = h.shape[:2]
  g = cfg.q_per_kv
  q, k, v = qkv[:, :, :, :g].reshape(B, T, cfg.q_heads, cfg.head_dim), qkv[:, :, :, g], qkv[:, :, :, g + 1]
  inv_freq = rope_frequencies(cfg)
  q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
  q = q.reshape(B, T, cfg.kv_heads, g, cfg.head_dim).transpose(0, 2, 1, 3, 4)
  return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _mlp(layer, x, cfg):
  h = rms_norm(x, layer.mlp_norm, cfg.norm_eps)
  gate_up = _matmul("bte,ecf->btcf", h, layer.gate_up)
  return x + _into_residual("btf,fe->bte", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], layer.w_down)


def _attn_out(layer, x, attn, cfg):
  B, H, T, g, D = attn.shape
  attn = attn.transpose(0, 2, 1, 3, 4).reshape(B, T, H * g, D)
  return x + _into_residual("bthd,hde->bte", attn, layer.o)


def _embed(params, tokens, cfg):
  from jkv import sharding  # here, as jkv.attention imports it: jkv.sharding imports the cache module
  looked = sharding.vocab_lookup(params.embedding, tokens)
  return (params.embedding[tokens] if looked is None else looked).astype(jnp.float32)


def _split_tokens(x):
  """A prompt's or a chunk's rows x [B, T, E] split by token over a ``seq`` mesh axis, so that the projections and
  the MLP, whose weights every device of ``seq`` holds whole, run on T / n rows on each device; XLA gathers the
  rows where a call takes them whole (q, k and v for the attention and the cache). Unchanged elsewhere, and where
  n does not divide T."""
  from jkv import sharding  # here, as jkv.attention imports it: jkv.sharding imports the cache module
  mesh = sharding.current_mesh()
  n = sharding.axis_size(mesh, sharding.SEQ_AXIS)
  if n == 1 or x.shape[1] % n:
    return x
  rows = "data" if x.shape[0] % sharding.axis_size(mesh, "data") == 0 else None
  return jax.lax.with_sharding_constraint(x, sharding.P(rows, sharding.SEQ_AXIS, None))


def _logits(params, x, cfg):
  """fp32 logits, never rounded to bf16: bf16 values near 20 are 0.125 apart, enough to flip a greedy near-tie."""
  x = rms_norm(x, params.final_norm, cfg.norm_eps)
  if params.lm_head is None:
    return _einsum32("bte,ve->btv", x, params.embedding)
  return _einsum32("bte,ev->btv", x, params.lm_head)


def forward(params: Params, tokens, positions, cache: KVCache, *, cfg: ModelConfig, prefill: bool = False,
            extend: bool = False, pre_decode: bool = False, logit_rows=None):
  """One model step over the cache.

  Args:
    params: the parameter tree.
    tokens: [B, T] int32.
    positions: [B, T] int32 RoPE positions. At prefill the prompt sits in slots [0, T) and padding has
      position -1; at decode the rows are the next positions, ``cache.lengths[:, None] + arange(T)``.
    cache: the KV cache; at prefill it must be empty.
    cfg: model config (static).
    prefill: store the prompt (attention is exact among its tokens) rather than step the cache.
    extend: store a later chunk of the prompts (chunked prefill, ``CacheMethod.extend``): rows at positions
      ``cache.lengths[:, None] + arange(T)``, -1 past a prompt's end.
    pre_decode: the method's pre-decode pass (``CacheMethod.pre_decode``): one row attends over the cache and is
      not stored; the lengths do not move.
    logit_rows: optional [B, K] int32 token indices: compute logits for those rows only (a long prompt's
      [B, T, vocab] logits can outgrow the whole cache).

  Returns:
    logits [B, T or K, vocab] float32 and the updated cache.
  """
  method = cache.method
  x = _embed(params, tokens, cfg)
  if prefill or extend:
    x = _split_tokens(x)
  if prefill:
    ctx = StepContext(lengths=jnp.sum(positions >= 0, axis=1).astype(jnp.int32), positions=positions,
                      impl=cache.impl)
    lengths = ctx.lengths
  elif extend:
    ctx = StepContext(lengths=cache.lengths, positions=positions, impl=cache.impl)
    lengths = cache.lengths + jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
  else:
    ctx = StepContext(lengths=cache.lengths, positions=positions, impl=cache.impl)
    lengths = cache.lengths if pre_decode else method.advance(cache.lengths, tokens.shape[1])

  def body(carry, xs):
    x, state = carry
    layer, i = xs
    with jax.named_scope("qkv"):
      q, k, v = _qkv(layer, rms_norm(x, layer.attn_norm, cfg.norm_eps), positions, cfg)
    if prefill:
      with jax.named_scope("attention"):
        attn = prompt_attention(q, k, v, positions, flash=cache.impl == "pallas")
      with jax.named_scope("cache_update"):
        state = method.prefill(state, i, q, k, v, ctx)
    elif extend:
      with jax.named_scope("cache_extend"):
        attn, state = method.extend(state, i, q, k, v, ctx)
    elif pre_decode:
      with jax.named_scope("pre_decode"):
        attn, state = method.pre_decode(state, i, q, k, v, ctx)
    else:
      with jax.named_scope("cache_step"):
        attn, state = method.step(state, i, q, k, v, ctx)
    x = _attn_out(layer, x, attn, cfg)
    with jax.named_scope("mlp"):
      x = _mlp(layer, x, cfg)
    return (x, state), None

  (x, state), _ = jax.lax.scan(body, (x, cache.state), (params.layers, jnp.arange(cfg.num_layers)))
  if not (prefill or extend or pre_decode):
    with jax.named_scope("cache_end_step"):
      state = method.end_step(state, ctx)
  if logit_rows is not None:
    x = jnp.take_along_axis(x, logit_rows[:, :, None], axis=1)
  return _logits(params, x, cfg), cache.replace(state=state, lengths=lengths)


@functools.partial(jax.jit, static_argnames=("cfg",), compiler_options=MODEL_COMPILER_OPTIONS)
def forward_no_cache(params: Params, cfg: ModelConfig, tokens):
  """Causal logits [B, T, vocab] float32 for full sequences, no cache (the parity reference path)."""
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = prompt_mask(positions)
  x = _embed(params, tokens, cfg)

  def body(x, layer):
    q, k, v = _qkv(layer, rms_norm(x, layer.attn_norm, cfg.norm_eps), positions, cfg)
    x = _attn_out(layer, x, gqa_attention_reference(q, k, v, mask), cfg)  # always the fp32 reference
    return _mlp(layer, x, cfg), None

  x, _ = jax.lax.scan(body, x, params.layers)
  return _logits(params, x, cfg)
