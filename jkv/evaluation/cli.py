"""CLI commands of the evaluation harness: ``jkv eval ppl``, ``jkv eval passkey`` and ``jkv compare``."""

import dataclasses
import json
import shlex
import sys
import time

from jkv import files
from jkv.evaluation import compare as compare_lib
from jkv.evaluation import passkey as passkey_lib
from jkv.evaluation import perplexity as ppl_lib


def _progress(msg):
  print(msg, file=sys.stderr, flush=True)


def _label(args, method) -> str:
  """The method with the options given on the command line and any other non-default ones: ``kivi:bits=2``."""
  given = [k[4:] for k, v in vars(args).items() if k.startswith("opt_") and v is not None]
  return compare_lib.method_label(method, given=given)


def _add_ppl_args(p, plan: ppl_lib.WindowPlan, cli):
  g = p.add_argument_group("perplexity")
  g.add_argument("--text-file", default=None, help="UTF-8 text to score (default: the stdlib's pydoc_data.topics)")
  g.add_argument("--context", type=cli.positive_int, default=plan.context,
                 help=f"tokens prefilled per window (default: {plan.context})")
  g.add_argument("--scored", type=cli.positive_int, default=plan.scored,
                 help=f"tokens scored per window, one decode step each (default: {plan.scored})")
  g.add_argument("--windows", type=cli.positive_int, default=plan.num_windows,
                 help=f"number of windows (default: {plan.num_windows})")
  g.add_argument("--batch-size", type=cli.positive_int, default=plan.batch_size,
                 help=f"windows decoded together (default: {plan.batch_size})")
  g.add_argument("--seed", type=cli.seed, default=plan.seed,
                 help=f"seed choosing the windows and pass keys (default: {plan.seed})")
  _add_prefill_chunk(g, cli)


def _add_prefill_chunk(g, cli):
  g.add_argument("--prefill-chunk", type=cli.positive_int, default=None, metavar="TOKENS",
                 help="prefill each context (and pass-key prompt) in chunks of this many tokens, rounded up to the "
                      "method's block (default: whole, as the papers do)")


def _add_passkey_args(p, grid: passkey_lib.PasskeyGrid, cli, prefix=""):
  g = p.add_argument_group("pass-key retrieval")
  g.add_argument(f"--{prefix}lengths", type=cli.positive_int, nargs="+", default=list(grid.lengths),
                 metavar="TOKENS", help=f"prompt lengths in tokens (default: {' '.join(map(str, grid.lengths))})")
  g.add_argument(f"--{prefix}depths", type=float, nargs="+", default=list(grid.depths), metavar="FRACTION",
                 help=f"fractions of the filler before the key (default: {' '.join(map(str, grid.depths))})")
  g.add_argument(f"--{prefix}trials", type=cli.positive_int, default=grid.trials,
                 help=f"keys per (length, depth) cell (default: {grid.trials})")
  g.add_argument(f"--{prefix}batch-size", type=cli.positive_int, default=grid.batch_size,
                 help=f"prompts generated together (default: {grid.batch_size})")
  g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")


def _plan(args) -> ppl_lib.WindowPlan:
  plan = ppl_lib.WindowPlan(context=args.context, scored=args.scored, num_windows=args.windows, seed=args.seed,
                            batch_size=args.batch_size, prefill_chunk=args.prefill_chunk)
  plan.validate()
  return plan


def _grid(args, prefix="") -> passkey_lib.PasskeyGrid:
  get = lambda name: getattr(args, prefix + name)
  grid = passkey_lib.PasskeyGrid(lengths=tuple(get("lengths")), depths=tuple(get("depths")), trials=get("trials"),
                                 seed=args.seed, batch_size=get("batch_size"), chat=args.chat,
                                 prefill_chunk=args.prefill_chunk)
  grid.validate()
  return grid


def _text(args) -> tuple[str, str]:
  if args.text_file is None:
    return ppl_lib.default_text(), "pydoc_data.topics (Python stdlib)"
  try:
    with open(args.text_file, encoding="utf-8") as f:
      return f.read(), args.text_file
  except UnicodeDecodeError as e:
    raise ValueError(f"{args.text_file} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def _load(args):
  from jkv.load import load_model
  _progress(f"loading model {args.model} ...")
  model = load_model(args.model, args.dtype)
  if model.tokenizer is None:
    raise ValueError(f"model {args.model} has no tokenizer; this command needs one")
  return model


def cmd_ppl(args, cli):
  method = cli.method_from_args(args)
  plan = _plan(args)
  text, source = _text(args)
  mesh = cli.mesh_from_args(args)  # a mesh the devices cannot hold fails before the model loads
  model = _load(args)
  ids = model.tokenizer.encode(text, add_bos=False)
  res = ppl_lib.perplexity(model.params, model.config, ids, method=method, plan=plan,
                           attention_impl=args.attention_impl, mesh=mesh)
  if not cli.is_lead_process():
    return 0
  out = dict(method=_label(args, method), text=source, plan=dataclasses.asdict(plan), **res.as_dict())
  if args.json:
    print(json.dumps(out))
  else:
    print(f"perplexity {res.ppl:.4f} (mean NLL {res.nll:.4f} nats over {res.tokens_scored} tokens, "
          f"{plan.num_windows} windows of {plan.context} + {plan.scored}) with {method}")
    _progress(f"kv cache: {res.kv_bytes:,} bytes vs {res.dense_kv_bytes:,} dense at {res.kv_tokens} tokens "
              f"({res.dense_kv_bytes / res.kv_bytes:.2f}x); decode {res.decode_tokens_per_s:.1f} tokens/s")
  return 0


def cmd_passkey(args, cli):
  method = cli.method_from_args(args)
  grid = _grid(args)
  if args.plot:
    cli.check_output(args.plot)
  mesh = cli.mesh_from_args(args)
  model = _load(args)
  with cli.kept_on_interrupt(f"{args.plot} not written" if args.plot else "nothing written"):
    res = passkey_lib.run_passkey(model.params, model.config, model.tokenizer, method=method, grid=grid,
                                  attention_impl=args.attention_impl, mesh=mesh)
    if not cli.is_lead_process():
      return 0
    if args.plot:
      with files.written_together([args.plot]) as (partial,):  # no half-written image
        passkey_lib.plot_heatmap(res, partial, title=f"pass-key retrieval: {args.model}, {_label(args, method)}")
  if args.json:
    print(json.dumps(dict(method=_label(args, method), method_config=dataclasses.asdict(method),
                          grid=dataclasses.asdict(grid), **res.as_dict())))
  else:
    print("depth \\ length " + "".join(f"{n:>8}" for n in res.lengths))
    for di, d in enumerate(res.depths):
      print(f"{d:>14.2f} " + "".join(f"{res.accuracy[li][di]:>8.2f}" for li in range(len(res.lengths))))
    print(f"mean accuracy {res.mean_accuracy:.3f} with {method}")
  return 0


def cmd_compare(args, cli):
  specs = compare_lib.parse_methods(args.methods)  # bad specs fail before the model loads
  for spec in specs:
    spec.method()  # and so do settings a method refuses whatever the model (kivi bits=3)
  labels = [spec.label for spec in specs]
  twice = next((label for i, label in enumerate(labels) if label in labels[:i]), None)
  if twice is not None:
    raise ValueError(f"method {twice} is given twice (rows are told apart by their labels)")
  if args.baseline is not None and args.baseline not in labels:
    raise ValueError(f"--baseline {args.baseline} is none of the methods compared: {', '.join(labels)}")
  baseline = "dense" if args.baseline is None else args.baseline
  plan = _plan(args)
  grid = None if args.no_passkey else _grid(args, prefix="passkey_")
  if args.output:
    for suffix in (".json", ".md", ".png"):
      cli.check_output(args.output + suffix)
  text, source = _text(args)
  mesh = cli.mesh_from_args(args)
  t0 = time.perf_counter()
  model = _load(args)
  if grid is not None:
    grid.validate(model.config, model.tokenizer)  # every length, before the first method runs
  ids = model.tokenizer.encode(text, add_bos=False)
  kept = "nothing written" + (f" ({args.output}.json, .md and .png come once every method has run)"
                              if args.output else "")
  paths = []
  with cli.kept_on_interrupt(kept):
    rows = compare_lib.compare(model, specs, token_ids=ids, ppl=plan, passkey=grid, baseline=baseline,
                               attention_impl=args.attention_impl, mesh=mesh)
    if not cli.is_lead_process():
      return 0
    meta = dict(command=shlex.join(["jkv"] + sys.argv[1:]), model=args.model, dtype=args.dtype, text=source,
                ppl=dataclasses.asdict(plan), passkey=None if grid is None else dataclasses.asdict(grid),
                baseline=baseline, environment=compare_lib.environment(mesh), seconds=time.perf_counter() - t0)
    if args.output:
      paths = compare_lib.write_outputs(rows, meta, args.output)
  for path in paths:
    _progress(f"wrote {path}")
  if args.json:
    print(json.dumps(dict(meta=meta, rows=rows)))
  else:
    print(compare_lib.markdown_table(rows))
  return 0


def cmd_frontier(args, cli):
  from jkv.evaluation import frontier
  specs = frontier.sweep_specs(args.methods) + [compare_lib.MethodSpec.parse(t) for t in args.add]
  for spec in specs:
    spec.method()
  plan = _plan(args)
  for suffix in (".json", ".md", ".png"):
    cli.check_output(args.output + suffix)
  if args.text_file is None:
    make_text, source = frontier.TEXTS[args.text]
    text = make_text()
  else:
    text, source = _text(args)
  mesh = cli.mesh_from_args(args)
  model = _load(args)
  ids = model.tokenizer.encode(text, add_bos=False)
  meta = dict(command=shlex.join(["jkv"] + sys.argv[1:]), model=args.model, dtype=args.dtype, text=source,
              ppl=dataclasses.asdict(plan), environment=compare_lib.environment(mesh))
  json_path = args.output + ".json"
  with cli.kept_on_interrupt(f"{json_path} keeps every configuration measured so far (the same command resumes "
                             f"there); {args.output}.md and .png not written"):
    data = frontier.sweep(model, specs, token_ids=ids, plan=plan, path=json_path, meta=meta,
                          attention_impl=args.attention_impl, mesh=mesh)
  if not cli.is_lead_process():
    return 0
  rows = frontier.annotate(data["rows"])
  for path in frontier.write_outputs(rows, data["meta"], args.output):
    _progress(f"wrote {path}")
  if args.json:
    print(json.dumps(dict(meta=data["meta"], rows=rows)))
  else:
    print(frontier.markdown_report(rows, data["meta"]))
  return 0


def add_commands(sub, cli):
  """Add ``eval`` and ``compare`` to the subcommands ``sub``; ``cli`` is ``jkv.cli`` (shared flags and checks)."""
  e = sub.add_parser("eval", help="evaluate a cache method: perplexity or pass-key retrieval")
  esub = e.add_subparsers(dest="eval_command", required=True)

  p = esub.add_parser("ppl", help="perplexity of a text, scored through the compressed cache's decode path")
  cli.add_model_args(p)
  cli.add_method_args(p)
  _add_ppl_args(p, ppl_lib.WindowPlan(), cli)
  p.add_argument("--json", action="store_true", help=cli.JSON_HELP)
  p.set_defaults(fn=lambda args: cmd_ppl(args, cli))

  k = esub.add_parser("passkey", help="pass-key retrieval over context lengths x depths")
  cli.add_model_args(k)
  cli.add_method_args(k)
  _add_passkey_args(k, passkey_lib.PasskeyGrid(), cli)
  _add_prefill_chunk(k, cli)
  k.add_argument("--seed", type=cli.seed, default=0, help="seed choosing the pass keys (default: 0)")
  k.add_argument("--plot", default=None, metavar="PNG", help="write the accuracy heat map here (default: none)")
  k.add_argument("--json", action="store_true", help=cli.JSON_HELP)
  k.set_defaults(fn=lambda args: cmd_passkey(args, cli))

  c = sub.add_parser("compare", help="several methods side by side: memory, perplexity, retrieval, speed")
  cli.add_model_args(c)
  c.add_argument("--methods", nargs="+", default=list(compare_lib.DEFAULT_METHODS), metavar="SPEC",
                 help="configurations as NAME or NAME:OPTION=VALUE,... (default: dense, KIVI-4, KIVI-2 and the "
                      "four 2-bit fake-quant layouts)")
  c.add_argument("--baseline", default=None, help="label of the row Δppl is measured from (default: dense, when "
                                                   "compared)")
  _add_ppl_args(c, compare_lib.DEFAULT_PPL, cli)
  _add_passkey_args(c, compare_lib.DEFAULT_PASSKEY, cli, prefix="passkey-")
  c.add_argument("--no-passkey", action="store_true", help="skip pass-key retrieval")
  c.add_argument("--output", default="compare", metavar="PREFIX",
                 help="write PREFIX.json, PREFIX.md and PREFIX.png ('' writes nothing; default: compare)")
  c.add_argument("--json", action="store_true", help=cli.JSON_HELP)
  c.set_defaults(fn=lambda args: cmd_compare(args, cli))

  from jkv.evaluation import frontier
  f = sub.add_parser("frontier", help="sweep every method's knobs: perplexity against KV bytes per token, the "
                                      "Pareto front, resumable")
  cli.add_model_args(f)
  f.add_argument("--methods", nargs="+", default=list(frontier.SWEEP), metavar="NAME",
                 help=f"methods whose grids to sweep (default: {' '.join(frontier.SWEEP)})")
  f.add_argument("--add", nargs="+", default=[], metavar="SPEC",
                 help="more configurations to measure, as NAME:OPTION=VALUE,... (as jkv compare --methods)")
  _add_ppl_args(f, frontier.DEFAULT_PPL, cli)
  f.add_argument("--text", choices=sorted(frontier.TEXTS), default="topics",
                 help="named stdlib text to score (default: topics, pydoc_data.topics; docstrings: the held-out "
                      "text); --text-file overrides it")
  f.add_argument("--output", default="frontier", metavar="PREFIX",
                 help="PREFIX.json (written after every configuration; an existing one is resumed), PREFIX.md and "
                      "PREFIX.png (default: frontier)")
  f.add_argument("--json", action="store_true", help=cli.JSON_HELP)
  f.set_defaults(fn=lambda args: cmd_frontier(args, cli))
