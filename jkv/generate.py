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

from jkv.cache import CacheMethod, CacheSpec, KVCache, dense_kv_bytes
from jkv.config import ModelConfig
from jkv.methods.dense import Dense
from jkv.model import forward
from jkv.params import Params
from jkv.sampling import Greedy

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
  longest = max(prompt_lens)
  need = longest + max_new_tokens
  if need > cfg.max_position:
    raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                     f"context of {cfg.max_position} tokens")
  if capacity is not None:
    if need > capacity:
      raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the cache "
                       f"capacity of {capacity} tokens")
    capacity = round_up(capacity, method.capacity_multiple())
  else:
    capacity = round_up(bucket(longest) + round_up(max_new_tokens, chunk), method.capacity_multiple())
  return capacity


@functools.partial(jax.jit, static_argnames=("cfg", "sampler"), donate_argnames=("cache",))
def _prefill(params, tokens, positions, cache, key, *, cfg, sampler):
  last = jnp.sum(positions >= 0, axis=1, keepdims=True) - 1  # [B, 1]: each prompt's last token
  logits, cache = forward(params, tokens, positions, cache, cfg=cfg, prefill=True, logit_rows=last)
  return sampler.next_tokens(logits[:, 0], key), cache


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "steps"), donate_argnames=("cache",))
def _decode_chunk(params, cache, tokens, done, key, eos_ids, pad_id, *, cfg, sampler, steps):
  """``steps`` decode steps in one scan. tokens [B]: the last sampled token of each sequence."""

  def step(carry, _):
    cache, tokens, done, key = carry
    key, sub = jax.random.split(key)
    logits, cache = forward(params, tokens[:, None], cache.lengths[:, None], cache, cfg=cfg)
    nxt = jnp.where(done, pad_id, sampler.next_tokens(logits[:, 0], sub))
    done = done | jnp.isin(nxt, eos_ids)
    return (cache, nxt, done, key), nxt

  (cache, tokens, done, key), out = jax.lax.scan(step, (cache, tokens, done, key), None, length=steps)
  return cache, tokens, done, key, out.T


_WARM: set = set()


def _warm(fn, args, static):
  """Trace and compile ``fn`` for these shapes once per process (jit and ahead-of-time share compiled code)."""
  key = (fn, jax.tree.structure(args), tuple(jax.tree.map(lambda a: (a.shape, a.dtype), jax.tree.leaves(args))),
         tuple(sorted(static.items())))
  if key not in _WARM:
    fn.lower(*args, **static).compile()
    _WARM.add(key)


def _pad_prompts(prompts, length, pad_id):
  B = len(prompts)
  tokens = np.full((B, length), pad_id, np.int32)
  positions = np.full((B, length), -1, np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
    positions[b, :len(p)] = np.arange(len(p))
  return jnp.asarray(tokens), jnp.asarray(positions)


def _cut_at_eos(ids, eos_ids):
  for i, t in enumerate(ids):
    if t in eos_ids:
      return ids[:i]
  return ids


def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *,
             method: CacheMethod = Dense(), max_new_tokens: int = 64, sampler=Greedy(), seed: int = 0,
             capacity: Optional[int] = None, chunk: int = 32, eos_ids: Optional[Sequence[int]] = None,
             pad_id: int = 0) -> GenerateResult:
  """Generate up to ``max_new_tokens`` tokens for each prompt (lists of token ids) in one batch.

  Decoding stops for a sequence at its first end-of-sequence token (``eos_ids``, default the model's) and for
  the batch once every sequence stopped. Stats report the KV bytes the method holds, the dense bytes for the
  same tokens, and prefill/decode times with compilation counted apart.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  eos = tuple(cfg.eos_ids if eos_ids is None else eos_ids)
  lens = [len(p) for p in prompts]
  chunk = min(chunk, max_new_tokens)
  cap = plan_capacity(cfg, method, lens, max_new_tokens, chunk, capacity)
  tokens, positions = _pad_prompts(prompts, bucket(max(lens)), pad_id)
  spec = CacheSpec.for_model(cfg, len(prompts), cap)
  cache = KVCache.create(method, spec)
  key = jax.random.key(seed)
  eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)

  key, sub = jax.random.split(key)
  prefill_args = (params, tokens, positions, cache, sub)
  decode_args = lambda cache, last, done, key: (params, cache, last, done, key, eos_arr, jnp.int32(pad_id))
  with CompileCounter() as compiles:
    t_compile = time.perf_counter()
    # Compile (or find compiled) before timing, so the timings below are run time alone.
    _warm(_prefill, prefill_args, dict(cfg=cfg, sampler=sampler))
    _warm(_decode_chunk, decode_args(cache, tokens[:, 0], jnp.zeros(len(prompts), bool), key),
          dict(cfg=cfg, sampler=sampler, steps=chunk))
    compile_s = time.perf_counter() - t_compile

    t0 = time.perf_counter()
    first, cache = _prefill(*prefill_args, cfg=cfg, sampler=sampler)
    first.block_until_ready()
    prefill_s = time.perf_counter() - t0

    done = jnp.isin(first, eos_arr)
    out = [np.asarray(first)[:, None]]
    t1 = time.perf_counter()
    produced = 1
    last = first
    while produced < max_new_tokens and not bool(np.all(np.asarray(done))):
      cache, last, done, key, chunk_out = _decode_chunk(*decode_args(cache, last, done, key), cfg=cfg,
                                                        sampler=sampler, steps=chunk)
      out.append(np.asarray(chunk_out))
      produced += chunk
    jax.block_until_ready(cache)
    decode_s = time.perf_counter() - t1

  ids = np.concatenate(out, axis=1)[:, :max_new_tokens]
  result_tokens = [_cut_at_eos(row.tolist(), eos) for row in ids]
  decoded_steps = ids.shape[1] - 1
  held = np.asarray(lens) + decoded_steps
  run_decode_s = max(decode_s, 1e-9)
  stats = dict(
      method=method.name,
      batch=len(prompts),
      prompt_tokens=lens,
      new_tokens=[len(t) for t in result_tokens],
      capacity=cap,
      # Counted for the tokens asked for: the last chunk may have run past them.
      kv_bytes=int(method.kv_bytes(spec, held)),
      dense_kv_bytes=dense_kv_bytes(spec, held),
      allocated_kv_bytes=cache.allocated_bytes(),
      prefill_s=prefill_s,
      decode_s=run_decode_s,
      decode_tokens_per_s=(len(prompts) * decoded_steps / run_decode_s) if decoded_steps else 0.0,
      compile_s=compile_s,  # tracing and compiling (near zero when every shape was seen before)
      compiles=compiles.count,
  )
  return GenerateResult(tokens=result_tokens, stats=stats)


def stream(params: Params, cfg: ModelConfig, prompt: Sequence[int], *, method: CacheMethod = Dense(),
           max_new_tokens: int = 64, sampler=Greedy(), seed: int = 0, eos_ids: Optional[Sequence[int]] = None):
  """Yield generated token ids one at a time for a single prompt (the CLI's streaming path)."""
  eos = tuple(cfg.eos_ids if eos_ids is None else eos_ids)
  cap = plan_capacity(cfg, method, [len(prompt)], max_new_tokens, 1)
  tokens, positions = _pad_prompts([prompt], bucket(len(prompt)), 0)
  cache = KVCache.create(method, CacheSpec.for_model(cfg, 1, cap))
  key, sub = jax.random.split(jax.random.key(seed))
  last, cache = _prefill(params, tokens, positions, cache, sub, cfg=cfg, sampler=sampler)
  done = jnp.zeros((1,), bool)
  eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)
  for i in range(max_new_tokens):
    tok = int(last[0])
    if tok in eos:
      return
    yield tok
    if i + 1 < max_new_tokens:
      cache, last, done, key, _ = _decode_chunk(params, cache, last, done, key, eos_arr, jnp.int32(0),
                                                cfg=cfg, sampler=sampler, steps=1)
