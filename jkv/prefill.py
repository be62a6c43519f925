"""The prefill phase: a batch of prompts into an empty cache, returning each prompt's last-token logits.

One of three ways, chosen by ``plan`` from how many prompt tokens one call may take (``prefill_tokens``; default
what half the device's free memory holds beside the cache):

- the whole batch in one call, in place;
- sub-batches of whole prompts: each call prefills a fresh state of its sequences and writes it into the cache (a
  temporary of those sequences' cache), the same result as one call;
- chunked prefill, where not even one whole prompt fits a call, or when asked (``chunk``): the prompts go through
  the model C tokens at a time, the whole batch in place. The first chunk is the method's ``prefill``; each later
  one its ``extend``: attention over what the cache holds of the earlier chunks, as the method holds them, plus the
  chunk itself exactly. Activations are O(B C) rather than O(B T), so the cache, not prefill, bounds the context.

Prompts that continue a cache which already holds tokens (a saved cache, ``jkv.saved_cache``) go through
``plan_continuation``: every call is the method's ``extend``, from each sequence's held length.

Whole prompts are the default wherever they fit: the papers prefill a prompt whole, with exact attention among its
tokens, and a chunked prompt's later tokens attend the compressed earlier ones (docs/long_context.md measures the
difference per method). A chunk ends where the method's blocks end (``CacheMethod.chunk_multiple``).
"""

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv import memory
from jkv import sharding
from jkv.cache import CacheMethod, KVCache
from jkv.config import ModelConfig
from jkv.model import forward
from jkv.xla_options import MODEL_COMPILER_OPTIONS

MIN_PROMPT_BUCKET = 16


def bucket(n: int) -> int:
  return max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """How ``batch`` prompts are prefilled: ``rows`` sequences of ``chunk`` tokens a call, the prompts padded to
  ``width`` tokens, into a cache of ``capacity`` tokens per sequence."""

  batch: int
  width: int  # tokens per prompt as padded: a power-of-two bucket, or whole chunks
  rows: int  # sequences per call (the batch: in place)
  chunk: int  # tokens per sequence per call (width: whole prompts)
  capacity: int  # the cache's capacity: chunked, a chunk multiple past the last chunk (CacheMethod.extend)
  continues: bool = False  # the cache holds tokens already: every call extends it (plan_continuation)

  @property
  def chunked(self) -> bool:
    return self.continues or self.chunk < self.width

  def calls(self) -> int:
    return len(prefill_starts(self.batch, self.rows)) if self.rows < self.batch else self.width // self.chunk


def plan(cfg: ModelConfig, method: CacheMethod, lengths: Sequence[int], capacity: int, *,
         prefill_tokens: Optional[int] = None, chunk: Optional[int] = None, mesh=None,
         max_decode: Optional[int] = None) -> PrefillPlan:
  """The prefill plan for prompts of these lengths in a cache of ``capacity`` tokens (``jkv.generate``'s plan),
  before the cache is allocated.

  ``prefill_tokens``: prompt tokens one call may take (default: what half the device's free memory holds beside
  the cache, and beside a sub-batch's fresh state or the chunk's held rows). ``chunk``: chunked prefill with chunks
  of this many tokens (rounded up to ``chunk_multiple``) whatever fits; whole prompts where one chunk holds them.
  Chunked, the capacity grows to hold a chunk multiple past the last chunk. ``max_decode``: the cache's
  (``CacheSpec.max_decode``), which sizes it."""
  B, longest = len(lengths), max(lengths)
  width = min(bucket(longest), capacity)
  multiple = method.chunk_multiple()
  whole = PrefillPlan(B, width, B, width, capacity)
  if chunk is not None:
    if chunk < 1:
      raise ValueError(f"prefill chunk must be >= 1 token, got {chunk}")
    return _chunked(B, longest, capacity, round_up(chunk, multiple), multiple, even=False) if chunk < longest else whole
  shards = sharding.axis_size(mesh, "data")
  # Prompt tokens of one call over the mesh: each device takes 1 / data of them (budgets count one device's memory).
  budget = lambda **extra: prefill_tokens or shards * memory.prefill_token_budget(cfg, **extra)
  in_cache = memory.cache_bytes(method, cfg, B, capacity, mesh, max_decode)
  if B * width <= budget(fixed_bytes=in_cache):
    return whole
  # Beside a sub-batch's fresh state; at least one prompt per device where that fits whole (what
  # memory.largest_batch leaves room for).
  per_sequence = memory.sub_batch_state_per_token(cfg, method, capacity, width, mesh)
  rows = budget(fixed_bytes=in_cache, state_bytes_per_token=per_sequence, floor_tokens=width) // width
  if rows >= 1:
    return PrefillPlan(B, width, sharding.batch_rows(rows, B, mesh), width, capacity)
  return _chunked(B, longest, capacity, _chunk_budget(cfg, method, B, capacity, prefill_tokens, mesh, max_decode),
                  multiple, even=True)


def plan_continuation(cfg: ModelConfig, method: CacheMethod, held: Sequence[int], lengths: Sequence[int],
                      capacity: int, *, prefill_tokens: Optional[int] = None, chunk: Optional[int] = None,
                      mesh=None) -> PrefillPlan:
  """The plan for prompts of these lengths that continue a cache holding ``held`` tokens of each sequence: every
  call is the method's ``extend`` of the whole batch, in chunks of whole ``chunk_multiple``s. ``chunk`` as in
  ``plan``; by default one call where the prompts fit ``prefill_tokens`` (as ``plan``'s), else as few even chunks as
  fit. The capacity grows to hold a chunk multiple past the last chunk after the longest held sequence."""
  B, longest, multiple = len(lengths), max(lengths), method.chunk_multiple()
  if chunk is not None:
    if chunk < 1:
      raise ValueError(f"prefill chunk must be >= 1 token, got {chunk}")
    size = round_up(chunk, multiple)
  else:
    whole = round_up(bucket(longest), multiple)
    budget = _chunk_budget(cfg, method, B, capacity, prefill_tokens, mesh)
    size = whole if whole <= budget else round_up(-(-longest // -(-longest // budget)), multiple)
  width = -(-longest // size) * size
  capacity = round_up(max(capacity, max(held) + width + multiple), multiple)
  return PrefillPlan(B, width, B, size, capacity, continues=True)


def _chunk_budget(cfg: ModelConfig, method: CacheMethod, batch: int, capacity: int, prefill_tokens: Optional[int],
                  mesh, max_decode: Optional[int] = None) -> int:
  """Tokens per sequence of one chunked call: ``prefill_tokens`` over the batch, or what half the free memory holds
  beside the cache and the chunk's held rows; whole chunk multiples, at least ``memory.MIN_CHUNK``."""
  multiple, shards = method.chunk_multiple(), sharding.axis_size(mesh, "data")
  # Per device: the cache's share, and the held rows of its sequences, KV heads and range of tokens.
  held = memory.held_rows_bytes(cfg, batch // shards, capacity) // (sharding.axis_size(mesh, "model")
                                                                     * sharding.axis_size(mesh, sharding.SEQ_AXIS))
  fixed = memory.cache_bytes(method, cfg, batch, capacity, mesh, max_decode) + held
  # (a chunk's more held rows at the grown capacity: within the halving)
  tokens = prefill_tokens or shards * memory.prefill_token_budget(cfg, fixed_bytes=fixed)  # over the mesh
  size = tokens // batch // multiple * multiple
  return max(size, round_up(memory.MIN_CHUNK, multiple))


def _chunked(batch: int, longest: int, capacity: int, size: int, multiple: int, *, even: bool) -> PrefillPlan:
  """Chunks of ``size`` tokens (a multiple of ``multiple``), or with ``even`` as few of at most that size as cover
  the longest prompt and as even as whole multiples let them be; the capacity grown to hold ``multiple`` tokens
  past the last chunk (what a call may write past its rows: ``CacheMethod.extend``)."""
  calls = -(-longest // size)
  chunk = round_up(-(-longest // calls), multiple) if even else size
  width = calls * chunk
  capacity = round_up(max(capacity, width + (multiple if calls > 1 else 0)), multiple)
  return PrefillPlan(batch, width, batch, chunk, capacity)


def prefill_starts(batch: int, rows: int) -> list:
  """First sequence of each prefill sub-batch of ``rows`` sequences: the last one is moved back to end at the
  batch's end (its overlap is prefilled twice, identically), so every call has the same shape."""
  starts = list(range(0, batch - rows + 1, rows))
  if starts[-1] + rows < batch:
    starts.append(batch - rows)
  return starts


def sub_batch(batch: int, rows: int, start: int, shards: int) -> np.ndarray:
  """The sequences [rows] of a prefill sub-batch of a cache whose ``batch`` sequences are split into ``shards`` equal
  parts (a data mesh): ``rows / shards`` from ``start`` within each part, so that every device prefills and writes
  sequences it holds (``sharding.put_rows``). [start, start + rows) with one part."""
  per, part = rows // shards, batch // shards
  return (np.arange(shards)[:, None] * part + start + np.arange(per)[None]).reshape(-1)


def pad_prompts(prompts, width: int, pad_id: int) -> np.ndarray:
  """Prompts (lists of ids) right-padded with ``pad_id`` to [B, width] int32."""
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  return tokens


def prompt_positions(lengths, start, width: int, held=0):
  """[B, width] int32: positions held + start + [0, width) of prompts of these lengths [B] (after held [B] tokens
  the cache holds already, or none), -1 past each one's end."""
  pos = start + jnp.arange(width, dtype=jnp.int32)[None]
  return jnp.where(pos < lengths[:, None], pos + jnp.asarray(held, jnp.int32).reshape(-1, 1), -1)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",),
                   compiler_options=MODEL_COMPILER_OPTIONS)
def _prefill_rows(params, tokens, lengths, cache, start, *, cfg):
  """Prefill sequences [start, start + b) of the cache (on a data mesh, b / data sequences from ``start`` within
  each shard: ``sub_batch``) with tokens [b, T] of prompts of lengths [b]; returns their last-token logits
  [b, vocab] and the cache. Other sequences' state is untouched, so a batch can be filled a
  sub-batch at a time (the activations of one call are bounded by b x T tokens). The sub-batch starts from a fresh
  empty state, not a slice of the cache: with the cache's only use the in-place write, XLA needs no copy of it
  (reading a slice first made it copy the whole donated cache, 27 GiB at B=98 on the H100)."""
  part = KVCache.create(cache.method, cache.spec.with_batch(tokens.shape[0]), cache.impl)
  positions = prompt_positions(lengths, 0, tokens.shape[1])
  logits, part = forward(params, tokens, positions, part, cfg=cfg, prefill=True, logit_rows=(lengths - 1)[:, None])
  return logits[:, 0], sharding.put_rows(cache, start, part)


@functools.partial(jax.jit, static_argnames=("cfg", "first"), donate_argnames=("cache", "logits"),
                   compiler_options=MODEL_COMPILER_OPTIONS)
def _prefill_chunk(params, tokens, start, lengths, held, logits, cache, *, cfg, first):
  """Tokens [B, C]: tokens start + [0, C) of prompts of lengths [B] that follow held [B] tokens in the cache, into
  the whole batch's cache in place (the method's ``prefill`` for the ``first`` chunk of prompts into an empty cache,
  ``extend`` after). logits [B, vocab]: each prompt's last-token logits, replaced for the prompts whose last token
  is in this chunk."""
  C = tokens.shape[1]
  last = lengths - 1 - start
  new, cache = forward(params, tokens, prompt_positions(lengths, start, C, held), cache, cfg=cfg, prefill=first,
                       extend=not first, logit_rows=jnp.clip(last, 0, C - 1)[:, None])
  here = (last >= 0) & (last < C)
  return jnp.where(here[:, None], new[:, 0], logits), cache


class Prefill:
  """A plan's calls, compiled (``warm``) and run (``__call__``) on right-padded tokens [B, width] of prompts of
  these lengths, after ``held`` [B] tokens the cache holds already (a continuing plan's; none otherwise)."""

  def __init__(self, plan: PrefillPlan, cfg: ModelConfig, tokens: np.ndarray, lengths: Sequence[int],
               held: Optional[Sequence[int]] = None):
    self.plan, self.cfg, self.tokens = plan, cfg, tokens
    self.lengths = np.asarray(lengths, np.int32)
    self.held = np.zeros_like(self.lengths) if held is None else np.asarray(held, np.int32)

  def _zero_logits(self, cache):
    """The logits before the first chunk, committed where the cache's lengths are: as committed as each chunk's
    output that the next chunk takes, so that the calls compiled in ``warm`` serve them all (uncommitted zeros made
    every later chunk trace and lower its call again, seconds inside the timed prefill)."""
    return jax.device_put(jnp.zeros((self.plan.batch, self.cfg.vocab_size), jnp.float32), cache.lengths.sharding)

  def warm(self, warm, params, cache) -> None:
    """Compile (or find compiled) every call the plan makes, with ``warm(fn, args, static)``."""
    p = self.plan
    if p.rows < p.batch:
      warm(_prefill_rows, (params, jnp.asarray(self.tokens[:p.rows]), jnp.asarray(self.lengths[:p.rows]), cache,
                           jnp.int32(0)), dict(cfg=self.cfg))
      return
    args = (params, jnp.asarray(self.tokens[:, :p.chunk]), jnp.int32(0), jnp.asarray(self.lengths),
            jnp.asarray(self.held), self._zero_logits(cache), cache)
    for first in {start == 0 and not p.continues for start in range(0, p.width, p.chunk)}:
      warm(_prefill_chunk, args, dict(cfg=self.cfg, first=first))

  def __call__(self, params, cache, logits=None):
    """Returns the last-token logits [B, vocab] float32 and the cache. ``logits``: those of the prompts that end
    before this plan's tokens (an empty continuation; a continuing plan only), kept where no token of theirs is
    here."""
    p = self.plan
    if p.rows < p.batch:
      logits, shards = None, sharding.data_shards(cache)
      for start in prefill_starts(p.batch // shards, p.rows // shards):
        rows = sub_batch(p.batch, p.rows, start, shards)
        part, cache = _prefill_rows(params, jnp.asarray(self.tokens[rows]), jnp.asarray(self.lengths[rows]), cache,
                                    jnp.int32(start), cfg=self.cfg)
        logits = jnp.zeros((p.batch,) + part.shape[1:], part.dtype) if logits is None else logits
        logits = logits.at[rows].set(part)
      return logits, cache
    logits = self._zero_logits(cache) if logits is None else logits
    lengths, held = jnp.asarray(self.lengths), jnp.asarray(self.held)
    for start in range(0, p.width, p.chunk):
      logits, cache = _prefill_chunk(params, jnp.asarray(self.tokens[:, start:start + p.chunk]), jnp.int32(start),
                                     lengths, held, logits, cache, cfg=self.cfg, first=start == 0 and not p.continues)
    return logits, cache
