"""Batched generation: one jitted prefill, then decoding in jitted ``lax.scan`` chunks over a donated cache.

Prompts of different lengths share a batch: each sequence sits in slots [0, length) with its own length, so
its tokens are those it would get alone. Prompt lengths are bucketed to powers of two and decoding runs in
chunks of a static size, so a second call with the same shapes compiles nothing; the host looks at the
end-of-sequence flags once per chunk, never per token.
"""

import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv import memory
from jkv import sharding
from jkv.attention import choose_impl
from jkv.cache import CacheMethod, CacheSpec, KVCache, dense_kv_bytes
from jkv.config import ModelConfig
from jkv.methods.dense import Dense
from jkv.model import forward
from jkv.params import Params
from jkv.sampling import Greedy
from jkv.xla_options import MODEL_COMPILER_OPTIONS

MIN_PROMPT_BUCKET = 16


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


def bucket(n: int) -> int:
  return max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length())


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def plan_capacity(cfg: ModelConfig, method: CacheMethod, prompt_lens, max_new_tokens: int, chunk: int,
                  capacity: Optional[int] = None) -> int:
  """Cache capacity for these prompts, or a one-line ValueError when they cannot fit."""
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
    capacity = round_up(bucket(longest) + round_up(max_new_tokens, chunk), multiple)
  return capacity


def padded_length(prompt_lens, capacity: int) -> int:
  """Prompts are padded to a power-of-two bucket (few shapes, few compilations), within the capacity."""
  return min(bucket(max(prompt_lens)), capacity)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",),
                   compiler_options=MODEL_COMPILER_OPTIONS)
def _prefill_rows(params, tokens, positions, cache, start, *, cfg):
  """Prefill sequences [start, start + b) of the cache with tokens [b, T]; returns their last-token logits
  [b, vocab] and the cache. Other sequences' state is untouched, so a batch can be filled a sub-batch at a time
  (the activations of one call are bounded by b x T tokens). The sub-batch starts from a fresh empty state, not
  a slice of the cache: with the cache's only use the in-place write, XLA needs no copy of it (reading a slice
  first made it copy the whole donated cache, 27 GiB at B=98 on the H100)."""
  part = KVCache.create(cache.method, cache.spec.with_batch(tokens.shape[0]), cache.impl)
  last = jnp.sum(positions >= 0, axis=1, keepdims=True) - 1  # [b, 1]: each prompt's last token
  logits, part = forward(params, tokens, positions, part, cfg=cfg, prefill=True, logit_rows=last)
  return logits[:, 0], cache.put_rows(start, part)


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


def _pad_prompts(prompts, length, pad_id):
  B = len(prompts)
  tokens = np.full((B, length), pad_id, np.int32)
  positions = np.full((B, length), -1, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
    positions[b, :len(p)] = np.arange(len(p))
  return tokens, positions


def prefill_starts(batch: int, rows: int) -> list:
  """First sequence of each prefill sub-batch of ``rows`` sequences: the last one is moved back to end at the
  batch's end (its overlap is prefilled twice, identically), so every call has the same shape."""
  starts = list(range(0, batch - rows + 1, rows))
  if starts[-1] + rows < batch:
    starts.append(batch - rows)
  return starts


def _prefill(params, cfg, tokens, positions, cache, prefill_tokens):
  """Prefill the whole batch in sub-batches of at most ``prefill_tokens`` prompt tokens (at least one sequence).
  Returns the last-token logits [B, vocab] and the cache."""
  B, T = tokens.shape
  rows = sharding.batch_rows(prefill_tokens // T, B, sharding.cache_mesh(cache))
  logits = None
  for start in prefill_starts(B, rows):
    part, cache = _prefill_rows(params, jnp.asarray(tokens[start:start + rows]),
                                jnp.asarray(positions[start:start + rows]), cache, jnp.int32(start), cfg=cfg)
    logits = jnp.zeros((B,) + part.shape[1:], part.dtype) if logits is None else logits
    logits = logits.at[start:start + rows].set(part)
  return logits, cache


def _cut_at_eos(ids, eos_ids):
  for i, t in enumerate(ids):
    if t in eos_ids:
      return ids[:i]
  return ids


@sharding.under_mesh
def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
             method: CacheMethod = Dense(), max_new_tokens: int = 64, sampler=Greedy(), seed: int = 0,
             capacity: Optional[int] = None, chunk: int = 32, eos_ids: Optional[Sequence[int]] = None,
             pad_id: int = 0, attention_impl: str = "auto", prefill_tokens: Optional[int] = None,
             mesh=None) -> GenerateResult:
  """Generate up to ``max_new_tokens`` tokens for each prompt (lists of token ids) in one batch.

  Decoding stops for a sequence at its first end-of-sequence token (``eos_ids``, default the model's) and for
  the batch once every sequence stopped. ``attention_impl`` picks the attention implementation ("auto": the
  Pallas kernels on a GPU that runs them, XLA elsewhere; see ``jkv.attention.choose_impl``). Prefill runs in
  sub-batches of at most ``prefill_tokens`` prompt tokens (default: what the device's free memory holds), so the
  batch is bounded by the cache, not by prefill activations; the result is the same as one call (bit for bit on a
  CPU; on a GPU up to the order in which a matmul adds its terms, which cuBLAS and XLA choose per shape).

  Stats report the KV bytes the method holds on the device and in host memory, the dense bytes for the same
  tokens, the allocated bytes, prefill/decode times with compilation counted apart, and the device's peak
  memory where jax reports it. A method that carries a speculative row (``CacheMethod.speculative_rows``) gets its
  pre-decode pass before the first step, timed apart (``pre_decode_s``, once per call, like prefill; ``decode_s``
  is the decode steps alone). ``method_stats`` holds what the method gathered while decoding
  (``CacheMethod.decode_stats``: SpeCache's ``speculation_hit_rate``) and, for a speculative method,
  ``speculative_token_match`` (how often the speculative token was the real next token). Non-finite logits raise
  a one-line ValueError naming the sequences.

  ``mesh`` (a ``jax.sharding.Mesh``, a spec such as ``"data=2,model=4"``, or None) runs it on a device mesh
  (``jkv.sharding``): parameters tensor-parallel over ``model``, the cache split over sequences (``data``) and KV
  heads (``model``), every cache call run per shard; the tokens are those of one device.
  """
  prompts = check_prompts(prompts, cfg.vocab_size)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  impl = choose_impl(attention_impl)
  eos = tuple(cfg.eos_ids if eos_ids is None else eos_ids)
  lens = [len(p) for p in prompts]
  chunk = min(chunk, max_new_tokens)
  cap = plan_capacity(cfg, method, lens, max_new_tokens, chunk, capacity)
  tokens, positions = _pad_prompts(prompts, padded_length(lens, cap), pad_id)
  spec = CacheSpec.for_model(cfg, len(prompts), cap)
  sharding.check_mesh(mesh, cfg, len(prompts))
  if prefill_tokens is not None and prefill_tokens < 1:
    raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
  # Refused here, before anything is allocated, when the cache cannot fit; an allocation that fails later says
  # the same in one line (jkv.memory.guard).
  with memory.guard(memory.CacheRequest(cfg, method, len(prompts), cap, tokens.shape[1], mesh)):
    params = sharding.shard_params(params, cfg, mesh)
    params, cache = committed((params, sharding.create_cache(method, spec, impl, mesh)))
    if prefill_tokens is None:
      jax.block_until_ready(cache)  # allocation is asynchronous: the free memory must count the cache
      # One sequence's whole state (not split over a mesh: one sequence does not split over ``data``; an upper
      # bound where ``model`` splits its heads).
      prefill_tokens = memory.prefill_token_budget(cfg, state_bytes_per_token=-(
          -memory.cache_bytes(method, cfg, 1, cap) // tokens.shape[1]))
    rows = sharding.batch_rows(prefill_tokens // tokens.shape[1], len(prompts), mesh)
    B = len(prompts)
    S = method.speculative_rows
    key, eos_arr, pad, no, no_spec, zero_counts, first_ids = sharding.rows(committed((
        jax.random.key(seed), jnp.asarray(eos if eos else (-1,), jnp.int32), jnp.int32(pad_id), jnp.zeros((B,), bool),
        jnp.zeros((B, S), jnp.int32), jnp.zeros((B, 2), jnp.int32), jnp.asarray(tokens[:, 0]))), mesh)
    key, sub = jax.random.split(key)
    decode_args = lambda cache, last, spec, done, bad, counts, key: (params, cache, last, spec, done, bad, counts, key,
                                                                     eos_arr, pad)
    with CompileCounter() as compiles:
      t_compile = time.perf_counter()
      # Compile (or find compiled) before timing, so the timings below are run time alone.
      _warm(_prefill_rows, (params, jnp.asarray(tokens[:rows]), jnp.asarray(positions[:rows]), cache, jnp.int32(0)),
            dict(cfg=cfg))
      _warm(_first_tokens, sharding.rows((committed(jnp.zeros((B, cfg.vocab_size), jnp.float32)), sub), mesh),
            dict(sampler=sampler))
      if S:
        _warm(_pre_decode, (params, cache, first_ids), dict(cfg=cfg))
      _warm(_decode_chunk, decode_args(cache, first_ids, no_spec, no, no, zero_counts, key),
            dict(cfg=cfg, sampler=sampler, steps=chunk))
      compile_s = time.perf_counter() - t_compile

      t0 = time.perf_counter()
      logits, cache = _prefill(params, cfg, tokens, positions, cache, prefill_tokens)
      first, bad = sharding.rows(_first_tokens(*sharding.rows((committed(logits), sub), mesh), sampler=sampler), mesh)
      first.block_until_ready()
      prefill_s = time.perf_counter() - t0

      done = jnp.isin(first, eos_arr)
      out = [np.asarray(first)[:, None]]
      t_pre = time.perf_counter()
      guess, cache = speculative_start(params, cfg, cache, first)
      guess = sharding.rows(guess, mesh)
      if S:
        jax.block_until_ready((guess, cache))
      pre_decode_s = time.perf_counter() - t_pre
      t1 = time.perf_counter()
      produced = 1
      last, counts = first, zero_counts
      while produced < max_new_tokens and not bool(np.all(np.asarray(done))):
        cache, last, guess, done, bad, counts, key, chunk_out = _decode_chunk(
            *decode_args(cache, last, guess, done, bad, counts, key), cfg=cfg, sampler=sampler, steps=chunk)
        # One placement for what the next chunk takes (a mesh's partitioner may return another): one compilation.
        last, guess, done, bad, counts, key = sharding.rows((last, guess, done, bad, counts, key), mesh)
        out.append(np.asarray(sharding.rows(chunk_out, mesh)))
        produced += chunk
      jax.block_until_ready(cache)
      decode_s = time.perf_counter() - t1

  bad = np.flatnonzero(np.asarray(bad))
  if bad.size:
    raise ValueError(f"the model produced non-finite logits for sequence(s) {', '.join(map(str, bad))}: its "
                     "weights or activations overflow (try --dtype float32) or are corrupt")
  ids = np.concatenate(out, axis=1)[:, :max_new_tokens]
  result_tokens = [_cut_at_eos(row.tolist(), eos) for row in ids]
  decoded_steps = ids.shape[1] - 1
  held = np.asarray(lens) + decoded_steps
  kv = cache.held_bytes(held)  # counted for the tokens asked for: the last chunk may have run past them
  allocated = cache.allocated_bytes()
  mem = memory.device_memory()
  run_decode_s = max(decode_s, 1e-9)
  stats = dict(
      method=method.name,
      method_config=cache.method.settings(),  # as it ran: settings left to the device decided (KIVI's mma)
      attention_impl=impl,
      mesh=sharding.mesh_label(mesh),  # e.g. "data=2,model=4"; None on one device
      batch=B,
      prompt_tokens=lens,
      new_tokens=[len(t) for t in result_tokens],
      capacity=cap,
      kv_bytes=kv.device,  # what the cache holds on the device for these tokens
      kv_host_bytes=kv.host,  # what it holds in host memory (SpeCache's full-precision copy)
      dense_kv_bytes=dense_kv_bytes(spec, held),
      allocated_kv_bytes=allocated.device,
      allocated_kv_host_bytes=allocated.host,
      prefill_sub_batch=rows,
      prefill_s=prefill_s,
      pre_decode_s=pre_decode_s,  # a speculative method's pre-decode pass (once, before the first step)
      decode_s=run_decode_s,  # the decode steps
      decode_steps=produced - 1,  # steps run: whole chunks, so the last may run past max_new_tokens
      decode_tokens_per_s=(B * decoded_steps / run_decode_s) if decoded_steps else 0.0,
      compile_s=compile_s,  # tracing and compiling (near zero when every shape was seen before)
      compiles=compiles.count,
      peak_device_bytes=None if mem is None else mem["peak"],
  )
  stats["method_stats"] = method.decode_stats(cache.state)
  if S:
    counts = np.asarray(counts).sum(axis=0)
    # How often the speculative token was the real next token (the method never checks its guess; this shows how
    # good the guesses were).
    stats["method_stats"]["speculative_token_match"] = float(counts[0] / counts[1]) if counts[1] else None
  return GenerateResult(tokens=result_tokens, stats=stats)


def stream(params: Params, cfg: ModelConfig, prompt: Sequence[int], *, method: CacheMethod = Dense(),
           max_new_tokens: int = 64, sampler=Greedy(), seed: int = 0, eos_ids: Optional[Sequence[int]] = None,
           attention_impl: str = "auto"):
  """Yield generated token ids one at a time for a single prompt (the CLI's streaming path)."""
  (prompt,) = check_prompts([prompt], cfg.vocab_size)
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  eos = tuple(cfg.eos_ids if eos_ids is None else eos_ids)
  cap = plan_capacity(cfg, method, [len(prompt)], max_new_tokens, 1)
  tokens, positions = _pad_prompts([prompt], padded_length([len(prompt)], cap), 0)
  with memory.guard(memory.CacheRequest(cfg, method, 1, cap, tokens.shape[1])):
    params, cache = committed((params, KVCache.create(method, CacheSpec.for_model(cfg, 1, cap),
                                                      choose_impl(attention_impl))))
    key, done, counts, eos_arr, pad = committed((
        jax.random.key(seed), jnp.zeros((1,), bool), jnp.zeros((1, 2), jnp.int32),
        jnp.asarray(eos if eos else (-1,), jnp.int32), jnp.int32(0)))
    key, sub = jax.random.split(key)
    logits, cache = _prefill(params, cfg, tokens, positions, cache, tokens.shape[1])
    last, bad = _first_tokens(committed(logits), sub, sampler=sampler)
    spec = None
    for i in range(max_new_tokens):
      if bool(bad[0]):
        raise ValueError("the model produced non-finite logits: its weights or activations overflow "
                         "(try --dtype float32) or are corrupt")
      tok = int(last[0])
      if tok in eos:
        return
      yield tok
      if i + 1 < max_new_tokens:
        if spec is None:
          spec, cache = speculative_start(params, cfg, cache, last)
        cache, last, spec, done, bad, counts, key, _ = _decode_chunk(
            params, cache, last, spec, done, bad, counts, key, eos_arr, pad, cfg=cfg, sampler=sampler, steps=1)
