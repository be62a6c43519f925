"""``fakequant``: simulated quantization for the KIVI Table 1 ablation (arXiv:2402.02750, Sec. 3.1 and Table 3).

The dense cache is kept (the ``dense`` method's state and writes, by composition); at every decode step the whole
cache, the current token included, is quantized and dequantized with the chosen grouping, and attention runs on the
result (the paper does not say how often it re-quantizes). Prefill attention stays exact. No residual: every
token is quantized. Keys or values grouped per channel form groups of G tokens; the last, partial group is
zero-padded as in the paper (positions past a sequence's length count as zeros).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jkv.attention import causal_mask
from jkv.cache import CacheMethod, CacheSpec, HeldBytes, StepContext
from jkv.chunk_attention import HeldRows
from jkv.config import DTYPES
from jkv.methods import dense
from jkv.methods.registry import register
from jkv_kernels.attention_reference import gqa_attention_reference
from jkv_kernels.quantization import BITS, dequantize, quantize

AXES = ("channel", "token")


@register
@dataclasses.dataclass(frozen=True)
class FakeQuant(CacheMethod):
  name = "fakequant"
  bits: int = dataclasses.field(default=2, metadata={"help": "code width of keys and values"})
  key_axis: str = dataclasses.field(default="channel", metadata={
      "help": "'channel' groups G consecutive tokens of one key channel, 'token' G channels of one token"})
  value_axis: str = dataclasses.field(default="token", metadata={"help": "grouping of values, as --key-axis"})
  group_size: int = dataclasses.field(default=32, metadata={"help": "G: elements per quantization group"})
  meta_dtype: str = dataclasses.field(default="float16", metadata={"help": "dtype of scales and zero-points"})

  def __post_init__(self):
    if self.bits not in BITS:
      raise ValueError(f"fakequant bits={self.bits} is not supported; choose one of {', '.join(map(str, BITS))}")
    for label, axis in (("key_axis", self.key_axis), ("value_axis", self.value_axis)):
      if axis not in AXES:
        raise ValueError(f"fakequant {label}={axis!r}; choose 'channel' or 'token'")
    if self.group_size < 1:
      raise ValueError(f"fakequant group_size={self.group_size} must be positive")
    if self.meta_dtype not in DTYPES:
      raise ValueError(f"fakequant meta_dtype={self.meta_dtype!r}; choose one of {', '.join(DTYPES)}")

  def check(self, spec: CacheSpec) -> None:
    if "token" in (self.key_axis, self.value_axis) and spec.head_dim % self.group_size:
      raise ValueError(f"fakequant group_size={self.group_size} does not divide the head dim {spec.head_dim}")

  def capacity_multiple(self) -> int:
    return self.group_size

  def abstract(self, spec: CacheSpec) -> dense.DenseState:
    return dense.dense_abstract(spec)

  def prefill(self, state, layer, q, k, v, ctx: StepContext):
    return dense.dense_prefill(state, layer, k, v)

  def _fake(self, x, axis_name, lengths):
    """x [B, H, C, D]: quantize-dequantize with padding (positions >= length) set to zero."""
    valid = (jnp.arange(x.shape[2])[None] < lengths[:, None])[:, None, :, None]
    x = jnp.where(valid, x.astype(jnp.float32), 0.0)
    axis = 2 if axis_name == "channel" else 3
    codes, scale, zero = quantize(x, bits=self.bits, axis=axis, group_size=self.group_size,
                                  meta_dtype=DTYPES[self.meta_dtype])
    return dequantize(codes, scale, zero, axis=axis, group_size=self.group_size, dtype=jnp.float32)

  def step(self, state, layer, q, k, v, ctx: StepContext):
    state = dense.dense_store(state, layer, k, v, ctx.lengths)
    return self._attention(state, layer, q, ctx.positions, self.advance(ctx.lengths, q.shape[2])), state

  def _attention(self, state, layer, q, positions, held, *, return_lse: bool = False):
    """q over the cache of ``held`` [B] tokens fake-quantized, row t seeing the slots <= positions [B, T]."""
    k_fake = self._fake(state.k[layer], self.key_axis, held)
    v_fake = self._fake(state.v[layer], self.value_axis, held)
    return gqa_attention_reference(q, k_fake, v_fake, causal_mask(positions, k_fake.shape[2]), return_lse=return_lse)

  # One range of each sequence's slots (jkv.context_parallel): a range is whole groups of G tokens (the capacity's
  # multiple), so each device quantizes the groups it holds as one device quantizes them, the last one zero-padded
  # by the device that holds the sequence's end.

  def attend(self, state, layer, q, ctx: StepContext):
    return self._attention(state, layer, q, ctx.positions, ctx.lengths, return_lse=True)

  def store_span(self, state, layer, q, k, v, ctx: StepContext):
    return dense.dense_store_span(state, layer, k, v, ctx.lengths)

  def held_rows(self, state, layer, lengths) -> HeldRows:
    """The dense cache fake-quantized whole, as each decode step reads it."""
    fake = lambda x, axis: self._fake(x[layer], axis, lengths).astype(x.dtype)
    return HeldRows(fake(state.k, self.key_axis), fake(state.v, self.value_axis), lengths)

  def store_chunk(self, state, layer, q, k, v, ctx: StepContext):
    return dense.dense_store(state, layer, k, v, ctx.lengths)

  def held_bytes(self, spec: CacheSpec, state, lengths: np.ndarray) -> HeldBytes:
    """Bytes a real store of this layout would hold (the simulation itself keeps the dense cache): codes plus
    one scale and zero-point per group, per-channel groups counted over the zero-padded token axis."""
    G, meta = self.group_size, np.dtype(DTYPES[self.meta_dtype]).itemsize
    n = np.asarray(lengths, np.int64)
    n_pad = -(-n // G) * G
    per_tensor = lambda axis: (n_pad if axis == "channel" else n) * (self.bits / 8 + 2 * meta / G)
    per_row = per_tensor(self.key_axis) + per_tensor(self.value_axis)
    return HeldBytes(device=int(round(spec.num_layers * spec.kv_heads * spec.head_dim * per_row.sum())))
