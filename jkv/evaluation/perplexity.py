"""Perplexity of a text under a cache method, measured through the decode path.

Each window of ``context + scored + 1`` tokens is cut from the text's token stream. Its first ``context`` tokens
are prefilled into the method's cache (prefill attention is exact, as in every method); then the next ``scored``
tokens are fed one at a time through ``forward``'s decode path, and each step's logits score the token that
follows. So every scored token is predicted by attention over the compressed cache, never by prefill attention.
Windows are disjoint, chosen with a fixed seed, and batched so that one jitted scan decodes several at once.
"""

import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jkv import context_parallel
from jkv import generate as gen
from jkv import memory
from jkv import prefill as prefill_lib
from jkv import sharding
from jkv.attention import choose_impl
from jkv.cache import CacheMethod, CacheSpec, dense_kv_bytes
from jkv.config import ModelConfig
from jkv.methods.dense import Dense
from jkv.model import forward
from jkv.params import Params
from jkv.xla_options import MODEL_COMPILER_OPTIONS


def default_text() -> str:
  """The perplexity text every Python install carries: the stdlib's ``pydoc_data.topics`` (about 465 KB of
  English), its entries joined in sorted key order."""
  from pydoc_data.topics import topics
  return "\n\n".join(topics[k] for k in sorted(topics))


@dataclasses.dataclass(frozen=True)
class WindowPlan:
  """Which tokens are prefilled and scored: ``num_windows`` disjoint windows of ``context + scored + 1`` tokens."""

  context: int = 384  # tokens prefilled into the cache per window
  scored: int = 64  # tokens scored per window, each through one decode step
  num_windows: int = 6
  seed: int = 0
  batch_size: int = 3  # windows decoded together in one batch
  prefill_chunk: Optional[int] = None  # chunked prefill of each context in chunks of this many tokens (None: whole)

  @property
  def window(self) -> int:
    return self.context + self.scored + 1

  def validate(self) -> None:
    for name in ("context", "scored", "num_windows", "batch_size", "prefill_chunk"):
      if getattr(self, name) is not None and getattr(self, name) < 1:
        raise ValueError(f"perplexity {name} must be >= 1, got {getattr(self, name)}")

  def starts(self, num_tokens: int) -> np.ndarray:
    """Start offsets of the windows: ``num_windows`` of the text's disjoint window slots, drawn with ``seed``
    and sorted."""
    self.validate()
    slots = num_tokens // self.window
    if slots < self.num_windows:
      raise ValueError(f"the text has {num_tokens} tokens: room for {slots} windows of {self.window} tokens, "
                       f"not {self.num_windows}; use a longer text or fewer/shorter windows")
    chosen = np.random.default_rng(self.seed).choice(slots, size=self.num_windows, replace=False)
    return np.sort(chosen) * self.window


@dataclasses.dataclass
class PerplexityResult:
  ppl: float  # exp(mean NLL) over every scored token
  nll: float  # mean NLL in nats
  tokens_scored: int
  window_nll: list  # mean NLL per window
  starts: list  # window offsets in the token stream
  kv_bytes: int  # device bytes the method holds for one sequence of context + scored tokens (mean over windows)
  kv_host_bytes: int  # host-memory bytes it holds for one such sequence
  dense_kv_bytes: int  # bytes the dense cache would hold for the same tokens
  kv_tokens: int  # context + scored: the sequence length the bytes are counted at
  decode_tokens_per_s: float  # batch rows x decode steps per second, compilation excluded
  compile_s: float
  seconds: float  # wall time, compilation included
  method_stats: dict = dataclasses.field(default_factory=dict)  # ``decode_stats`` averaged over the batches
  method_config: dict = dataclasses.field(default_factory=dict)  # settings as they ran (``CacheMethod.settings``)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",),
                   compiler_options=MODEL_COMPILER_OPTIONS)
def _prefill(params, tokens, cache, *, cfg):
  """Store tokens [B, T] (every row a full prompt) in the empty cache. The logits are unused, so XLA drops
  the vocabulary projection."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  _, cache = forward(params, tokens, positions, cache, cfg=cfg, prefill=True)
  return cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",),
                   compiler_options=MODEL_COMPILER_OPTIONS)
def _score(params, cache, inputs, targets, *, cfg):
  """Teacher-forced decoding: step t feeds inputs[:, t] and returns the fp32 NLL of targets[:, t]. [B, S] -> [B, S].

  A method with a speculative row (``CacheMethod.speculative_rows``) first gets its pre-decode pass on inputs[:, 0];
  each step then feeds the speculative token after the real one (the greedy output of the previous step's
  speculative row, as in generate), and only the real row is scored.
  """
  if cache.method.speculative_rows == 0:
    def step(cache, xs):
      tok, target = xs  # [B], [B]
      logits, cache = forward(params, tok[:, None], cache.lengths[:, None], cache, cfg=cfg)
      logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
      return cache, -jnp.take_along_axis(logp, target[:, None], axis=1)[:, 0]

    cache, nll = jax.lax.scan(step, cache, (inputs.T, targets.T))
    return cache, nll.T

  spec, cache = gen.pre_decode_tokens(params, cache, inputs[:, 0], cfg=cfg)

  def spec_step(carry, xs):
    cache, spec = carry
    tok, target = xs
    rows = jnp.concatenate([tok[:, None], spec], axis=1)
    logits, cache = forward(params, rows, cache.lengths[:, None] + jnp.arange(rows.shape[1]), cache, cfg=cfg)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
    spec = jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)
    return (cache, spec), -jnp.take_along_axis(logp, target[:, None], axis=1)[:, 0]

  (cache, _), nll = jax.lax.scan(spec_step, (cache, spec), (inputs.T, targets.T))
  return cache, nll.T


@sharding.under_mesh
def window_nll(params: Params, cfg: ModelConfig, windows: np.ndarray, *, method: CacheMethod,
               context: int, attention_impl: str = "auto", prefill_chunk: Optional[int] = None,
               mesh=None) -> tuple[np.ndarray, dict]:
  """NLL [N, S] of tokens windows[:, context + 1:], for windows [N, context + S + 1] decoded as one batch; the
  contexts prefilled whole, or in chunks of ``prefill_chunk`` tokens (``jkv.prefill``).

  Returns the NLLs and a dict: timings (``decode_s`` of the scan, ``compile_s`` of this call's compilations),
  ``held``, the ``HeldBytes`` of the whole batch's cache at the end (context + scored tokens per window), and
  ``method_stats``, what the method gathered while decoding (``CacheMethod.decode_stats``), and
  ``method_config``, its settings as they ran (``CacheMethod.settings``). ``mesh``: as in
  ``jkv.generate.generate`` (N must split over its data axis).
  """
  windows = np.asarray(windows, np.int32)
  B, W = windows.shape
  scored = W - context - 1
  if scored < 1:
    raise ValueError(f"windows of {W} tokens leave nothing to score after a context of {context}")
  cap = gen.plan_capacity(cfg, method, [context], scored, 1, capacity=context + scored)
  sharding.check_mesh(mesh, cfg, B)
  plan = prefill_lib.plan(cfg, method, [context] * B, cap, chunk=prefill_chunk, prefill_tokens=B * cap, mesh=mesh)
  plan = dataclasses.replace(plan, capacity=context_parallel.split_capacity(plan.capacity, method, mesh))
  params = sharding.shard_params(params, cfg, mesh)
  with memory.guard(memory.CacheRequest(cfg, method, B, plan.capacity, plan.chunk, mesh)):
    cache = sharding.create_cache(method, CacheSpec.for_model(cfg, B, plan.capacity), choose_impl(attention_impl),
                                  mesh)
    with gen.CompileCounter() as compiles:
      if plan.chunked:
        tokens = prefill_lib.pad_prompts(windows[:, :context], plan.width, 0)
        _, cache = prefill_lib.Prefill(plan, cfg, tokens, [context] * B)(params, cache)
      else:
        cache = _prefill(params, jnp.asarray(windows[:, :context]), cache, cfg=cfg)
      jax.block_until_ready(cache)
      before = compiles.seconds
      t0 = time.perf_counter()
      cache, nll = _score(params, cache, jnp.asarray(windows[:, context:-1]), jnp.asarray(windows[:, context + 1:]),
                          cfg=cfg)
      nll = np.asarray(nll)
      decode_s = time.perf_counter() - t0
  held = cache.held_bytes()
  method_stats = method.decode_stats(cache.state)
  settings = cache.method.settings()
  del cache
  return nll, dict(decode_s=decode_s, decode_compile_s=compiles.seconds - before, compile_s=compiles.seconds,
                   held=held, method_stats=method_stats, method_config=settings)


@sharding.under_mesh
def perplexity(params: Params, cfg: ModelConfig, token_ids: Sequence[int], *, method: CacheMethod = Dense(),
               plan: WindowPlan = WindowPlan(), progress: Optional[bool] = None,
               attention_impl: str = "auto", mesh=None) -> PerplexityResult:
  """Perplexity of ``token_ids`` under ``method``: windows per ``plan``, scored through the decode path.

  ``mesh``: as in ``jkv.generate.generate``; batches are rounded up to a multiple of its data axis (padded as
  the last batch is)."""
  t_start = time.perf_counter()
  ids = np.asarray(token_ids, np.int32)
  if ids.ndim != 1:
    raise ValueError("token_ids must be one flat sequence of token ids")
  starts = plan.starts(len(ids))
  windows = np.stack([ids[s:s + plan.window] for s in starts])
  B = sharding.round_batch(min(plan.batch_size, plan.num_windows), mesh)
  sharding.check_mesh(mesh, cfg)
  params = sharding.shard_params(params, cfg, mesh)  # once, not per batch
  nlls, decode_s, rows, compile_s, first_batch, held, stats = [], 0.0, 0, 0.0, None, [], []
  bar = tqdm(total=plan.num_windows * plan.scored, desc=f"ppl {method.name}", unit="tok", leave=False,
             disable=progress is False)
  for i in range(0, plan.num_windows, B):
    batch = windows[i:i + B]
    real = len(batch)
    if real < B:  # pad the last batch with repeats of its first window: the same shapes, nothing to compile
      batch = np.concatenate([batch, np.repeat(batch[:1], B - real, axis=0)])
    nll, t = window_nll(params, cfg, batch, method=method, context=plan.context, attention_impl=attention_impl,
                        prefill_chunk=plan.prefill_chunk, mesh=mesh)
    nlls.append(nll[:real])
    held.append((t["held"], B))
    stats.append(t["method_stats"])
    compile_s += t["compile_s"]
    if first_batch is None:
      first_batch = t
    elif t["decode_compile_s"] == 0:
      decode_s += t["decode_s"]
      rows += B * plan.scored
    bar.update(real * plan.scored)
  bar.close()
  if rows == 0:  # a single batch: its decode time less its compilation
    decode_s = max(first_batch["decode_s"] - first_batch["decode_compile_s"], 1e-9)
    rows = B * plan.scored
  nll = np.concatenate(nlls)
  n = plan.context + plan.scored
  spec = CacheSpec.for_model(cfg, 1, gen.round_up(n, method.capacity_multiple()))
  per_sequence = lambda side: int(round(sum(getattr(h, side) for h, _ in held) / sum(b for _, b in held)))
  return PerplexityResult(
      ppl=float(np.exp(nll.mean())), nll=float(nll.mean()), tokens_scored=int(nll.size),
      window_nll=[float(x) for x in nll.mean(axis=1)], starts=[int(s) for s in starts],
      kv_bytes=per_sequence("device"), kv_host_bytes=per_sequence("host"), dense_kv_bytes=dense_kv_bytes(spec, np.array([n])),
      kv_tokens=n, decode_tokens_per_s=rows / decode_s, compile_s=compile_s,
      seconds=time.perf_counter() - t_start,
      method_stats=mean_stats(stats), method_config=first_batch["method_config"])


def mean_stats(stats: list) -> dict:
  """Each method statistic's mean over the batches that have it (None where none has)."""
  out = {}
  for key in stats[0]:
    values = [s[key] for s in stats if s[key] is not None]
    out[key] = float(np.mean(values)) if values else None
  return out
