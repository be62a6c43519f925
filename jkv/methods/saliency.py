"""Token saliency for ZipCache: probe queries, normalized and accumulated attention scores, and the split of a
segment's tokens into a high- and a low-precision set (docs/methods/zipcache.md, "Saliency"; arXiv:2405.14256).

Counts that depend on a fraction of a length (probes, salient tokens) are computed exactly, with the fraction
read as the decimal the user wrote (0.6 is 3/5): ``ceil(0.6 * 100)`` in floating point is 61.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from jkv_kernels.probe_mass import probe_mass as probe_mass_kernel, probe_mass_reference

SALIENCY = ("normalized", "accumulated")
NORMALIZE_BY = ("probes", "queries")


# ------------------------------------------------------------------------------------------------- exact counts

def exact_fraction(x: float) -> Fraction:
  """The decimal a float was written as: 0.6 -> 3/5 (not 0.59999999999999997779...)."""
  return Fraction(repr(float(x)))


def ceil_fraction(f: Fraction, n) -> np.ndarray:
  """ceil(f * n) for integer n (scalar or array), exactly."""
  n = np.asarray(n, np.int64)
  return -((-f.numerator * n) // f.denominator)


def round_fraction(f: Fraction, n) -> np.ndarray:
  """f * n rounded half to even (Python's ``round``), exactly."""
  n = np.asarray(n, np.int64)
  q, rem = np.divmod(f.numerator * n, f.denominator)
  twice = 2 * rem
  up = (twice > f.denominator) | ((twice == f.denominator) & (q % 2 == 1))
  return q + up


def probe_counts(n, recent: float, random: float) -> tuple[np.ndarray, np.ndarray]:
  """(recent, random) probe counts for segments of n tokens: n_rec = max(1, round(recent n)) (the last query is
  always a probe, so every token is seen by one), n_rand = min(n - n_rec, round(random n)); 0 for n = 0."""
  n = np.asarray(n, np.int64)
  n_rec = np.minimum(n, np.maximum(1, round_fraction(exact_fraction(recent), n)))
  n_rand = np.minimum(n - n_rec, round_fraction(exact_fraction(random), n))
  return n_rec, n_rand


# ------------------------------------------------------------------------------------------------- probes

def position_priority(key, positions):
  """A uniform [0, 1) number per position, from ``fold_in(key, position)``: it depends on the position alone,
  never on the batch row or the padded length, so a sequence draws the same probes in any batch."""
  flat = positions.reshape(-1)
  u = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(key, p)))(flat)
  return u.reshape(positions.shape)


def prefill_probes(key, lengths, num_tokens: int, recent: float, random: float, offset=0):
  """Probe rows of right-padded prompts (arXiv:2405.14256, Sec. 4.3): the last n_rec positions of each prompt, plus
  the n_rand earlier positions of lowest priority (distinct, drawn without replacement; shared by every batch row and
  head).

  Args:
    key: PRNG key (one per layer).
    lengths: [B] int32 valid tokens per prompt.
    num_tokens: T, the padded prompt length (static).
    offset: [B] int32 (or 0): the position of each prompt's first token (a later chunk's), which the random
      draws follow.

  Returns:
    rows [B, P] int32 positions and ok [B, P] bool (False: padding of the probe list), P static.
  """
  n_rec_t, n_rand_t = probe_counts(np.arange(num_tokens + 1), recent, random)
  n_rec = jnp.asarray(n_rec_t, jnp.int32)[lengths]
  n_rand = jnp.asarray(n_rand_t, jnp.int32)[lengths]
  max_rec, max_rand = int(n_rec_t.max()), int(n_rand_t.max())
  slot = jnp.arange(max_rec)[None]
  recent_rows = lengths[:, None] - n_rec[:, None] + slot
  recent_ok = slot < n_rec[:, None]
  pos = jnp.arange(num_tokens)
  eligible = pos[None] < (lengths - n_rec)[:, None]
  u = position_priority(key, jnp.broadcast_to(jnp.asarray(offset, jnp.int32).reshape(-1, 1) + pos[None],
                                                eligible.shape))
  random_rows = jnp.argsort(jnp.where(eligible, u, 2.0), axis=1)[:, :max_rand].astype(jnp.int32)
  random_ok = jnp.arange(max_rand)[None] < n_rand[:, None]
  rows = jnp.concatenate([recent_rows, random_rows], axis=1)
  ok = jnp.concatenate([recent_ok, random_ok], axis=1)
  return jnp.where(ok, rows, 0), ok


def probe_mass(q, k, rows, ok, *, impl: str = "xla"):
  """The attention mass each key receives from the probe rows, and how many probes see it.

  Causal attention of the probe queries over the prompt, never the [B, Hq, T, T] matrix: impl "xla" runs the one
  attention reference over a chunk of probe rows at a time (``probe_mass_reference``), "pallas" the two-pass
  kernel that materializes no probabilities (``jkv_kernels.probe_mass``; "interpret": the same in Pallas
  interpret mode, CPU tests).

  Args:
    q: [B, H, T, g, D] prompt queries; k: [B, H, T, D] prompt keys.
    rows, ok: [B, P] probe positions and which are real (``prefill_probes``).
    impl: "xla", "pallas" or "interpret".

  Returns:
    mass [B, H, T] f32 (summed over probes and the g query heads of each KV head: one salient set per KV head)
    and seen [B, T] int32 = #{probes p >= j} (the paper's Eq. 8 read literally on the probe rows).
  """
  if impl == "xla":
    mass = probe_mass_reference(q, k, rows, ok)
  else:
    mass = probe_mass_kernel(q, k, rows, ok, interpret=impl == "interpret")
  return mass, probes_at_or_after(rows, ok, k.shape[2])


def probes_at_or_after(rows, ok, num_tokens: int):
  """[B, T] int32: the real probes at positions >= j, for each token j (rows, ok [B, P]; positions in [0, T)).

  A histogram of the probe positions summed from the end: O(P + T) per row, not the [P, T] comparison."""
  batch = rows.shape[0]
  count = jnp.zeros((batch, num_tokens), jnp.int32).at[jnp.arange(batch)[:, None], rows].add(ok.astype(jnp.int32))
  return jnp.flip(jnp.cumsum(jnp.flip(count, axis=1), axis=1), axis=1)


# ------------------------------------------------------------------------------------------------- scores

def saliency_scores(mass, seen, lengths, *, saliency: str, normalize_by: str):
  """Score of each token of a segment (arXiv:2405.14256, Eq. 7-8; docs/methods/zipcache.md, 'Saliency').

  Args:
    mass: [B, H, T] f32 attention mass from the probes (summed over probes and query heads).
    seen: [B, T] probes that saw each token (used with normalize_by="probes").
    lengths: [B] valid tokens of each segment; tokens past it score -inf.
    saliency: "normalized" (ZipCache: mass / queries that can see the token) or "accumulated" (H2O, MiKV).
    normalize_by: "probes" (the paper: probes p >= j) or "queries" (the reference code: all queries, n - j).

  Returns:
    [B, H, T] f32.
  """
  j = jnp.arange(mass.shape[-1])[None]
  if saliency == "accumulated":
    score = mass
  elif normalize_by == "probes":
    score = mass / jnp.maximum(seen, 1)[:, None, :].astype(jnp.float32)
  else:
    score = mass / jnp.maximum(lengths[:, None] - j, 1)[:, None, :].astype(jnp.float32)
  return jnp.where((j < lengths[:, None])[:, None, :], score, -jnp.inf)


def split_by_score(score, n_high, n_valid, rows_high: int, rows_low: int):
  """Gather indices of the high- and low-precision rows of a segment.

  Per (sequence, KV head), the ``n_high`` valid tokens of highest score are high (ties: the earlier token), the
  other valid tokens low. Each set is listed in position order and padded to its static row count by repeating
  its last token, so a group of pool rows that ends in padding has the min and max of its real tokens.

  Args:
    score: [B, H, T] (-inf past each segment's length).
    n_high, n_valid: [B] int32 high tokens and valid tokens per sequence.
    rows_high, rows_low: static row counts (>= every sequence's set).

  Returns:
    (high [B, H, rows_high], low [B, H, rows_low]) int32 token indices.
  """
  T = score.shape[-1]
  order = jnp.argsort(-score, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1)
  j = jnp.arange(T)[None, None]
  valid = j < n_valid[:, None, None]
  high = valid & (rank < n_high[:, None, None])
  low = valid & ~high

  def listed(chosen, count, size):
    by_position = jnp.argsort(jnp.where(chosen, j, T + j), axis=-1)  # chosen tokens first, in position order
    slot = jnp.clip(jnp.minimum(jnp.arange(size)[None, None], count[:, None, None] - 1), 0, T - 1)
    return jnp.take_along_axis(by_position, jnp.broadcast_to(slot, (*score.shape[:2], size)), axis=-1)

  return (listed(high, n_high, rows_high).astype(jnp.int32),
          listed(low, n_valid - n_high, rows_low).astype(jnp.int32))
