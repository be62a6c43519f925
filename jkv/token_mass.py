"""The token mass of a store: the probability each of its slots receives from R query rows, summed over the g query
heads of its KV head, kept in the factored form the attention pass leaves it in.

The Hopper kernel writes each query head's slot weights (fp16 p, relative to a running max m per 16-slot tile) and
the probability of a slot is p exp(m - lse) once the merged log-sum-exp is known. Summed over the heads into one
[B, H, R, C] float32 array, the mass of a 524k-token store is 16 MiB a layer, written once and read three times
more by a top-k (the sum, the candidates' mask, the first round of block maxima): 1.0 ms of a 12.9 ms SpeCache step
on an H200 (``benchmarks/profile_decode_step.py``). ``TokenMass.block_max`` reads the weights once and writes one
value per block; ``TokenMass.at`` sums the heads at a few positions.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

NOT_A_CANDIDATE = -1.0  # below every probability: a top-k picks it only where fewer than k slots are candidates


@struct.dataclass
class TokenMass:
  """weights [B, H, R, G, C]: each of G query heads' share of a slot (G = 1: already summed over the heads);
  scale [B, H, R, G, C / S] float32 or None: the factor of each head's run of S slots (the kernel's tiles), so a
  slot's mass is sum over G of weights * scale; mask [B, H, C] bool or None: the slots that are keys (below the
  store's length and not holes). A masked slot's weights are unspecified."""
  weights: jax.Array
  scale: Optional[jax.Array] = None
  mask: Optional[jax.Array] = None

  @property
  def length(self) -> int:
    return self.weights.shape[-1]

  def _summed(self, weights, scale):
    """Sum over G of weights [..., G, N] times scale [..., G, N] (None: 1), head by head: elementwise adds, so XLA
    fuses them into whatever reduces the result next (a reduction over G would be a reduction of its own)."""
    terms = [weights[..., j, :].astype(jnp.float32) * (1.0 if scale is None else scale[..., j, :])
             for j in range(weights.shape[-2])]
    total = terms[0]
    for term in terms[1:]:
      total = total + term
    return total

  def _scale_at(self, positions):
    """The scale of each head at positions [B, H, R, N] -> [B, H, R, G, N] (None without one)."""
    if self.scale is None:
      return None
    per = self.length // self.scale.shape[-1]
    return jnp.take_along_axis(self.scale, (positions // per)[:, :, :, None, :], axis=-1)

  def dense(self):
    """[B, H, R, C] float32, 0 at the slots that are not keys."""
    scale = None if self.scale is None else jnp.repeat(self.scale, self.length // self.scale.shape[-1], axis=-1)
    total = self._summed(self.weights, scale)
    return total if self.mask is None else jnp.where(self.mask[:, :, None, :], total, 0.0)

  def candidates(self, bound):
    """[B, H, R, C] bool: the slots that are keys and below bound [B, R]."""
    ok = jnp.arange(self.length) < bound[:, None, :, None]
    return ok if self.mask is None else ok & self.mask[:, :, None, :]

  def block_max(self, block: int, bound):
    """[B, H, R, ceil(C / block)] float32: each run of ``block`` slots' largest mass among its candidates (slots
    that are keys and below bound [B, R]), NOT_A_CANDIDATE where it has none. One pass over the weights."""
    B, H, R, G, C = self.weights.shape
    n = -(-C // block)
    scale = None if self.scale is None else jnp.repeat(self.scale, C // self.scale.shape[-1], axis=-1)
    values = jnp.where(self.candidates(bound), self._summed(self.weights, scale), NOT_A_CANDIDATE)
    if n * block > C:
      values = jnp.pad(values, ((0, 0),) * 3 + ((0, n * block - C),), constant_values=NOT_A_CANDIDATE)
    return jnp.max(values.reshape(B, H, R, n, block), axis=-1)

  def at(self, positions, bound):
    """The mass at positions [B, H, R, N] (any int; those outside [0, C) are not candidates) -> [B, H, R, N]
    float32, NOT_A_CANDIDATE where the slot is not a key or not below bound [B, R]."""
    inside = (positions >= 0) & (positions < self.length)
    at = jnp.clip(positions, 0, self.length - 1)
    weights = jnp.take_along_axis(self.weights, at[:, :, :, None, :], axis=-1)
    ok = inside & (positions < bound[:, None, :, None])
    if self.mask is not None:
      ok &= jnp.take_along_axis(jnp.broadcast_to(self.mask[:, :, None, :], self.weights.shape[:3] + (self.length,)),
                                at, axis=-1)
    return jnp.where(ok, self._summed(weights, self._scale_at(at)), NOT_A_CANDIDATE)
