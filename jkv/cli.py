"""The ``jkv`` command line: generate, convert, info (and eval, compare from ``jkv.evaluation``).

Method options become flags by themselves: every field of every registered method's config is a flag
(``--group-size``), so a new method joins the CLI by registration alone. Bad input exits 2 with one line.
"""

import argparse
import dataclasses
import json
import sys
import typing

import numpy as np

from jkv import cache as cache_lib


def _field_type(f):
  t = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing), {})  # noqa: S307 (own annotations)
  args = [a for a in typing.get_args(t) if a is not type(None)]
  return args[0] if args else t


def _bool(text):
  if text.lower() in ("1", "true", "yes", "on"):
    return True
  if text.lower() in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_method_args(parser):
  """``--method`` plus one flag per option of any registered method."""
  parser.add_argument("--method", default="dense", help=f"cache method: {', '.join(cache_lib.known_methods())}")
  seen = {}
  for name in cache_lib.known_methods():
    for f in dataclasses.fields(cache_lib.method_class(name)):
      seen.setdefault(f.name, []).append(name)
      if len(seen[f.name]) == 1:
        typ = _field_type(f)
        parser.add_argument("--" + f.name.replace("_", "-"), dest="opt_" + f.name, default=None,
                            type=_bool if typ is bool else typ, metavar=typ.__name__.upper())
  return seen


def method_from_args(args):
  options = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
  return cache_lib.make_method(args.method, **options)


def add_model_args(parser):
  parser.add_argument("--model", default="default",
                      help="'default' (SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file or a "
                           "directory written by `jkv convert`")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _progress(msg):
  print(msg, file=sys.stderr, flush=True)


def cmd_generate(args):
  from jkv import generate as gen
  from jkv.load import load_model
  from jkv.sampling import make_sampler

  method = method_from_args(args)
  sampler = make_sampler(args.temperature, args.top_k, args.top_p)
  prompts = args.prompt or [sys.stdin.read()]
  if not any(p.strip() for p in prompts):
    raise ValueError("empty prompt: give PROMPT arguments or text on standard input")
  _progress(f"loading model {args.model} ...")
  model = load_model(args.model, args.dtype)
  tok = model.tokenizer
  if tok is None:
    raise ValueError(f"model {args.model} has no tokenizer; jkv generate needs one")
  if args.raw or tok.chat_template is None:
    ids = [tok.encode(p) for p in prompts]
  else:
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_bos=False) for p in prompts]
  if args.stream and not args.json and len(ids) == 1:
    gen.plan_capacity(model.config, method, [len(ids[0])], args.max_new_tokens, 1, args.capacity)
    out = []
    shown = ""
    for t in gen.stream(model.params, model.config, ids[0], method=method, max_new_tokens=args.max_new_tokens,
                        sampler=sampler, seed=args.seed, eos_ids=tok.eos_ids):
      out.append(t)
      text = tok.decode(out, skip_special_tokens=True)
      print(text[len(shown):], end="", flush=True)
      shown = text
    print()
    return 0
  _progress(f"generating with {method.name} ...")
  res = gen.generate(model.params, model.config, ids, method=method, max_new_tokens=args.max_new_tokens,
                     sampler=sampler, seed=args.seed, capacity=args.capacity, eos_ids=tok.eos_ids)
  texts = [tok.decode(t, skip_special_tokens=True) for t in res.tokens]
  if args.json:
    single = len(texts) == 1
    print(json.dumps(dict(text=texts[0] if single else texts, tokens=res.tokens[0] if single else res.tokens,
                          method_config=dataclasses.asdict(method), **res.stats)))
  else:
    for t in texts:
      print(t)
    s = res.stats
    _progress(f"kv cache: {s['kv_bytes']:,} bytes vs {s['dense_kv_bytes']:,} dense "
              f"({s['dense_kv_bytes'] / max(s['kv_bytes'], 1):.2f}x); prefill {s['prefill_s']:.3f} s; "
              f"decode {s['decode_tokens_per_s']:.1f} tokens/s; compile {s['compile_s']:.1f} s")
  return 0


def cmd_convert(args):
  from jkv.load import convert
  model = convert(args.src, args.out, args.dtype)
  if args.json:
    print(json.dumps(dict(out=args.out, config=dataclasses.asdict(model.config))))
  else:
    print(f"saved {args.src} as a jkv checkpoint in {args.out}")
  return 0


def cmd_info(args):
  from jkv.cache import CacheSpec
  from jkv.load import load_model

  model = load_model(args.model, args.dtype)
  method = method_from_args(args)
  n = args.tokens
  spec = CacheSpec.for_model(model.config, 1, -(-n // method.capacity_multiple()) * method.capacity_multiple())
  method.validate(spec)
  kv = method.kv_bytes(spec, np.array([n]))
  dense = cache_lib.dense_kv_bytes(spec, np.array([n]))
  info = dict(config=dataclasses.asdict(model.config), method=method.name, method_config=dataclasses.asdict(method),
              tokens=n, kv_bytes=kv, dense_kv_bytes=dense, kv_bytes_per_token=kv / n,
              dense_kv_bytes_per_token=dense / n, compression=dense / kv)
  if args.json:
    print(json.dumps(info))
  else:
    for k, v in info["config"].items():
      print(f"{k:>16}: {v}")
    print(f"{'method':>16}: {method}")
    print(f"{'kv bytes/token':>16}: {kv / n:,.1f} at {n} tokens (dense {dense / n:,.1f}; {dense / kv:.2f}x)")
  return 0


def build_parser():
  parser = argparse.ArgumentParser(prog="jkv", description="LLM inference with a compressed KV cache")
  sub = parser.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="generate text for one or more prompts")
  g.add_argument("prompt", nargs="*", help="prompt text (several run as one batch); standard input if none")
  add_model_args(g)
  add_method_args(g)
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  g.add_argument("--top-k", type=int, default=None)
  g.add_argument("--top-p", type=float, default=None)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--capacity", type=int, default=None, help="cache capacity in tokens (default: fitted)")
  g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
  g.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
  g.add_argument("--json", action="store_true")
  g.set_defaults(fn=cmd_generate)

  c = sub.add_parser("convert", help="convert a Hugging Face directory or GGUF file into a jkv checkpoint")
  c.add_argument("src")
  c.add_argument("out")
  c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  c.add_argument("--json", action="store_true")
  c.set_defaults(fn=cmd_convert)

  i = sub.add_parser("info", help="model config and KV bytes per token for a method")
  add_model_args(i)
  add_method_args(i)
  i.add_argument("--tokens", type=int, default=4096, help="sequence length the bytes are counted at")
  i.add_argument("--json", action="store_true")
  i.set_defaults(fn=cmd_info)

  from jkv.evaluation import cli as eval_cli  # eval and compare live with the harness
  eval_cli.add_commands(sub, add_model_args=add_model_args, add_method_args=add_method_args,
                        method_from_args=method_from_args)
  return parser


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    return args.fn(args)
  except (ValueError, OSError, RuntimeError, NotImplementedError) as e:
    print(f"jkv: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
