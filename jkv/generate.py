"""Batched generation in phases: plan, placement, compilation, prefill (``jkv.prefill``), then decoding in jitted
``lax.scan`` chunks over a donated cache. Placement may load a saved cache that the prompts continue, and the cache
as prefill leaves it may be saved (``jkv.saved_cache``).

Prompts of different lengths share a batch: each sequence sits in slots [0, length) with its own length, so
its tokens are those it would get alone. Prompt lengths are bucketed to powers of two (or whole prefill chunks)
and decoding runs in chunks of a static size, so a second call with the same shapes compiles nothing; the host
looks at the end-of-sequence flags once per chunk, never per token.
"""

import dataclasses
import functools
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv import context_parallel
from jkv import memory
from jkv import prefill as prefill_lib
from jkv import saved_cache
from jkv import sharding
from jkv.attention import choose_impl
from jkv.cache import CacheMethod, CacheSpec, dense_kv_bytes
from jkv.config import ModelConfig
from jkv.methods.dense import Dense
from jkv.model import forward
from jkv.params import Params
from jkv.sampling import Greedy
from jkv.prefill import bucket, round_up
from jkv.xla_options import MODEL_COMPILER_OPTIONS


DECODE_CHUNK = 32  # decode steps per compiled call (generate's default ``chunk``)


class CompileCounter:
  """Counts XLA backend compilations (and their seconds) while active; used for stats and tests."""

  _active: list = []
  _installed = False

  def __init__(self):
    self.count = 0
    self.seconds = 0.0

  @classmethod
  def _listener(cls, event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      for counter in cls._active:
        counter.count += 1
        counter.seconds += duration

  def __enter__(self):
    if not CompileCounter._installed:
      jax.monitoring.register_event_duration_secs_listener(CompileCounter._listener)
      CompileCounter._installed = True
    CompileCounter._active.append(self)
    return self

  def __exit__(self, *exc):
    CompileCounter._active.remove(self)


@dataclasses.dataclass
class GenerateResult:
  tokens: list  # per sequence: generated ids, cut before the first end-of-sequence token
  stats: dict  # kv_bytes, dense_kv_bytes, prefill_s, decode_s, decode_tokens_per_s, compile_s, ...
  texts: Optional[list] = None


def plan_capacity(cfg: ModelConfig, method: CacheMethod, prompt_lens, max_new_tokens: int, chunk: int,
                  capacity: Optional[int] = None, continued: bool = False,
                  fits: Optional[Callable[[int], bool]] = None) -> int:
  """Cache capacity for these prompts, or a one-line ValueError when they cannot fit. A new prompt's length is
  bucketed to a power of two (the width its whole prefill pads to, one compilation for many lengths), unless the
  bucket leaves too little of the device (``fits(capacity)``: False; ``plan_generation``'s: its cache does not fit,
  or the chunks its prefill would take are shorter than ``memory.LONG_PROMPT_CHUNK``): such a prompt is prefilled
  in chunks, which pad to whole chunks, not to the bucket, and at the longest context ``jkv info`` reports the
  bucket is up to twice the prompt. ``continued`` prompts (lengths counting what a loaded cache holds) are not
  bucketed either: they run in chunks on top of it, and the continuation's plan grows the capacity to what its
  chunks write (a 128k document continued by a question would otherwise double its cache)."""
  multiple = method.capacity_multiple()
  if multiple > cfg.max_position:  # a group or window longer than any sequence: a cache of that many tokens, unused
    raise ValueError(f"cache method {method.name!r} holds tokens in blocks of {multiple} (its settings), more than the "
                     f"model's context of {cfg.max_position} tokens")
  longest = max(prompt_lens)
  need = longest + max_new_tokens
  if need > cfg.max_position:
    raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                     f"context of {cfg.max_position} tokens")
  if capacity is not None:
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1 token, got {capacity}")
    if need > capacity:
      raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the cache "
                       f"capacity of {capacity} tokens")
    capacity = round_up(capacity, multiple)
  else:
    decoded = round_up(max_new_tokens, chunk)
    capacity = round_up((longest if continued else bucket(longest)) + decoded, multiple)
    if fits is not None and not fits(capacity):
      capacity = round_up(longest + decoded, multiple)
  return capacity


def max_decode(max_new_tokens: int, chunk: int, saved) -> Optional[int]:
  """The most tokens a sequence stores after its prompt (``CacheSpec.max_decode``): whole decode chunks, as the
  capacity counts them. None continuing a ``saved`` cache: its arrays, sized by the run that saved it, are grown to
  this one's, so this one's hold any mix."""
  return None if saved is not None else round_up(max_new_tokens, chunk)


@functools.partial(jax.jit, static_argnames=("sampler",))
def _first_tokens(logits, key, *, sampler):
  """The first generated token of each sequence from its prompt's logits [B, vocab], and whether they were
  finite."""
  return sampler.next_tokens(logits, key), ~jnp.all(jnp.isfinite(logits), axis=-1)


def pre_decode_tokens(params, cache, first, *, cfg):
  """The method's pre-decode pass (``CacheMethod.pre_decode``) on the first generated tokens first [B]: returns
  the first speculative tokens [B, 1] (its greedy output) and the cache, whose lengths do not move. Traceable
  inside a caller's jit (perplexity's scoring scan); ``_pre_decode`` is its own jitted form."""
  check_speculative_rows(cache.method)
  logits, cache = forward(params, first[:, None], cache.lengths[:, None], cache, cfg=cfg, pre_decode=True)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


_pre_decode = jax.jit(pre_decode_tokens, static_argnames=("cfg",), donate_argnames=("cache",),
                      compiler_options=MODEL_COMPILER_OPTIONS)


def check_speculative_rows(method: CacheMethod) -> None:
  if method.speculative_rows not in (0, 1):
    raise ValueError(f"cache method {method.name!r} asks for {method.speculative_rows} speculative rows; "
                     "decoding runs 0 or 1")


def speculative_start(params, cfg, cache, first):
  """The speculative tokens [B, S] the first decode step carries (S = the method's ``speculative_rows``; an
  empty [B, 0] for methods without any) and the cache."""
  if cache.method.speculative_rows == 0:
    return jax.device_put(jnp.zeros((first.shape[0], 0), jnp.int32), first.sharding), cache
  return _pre_decode(params, cache, first, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "steps"), donate_argnames=("cache",),
                   compiler_options=MODEL_COMPILER_OPTIONS)
def _decode_chunk(params, cache, tokens, spec, done, bad, spec_counts, key, eos_ids, pad_id, *, cfg, sampler,
                  steps):
  """``steps`` decode steps in one scan. tokens [B]: the last sampled token of each sequence; ``bad`` [B]
  collects sequences that met non-finite logits.

  With a method that carries a speculative row (``speculative_rows`` = 1), spec [B, 1] is the speculative token
  each step feeds after the real one, at the next position; the step's second row gives the next one (greedy),
  and spec_counts [B, 2] int32 adds up the steps whose speculative token equalled the real token it guessed, and
  the steps counted. Without one, spec is [B, 0], spec_counts stays 0 and the step is the one-row step.
  """
  speculative = cache.method.speculative_rows > 0

  def step(carry, _):
    cache, tokens, spec, done, bad, spec_counts, key = carry
    key, sub = jax.random.split(key)
    if speculative:
      rows = jnp.concatenate([tokens[:, None], spec], axis=1)
      logits, cache = forward(params, rows, cache.lengths[:, None] + jnp.arange(rows.shape[1]), cache, cfg=cfg)
    else:
      logits, cache = forward(params, tokens[:, None], cache.lengths[:, None], cache, cfg=cfg)
    bad = bad | (~done & ~jnp.all(jnp.isfinite(logits[:, 0]), axis=-1))
    nxt = jnp.where(done, pad_id, sampler.next_tokens(logits[:, 0], sub))
    if speculative:
      spec_counts = spec_counts + jnp.stack([~done & (spec[:, 0] == nxt), ~done], axis=1).astype(jnp.int32)
      spec = jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)
    done = done | jnp.isin(nxt, eos_ids)
    return (cache, nxt, spec, done, bad, spec_counts, key), nxt

  carry = (cache, tokens, spec, done, bad, spec_counts, key)
  (cache, tokens, spec, done, bad, spec_counts, key), out = jax.lax.scan(step, carry, None, length=steps)
  return cache, tokens, spec, done, bad, spec_counts, key, out.T


_WARM: set = set()


def committed(tree):
  """``tree`` with every array committed to where it already is (device and memory kind). Once an argument lives in
  host memory (SpeCache's host copy), jit keys its compiled code on which device arguments are committed, and the
  outputs of jitted calls are: so warm-up and first calls pass committed arrays too, or later calls compile again."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)


def _warm(fn, args, static):
  """Trace and compile ``fn`` for these shapes once per process (jit and ahead-of-time share compiled code)."""
  key = (fn, jax.tree.structure(args), tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(args)),
         tuple(sorted(static.items())))
  if key not in _WARM:
    fn.lower(*args, **static).compile()
    _WARM.add(key)


def check_prompts(prompts, vocab_size: int) -> list:
  """Prompts as lists of Python ints, or a one-line ValueError naming the first bad one (empty prompt, a
  non-integer id, an id outside [0, vocab_size))."""
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of token-id lists")
  checked = []
  for b, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"prompt {b} must be a non-empty flat list of token ids, got shape {ids.shape}")
    if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt {b} holds non-integer token ids ({ids.dtype}); token ids are integers")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
      raise ValueError(f"prompt {b} token {bad[0]}: id {ids[bad[0]]} is outside the vocabulary [0, {vocab_size})")
    checked.append(ids.astype(np.int64).tolist())
  return checked


def _cut_at_eos(ids, eos_ids):
  for i, t in enumerate(ids):
    if t in eos_ids:
      return ids[:i]
  return ids


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
  """What a call runs, decided before anything is allocated: the prompts, the cache's capacity, the prefill plan and
  the decode chunk."""

  prompts: list  # lists of token ids
  capacity: int
  prefill: prefill_lib.PrefillPlan
  chunk: int  # decode steps per jitted call
  max_new_tokens: int
  eos: tuple
  pad_id: int
  impl: str
  saved: Optional[saved_cache.SavedCache] = None  # a saved cache the prompts continue
  held: Optional[list] = None  # tokens it holds of each sequence (None: the prompts start an empty cache)
  save_to: Optional[str] = None  # where the cache is saved after prefill
  heads: Optional[list] = None  # saving: tokens of each prompt the saved cache holds (whole chunk multiples)
  rest: Optional[prefill_lib.PrefillPlan] = None  # saving: the prompts' other tokens, continuing the cache saved

  @property
  def batch(self) -> int:
    return len(self.prompts)

  @property
  def lengths(self) -> list:
    return [len(p) for p in self.prompts]

  @property
  def max_decode(self) -> Optional[int]:
    return max_decode(self.max_new_tokens, self.chunk, self.saved)

  @property
  def starts(self) -> list:
    """Tokens each sequence holds before its prompt."""
    return self.held or [0] * self.batch

  def parts(self) -> list:
    """(token ids, plan, tokens held before them) of each prefill: the prompts, or, saving, the heads the saved cache
    holds and then the rest."""
    if self.rest is None:
      return [(self.prompts, self.prefill, self.held)]
    return [([p[:n] for p, n in zip(self.prompts, self.heads)], self.prefill, self.held),
            ([p[n:] for p, n in zip(self.prompts, self.heads)], self.rest,
             [s + n for s, n in zip(self.starts, self.heads)])]


def plan_generation(cfg: ModelConfig, method: CacheMethod, prompts, *, max_new_tokens: int, capacity=None,
                    chunk: int = DECODE_CHUNK, eos_ids=None, pad_id: int = 0, attention_impl: str = "auto",
                    prefill_tokens: Optional[int] = None, prefill_chunk: Optional[int] = None,
                    mesh=None, cache: Optional[str] = None, save_cache: Optional[str] = None) -> GenerationPlan:
  """Check the arguments (one-line ValueErrors) and plan the call (``generate``'s arguments): a saved ``cache``
  against the model, the method's settings as they run here and the batch; ``save_cache`` as a place to write."""
  prompts = check_prompts(prompts, cfg.vocab_size)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if prefill_tokens is not None and prefill_tokens < 1:
    raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
  impl = choose_impl(attention_impl)
  chunk = min(chunk, max_new_tokens)
  saved = held = heads = rest = None
  if cache is not None:
    saved = saved_cache.open_saved(cache)
    saved.check_model(cfg)
    held = saved.check_batch(len(prompts))
    prompts = [tail + p for tail, p in zip(saved.tails(len(prompts)), prompts)]
  lengths = [len(p) for p in prompts]
  if save_cache is not None:
    saved_cache.check_target(save_cache)
    heads = saved_cache.heads(method, lengths)
  split = heads is not None and heads != lengths
  first = heads if split else lengths
  decode = max_decode(max_new_tokens, chunk, saved)
  options = dict(prefill_tokens=prefill_tokens, chunk=prefill_chunk, mesh=mesh)

  def fits(capacity: int) -> bool:  # a new prompt's bucket (plan_capacity); chunks asked for are taken as asked
    if not memory.cache_fits(cfg, method, len(prompts), capacity, mesh, decode):
      return False
    if prefill_chunk is not None or prefill_tokens is not None:
      return True
    planned = prefill_lib.plan(cfg, method, first, capacity, max_decode=decode, **options)
    return not planned.chunked or planned.chunk >= memory.LONG_PROMPT_CHUNK

  cap = plan_capacity(cfg, method, [h + n for h, n in zip(held or [0] * len(lengths), lengths)], max_new_tokens,
                      chunk, capacity, continued=saved is not None, fits=fits)
  sharding.check_mesh(mesh, cfg, len(prompts))
  context_parallel.check(method, mesh)
  cap = context_parallel.split_capacity(cap, method, mesh, requested=capacity)
  if saved is None:
    prefill = prefill_lib.plan(cfg, method, first, cap, max_decode=decode, **options)
  else:
    prefill = prefill_lib.plan_continuation(cfg, method, held, first, cap, **options)
    saved.check_method(method.for_impl(CacheSpec.for_model(cfg, len(prompts), prefill.capacity), impl))
  if split:  # the cache saved holds whole chunks; the prompts' other tokens continue it once it is saved
    after = [s + n for s, n in zip(held or [0] * len(first), first)]
    rest = prefill_lib.plan_continuation(cfg, method, after, [n - h for n, h in zip(lengths, first)],
                                         prefill.capacity, **options)
    prefill = dataclasses.replace(prefill, capacity=rest.capacity)
  if context_parallel.seq_devices(mesh) > 1:  # a capacity that chunks grew, split again
    cap = context_parallel.split_capacity(prefill.capacity, method, mesh)
    prefill = dataclasses.replace(prefill, capacity=cap)
    rest = rest and dataclasses.replace(rest, capacity=cap)
  eos = tuple(cfg.eos_ids if eos_ids is None else eos_ids)
  return GenerationPlan(prompts, prefill.capacity, prefill, chunk, max_new_tokens, eos, pad_id, impl, saved, held,
                        save_cache, heads, rest)


@dataclasses.dataclass
class _Carry:
  """The small arrays decoding carries from call to call, in one placement (``sharding.rows``)."""

  last: jax.Array  # [B] the last sampled token of each sequence
  spec: jax.Array  # [B, S] speculative tokens (S = the method's speculative_rows)
  done: jax.Array  # [B] bool
  bad: jax.Array  # [B] bool: met non-finite logits
  counts: jax.Array  # [B, 2] int32: speculative tokens that were right, steps counted
  key: jax.Array

  def decode_args(self, params, cache, eos, pad):
    return (params, cache, self.last, self.spec, self.done, self.bad, self.counts, self.key, eos, pad)


class _Generation:
  """One ``generate`` call's phases over its plan: placement, compilation, prefill, decoding, statistics."""

  def __init__(self, params, cfg: ModelConfig, method: CacheMethod, plan: GenerationPlan, sampler, seed: int,
               mesh):
    self.cfg, self.plan, self.sampler, self.mesh = cfg, plan, sampler, mesh
    self.spec = CacheSpec.for_model(cfg, plan.batch, plan.capacity, plan.max_decode)
    self.prefills = [prefill_lib.Prefill(part, cfg, prefill_lib.pad_prompts(ids, part.width, plan.pad_id),
                                         [len(p) for p in ids], held) for ids, part, held in plan.parts()]
    # Placement: the parameters over the mesh, the cache allocated in its shards (or loaded), the carried arrays
    # committed.
    self.params = sharding.shard_params(params, cfg, mesh)
    self.params, self.cache = committed((self.params, self._place_cache(method)))
    self.saved = None  # what run_save wrote
    self.chunk_s = []  # each decode chunk's seconds (run_decode)
    B, S = plan.batch, method.speculative_rows
    self.speculative = S
    key, self.eos, self.pad, no, no_spec, zero_counts, self.first_ids = self._rows(committed((
        jax.random.key(seed), jnp.asarray(plan.eos if plan.eos else (-1,), jnp.int32), jnp.int32(plan.pad_id),
        jnp.zeros((B,), bool), jnp.zeros((B, S), jnp.int32), jnp.zeros((B, 2), jnp.int32),
        jnp.asarray([p[0] for p in plan.prompts]))))
    self.key, self.sub = jax.random.split(key)
    self.carry = _Carry(self.first_ids, no_spec, no, no, zero_counts, self.key)

  def _place_cache(self, method: CacheMethod):
    """An empty cache, or the saved one the prompts continue, grown to the plan's capacity; ``context`` holds the
    token ids each sequence holds before its prompt, ``loaded`` what loading read."""
    self.context, self.loaded = [[] for _ in self.plan.prompts], None
    if self.plan.saved is None:
      return sharding.create_cache(method, self.spec, self.plan.impl, self.mesh)
    cache, self.context, self.loaded = saved_cache.load(self.plan.saved, self.params,
                                                        method.for_impl(self.spec, self.plan.impl), self.spec,
                                                        self.plan.impl, self.mesh)
    return cache

  def _rows(self, tree):
    return sharding.rows(tree, self.mesh)

  def warm(self) -> None:
    """Compile (or find compiled) every call before timing, so the timings are run time alone."""
    B = self.plan.batch
    sharding.warm_collectives(self.mesh)
    for prefill in self.prefills:
      prefill.warm(_warm, self.params, self.cache)
    _warm(_first_tokens, self._rows((committed(jnp.zeros((B, self.cfg.vocab_size), jnp.float32)), self.sub)),
          dict(sampler=self.sampler))
    if self.speculative:
      _warm(_pre_decode, (self.params, self.cache, self.first_ids), dict(cfg=self.cfg))
    if self.plan.max_new_tokens > 1:  # else no step runs (a prefill to save, say): nothing to compile
      _warm(_decode_chunk, self.carry.decode_args(self.params, self.cache, self.eos, self.pad),
            dict(cfg=self.cfg, sampler=self.sampler, steps=self.plan.chunk))

  def run_prefill(self):
    """The prompts into the cache and each sequence's first token; returns [B, 1] host ids. Saving, the cache is
    saved between the prefill of the tokens it holds and of the rest (``run_save``)."""
    logits, self.cache = self.prefills[0](self.params, self.cache)
    if self.plan.save_to is not None:
      self.run_save()
    for prefill in self.prefills[1:]:
      logits, self.cache = prefill(self.params, self.cache, logits)
    first, bad = self._rows(_first_tokens(*self._rows((committed(logits), self.sub)), sampler=self.sampler))
    first.block_until_ready()
    self.carry.last, self.carry.bad = first, bad
    self.carry.done = jnp.isin(first, self.eos)
    return np.asarray(first)[:, None]

  def run_save(self) -> None:
    """The cache as prefill left it, with the token ids each sequence holds and those of its prompt it does not
    hold yet, to the plan's ``save_to``; ``saved`` holds what was written."""
    heads = self.plan.heads or self.plan.lengths
    held = [c + p[:n] for c, p, n in zip(self.context, self.plan.prompts, heads)]
    tails = [p[n:] for p, n in zip(self.plan.prompts, heads)]
    self.saved = saved_cache.save(self.plan.save_to, self.cache, self.cfg, self.params, held, tails)

  def run_pre_decode(self) -> None:
    guess, self.cache = speculative_start(self.params, self.cfg, self.cache, self.carry.last)
    self.carry.spec = self._rows(guess)
    if self.speculative:
      jax.block_until_ready((guess, self.cache))

  def run_decode(self, out: list) -> int:
    """Decode chunks until every sequence stopped or ``max_new_tokens`` were produced; appends each chunk's host
    ids to ``out`` and returns the tokens produced (whole chunks: the last may run past the limit)."""
    produced, c, last = 1, self.carry, time.perf_counter()
    while produced < self.plan.max_new_tokens and not bool(np.all(np.asarray(c.done))):
      self.cache, c.last, c.spec, c.done, c.bad, c.counts, c.key, chunk_out = _decode_chunk(
          *c.decode_args(self.params, self.cache, self.eos, self.pad), cfg=self.cfg, sampler=self.sampler,
          steps=self.plan.chunk)
      # One placement for what the next chunk takes (a mesh's partitioner may return another): one compilation.
      c.last, c.spec, c.done, c.bad, c.counts, c.key = self._rows((c.last, c.spec, c.done, c.bad, c.counts, c.key))
      out.append(np.asarray(self._rows(chunk_out)))  # (waits for the chunk: its time is known here)
      self.chunk_s.append(time.perf_counter() - last)
      last += self.chunk_s[-1]
      produced += self.plan.chunk
    jax.block_until_ready(self.cache)
    return produced


@sharding.under_mesh
def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
             method: CacheMethod = Dense(), max_new_tokens: int = 64, sampler=Greedy(), seed: int = 0,
             capacity: Optional[int] = None, chunk: int = DECODE_CHUNK, eos_ids: Optional[Sequence[int]] = None,
             pad_id: int = 0, attention_impl: str = "auto", prefill_tokens: Optional[int] = None,
             prefill_chunk: Optional[int] = None, mesh=None, cache: Optional[str] = None,
             save_cache: Optional[str] = None) -> GenerateResult:
  """Generate up to ``max_new_tokens`` tokens for each prompt (lists of token ids) in one batch.

  Decoding stops for a sequence at its first end-of-sequence token (``eos_ids``, default the model's) and for
  the batch once every sequence stopped. ``attention_impl`` picks the attention implementation ("auto": the
  Pallas kernels on a GPU that runs them, XLA elsewhere; see ``jkv.attention.choose_impl``).

  Prefill (``jkv.prefill``) takes whole prompts wherever they fit a call of ``prefill_tokens`` prompt tokens
  (default: what the device's free memory holds beside the cache), in sub-batches where the batch does not, and the
  result is the same as one call (bit for bit on a CPU; on a GPU up to the order in which a matmul adds its terms,
  which cuBLAS and XLA choose per shape). Where not even one prompt fits a call, or with ``prefill_chunk``, it is
  chunked: C tokens of every prompt a call, each chunk attending the cache as the method holds it (so the context
  is bounded by the cache, not by prefill's activations; the capacity then holds a few blocks more).

  Stats report the KV bytes the method holds on the device and in host memory, the dense bytes for the same
  tokens, the allocated bytes, prefill/decode times with compilation counted apart, the prefill plan, and the
  device's peak memory where jax reports it. A method that carries a speculative row
  (``CacheMethod.speculative_rows``) gets its pre-decode pass before the first step, timed apart (``pre_decode_s``,
  once per call, like prefill; ``decode_s`` is the decode steps alone, ``decode_chunk_s`` each chunk's share of it:
  a first chunk longer than the rest shows a cost of first runs, not of steps). ``method_stats`` holds what the method
  gathered while decoding (``CacheMethod.decode_stats``: SpeCache's ``speculation_hit_rate``) and, for a
  speculative method, ``speculative_token_match`` (how often the speculative token was the real next token).
  Non-finite logits raise a one-line ValueError naming the sequences.

  ``mesh`` (a ``jax.sharding.Mesh``, a spec such as ``"data=2,model=4"``, or None) runs it on a device mesh
  (``jkv.sharding``): parameters tensor-parallel over ``model``, the cache split over sequences (``data``) and KV
  heads (``model``), every cache call run per shard; the tokens are those of one device.

  ``save_cache`` (a directory to create) saves the cache as prefill leaves it, before decoding (``jkv.saved_cache``):
  each prompt's whole chunks of the method (``CacheMethod.chunk_multiple``), whose prefill is saved before the last
  tokens are fed. ``cache`` (a directory saved so, by this model with this method and settings) is loaded instead
  of an empty cache, and the prompts continue what it holds: its last tokens and then each prompt are fed as the next
  chunk of its sequence (``extend``), one prompt per saved sequence, or any number after a cache of one. Stats then
  count the saved tokens in the bytes held, and report ``cache_saved`` (bytes on disk and held, seconds, GB/s) and
  ``cache_loaded``.
  """
  plan = plan_generation(cfg, method, prompts, max_new_tokens=max_new_tokens, capacity=capacity, chunk=chunk,
                         eos_ids=eos_ids, pad_id=pad_id, attention_impl=attention_impl,
                         prefill_tokens=prefill_tokens, prefill_chunk=prefill_chunk, mesh=mesh, cache=cache,
                         save_cache=save_cache)
  # Refused here, before anything is allocated, when the cache cannot fit; an allocation that fails later says
  # the same in one line (jkv.memory.guard).
  with memory.guard(memory.CacheRequest(cfg, method, plan.batch, plan.capacity, plan.prefill.chunk, mesh,
                                        plan.max_decode)):
    run = _Generation(params, cfg, method, plan, sampler, seed, mesh)
    with CompileCounter() as compiles:
      t_compile = time.perf_counter()
      run.warm()
      compile_s = time.perf_counter() - t_compile
      t0 = time.perf_counter()
      out = [run.run_prefill()]
      prefill_s = time.perf_counter() - t0 - (run.saved["save_s"] if run.saved else 0.0)  # saving timed apart
      t_pre = time.perf_counter()
      run.run_pre_decode()
      pre_decode_s = time.perf_counter() - t_pre
      t1 = time.perf_counter()
      produced = run.run_decode(out)
      decode_s = time.perf_counter() - t1
  timings = dict(compile_s=compile_s, compiles=compiles.count, prefill_s=prefill_s, pre_decode_s=pre_decode_s,
                 decode_s=max(decode_s, 1e-9))
  return _result(run, out, produced, timings)


def _result(run: _Generation, out: list, produced: int, timings: dict) -> GenerateResult:
  """The tokens cut at each sequence's end and the call's statistics (``generate``'s docstring)."""
  plan, cache = run.plan, run.cache
  bad = np.flatnonzero(np.asarray(run.carry.bad))
  if bad.size:
    raise ValueError(f"the model produced non-finite logits for sequence(s) {', '.join(map(str, bad))}: its "
                     "weights or activations overflow (try --dtype float32) or are corrupt")
  ids = np.concatenate(out, axis=1)[:, :plan.max_new_tokens]
  result_tokens = [_cut_at_eos(row.tolist(), plan.eos) for row in ids]
  decoded_steps = ids.shape[1] - 1
  held = np.asarray(plan.starts) + np.asarray(plan.lengths) + decoded_steps
  kv = cache.held_bytes(held)  # counted for the tokens asked for: the last chunk may have run past them
  allocated = cache.allocated_bytes()
  mem = memory.device_memory()
  B = plan.batch
  stats = dict(
      method=cache.method.name,
      method_config=cache.method.settings(),  # as it ran: settings left to the device decided (KIVI's mma)
      attention_impl=plan.impl,
      mesh=sharding.mesh_label(run.mesh),  # e.g. "data=2,model=4"; None on one device
      batch=B,
      prompt_tokens=plan.lengths,
      new_tokens=[len(t) for t in result_tokens],
      capacity=plan.capacity,
      kv_bytes=kv.device,  # what the cache holds on the device for these tokens
      kv_host_bytes=kv.host,  # what it holds in host memory (SpeCache's full-precision copy)
      dense_kv_bytes=dense_kv_bytes(run.spec, held),
      allocated_kv_bytes=allocated.device,
      allocated_kv_host_bytes=allocated.host,
      prefill_sub_batch=plan.prefill.rows,  # sequences per prefill call
      prefill_chunk=plan.prefill.chunk if plan.prefill.chunked else None,  # tokens per call when chunked
      prefill_calls=sum(part.calls() for _, part, _ in plan.parts()),
      prefill_s=timings["prefill_s"],
      prefill_tokens_per_s=sum(plan.lengths) / max(timings["prefill_s"], 1e-9),
      pre_decode_s=timings["pre_decode_s"],  # a speculative method's pre-decode pass (once, before the first step)
      decode_s=timings["decode_s"],  # the decode steps
      decode_steps=produced - 1,  # steps run: whole chunks, so the last may run past max_new_tokens
      decode_chunk_s=run.chunk_s,  # each chunk's seconds, plan.chunk steps each
      decode_tokens_per_s=(B * decoded_steps / timings["decode_s"]) if decoded_steps else 0.0,
      compile_s=timings["compile_s"],  # tracing and compiling (near zero when every shape was seen before)
      compiles=timings["compiles"],
      peak_device_bytes=None if mem is None else mem["peak"],
      held_tokens=plan.starts,  # tokens of a saved cache each sequence continued (0: none)
      cache_saved=run.saved,  # save_cache: directory, array_bytes, disk_bytes, held_bytes, save_s, save_gb_per_s
      cache_loaded=run.loaded,  # cache: directory, load_s, load_gb_per_s
  )
  stats["method_stats"] = cache.method.decode_stats(cache.state)
  if run.speculative:
    counts = np.asarray(run.carry.counts).sum(axis=0)
    # How often the speculative token was the real next token (the method never checks its guess; this shows how
    # good the guesses were).
    stats["method_stats"]["speculative_token_match"] = float(counts[0] / counts[1]) if counts[1] else None
  return GenerateResult(tokens=result_tokens, stats=stats)


def stream(params: Params, cfg: ModelConfig, prompt: Sequence[int], *, method: CacheMethod = Dense(),
           max_new_tokens: int = 64, sampler=Greedy(), seed: int = 0, eos_ids: Optional[Sequence[int]] = None,
           attention_impl: str = "auto", prefill_chunk: Optional[int] = None, cache: Optional[str] = None,
           save_cache: Optional[str] = None):
  """Yield generated token ids one at a time for a single prompt (the CLI's streaming path); ``cache`` and
  ``save_cache`` as ``generate``'s."""
  plan = plan_generation(cfg, method, [prompt], max_new_tokens=max_new_tokens, chunk=1, eos_ids=eos_ids,
                         attention_impl=attention_impl, prefill_chunk=prefill_chunk, cache=cache,
                         save_cache=save_cache)
  with memory.guard(memory.CacheRequest(cfg, method, 1, plan.capacity, plan.prefill.chunk,
                                        max_decode=plan.max_decode)):
    run = _Generation(params, cfg, method, plan, sampler, seed, None)
    run.run_prefill()
    c = run.carry
    for i in range(max_new_tokens):
      if bool(c.bad[0]):
        raise ValueError("the model produced non-finite logits: its weights or activations overflow "
                         "(try --dtype float32) or are corrupt")
      tok = int(c.last[0])
      if tok in plan.eos:
        return
      yield tok
      if i + 1 < max_new_tokens:
        if i == 0:
          run.run_pre_decode()
        run.cache, c.last, c.spec, c.done, c.bad, c.counts, c.key, _ = _decode_chunk(
            *c.decode_args(run.params, run.cache, run.eos, run.pad), cfg=cfg, sampler=sampler, steps=1)
