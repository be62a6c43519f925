"""Where SpeCache's perplexity gap to dense comes from, on the default model, CPU or GPU.

SpeCache attends the k rows that the previous step's speculative row found most attended, in 16 bits. Its
speculative token is a guess of the next real token (the greedy output of the previous speculative row). In
perplexity scoring the real tokens are the text's, so the guess is right only as often as the model predicts the
text. This script scores the same windows (``jkv.evaluation.perplexity``'s windows and decode path) four ways:

    dense         no compression
    oracle        ``specache:speculate=false``: the real row picks its own top k over the low-bit copy, the rows
                  are fetched, it attends again (the paper's non-speculative baseline: no guess)
    speculative   SpeCache as it runs (``generate`` feeds the same tokens)
    true_next     SpeCache with the text's own next token as the speculative token: a guess that is always
                  right, so the fetch differs from the oracle's only in being chosen one step ahead

and reports per variant the perplexity, how often the speculative token equals the text's next token, and the
speculation hit rate (the share of the real row's top k that was fetched) on the steps where the guess was right
and where it was wrong. Then it generates ``--scored`` tokens greedily from each window's context with dense, the
oracle and SpeCache, where the real next token is the model's own argmax, and reports how often the speculative
token is right there, the hit rate, and for how many tokens each output agrees with dense's. Method settings other
than speculation come from ``--method`` (a ``jkv compare`` spec).

    python benchmarks/specache_quality.py --output benchmarks/results/specache_quality_512.json
    python benchmarks/specache_quality.py --context 64 --scored 8 --windows 2 --model PATH   # a quick check
"""

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jkv import generate as gen
from jkv.attention import choose_impl
from jkv.cache import KVCache, CacheSpec
from jkv.evaluation import compare as compare_lib
from jkv.evaluation import perplexity as ppl_lib
from jkv.load import load_model
from jkv.model import forward


@functools.partial(jax.jit, static_argnames=("cfg", "true_next"), donate_argnames=("cache",))
def _score(params, cache, inputs, targets, *, cfg, true_next):
  """Teacher-forced SpeCache decoding as ``perplexity._score`` does it, returning per step [B, S]: the NLL, whether
  the speculative token was the text's next token, and the step's hit fraction (mean over layers and KV heads)."""
  spec, cache = gen.pre_decode_tokens(params, cache, inputs[:, 0], cfg=cfg)

  def step(carry, xs):
    cache, spec = carry
    tok, target = xs
    if true_next:
      spec = target[:, None]
    before = cache.state.hit_sum.sum(axis=(0, 2)), cache.state.hit_steps.sum(axis=(0, 2))
    rows = jnp.concatenate([tok[:, None], spec], axis=1)
    logits, cache = forward(params, rows, cache.lengths[:, None] + jnp.arange(2), cache, cfg=cfg)
    logp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
    hits = (cache.state.hit_sum.sum(axis=(0, 2)) - before[0]) / jnp.maximum(
        cache.state.hit_steps.sum(axis=(0, 2)) - before[1], 1)
    nll = -jnp.take_along_axis(logp, target[:, None], axis=1)[:, 0]
    return (cache, jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)), (nll, spec[:, 0] == target, hits)

  _, (nll, right, hits) = jax.lax.scan(step, (cache, spec), (inputs.T, targets.T))
  return nll.T, right.T, hits.T


def speculative_windows(model, method, windows, context: int, *, true_next: bool):
  """NLL, guess-right flags and hit fractions [N, S] of windows [N, context + S + 1], decoded as one batch."""
  cfg = model.config
  B, W = windows.shape
  cap = gen.plan_capacity(cfg, method, [context], W - context - 1, 1, capacity=W - 1)
  cache = KVCache.create(method, CacheSpec.for_model(cfg, B, cap), choose_impl("auto"))
  cache = ppl_lib._prefill(model.params, jnp.asarray(windows[:, :context]), cache, cfg=cfg)
  out = _score(model.params, cache, jnp.asarray(windows[:, context:-1]), jnp.asarray(windows[:, context + 1:]),
               cfg=cfg, true_next=true_next)
  return [np.asarray(x) for x in out]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--method", default="specache", help="SpeCache settings as a jkv compare spec (default: specache)")
  p.add_argument("--context", type=int, default=512)
  p.add_argument("--scored", type=int, default=64)
  p.add_argument("--windows", type=int, default=16)
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--output", default=None, help="write the JSON record here")
  args = p.parse_args(argv)
  spec = compare_lib.MethodSpec.parse(args.method)
  method = spec.method()
  if method.name != "specache":
    raise SystemExit(f"specache_quality.py: --method must be a specache spec, got {args.method!r}")
  method = dataclasses.replace(method, speculate=True, hit_rate=True)
  oracle = dataclasses.replace(method, speculate=False)
  plan = ppl_lib.WindowPlan(context=args.context, scored=args.scored, num_windows=args.windows,
                            batch_size=args.batch_size)
  t0 = time.perf_counter()
  model = load_model(args.model, "float32")
  ids = np.asarray(model.tokenizer.encode(ppl_lib.default_text(), add_bos=False), np.int32)
  starts = plan.starts(len(ids))
  windows = np.stack([ids[s:s + plan.window] for s in starts])
  record = dict(command=" ".join(["python", "benchmarks/specache_quality.py"] + sys.argv[1:]),
                method=compare_lib.method_label(method), plan=dataclasses.asdict(plan),
                text="pydoc_data.topics (Python stdlib)", environment=compare_lib.environment(), variants={},
                generate={})
  for name, m in (("dense", None), ("oracle", oracle)):
    r = ppl_lib.perplexity(model.params, model.config, ids, plan=plan, progress=False,
                           **({} if m is None else dict(method=m)))
    record["variants"][name] = dict(ppl=r.ppl, kv_bytes=r.kv_bytes, kv_tokens=r.kv_tokens)
    print(f"{name}: ppl {r.ppl:.3f}", file=sys.stderr, flush=True)
  for name, true_next in (("speculative", False), ("true_next", True)):
    parts = [speculative_windows(model, method, windows[i:i + plan.batch_size], plan.context, true_next=true_next)
             for i in range(0, plan.num_windows, plan.batch_size)]
    nll, right, hits = (np.concatenate(x) for x in zip(*parts))
    record["variants"][name] = dict(
        ppl=float(np.exp(nll.mean())), guess_right=float(right.mean()), hit_rate=float(hits.mean()),
        hit_rate_guess_right=float(hits[right].mean()) if right.any() else None,
        hit_rate_guess_wrong=float(hits[~right].mean()) if (~right).any() else None,
        # NLL on the steps where the guess was right and where it was wrong, to set against dense's on the same
        # steps (dense_nll_*, filled in below)
        nll_guess_right=float(nll[right].mean()) if right.any() else None,
        nll_guess_wrong=float(nll[~right].mean()) if (~right).any() else None, right=right.tolist())
    print(f"{name}: ppl {record['variants'][name]['ppl']:.3f}, guess right {right.mean():.3f}, "
          f"hit rate {hits.mean():.3f}", file=sys.stderr, flush=True)
  # Dense's NLL on the same steps the speculative guess got right and wrong.
  dense_nll = np.concatenate([ppl_lib.window_nll(model.params, model.config, windows[i:i + plan.batch_size],
                                                 method=compare_lib.MethodSpec.parse("dense").method(),
                                                 context=plan.context)[0]
                              for i in range(0, plan.num_windows, plan.batch_size)])
  right = np.asarray(record["variants"]["speculative"].pop("right"))
  record["variants"]["true_next"].pop("right")
  record["variants"]["dense"].update(nll_guess_right=float(dense_nll[right].mean()),
                                     nll_guess_wrong=float(dense_nll[~right].mean()))
  # Greedy generation from the windows' contexts, where the real next token is the model's own argmax: how often
  # the speculative token is right there, the hit rate, and how long each method's output agrees with dense's.
  greedy = {}
  for name, m in (("dense", compare_lib.MethodSpec.parse("dense").method()), ("oracle", oracle),
                  ("speculative", method)):
    res = gen.generate(model.params, model.config, [w[:plan.context].tolist() for w in windows], method=m,
                       max_new_tokens=plan.scored, eos_ids=())
    greedy[name] = np.asarray(res.tokens)
    record["generate"][name] = dict(res.stats["method_stats"])
  for name in ("oracle", "speculative"):
    same = np.cumprod(greedy[name] == greedy["dense"], axis=1)  # 1 up to the first token that differs
    record["generate"][name]["tokens_agreeing_with_dense"] = float(same.sum(axis=1).mean())
    record["generate"][name]["tokens_equal_to_dense"] = float((greedy[name] == greedy["dense"]).mean())
  print(json.dumps(record["generate"]), file=sys.stderr, flush=True)
  record["seconds"] = time.perf_counter() - t0
  text = json.dumps(record, indent=1)
  if args.output:
    with open(args.output, "w") as f:
      f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
