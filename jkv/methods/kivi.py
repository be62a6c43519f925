"""``kivi``: keys quantized per channel, values per token, with a full-precision residual (KIVI, ICML 2024).

Spec: shared/specs/kivi.md. State per layer (C = capacity, a multiple of R; Pk = 32/k_bits, Pv = 32/v_bits):

- keys are quantized in groups of G tokens of one channel, once R of them have gathered in the key ring
  (a flush); values are quantized per token in groups of G channels the moment they arrive (spec §3.1 rec:
  per-token groups do not depend on neighbours, so this equals quantizing them when they leave the window);
- the ring of exact keys holds positions [bK, N), slot p mod R; the ring of exact values holds the newest
  R + λ positions, slot p mod (R + λ).

With λ = 1 (the reference code's order, the default) a step attends and then compresses, so at a step with N
tokens keys before bK = R⌊(N-1)/R⌋ and values before bV = max(0, N-1-R) are read dequantized; λ = 0 is the
paper's Algorithm 1 (quantize, then attend). Those two boundaries are the whole semantics (spec §2.6), which is
why the state needs no counters beyond the sequence length.
"""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.cache import CacheMethod, CacheSpec, read_at, register, write_at
from jkv.config import DTYPES
from jkv.methods.dense import causal_mask
from jkv_kernels import dequant_attention
from jkv_kernels.attention_reference import gqa_attention_reference
from jkv_kernels.quantize_pack import quantize_pack, quantize_pack_reference
from jkv_kernels.quantization import dequantize, unpack

KIVI_BITS = (2, 4, 8)


@struct.dataclass
class KiviState:
  k_codes: jax.Array  # [L, B, H, D, C/Pk] uint32, packed along tokens
  k_scale: jax.Array  # [L, B, H, D, C/G] meta dtype
  k_zero: jax.Array  # [L, B, H, D, C/G] meta dtype
  v_codes: jax.Array  # [L, B, H, C, D/Pv] uint32, packed along channels
  v_scale: jax.Array  # [L, B, H, C, D/G] meta dtype
  v_zero: jax.Array  # [L, B, H, C, D/G] meta dtype
  k_ring: jax.Array  # [L, B, H, R, D] exact keys, slot p mod R
  v_ring: jax.Array  # [L, B, H, R + λ, D] exact values, slot p mod (R + λ)


def _gpu_kernel_available() -> bool:
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return False
  cc = getattr(dev, "compute_capability", "0.0")
  return float(cc) >= 8.0


@register
@dataclasses.dataclass(frozen=True)
class Kivi(CacheMethod):
  """KIVI settings. ``bits`` sets both widths unless ``k_bits``/``v_bits`` override one.

  ``use_kernel``: None picks the fused Pallas kernel on a GPU of compute capability >= 8.0 and the plain-jnp
  reference elsewhere; True forces the kernel (interpreted on CPU); False forces the reference.
  """

  name = "kivi"
  bits: int = 2
  k_bits: Optional[int] = None
  v_bits: Optional[int] = None
  group_size: int = 32  # G: tokens per key group, channels per value group
  residual: int = 128  # R: keys flush every R tokens; the newest R values stay exact
  quantize_before_attend: bool = False  # λ = 0 (paper's Algorithm 1) when True
  meta_dtype: str = "float16"  # dtype of scales and zero-points
  use_kernel: Optional[bool] = None

  @property
  def kb(self) -> int:
    return self.bits if self.k_bits is None else self.k_bits

  @property
  def vb(self) -> int:
    return self.bits if self.v_bits is None else self.v_bits

  @property
  def lam(self) -> int:
    return 0 if self.quantize_before_attend else 1

  @property
  def meta(self):
    return DTYPES[self.meta_dtype]

  def validate(self, spec: CacheSpec) -> None:
    G, R, D = self.group_size, self.residual, spec.head_dim
    for label, b in (("bits", self.bits), ("k_bits", self.kb), ("v_bits", self.vb)):
      if b not in KIVI_BITS:
        raise ValueError(f"kivi {label}={b} is not supported; choose one of {', '.join(map(str, KIVI_BITS))}")
    if self.meta_dtype not in DTYPES:
      raise ValueError(f"kivi meta_dtype={self.meta_dtype!r}; choose one of {', '.join(DTYPES)}")
    if G < 1 or R < 1:
      raise ValueError(f"kivi group_size={G} and residual={R} must be positive")
    if R % G:
      raise ValueError(f"kivi residual={R} must be a multiple of group_size={G}")
    if D % G:
      raise ValueError(f"kivi group_size={G} does not divide the head dim {D} (value groups span channels)")
    for b in (self.kb, self.vb):
      if G % (32 // b):
        raise ValueError(f"kivi group_size={G} must be a multiple of {32 // b} ({b}-bit codes pack {32 // b} per word)")

  def capacity_multiple(self) -> int:
    return self.residual

  # ---------------------------------------------------------------------------------------------- state

  def init(self, spec: CacheSpec) -> KiviState:
    L, B, H, C, D = spec.num_layers, spec.batch, spec.kv_heads, spec.capacity, spec.head_dim
    G, R = self.group_size, self.residual
    z = jnp.zeros
    return KiviState(
        k_codes=z((L, B, H, D, C * self.kb // 32), jnp.uint32),
        k_scale=z((L, B, H, D, C // G), self.meta),
        k_zero=z((L, B, H, D, C // G), self.meta),
        v_codes=z((L, B, H, C, D * self.vb // 32), jnp.uint32),
        v_scale=z((L, B, H, C, D // G), self.meta),
        v_zero=z((L, B, H, C, D // G), self.meta),
        k_ring=z((L, B, H, R, D), spec.dtype),
        v_ring=z((L, B, H, R + self.lam, D), spec.dtype),
    )

  def key_boundary(self, n):
    """bK: at a step holding n tokens, keys before this position are read dequantized."""
    R = self.residual
    return R * (jnp.maximum(n - self.lam, 0) // R)

  def value_boundary(self, n):
    """bV: at a step holding n tokens, values before this position are read dequantized."""
    return jnp.maximum(n - self.lam - self.residual, 0)

  def _quantize_keys(self, k, fused=False):
    """k [..., T, D] -> codes [..., D, T/Pk], scale and zero [..., D, T/G] (groups of G tokens per channel)."""
    return self._quantize_pack(k, self.kb, -2, fused)

  def _quantize_values(self, v, fused=False):
    """v [..., T, D] -> codes [..., T, D/Pv], scale and zero [..., T, D/G] (groups of G channels per token)."""
    return self._quantize_pack(v, self.vb, -1, fused)

  def _quantize_pack(self, x, bits, axis, fused):
    """The Pallas quantize-and-pack kernel for whole prompts and flushes (``fused``) where kernels run; the
    jnp reference for single tokens, where a kernel launch would cost more than the work."""
    if fused and self._use_kernel(x.shape[-1]):
      return quantize_pack(x, bits=bits, group_size=self.group_size, axis=axis, meta_dtype=self.meta,
                           interpret=jax.devices()[0].platform != "gpu")
    return quantize_pack_reference(x, bits=bits, group_size=self.group_size, axis=axis, meta_dtype=self.meta)

  # ---------------------------------------------------------------------------------------------- updates

  def prefill(self, state, layer, k, v, q, lengths):
    """Quantize every whole group of the prompt and fill both rings from the prompt's tail.

    Key groups at or past bK hold codes of exact-ring tokens or of padding; they are never read as
    quantized and the flush that reaches them rewrites them from the ring.
    """
    del q
    B, H, T, D = k.shape
    R, W = self.residual, self.residual + self.lam
    T_pad = -(-T // R) * R
    k_pad = jnp.pad(k, ((0, 0), (0, 0), (0, T_pad - T), (0, 0)))
    kc, ks, kz = self._quantize_keys(k_pad, fused=True)
    vc, vs, vz = self._quantize_values(v, fused=True)
    at = lambda buf, x, *idx: jax.lax.dynamic_update_slice(buf, x[None].astype(buf.dtype), (layer,) + idx)
    state = state.replace(
        k_codes=at(state.k_codes, kc, 0, 0, 0, 0), k_scale=at(state.k_scale, ks, 0, 0, 0, 0),
        k_zero=at(state.k_zero, kz, 0, 0, 0, 0), v_codes=at(state.v_codes, vc, 0, 0, 0, 0),
        v_scale=at(state.v_scale, vs, 0, 0, 0, 0), v_zero=at(state.v_zero, vz, 0, 0, 0, 0))
    # Key ring slot s holds position bK + s (bK is a multiple of R); value ring slot s the newest p ≡ s mod W.
    slots_k = self.key_boundary(lengths)[:, None] + jnp.arange(R)[None]  # [B, R]
    last = lengths[:, None] - 1
    slots_v = last - (last - jnp.arange(W)[None]) % W  # [B, W]
    take = lambda x, pos: jnp.take_along_axis(x, jnp.clip(pos, 0, T - 1)[:, None, :, None], axis=2)
    return state.replace(k_ring=state.k_ring.at[layer].set(take(k, slots_k).astype(state.k_ring.dtype)),
                         v_ring=state.v_ring.at[layer].set(take(v, slots_v).astype(state.v_ring.dtype)))

  def append(self, state, layer, k, v, q, lengths):
    del q
    for t in range(k.shape[2]):  # T is 1..4 at decode: a short static loop
      state = self._append_one(state, layer, k[:, :, t], v[:, :, t], lengths + t)
    return state

  def _append_one(self, state, layer, k, v, pos):
    """k, v [B, H, D] at positions pos [B]."""
    R, W = self.residual, self.residual + self.lam
    vc, vs, vz = self._quantize_values(v[:, :, None])  # [B, H, 1, ...]
    state = state.replace(v_codes=write_at(state.v_codes, layer, vc, pos, axis=2),
                          v_scale=write_at(state.v_scale, layer, vs, pos, axis=2),
                          v_zero=write_at(state.v_zero, layer, vz, pos, axis=2),
                          v_ring=write_at(state.v_ring, layer, v[:, :, None], pos % W, axis=2))
    if self.lam == 1:  # the block before p leaves the ring before p takes slot 0
      state = self._flush(state, layer, pos, due=(pos % R == 0) & (pos > 0))
    state = state.replace(k_ring=write_at(state.k_ring, layer, k[:, :, None], pos % R, axis=2))
    if self.lam == 0:  # the block ending at p is quantized before this step attends
      state = self._flush(state, layer, pos + 1, due=(pos + 1) % R == 0)
    return state

  def _flush(self, state, layer, end, due):
    """Quantize the key ring (positions [end - R, end)) into the key store, for the sequences where ``due``.

    Runs only on steps where some sequence is due (one step in R for a batch in lockstep).
    """
    return jax.lax.cond(jnp.any(due), lambda s: self._flush_now(s, layer, end, due), lambda s: s, state)

  def _flush_now(self, state, layer, end, due):
    R, G = self.residual, self.group_size
    kc, ks, kz = self._quantize_keys(state.k_ring[layer], fused=True)  # [B, H, D, R/Pk], [B, H, D, R/G]
    start = jnp.maximum(end - R, 0)
    Pk = 32 // self.kb
    def put(buf, new, offset):
      old = read_at(buf, layer, offset, new.shape[-1], axis=3)
      return write_at(buf, layer, jnp.where(due[:, None, None, None], new, old), offset, axis=3)
    return state.replace(k_codes=put(state.k_codes, kc, start // Pk),
                         k_scale=put(state.k_scale, ks, start // G),
                         k_zero=put(state.k_zero, kz, start // G))

  # ---------------------------------------------------------------------------------------------- attention

  def _use_kernel(self, head_dim) -> bool:
    if self.use_kernel is not None:
      return self.use_kernel
    # The Triton kernels tile by powers of two.
    return _gpu_kernel_available() and head_dim & (head_dim - 1) == 0 and self.group_size & (self.group_size - 1) == 0

  def attend(self, state, layer, q, q_positions, lengths):
    if self._use_kernel(q.shape[-1]):
      return self._attend_fused(state, layer, q, q_positions, lengths)
    return self._attend_reference(state, layer, q, q_positions, lengths)

  def _dequantized_keys(self, state, layer):
    kc = unpack(state.k_codes[layer], bits=self.kb, axis=-1)
    k = dequantize(kc, state.k_scale[layer], state.k_zero[layer], axis=-1, group_size=self.group_size,
                   dtype=jnp.float32)
    return jnp.swapaxes(k, -1, -2)  # [B, H, C, D]

  def _attend_reference(self, state, layer, q, q_positions, lengths):
    """Dequantize everything and run one softmax over the quantized and exact parts (spec §2.6)."""
    R, W = self.residual, self.residual + self.lam
    C = state.v_codes.shape[3]
    pos = jnp.arange(C)
    vc = unpack(state.v_codes[layer], bits=self.vb, axis=-1)
    v_deq = dequantize(vc, state.v_scale[layer], state.v_zero[layer], axis=-1, group_size=self.group_size,
                       dtype=jnp.float32)
    k_exact = state.k_ring[layer][:, :, pos % R].astype(jnp.float32)
    v_exact = state.v_ring[layer][:, :, pos % W].astype(jnp.float32)
    quant_k = (pos[None] < self.key_boundary(lengths)[:, None])[:, None, :, None]
    quant_v = (pos[None] < self.value_boundary(lengths)[:, None])[:, None, :, None]
    k = jnp.where(quant_k, self._dequantized_keys(state, layer), k_exact)
    v = jnp.where(quant_v, v_deq, v_exact)
    return gqa_attention_reference(q, k, v, causal_mask(q_positions, C))

  def _attend_fused(self, state, layer, q, q_positions, lengths):
    """The fused kernel reads values and keys before bV from the packed store; the exact window [bV, N)
    (at most R + λ tokens) is one full-precision segment, its keys before bK dequantized here."""
    R, W, G = self.residual, self.residual + self.lam, self.group_size
    b_k, b_v = self.key_boundary(lengths), self.value_boundary(lengths)
    last = lengths[:, None] - 1
    win = last - (last - jnp.arange(W)[None]) % W  # [B, W] position held by each value-ring slot
    Pk = 32 // self.kb
    words = jnp.take_along_axis(state.k_codes[layer], jnp.clip(win // Pk, 0)[:, None, None, :], axis=-1)
    codes = unpack(words, bits=self.kb, axis=-1).reshape(words.shape + (Pk,))
    codes = jnp.take_along_axis(codes, (jnp.clip(win, 0) % Pk)[:, None, None, :, None], axis=-1)[..., 0]
    group = jnp.clip(win, 0)[:, None, None, :] // G
    scale = jnp.take_along_axis(state.k_scale[layer], group, axis=-1).astype(jnp.float32)
    zero = jnp.take_along_axis(state.k_zero[layer], group, axis=-1).astype(jnp.float32)
    k_deq = jnp.swapaxes(codes.astype(jnp.float32) * scale + zero, -1, -2)  # [B, H, W, D]
    k_exact = jnp.take_along_axis(state.k_ring[layer], (jnp.clip(win, 0) % R)[:, None, :, None], axis=2)
    k_win = jnp.where((win < b_k[:, None])[:, None, :, None], k_deq, k_exact.astype(jnp.float32))
    v_win = jnp.take_along_axis(state.v_ring[layer], (jnp.clip(win, 0) % W)[:, None, :, None], axis=2)
    mask = (win[:, None, :] >= b_v[:, None, None]) & (win[:, None, :] >= 0) & (
        win[:, None, :] <= q_positions[:, :, None])
    segment = (k_win.astype(q.dtype), v_win.astype(q.dtype), mask)
    return dequant_attention.decode_attention(
        q, state.k_codes[layer], state.k_scale[layer], state.k_zero[layer], state.v_codes[layer],
        state.v_scale[layer], state.v_zero[layer], b_v, (segment,), k_bits=self.kb, v_bits=self.vb,
        group_size=G, interpret=jax.devices()[0].platform != "gpu")

  # ---------------------------------------------------------------------------------------------- memory

  def kv_bytes(self, spec: CacheSpec, lengths: np.ndarray) -> int:
    """Bytes of the live state between steps (spec §3.2): nK = R⌊N/R⌋ quantized keys and N - nK exact ones,
    nV = max(0, N - R) quantized values and min(N, R) exact ones, plus one int32 length per sequence."""
    n = np.asarray(lengths, np.int64)
    R, G = self.residual, self.group_size
    meta = jnp.dtype(self.meta).itemsize
    act = jnp.dtype(spec.dtype).itemsize
    n_k = R * (n // R)
    n_v = np.maximum(n - R, 0)
    per_row = ((self.kb / 8 + 2 * meta / G) * n_k + (self.vb / 8 + 2 * meta / G) * n_v
               + act * ((n - n_k) + (n - n_v)))
    return int(round(spec.num_layers * spec.kv_heads * spec.head_dim * per_row.sum())) + 4 * len(n)

