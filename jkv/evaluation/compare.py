"""Cache methods side by side: memory, perplexity, pass-key retrieval and decode speed, as one table and a plot.

A configuration is written ``name:option=value,option=value`` (``kivi:bits=2,residual=64``). Values are coerced to
the types of the method's config fields, so any registered method joins by registration alone; unknown methods
and options are rejected in one line before anything runs.
"""

import dataclasses
import json
import os
import platform
import sys
import time
import typing
from typing import Optional, Sequence

import jax

from jkv import files
from jkv import methods as methods_lib
from jkv.cache import CacheMethod, CacheSpec
from jkv.evaluation import passkey as passkey_lib
from jkv.evaluation import perplexity as ppl_lib

# dense, KIVI-4, KIVI-2 and the four 2-bit fake-quantization layouts of KIVI's Table 1 (arXiv:2402.02750).
DEFAULT_METHODS = (
    "dense",
    "kivi:bits=4",
    "kivi:bits=2",
    "fakequant:bits=2,key_axis=channel,value_axis=token",
    "fakequant:bits=2,key_axis=token,value_axis=token",
    "fakequant:bits=2,key_axis=channel,value_axis=channel",
    "fakequant:bits=2,key_axis=token,value_axis=channel",
)
# Sized so that the seven default configurations run in about 10 minutes on 2 CPU cores
# (benchmarks/results/compare_default.md).
DEFAULT_PPL = ppl_lib.WindowPlan()  # 6 windows of 384 prefilled + 64 scored tokens
DEFAULT_PASSKEY = passkey_lib.PasskeyGrid(lengths=(1024,), depths=(0.0, 0.25, 0.5, 0.75), trials=2, seed=0,
                                          batch_size=8)


def _coerce(text: str, typ, what: str):
  """``text`` as a value of the annotated type ``typ`` (bool, int, float, str, or Optional of one)."""
  args = [a for a in typing.get_args(typ) if a is not type(None)]
  if args:  # Optional[X]
    if text.lower() == "none":
      return None
    typ = args[0]
  if typ is bool:
    if text.lower() in ("1", "true", "yes", "on"):
      return True
    if text.lower() in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"{what}: expected true or false, got {text!r}")
  try:
    return typ(text)
  except (TypeError, ValueError):
    raise ValueError(f"{what}: expected {getattr(typ, '__name__', typ)}, got {text!r}") from None


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One configuration to compare: a registered method's name and its options, in the order given."""

  name: str
  options: tuple = ()  # ((option, value), ...)

  @classmethod
  def parse(cls, text: str) -> "MethodSpec":
    """``name`` or ``name:option=value,...``; values coerced by the method config's field types."""
    name, _, rest = text.strip().partition(":")
    method_cls = methods_lib.method_class(name)  # unknown name: one line listing the known ones
    hints = typing.get_type_hints(method_cls)
    fields = {f.name for f in dataclasses.fields(method_cls)}
    options = []
    for item in filter(None, rest.split(",")):
      key, eq, value = item.partition("=")
      key = key.strip().replace("-", "_")
      if not eq:
        raise ValueError(f"method spec {text!r}: expected option=value, got {item!r}")
      if key == "preset":  # a named option set of the method (methods.presets), which later options override
        methods_lib.make_method(name, preset=value.strip())
        options.append((key, value.strip()))
        continue
      if key not in fields:
        raise ValueError(f"method {name!r} has no option {key}; its options: {', '.join(sorted(fields)) or 'none'}")
      if key in dict(options):
        raise ValueError(f"method spec {text!r}: option {key} is given twice")
      options.append((key, _coerce(value.strip(), hints[key], f"method {name!r} option {key}")))
    return cls(name, tuple(options))

  def method(self) -> CacheMethod:
    return methods_lib.make_method(self.name, **dict(self.options))

  @property
  def label(self) -> str:
    """The preset if one is named, the settings given, then any other field away from its default:
    ``kivi:bits=2``, ``ott:preset=paper``."""
    given = [k for k, _ in self.options if k != "preset"]
    preset = dict(self.options).get("preset")
    if preset is None:
      return method_label(self.method(), given=given)
    shown = ",".join(f"{k}={v}" for k, v in self.options if k != "preset")
    return f"{self.name}:preset={preset}" + ("," + shown if shown else "")


def method_label(method: CacheMethod, given=()) -> str:
  """``name:option=value,...`` for the options in ``given`` and every other field away from its default."""
  shown = list(given) + [f.name for f in dataclasses.fields(method)
                         if f.name not in given and getattr(method, f.name) != f.default]
  return method.name + (":" + ",".join(f"{k}={getattr(method, k)}" for k in shown) if shown else "")


def parse_methods(texts: Sequence[str]) -> list:
  specs = [MethodSpec.parse(t) for t in texts]
  if not specs:
    raise ValueError("give at least one method to compare")
  return specs


def compare(model, specs: Sequence[MethodSpec], *, token_ids: Sequence[int], ppl: ppl_lib.WindowPlan = DEFAULT_PPL,
            passkey: Optional[passkey_lib.PasskeyGrid] = DEFAULT_PASSKEY, baseline: Optional[str] = "dense",
            progress: Optional[bool] = None, attention_impl: str = "auto", mesh=None) -> list:
  """One row per spec (in order): KV bytes, compression, perplexity, pass-key accuracy, decode tokens/s.

  ``delta_ppl`` is relative to the row whose label is ``baseline`` (None when it is not among the specs).
  Every spec is checked against the model before anything runs. ``passkey=None`` skips retrieval (and then
  the model needs no tokenizer). ``mesh`` (a ``Mesh`` or a spec such as ``"data=2,model=4"``) runs every
  configuration on that device mesh (``jkv.sharding``).
  """
  from jkv import sharding
  mesh = sharding.make_mesh(mesh)
  cfg = model.config
  methods = [s.method() for s in specs]
  probe = CacheSpec.for_model(cfg, 1, ppl.context + ppl.scored)
  for m in methods:
    m.check(probe)
  sharding.check_mesh(mesh, cfg)
  params = sharding.shard_params(model.params, cfg, mesh)  # once for every configuration
  ppl.validate()
  ppl.starts(len(token_ids))
  if passkey is not None:
    passkey.validate(cfg)
    if model.tokenizer is None:
      raise ValueError("the pass-key test needs a tokenizer; this model has none (skip it with no pass-key grid)")
  rows = []
  for i, (spec, method) in enumerate(zip(specs, methods)):
    if progress is not False:
      print(f"[{i + 1}/{len(specs)}] {spec.label}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    p = ppl_lib.perplexity(params, cfg, token_ids, method=method, plan=ppl, progress=progress,
                           attention_impl=attention_impl, mesh=mesh)
    pk = None
    if passkey is not None:
      pk = passkey_lib.run_passkey(params, cfg, model.tokenizer, method=method, grid=passkey,
                                   progress=progress, attention_impl=attention_impl, mesh=mesh)
    rows.append(dict(
        method=spec.label, name=spec.name, settings=dataclasses.asdict(method),  # as asked (a sweep's resume key)
        method_config=p.method_config,  # as it ran: settings left to the device decided
        kv_bytes=p.kv_bytes, kv_host_bytes=p.kv_host_bytes, dense_kv_bytes=p.dense_kv_bytes, kv_tokens=p.kv_tokens,
        compression=p.dense_kv_bytes / p.kv_bytes, ppl=p.ppl, nll=p.nll, delta_ppl=None, window_nll=p.window_nll,
        passkey_acc=None if pk is None else pk.mean_accuracy,
        passkey_accuracy=None if pk is None else pk.accuracy,
        passkey_answers=None if pk is None else [a["answer"] for a in pk.answers],
        decode_tokens_per_s=p.decode_tokens_per_s, method_stats=p.method_stats, seconds=time.perf_counter() - t0))
  base = next((r for r in rows if r["method"] == baseline), None)
  for r in rows:
    r["delta_ppl"] = None if base is None else r["ppl"] - base["ppl"]
  return rows


def environment(mesh=None) -> dict:
  dev = jax.devices()[0]
  env = dict(jax=jax.__version__, device=f"{dev.platform}: {dev.device_kind}", cpu_count=_cpu_count(),
             python=platform.python_version(), machine=platform.machine())
  if mesh is not None:
    from jkv import sharding
    env["mesh"] = sharding.mesh_label(sharding.make_mesh(mesh))
  return env


def _cpu_count() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _fmt(x, spec):
  return "–" if x is None else format(x, spec)


def markdown_table(rows: Sequence[dict]) -> str:
  """One line per row; a host-bytes column only when some method holds KV in host memory (SpeCache)."""
  host = any(r.get("kv_host_bytes") for r in rows)
  lines = ["| method | KV bytes | " + ("host KV bytes | " if host else "")
           + "dense KV bytes | compression | ppl | Δppl | pass-key acc | decode tokens/s |",
           "| --- | ---: | " + ("---: | " if host else "") + "---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in rows:
    lines.append(f"| `{r['method']}` | {r['kv_bytes']:,} | " + (f"{r['kv_host_bytes']:,} | " if host else "")
                 + f"{r['dense_kv_bytes']:,} | {r['compression']:.2f}x "
                 f"| {r['ppl']:.3f} | {_fmt(r['delta_ppl'], '+.3f')} | {_fmt(r['passkey_acc'], '.2f')} "
                 f"| {r['decode_tokens_per_s']:.1f} |")
  return "\n".join(lines)


def markdown_report(rows: Sequence[dict], meta: dict) -> str:
  """The table with the command and settings that produced it."""
  ppl, pk = meta["ppl"], meta.get("passkey")
  out = [f"# jkv compare: {meta['model']}", "", "```", meta["command"], "```", "", markdown_table(rows), "",
         f"- perplexity: {meta['text']}; {ppl['num_windows']} windows (seed {ppl['seed']}) of "
         f"{ppl['context']} prefilled + {ppl['scored']} scored tokens, each scored token predicted by a decode "
         f"step over the compressed cache; batch {ppl['batch_size']}.",
         f"- KV bytes: held for one sequence of {rows[0]['kv_tokens']} tokens (context + scored); dense is K and V "
         f"in the model dtype ({meta.get('dtype', '?')}); compression = dense / method."]
  if pk:
    join = lambda xs: ", ".join(str(x) for x in xs)
    chat = "chat template" if pk["chat"] else "no chat template"
    out.append(f"- pass-key: lengths {join(pk['lengths'])} tokens x depths {join(pk['depths'])}, {pk['trials']} "
               f"trials per cell (seed {pk['seed']}), greedy, {chat}; accuracy over all cells.")
  out.append(f"- decode tokens/s: batch rows x decode steps per second in the perplexity scan, compilation "
             f"excluded; {meta['environment']['device']}, {meta['environment']['cpu_count']} cores, "
             f"jax {meta['environment']['jax']}.")
  said = lambda items: ", ".join(f"{k.replace('_', ' ')} {_fmt(v, '.3f')}" for k, v in items)
  stats = [f"`{r['method']}`: {said(r['method_stats'].items())}" for r in rows if r.get("method_stats")]
  if stats:
    out.append("- decode statistics of the perplexity scan: " + "; ".join(stats) + ".")
  out.append(f"- wall time: {meta['seconds']:.0f} s for the whole run.")
  return "\n".join(out) + "\n"


def plot(rows: Sequence[dict], path: str, title: str = "") -> None:
  """Compression (x) against perplexity and pass-key accuracy (y): one numbered point per row, legend below."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  has_pk = any(r["passkey_acc"] is not None for r in rows)
  ncol = 2 if len(rows) > 4 else 1
  legend_rows = -(-len(rows) // ncol)
  height = 4.2 + 0.2 * legend_rows
  fig, axes = plt.subplots(1, 2 if has_pk else 1, figsize=(12 if has_pk else 7, height), squeeze=False)
  panels = [("ppl", "perplexity (log scale)")] + ([("passkey_acc", "pass-key accuracy")] if has_pk else [])
  markers = "osD^vP*Xh<>p"
  for ax, (key, ylabel) in zip(axes[0], panels):
    seen = {}  # points drawn at (nearly) the same place get their numbers side by side
    for i, r in enumerate(rows):
      if r[key] is not None:
        ax.scatter(r["compression"], r[key], s=50, color=f"C{i % 10}", marker=markers[i % len(markers)],
                   label=f"{i + 1}: {r['method']}", zorder=3, alpha=0.85)
        spot = (round(r["compression"], 2), round(float(r[key]), 2))
        seen[spot] = seen.get(spot, -1) + 1
        ax.annotate(str(i + 1), (r["compression"], r[key]), textcoords="offset points",
                    xytext=(6 + 9 * seen[spot], 3), fontsize=8)
    ax.set_xlabel("KV compression vs dense (x)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if key == "ppl":
      ax.set_yscale("log")
    else:
      ax.set_ylim(-0.05, 1.08)
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
  fig.suptitle(title or "KV-cache methods: compression vs quality")
  fig.tight_layout(rect=(0, (0.2 * legend_rows + 0.15) / height, 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(rows: Sequence[dict], meta: dict, prefix: str) -> list:
  """``prefix``.json (meta + rows), ``prefix``.md (command, table, settings) and ``prefix``.png (the plot).

  All three are written under temporary names first and renamed into place together (``jkv.files.written_together``),
  so a failure or an interrupt while writing leaves no half-written file (and earlier outputs of the same prefix as
  they were), and two processes writing one prefix leave one's three files or the other's."""
  paths = [prefix + ".json", prefix + ".md", prefix + ".png"]
  with files.written_together(paths) as partial:
    with open(partial[0], "w") as f:
      json.dump(dict(meta=meta, rows=list(rows)), f, indent=1)
      f.write("\n")
    with open(partial[1], "w") as f:
      f.write(markdown_report(rows, meta))
    plot(rows, partial[2], title=f"{meta['model']}: compression vs quality")
  return paths
