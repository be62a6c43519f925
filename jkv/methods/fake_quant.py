"""``fakequant``: simulated quantization for the KIVI Table 1 ablation (spec §6.2, §7.15).

The dense cache is kept; at every decode step the whole cache, the current token included, is quantized and
dequantized with the chosen grouping, and attention runs on the result. Prefill attention stays exact. No
residual: every token is quantized. Keys or values grouped per channel form groups of G tokens; the last,
partial group is zero-padded as in the paper (positions past a sequence's length count as zeros).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jkv.cache import CacheSpec, register
from jkv.config import DTYPES
from jkv.methods.dense import Dense, causal_mask
from jkv_kernels.attention_reference import gqa_attention_reference
from jkv_kernels.quantization import dequantize, quantize

AXES = ("channel", "token")


@register
@dataclasses.dataclass(frozen=True)
class FakeQuant(Dense):
  """``key_axis``/``value_axis``: 'channel' groups G consecutive tokens of one channel, 'token' groups G
  consecutive channels of one token."""

  name = "fakequant"
  bits: int = 2
  key_axis: str = "channel"
  value_axis: str = "token"
  group_size: int = 32
  meta_dtype: str = "float16"

  def validate(self, spec: CacheSpec) -> None:
    if self.bits not in (1, 2, 4, 8):
      raise ValueError(f"fakequant bits={self.bits} is not supported; choose one of 1, 2, 4, 8")
    for label, axis in (("key_axis", self.key_axis), ("value_axis", self.value_axis)):
      if axis not in AXES:
        raise ValueError(f"fakequant {label}={axis!r}; choose 'channel' or 'token'")
    if "token" in (self.key_axis, self.value_axis) and spec.head_dim % self.group_size:
      raise ValueError(f"fakequant group_size={self.group_size} does not divide the head dim {spec.head_dim}")

  def capacity_multiple(self) -> int:
    return self.group_size

  def _fake(self, x, axis_name, lengths):
    """x [B, H, C, D]: quantize-dequantize with padding (positions >= length) set to zero."""
    valid = (jnp.arange(x.shape[2])[None] < lengths[:, None])[:, None, :, None]
    x = jnp.where(valid, x.astype(jnp.float32), 0.0)
    axis = 2 if axis_name == "channel" else 3
    codes, scale, zero = quantize(x, bits=self.bits, axis=axis, group_size=self.group_size,
                                  meta_dtype=DTYPES[self.meta_dtype])
    return dequantize(codes, scale, zero, axis=axis, group_size=self.group_size, dtype=jnp.float32)

  def attend(self, state, layer, q, q_positions, lengths):
    k = self._fake(state.k[layer], self.key_axis, lengths)
    v = self._fake(state.v[layer], self.value_axis, lengths)
    return gqa_attention_reference(q, k, v, causal_mask(q_positions, k.shape[2]))

  def kv_bytes(self, spec: CacheSpec, lengths: np.ndarray) -> int:
    """Bytes a real store of this layout would hold (the simulation itself keeps the dense cache): codes plus
    one scale and zero-point per group, per-channel groups counted over the zero-padded token axis."""
    G, meta = self.group_size, np.dtype(DTYPES[self.meta_dtype]).itemsize
    n = np.asarray(lengths, np.int64)
    n_pad = -(-n // G) * G
    per_tensor = lambda axis: (n_pad if axis == "channel" else n) * (self.bits / 8 + 2 * meta / G)
    per_row = per_tensor(self.key_axis) + per_tensor(self.value_axis)
    return int(round(spec.num_layers * spec.kv_heads * spec.head_dim * per_row.sum()))
