"""The token mass of a store: the probability each of its slots receives from R query rows, summed over the g query
heads of its KV head, kept in the factored form and the layout the attention pass leaves it in.

The Hopper kernel writes each query head's slot weights (fp16 p, relative to a running max m per 16-slot tile),
position by position with the heads innermost, and the probability of a slot is p exp(m - lse) once the merged
log-sum-exp is known. Summed over the heads into one [B, H, R, C] float32 array, the mass of a 524k-token store is
16 MiB a layer, written once and read three times more by a top-k (the sum, the candidates' mask, the first round of
block maxima): 1.0 ms of a 12.9 ms SpeCache step on an H200 (``benchmarks/profile_decode_step.py``); transposed to
heads-major first, another 0.8 ms. ``TokenMass.block_max`` reads the weights once, in place, and writes one value
per block; ``TokenMass.at`` sums the heads at a few positions.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

NOT_A_CANDIDATE = -1.0  # below every probability: a top-k picks it only where fewer than k slots are candidates


@struct.dataclass
class TokenMass:
  """weights [B, H, C, R, G]: each of G query heads' share of each slot, from each of R rows (G = 1: already summed
  over the heads); scale [B, H, C / S, R, G] float32 or None: the factor of each head's run of S slots (the
  kernel's tiles), so a slot's mass is the sum over G of weights * scale; mask [B, H, C] bool or None: the slots
  that are keys (below the store's length and not holes). A masked slot's weights are unspecified."""
  weights: jax.Array
  scale: Optional[jax.Array] = None
  mask: Optional[jax.Array] = None

  @classmethod
  def summed(cls, mass, mask=None) -> "TokenMass":
    """From a mass already summed over the heads, [B, H, R, C] (0 at slots that are not keys)."""
    return cls(jnp.moveaxis(mass, 2, 3)[..., None], mask=mask)

  @property
  def length(self) -> int:
    return self.weights.shape[2]

  @staticmethod
  def _summed(weights, scale):
    """Sum over G of weights [..., G] times scale [..., G] (None: 1), head by head: elementwise adds, so XLA fuses
    them into whatever reduces the result next (a reduction over G would be a reduction of its own)."""
    terms = [weights[..., j].astype(jnp.float32) * (1.0 if scale is None else scale[..., j])
             for j in range(weights.shape[-1])]
    total = terms[0]
    for term in terms[1:]:
      total = total + term
    return total

  def _per_slot(self):
    """The slots' mass [B, H, C, R] float32, unmasked."""
    scale = None if self.scale is None else jnp.repeat(self.scale, self.length // self.scale.shape[2], axis=2)
    return self._summed(self.weights, scale)

  def dense(self):
    """[B, H, R, C] float32, 0 at the slots that are not keys."""
    total = self._per_slot()
    total = total if self.mask is None else jnp.where(self.mask[..., None], total, 0.0)
    return jnp.moveaxis(total, 3, 2)

  def block_max(self, block: int, bound):
    """[B, H, R, ceil(C / block)] float32: each run of ``block`` slots' largest mass among its candidates (slots
    that are keys and below bound [B, R]), NOT_A_CANDIDATE where it has none. One pass over the weights."""
    B, H, C, R, _ = self.weights.shape
    n = -(-C // block)
    candidate = jnp.arange(C)[:, None] < bound[:, None, None, :]  # [B, 1, C, R]
    if self.mask is not None:
      candidate = candidate & self.mask[..., None]
    values = jnp.where(candidate, self._per_slot(), NOT_A_CANDIDATE)
    if n * block > C:
      values = jnp.pad(values, ((0, 0), (0, 0), (0, n * block - C), (0, 0)), constant_values=NOT_A_CANDIDATE)
    return jnp.moveaxis(jnp.max(values.reshape(B, H, n, block, R), axis=3), 3, 2)

  def at(self, positions, bound):
    """The mass at positions [B, H, R, N] (any int; those outside [0, C) are not candidates) -> [B, H, R, N]
    float32, NOT_A_CANDIDATE where the slot is not a key or not below bound [B, R]. Gathers from the flat arrays,
    whose order is their layout."""
    B, H, C, R, G = self.weights.shape
    if self.weights.size >= 2**31:  # the flat indices are int32
      raise ValueError(f"token mass of {self.weights.size} weights (shape {self.weights.shape}) is past what int32 "
                       "indices reach: split the batch")
    inside = (positions >= 0) & (positions < C)
    at = jnp.clip(positions, 0, C - 1)[..., None]  # [B, H, R, N, 1]
    sequence_head = (jnp.arange(B)[:, None] * H + jnp.arange(H))[:, :, None, None, None]  # [B, H, 1, 1, 1]
    column = (jnp.arange(R)[:, None, None] * G + jnp.arange(G))  # [R, 1, G]: row r's head j in a slot's R * G
    take = lambda x, i: jnp.take(x.reshape(-1), i, mode="clip")
    weights = take(self.weights, (sequence_head * C + at) * (R * G) + column)  # [B, H, R, N, G]
    scale = None
    if self.scale is not None:
      runs = self.scale.shape[2]
      scale = take(self.scale, (sequence_head * runs + at // (C // runs)) * (R * G) + column)
    ok = inside & (positions < bound[:, None, :, None])
    if self.mask is not None:
      ok &= take(self.mask, sequence_head[..., 0] * C + at[..., 0])
    return jnp.where(ok, self._summed(weights, scale), NOT_A_CANDIDATE)
