"""The quality-per-byte frontier: every method's main knobs swept on the same windows, perplexity against the KV
bytes each configuration holds per token, and which configurations no other one beats on both.

Each configuration is one ``compare.compare`` row (perplexity scored token by token through the decode path), so the
frontier and ``jkv compare`` measure the same thing, plus the bytes its cache holds after every scored step. A
sweep writes its JSON after every configuration (to a temporary file, then renamed), so a killed sweep keeps every
configuration it finished, and running the same command again measures only the rest. A configuration is identified
by its method and full settings, so two spellings of one setting are measured once.

Several processes may sweep into one output prefix at once (several machines sharing a file system, say): each adds
its row by a read-modify-write under the output directory's lock (``jkv.files.locked``), reading the file again and
adding the row only when no other process has added that configuration meanwhile, and skips a configuration another
process finished before it began it. No row is lost or kept twice; two processes may measure one configuration at
the same time, and the first to finish keeps it.

Bytes are device bytes per token, the budget a user spends on the accelerator, averaged over the scored steps as
the perplexity is: after every step of one window, ``held_trace`` reads the cache's ``held_bytes`` (from its state)
and divides by the tokens held. One length alone would favour some methods by phase: KIVI's full-precision keys
drop to none each time R tokens are flushed, OTT's buffer fills to G + R before a block is quantized, ZipCache's
window to its interval before it is compressed; at 576 tokens KIVI-2 (R = 32) holds no full-precision key and
OTT (G = 32, R = 32) its fullest buffer. SpeCache's 16-bit copy in host memory is reported beside the device
bytes, not in them.
"""

import ast
import dataclasses
import importlib.util
import json
import math
import os
import textwrap
from typing import Callable, Optional, Sequence

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jkv import files
from jkv import generate as gen
from jkv import methods as methods_lib
from jkv.attention import choose_impl
from jkv.cache import CacheSpec, KVCache
from jkv.evaluation import compare as compare_lib
from jkv.evaluation import perplexity as ppl_lib

DEFAULT_PPL = ppl_lib.WindowPlan(context=512, scored=64, num_windows=16, batch_size=4)

# Each method's main knobs (docs/frontier.md), 77 configurations: about an hour and a half at 512 + 64 tokens on 2
# shared CPU cores. Every method's default and its presets join the sweep whatever the grid says (``sweep_specs``).
SWEEP = {
    "dense": ("dense",),
    "kivi": tuple(f"kivi:bits={b},residual={r}" for b in (1, 2, 4) for r in (32, 64, 128))
    + ("kivi:k_bits=4,v_bits=2,residual=32", "kivi:k_bits=2,v_bits=4,residual=32", "kivi:bits=8,residual=32",
       "kivi:bits=2,group_size=64,residual=64", "kivi:bits=2,group_size=64,residual=128"),
    # value_group=none: values grouped as keys (min(G, head dim)), as these rows were first measured.
    "ott": tuple(f"ott:group_size={g},residual={r},pool_size={n},value_group=none"
                 for g, r in ((128, 32), (64, 32), (32, 32), (32, 64), (32, 128)) for n in (0, 3, 8))
    + tuple(f"ott:{c},value_group=none" for c in (
        "group_size=32,residual=16,pool_size=3", "bits=4,group_size=32,residual=32,pool_size=3",
        "group_size=32,residual=16,pool_size=8", "group_size=32,residual=48,pool_size=8",
        "group_size=32,residual=32,pool_size=16", "group_size=32,residual=32,pool_size=8,no_pool_layers=0",
        "group_size=16,residual=32,pool_size=8"))
    # Key groups of 16 tokens (the current default: G = 16, Gv = 32, R = 32, N = 8).
    + tuple(f"ott:group_size=16,residual={r},pool_size={n},value_group={gv}"
            for r, n, gv in ((32, 0, 32), (32, 3, 32), (32, 16, 32), (16, 8, 32), (48, 8, 32), (32, 8, 64),
                             (48, 8, 64)))
    + ("ott:group_size=32,residual=32,pool_size=8,value_group=64",),
    "zipcache": tuple(f"zipcache:salient_ratio={r},interval={n}" for r in (0.1, 0.2, 0.3, 0.6) for n in (32, 100))
    + ("zipcache:high_bits=8,salient_ratio=0.1,interval=32", "zipcache:high_bits=4,low_bits=4,interval=32",
       "zipcache:high_bits=2,low_bits=2,interval=32"),
    "specache": tuple(f"specache:bits={b},fetch_rows={k}" for b in (1, 2) for k in (0, 16, 32, 64, 128))
    + tuple(f"specache:bits=1,fetch_rows={k},residual=32" for k in (32, 64))
    + tuple(f"specache:bits=1,fetch_rows={k},speculate=false" for k in (16, 64, 128))
    + tuple(f"specache:bits={b},fetch_rows={k},repair=true" for b in (1, 2) for k in (64, 128)),
}


def sweep_specs(names: Optional[Sequence[str]] = None) -> list:
  """The configurations to measure for these methods (default: every method in ``SWEEP``), each method's default
  and presets first, duplicates (by settings) dropped."""
  names = list(SWEEP) if names is None else list(names)
  unknown = [n for n in names if n not in SWEEP]
  if unknown:
    raise ValueError(f"no frontier sweep for {', '.join(unknown)}; methods swept: {', '.join(SWEEP)}")
  specs, seen = [], set()
  for name in names:
    texts = [name] + [f"{name}:preset={p}" for p in methods_lib.presets(name)] + list(SWEEP[name])
    for spec in compare_lib.parse_methods(texts):
      key = config_key(spec.method())
      if key not in seen:
        seen.add(key)
        specs.append(spec)
  return specs


def config_key(method) -> str:
  """What identifies a configuration in a sweep file: the method's name and every setting."""
  return json.dumps([method.name, dataclasses.asdict(method)], sort_keys=True)


def _row_method(row):
  """The method a row measured: every setting is stored; a setting the method gained since takes its default,
  which therefore must be the behaviour before it (SpeCache's ``repair=False``)."""
  return methods_lib.make_method(row["name"], **row["settings"])


def label(row) -> str:
  """The configuration's name as the current defaults write it (``ott:group_size=32``), or its preset's name."""
  method = _row_method(row)
  for preset in methods_lib.presets(method.name):
    if config_key(methods_lib.make_method(method.name, preset=preset)) == config_key(method):
      return f"{method.name}:preset={preset}"
  return compare_lib.method_label(method)


def is_default(row) -> bool:
  return config_key(_row_method(row)) == config_key(methods_lib.make_method(row["name"]))


# ------------------------------------------------------------------------------------------------- the front

def pareto_front(points: Sequence[tuple]) -> list:
  """Indices (ascending) of the points (bytes, ppl) that no other point dominates: none has both coordinates
  <= and one <. Lower is better on both. One pass over the points sorted by bytes, then ppl: a point is on the
  front when its ppl is below every earlier point's, or when it repeats the last front point exactly (equal
  points do not dominate each other)."""
  order = sorted(range(len(points)), key=lambda i: tuple(points[i]))
  front, best = [], math.inf
  for i in order:
    if points[i][1] < best or (front and tuple(points[i]) == tuple(points[front[-1]])):
      front.append(i)
      best = points[i][1]
  return sorted(front)


def held_trace(model, method, window: np.ndarray, context: int, attention_impl: str = "auto") -> list:
  """Device and host bytes the cache holds after each decode step of one window [context + S + 1] (the
  perplexity's decode path, one step per call): [(tokens held, device bytes, host bytes)] * S."""
  cfg = model.config
  scored = len(window) - context - 1
  cap = gen.plan_capacity(cfg, method, [context], scored, 1, capacity=context + scored)
  cache = KVCache.create(method, CacheSpec.for_model(cfg, 1, cap), choose_impl(attention_impl))
  window = jnp.asarray(window[None], jnp.int32)
  cache = ppl_lib._prefill(model.params, window[:, :context], cache, cfg=cfg)
  trace = []
  for t in range(context, context + scored):
    # A speculative method runs its pre-decode pass at every call here: it stores nothing, so the bytes held
    # after each step are those of a run in one go.
    cache, _ = ppl_lib._score(model.params, cache, window[:, t:t + 1], window[:, t + 1:t + 2], cfg=cfg)
    held = cache.held_bytes()
    trace.append((t + 1, held.device, held.host))
  return trace


def bytes_per_token(row) -> float:
  """Device bytes per token held, averaged over the scored steps (``held_trace``)."""
  return float(np.mean([device / n for n, device, _ in row["held_trace"]]))


def host_bytes_per_token(row) -> float:
  return float(np.mean([host / n for n, _, host in row["held_trace"]]))


def annotate(rows: Sequence[dict]) -> list:
  """The rows with ``bytes_per_token``, ``on_front`` (the whole sweep's Pareto front), ``on_method_front`` (the
  method's own), ``default`` and ``label`` filled in from the current defaults and presets."""
  out = [dict(r, bytes_per_token=bytes_per_token(r), host_bytes_per_token=host_bytes_per_token(r), label=label(r),
              default=is_default(r)) for r in rows]
  points = [(r["bytes_per_token"], r["ppl"]) for r in out]
  front = set(pareto_front(points))
  for i, r in enumerate(out):
    r["on_front"] = i in front
  for name in {r["name"] for r in out}:
    idx = [i for i, r in enumerate(out) if r["name"] == name]
    own = {idx[j] for j in pareto_front([points[i] for i in idx])}
    for i in idx:
      out[i]["on_method_front"] = i in own
  return out


# ------------------------------------------------------------------------------------------------- the sweep

SAME = ("model", "dtype", "text", "ppl")  # meta keys a resumed sweep must share with the file


def write_json(path: str, data) -> None:
  """Write ``data`` to ``path`` whole or not at all: to a temporary file beside it, then renamed over it."""
  with files.written_together([path]) as (tmp,):
    with open(tmp, "w") as f:
      json.dump(data, f, indent=1)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())


def load_sweep(path: str, meta: dict) -> dict:
  """The sweep file at ``path`` ({"meta", "rows"}; empty rows if it does not exist). A file measured under other
  settings (``SAME``: model, dtype, text, windows) is refused in one line rather than mixed with new rows."""
  if not os.path.exists(path):
    return dict(meta=dict(meta, commands=[]), rows=[])
  try:
    with open(path) as f:
      data = json.load(f)
    old, rows = data["meta"], list(data["rows"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path} is not a frontier sweep file ({e}); choose another --output or remove it") from None
  for key in SAME:
    if old.get(key) != meta[key]:
      raise ValueError(f"{path} was measured with {key}={old.get(key)!r}, not {meta[key]!r}; choose another "
                       "--output or remove it")
  return dict(meta=dict(meta, commands=old.get("commands", [])), rows=rows)


def _measured(rows) -> set:
  return {config_key(_row_method(r)) for r in rows}


def add_row(path: str, meta: dict, row: dict, first: bool) -> bool:
  """Add ``row`` to the sweep file at ``path`` as it is now (other processes may have added rows since this one
  read it), unless its configuration is there already; ``first``: this process's first row, whose command joins
  the file's ``commands``. Read, merged and written under the lock of the file's directory. Whether it was added."""
  with files.locked(os.path.dirname(os.path.abspath(path))):
    data = load_sweep(path, meta)
    if config_key(_row_method(row)) not in _measured(data["rows"]):
      data["rows"].append(row)
      if first:
        data["meta"]["commands"].append(meta["command"])
      write_json(path, data)
      return True
  return False


def sweep(model, specs: Sequence[compare_lib.MethodSpec], *, token_ids: Sequence[int], plan: ppl_lib.WindowPlan,
          path: str, meta: dict, progress: Optional[bool] = None, attention_impl: str = "auto", mesh=None,
          measure: Callable = compare_lib.compare) -> dict:
  """Measure every configuration of ``specs`` not yet in the sweep file ``path``; return the file's contents
  ({"meta", "rows"}: every row measured so far, by this process or another, in the order added). A row is
  ``compare.compare``'s, plus ``held_trace`` over the first window.

  After each configuration the file holds every row so far (``add_row``). ``meta`` must carry the keys of
  ``SAME`` and ``command``, which joins the file's list of ``commands`` that measured its rows. ``measure`` is
  ``compare.compare`` (a test may count its calls)."""
  for spec in specs:
    spec.method()  # every configuration is valid before the first one runs
  ids = np.asarray(token_ids, np.int32)
  first_window = ids[plan.starts(len(ids))[0]:][:plan.window]
  rows = load_sweep(path, meta)["rows"]
  done = _measured(rows)
  todo = []
  for spec in specs:
    key = config_key(spec.method())
    if key not in done:
      done.add(key)
      todo.append(spec)
  bar = tqdm(total=len(rows) + len(todo), initial=len(rows), desc="frontier", unit="config",
             disable=progress is False)
  added = False
  for spec in todo:
    if config_key(spec.method()) not in _measured(load_sweep(path, meta)["rows"]):  # nor by another process since
      bar.set_postfix_str(spec.label)
      row, = measure(model, [spec], token_ids=token_ids, ppl=plan, passkey=None, baseline=None, progress=False,
                     attention_impl=attention_impl, mesh=mesh)
      row = dict(row, held_trace=held_trace(model, spec.method(), first_window, plan.context, attention_impl))
      added = add_row(path, meta, row, first=not added) or added
    bar.update(1)
  bar.close()
  return load_sweep(path, meta)


# ------------------------------------------------------------------------------------------------- texts

# Held-out text: the docstrings of these standard-library modules (the module's, then its classes' and functions'
# breadth-first, as ``ast.walk`` visits them),
# read from their source files with ``ast``, so every Python install carries them and ``-OO`` does not strip them.
# English prose about the library, not the language reference that ``pydoc_data.topics`` holds.
DOCSTRING_MODULES = ("argparse", "asyncio.events", "collections", "concurrent.futures._base", "configparser",
                     "dataclasses", "email.message", "functools", "http.client", "inspect", "logging",
                     "multiprocessing.pool", "optparse", "pathlib", "shutil", "subprocess", "tarfile", "threading",
                     "typing", "unittest.case", "unittest.mock", "urllib.request", "zipfile")


def stdlib_docstrings() -> str:
  """The held-out perplexity text: ``DOCSTRING_MODULES``' docstrings, in that order, joined by blank lines."""
  parts = []
  for name in DOCSTRING_MODULES:
    with open(importlib.util.find_spec(name).origin, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc and len(doc.split()) >= 8:  # one-line docstrings are mostly names restated
          parts.append(doc)
  return "\n\n".join(parts)


TEXTS = {
    "topics": (ppl_lib.default_text, "pydoc_data.topics (Python stdlib)"),
    "docstrings": (stdlib_docstrings, "docstrings of " + ", ".join(DOCSTRING_MODULES) + " (Python stdlib)"),
}


# ------------------------------------------------------------------------------------------------- reports

BUDGETS = (1 / 8, 1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2)  # fractions of dense's bytes a user may hold


def best_within(rows: Sequence[dict], budgets: Sequence[float] = BUDGETS) -> list:
  """For each budget (a fraction of dense's bytes per token), the lowest-perplexity annotated row within it:
  (budget, row or None)."""
  dense = next((r for r in rows if r["name"] == "dense"), None)
  if dense is None:
    raise ValueError("the sweep has no dense row: budgets are fractions of dense's bytes")
  out = []
  for b in budgets:
    inside = [r for r in rows if r["bytes_per_token"] <= b * dense["bytes_per_token"]]
    out.append((b, min(inside, key=lambda r: r["ppl"], default=None)))
  return out


def _delta(r, dense):
  return f"{100 * (r['ppl'] / dense['ppl'] - 1):+.1f}%"


def markdown_report(rows: Sequence[dict], meta: dict) -> str:
  """The command, the budget table, then every configuration by method and bytes, front and defaults marked."""
  dense = next(r for r in rows if r["name"] == "dense")
  plan = meta["ppl"]
  out = [f"# jkv frontier: {meta['model']} ({meta['dtype']}), {plan['context']} + {plan['scored']} tokens", "",
         "```", *meta["commands"], "```", "",
         "## Best configuration within a budget", "",
         "| budget (of dense's bytes) | configuration | bytes/token | ppl | vs dense |",
         "| --- | --- | ---: | ---: | ---: |"]
  for b, r in best_within(rows):
    out.append(f"| 1/{1 / b:.0f} | " + ("none measured |  |  |  |" if r is None else
                                       f"`{r['label']}` | {r['bytes_per_token']:,.0f} | {r['ppl']:.3f} "
                                       f"| {_delta(r, dense)} |"))
  out += ["", "## Every configuration", "",
          "`front`: no configuration of any method holds fewer bytes at no worse perplexity (the Pareto front); "
          "`default`: the method's default; `method front`: on its own method's front.", "",
          "| configuration | bytes/token | host bytes/token | compression | ppl | vs dense | front | default "
          "| method front |", "| --- | ---: | ---: | ---: | ---: | ---: | :---: | :---: | :---: |"]
  mark = lambda x: "✓" if x else ""
  for r in sorted(rows, key=lambda r: (list(SWEEP).index(r["name"]) if r["name"] in SWEEP else len(SWEEP),
                                       r["name"], r["bytes_per_token"], r["ppl"])):
    out.append(f"| `{r['label']}` | {r['bytes_per_token']:,.0f} | {r['host_bytes_per_token']:,.0f} "
               f"| {dense['bytes_per_token'] / r['bytes_per_token']:.2f}x | {r['ppl']:.3f} | {_delta(r, dense)} "
               f"| {mark(r['on_front'])} "
               f"| {mark(r['default'])} | {mark(r['on_method_front'])} |")
  out += ["", f"- perplexity: {meta['text']}; {plan['num_windows']} windows (seed {plan['seed']}) of "
          f"{plan['context']} prefilled + {plan['scored']} scored tokens, every scored token predicted by a decode "
          f"step over the compressed cache; the same windows for every configuration.",
          f"- bytes/token: device bytes the cache holds (`held_bytes`, from its state) divided by the tokens it "
          f"holds, after each of the {plan['scored']} scored steps of the first window, averaged; dense holds K "
          f"and V in {meta['dtype']}. Host bytes: SpeCache's 16-bit copy in host memory, not in bytes/token.",
          f"- {len(rows)} configurations, {meta['environment']['device']}, jax {meta['environment']['jax']}."]
  return "\n".join(out) + "\n"


def plot(rows: Sequence[dict], path: str, title: str) -> None:
  """Perplexity against bytes per token: each method's configurations with its own front as a line, the whole
  sweep's front dashed, dense and each default marked. Perplexity is cut at 1.6x dense's (a linear axis reads
  the gaps near dense); the configurations above are counted in the title."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  dense = next(r for r in rows if r["name"] == "dense")
  top = 1.6 * dense["ppl"]
  fig, ax = plt.subplots(figsize=(10, 6.5))
  names = [n for n in SWEEP if any(r["name"] == n for r in rows)]
  names += sorted({r["name"] for r in rows} - set(names))
  for i, name in enumerate(names):
    mine = sorted((r for r in rows if r["name"] == name), key=lambda r: r["bytes_per_token"])
    color = "black" if name == "dense" else f"C{i}"
    ax.scatter([r["bytes_per_token"] for r in mine], [r["ppl"] for r in mine], s=18, color=color, alpha=0.55,
               label=name)
    own = [r for r in mine if r["on_method_front"]]
    ax.plot([r["bytes_per_token"] for r in own], [r["ppl"] for r in own], color=color, lw=1.2, alpha=0.8)
    for r in mine:
      if r["default"]:
        ax.scatter(r["bytes_per_token"], r["ppl"], s=140, marker="*" if name == "dense" else "D", color=color,
                   edgecolor="black", linewidth=1.2, zorder=4)
        ax.annotate(f"{name} default", (r["bytes_per_token"], min(r["ppl"], top)), textcoords="offset points",
                    xytext=(7, 6), fontsize=8, color=color)
  front = sorted((r for r in rows if r["on_front"]), key=lambda r: r["bytes_per_token"])
  ax.step([r["bytes_per_token"] for r in front], [r["ppl"] for r in front], where="post", color="gray", ls="--",
          lw=1.5, label="Pareto front (all methods)", zorder=1)
  low = min(r["ppl"] for r in rows)
  ax.set_ylim(low - 0.03 * (top - low), top)
  ax.set_xscale("log")
  ax.set_xlabel("device KV bytes per token (log)")
  ax.set_ylabel("perplexity")
  ax.grid(True, which="both", alpha=0.25)
  ax.legend(fontsize=8, loc="upper right")
  above = sum(r["ppl"] > top for r in rows)
  title += f" ({above} configurations above {top:.1f}, off the chart)" if above else ""
  ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# The committed frontiers of the default model (float32), read by ``jkv info`` in a source checkout (the README's
# install is editable); (context, path), shortest context first.
COMMITTED = tuple((n, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results",
                                   f"frontier_{n}.json")) for n in (512, 2048))


def advice(fraction: float, committed=COMMITTED) -> list:
  """What the committed frontiers say about a budget of ``fraction`` of dense's bytes: for each one present, a line
  naming the lowest-perplexity configuration measured within that budget."""
  lines = []
  for context, path in committed:
    if not os.path.exists(path):
      continue
    with open(path) as f:
      data = json.load(f)
    rows = annotate(data["rows"])
    dense = next(r for r in rows if r["name"] == "dense")
    (_, best), = best_within(rows, (fraction,))
    where = f"default model (float32), {context} + {data['meta']['ppl']['scored']} tokens"
    lines.append(f"{where}: nothing measured within {fraction:.3f}x dense's bytes" if best is None else
                 f"{where}: within {fraction:.3f}x dense's bytes the lowest perplexity measured is "
                 f"{best['label']} ({best['bytes_per_token'] / dense['bytes_per_token']:.3f}x dense's bytes, ppl "
                 f"{_delta(best, dense)} vs dense; benchmarks/results/frontier_{context}.md)")
  return lines


def write_outputs(rows: Sequence[dict], meta: dict, prefix: str) -> list:
  """``prefix``.md (report) and ``prefix``.png (plot) from the annotated rows; ``prefix``.json is the sweep's own
  file, written as it ran."""
  paths = [prefix + ".md", prefix + ".png"]
  plan = meta["ppl"]
  with files.written_together(paths) as partial:
    with open(partial[0], "w") as f:
      f.write(markdown_report(rows, meta))
    plot(rows, partial[1], title=f"{meta['model']} ({meta['dtype']}): perplexity vs KV bytes per token, "
                                 f"{plan['num_windows']} windows of {plan['context']} + {plan['scored']} tokens of "
                                 f"{textwrap.shorten(meta['text'], 60)}")
  return paths
