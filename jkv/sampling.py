"""Sampling methods: small frozen classes with one method, ``next_tokens(logits, key) -> [B] int32``."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
  def next_tokens(self, logits, key):
    """The first index of each row's largest logit, as ``argmax``, by two plain reductions: over a vocabulary
    split across devices each is one small all-reduce, where argmax's (value, index) reduction all-gathers every
    shard's pair (one of a B = 1 step's two NCCL all-gathers on 4 H200s; the other, the costly one, gathered the
    embedding table: ``jkv.sharding.vocab_lookup``)."""
    del key
    vocab = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == best, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # a NaN row matches nothing: a valid token, as argmax gives


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Temperature sampling, optionally restricted to the top-k tokens and/or the top-p probability mass."""

  temperature: float = 1.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {self.temperature}")
    if self.top_k is not None and self.top_k < 1:
      raise ValueError(f"top_k must be >= 1, got {self.top_k}")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  def next_tokens(self, logits, key):
    logits = logits.astype(jnp.float32) / self.temperature  # [B, V]
    if self.top_k is not None and self.top_k < logits.shape[-1]:
      kth = jax.lax.top_k(logits, self.top_k)[0][:, -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p is not None and self.top_p < 1:
      sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
      cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
      # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
      keep = cum - jax.nn.softmax(sorted_logits, axis=-1) < self.top_p
      cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
      logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def make_sampler(temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None):
  """Greedy when temperature is 0 (and no top-k/top-p asked), else ``Sampling``."""
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if temperature == 0:
    if top_k is not None or top_p is not None:
      raise ValueError("top_k/top_p need a temperature > 0")
    return Greedy()
  return Sampling(temperature, top_k, top_p)
