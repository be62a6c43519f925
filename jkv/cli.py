"""The ``jkv`` command line: generate, convert, info (and eval, compare from ``jkv.evaluation``).

Method options become flags by themselves: every field of every registered method's config is a flag
(``--group-size``), so a new method joins the CLI by registration alone. Bad input exits 2 with one line
``jkv: error: ...``, checked before the model loads wherever the model is not needed; a batch that does not fit
the device's memory (``jkv.memory.DeviceMemoryError``, or XLA's own out-of-memory error) exits 1 with one line
``jkv: error: out of device memory: ...``, and so does any failure of jkv's own (``internal error``); Ctrl-C exits
130 with one line ``jkv: interrupted; <what was kept>``. ``--verbose`` shows XLA's log lines and, on failure, the
whole error before its line.
"""

# Only the standard library at module level: importing jax and flax takes seconds, and ``main`` installs its
# Ctrl-C handling before that (an interrupt during those imports printed a 40-line traceback).
import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import traceback
import typing
import warnings
from typing import Optional

DTYPES = ["float32", "bfloat16", "float16"]
MAX_SEED = 2 ** 63 - 1  # jax.random.key takes a signed 64-bit seed
MAX_INT = 2 ** 31 - 1  # counts and sizes: token positions and array shapes are int32 inside jax
MAX_DEVICE_GIB = 2 ** 20  # a PiB: past any device, and past what byte counts in int64 need
JSON_HELP = "print one JSON object on standard output instead of text"


class _Parser(argparse.ArgumentParser):
  """argparse with its errors on one line in jkv's form (argparse prints the whole usage block), and a command's
  positionals free to mix with its options: ``jkv generate "Hi" --method kivi "Second prompt"`` runs two prompts
  (plain argparse took the prompts only as one run, and refused "Second prompt" as unrecognized)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # What reads as a negative number is a value, not an option (no jkv option looks like one): argparse's own
    # pattern takes in -1 and -.5 only, so ``--temperature -1e-3`` or ``--random-probes -inf`` ended in "expected one
    # argument" instead of the option's own check.
    self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.I)

  def error(self, message):
    self.exit(2, f"jkv: error: {message} (see `{self.prog} --help`)\n")

  def parse_known_args(self, args=None, namespace=None):
    """A command's own parser (``jkv generate``'s, reached through the subcommand action, which calls this method)
    parses in two passes, as argparse's ``parse_known_intermixed_args`` does: the options wherever they stand, then
    the positionals in their order. Done here rather than through that method, which takes the ``--`` that ends the
    options as a value of the positionals it sets aside (``jkv generate -- -x`` then refused ``-x``; Python 3.11).
    The top-level parser, whose subcommand positional takes everything after it, parses as argparse does."""
    if self._subparsers is not None:
      return super().parse_known_args(args, namespace)
    args = list(sys.argv[1:] if args is None else args)
    end = args.index("--") if "--" in args else len(args)
    positionals, optionals = self._get_positional_actions(), self._get_optional_actions()
    saved = [(a, a.nargs, a.default) for a in positionals]
    try:
      for a in positionals:  # set aside: the first pass leaves their strings in the remainder
        a.nargs = a.default = argparse.SUPPRESS
      namespace, rest = super().parse_known_args(args[:end], namespace)
    finally:
      for a, nargs, default in saved:
        a.nargs, a.default = nargs, default
    required = [(a, a.required) for a in optionals]
    try:
      for a in optionals:  # seen (or reported missing) in the first pass
        a.required = False
      return super().parse_known_args(rest + args[end:], namespace)
    finally:
      for a, was in required:
        a.required = was


# ------------------------------------------------------------------------------------------------- flag types


def _bool(text):
  if text.lower() in ("1", "true", "yes", "on"):
    return True
  if text.lower() in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _number(text, kind):
  try:
    return kind(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _within(value, low, high: tuple):
  """``value`` unless it lies outside [low, high]; ``high`` is (bound, how the message writes it)."""
  if value < low:
    raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
  if value > high[0]:
    raise argparse.ArgumentTypeError(f"must be <= {high[1]}, got {value}")
  return value


def positive_int(text):
  """An argparse type: an integer in [1, 2**31 - 1]."""
  return _within(_number(text, int), 1, (MAX_INT, "2**31 - 1"))


def int32(text):
  """An argparse type: an integer a method option can hold (jax computes with it in int32)."""
  return _within(_number(text, int), -MAX_INT - 1, (MAX_INT, "2**31 - 1"))


def device_gib(text):
  """An argparse type: a device's memory in GiB, > 0 (a finite float, at most a PiB)."""
  value = finite_float(text)
  if not 0 < value <= MAX_DEVICE_GIB:
    raise argparse.ArgumentTypeError(f"must lie in (0, {MAX_DEVICE_GIB}] GiB, got {text}")
  return value


def seed(text):
  """An argparse type: an integer seed that ``jax.random.key`` takes (0 to 2**63 - 1)."""
  return _within(_number(text, int), 0, (MAX_SEED, "2**63 - 1"))


def finite_float(text):
  """An argparse type: a finite float (NaN and infinities pass every range check unnoticed)."""
  value = _number(text, float)
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
  return value


FLOAT32_TINY, FLOAT32_MAX = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127  # float32's smallest normal and largest


def temperature(text):
  """An argparse type: 0 (greedy), or a temperature the sampling's float32 holds: one past float32's largest value
  became inf with numpy's overflow warning in the output (1e308), one below its smallest normal became 0, and the
  logits divided by it inf (1e-300)."""
  value = finite_float(text)
  if value != 0 and not FLOAT32_TINY <= value <= FLOAT32_MAX:
    raise argparse.ArgumentTypeError(f"must be 0 or lie in [1.2e-38, 3.4e38] (float32, which sampling computes in), "
                                     f"got {text}")
  return value


def check_output(path: str) -> None:
  """Raise OSError (one line) unless a file can be written at ``path``: run before the work that produces it."""
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"cannot write {path}: no directory {parent}")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise PermissionError(f"cannot write {path}: directory {parent} is not writable")
  if os.path.isdir(path):
    raise IsADirectoryError(f"cannot write {path}: it is a directory")


# ------------------------------------------------------------------------------------------------- method flags


def _field_type(f):
  t = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing), {})  # noqa: S307 (own annotations)
  args = [a for a in typing.get_args(t) if a is not type(None)]
  return args[0] if args else t


def _default(f):
  if f.default is not dataclasses.MISSING:
    return f.default
  return f.default_factory() if f.default_factory is not dataclasses.MISSING else "required"


def _option_help(owners: list) -> str:
  """Help of one method flag: the field's own help, then the owning methods and the default(s)."""
  text = next((f.metadata["help"] for _, f in owners if f.metadata.get("help")), "an option of the method")
  names = ", ".join(name for name, _ in owners)
  defaults = {str(_default(f)) for _, f in owners}
  if len(defaults) == 1:
    default = defaults.pop()
  else:
    default = ", ".join(f"{_default(f)} for {name}" for name, f in owners)
  tail = f"(method{'s' if len(owners) > 1 else ''}: {names}; default: {default})"
  return f"{text} {tail}".replace("%", "%%")  # argparse %-formats help strings


def add_method_args(parser):
  """``--method`` plus one flag per option of any registered method; returns {option: [(method, field)]}."""
  from jkv import methods
  names = methods.known_methods()
  parser.add_argument("--method", default="dense", help=f"cache method: {', '.join(names)} (default: dense)")
  named = "; ".join(f"{n}: {', '.join(methods.presets(n))}" for n in names if methods.presets(n))
  parser.add_argument("--preset", default=None, help=f"a named setting of the method, which its other flags "
                                                     f"override ({named}; paper: the paper's main setting)")
  owners = {}
  for name in names:
    for f in dataclasses.fields(methods.method_class(name)):
      owners.setdefault(f.name, []).append((name, f))
  group = parser.add_argument_group("method options", "each applies to the method(s) its help names")
  for option, fields in owners.items():
    typ = _field_type(fields[0][1])
    group.add_argument("--" + option.replace("_", "-"), dest="opt_" + option, default=None,
                       type={bool: _bool, int: int32}.get(typ, typ), metavar=typ.__name__.upper(),
                       help=_option_help(fields))
  return owners


def method_from_args(args):
  from jkv import methods
  options = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
  return methods.make_method(args.method, preset=getattr(args, "preset", None), **options)


def mesh_spec(text):
  """An argparse type: a device mesh spec, ``data=N,model=M`` (its fit to the devices is checked at run time)."""
  from jkv.sharding import parse_mesh
  try:
    parse_mesh(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


def add_verbose_arg(parser):
  parser.add_argument("--verbose", action="store_true",
                      help="show XLA's own log lines, and on failure the whole error (an out-of-memory error's "
                           "allocator report) before its one line")


def add_model_args(parser):
  add_verbose_arg(parser)
  parser.add_argument("--model", default="default",
                      help="'default' (SmolLM2-135M-Instruct), a Hugging Face directory, a .gguf file or a "
                           "directory written by `jkv convert` (default: default)")
  parser.add_argument("--dtype", default="float32", choices=DTYPES,
                      help="dtype of the parameters and activations (default: float32)")
  parser.add_argument("--attention-impl", default="auto", choices=["auto", "pallas", "xla", "interpret"],
                      help="decode attention: the fused Pallas kernels (GPUs of compute capability >= 8.0), plain "
                           "XLA, or the kernels in interpret mode (slow; for testing) (default: auto, the kernels "
                           "where they run)")
  add_mesh_args(parser)


def add_mesh_args(parser):
  g = parser.add_argument_group("devices", "several devices, and several processes (multi-host): README, 'Sharding'")
  g.add_argument("--mesh", default=None, type=mesh_spec, metavar="data=N,model=M[,seq=S]",
                 help="run on a device mesh: the batch split over data, attention heads, the MLP and the cache's KV "
                      "heads over model, one sequence's tokens over seq (every method; SpeCache with speculate and "
                      "without repair); their product must equal the devices jax sees, model must divide the KV "
                      "heads (default: one device)")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="multi-process run: address of process 0 (jax.distributed); every process runs the same "
                      "command with its own --process-id")
  g.add_argument("--num-processes", type=positive_int, default=None, help="multi-process run: how many processes")
  g.add_argument("--process-id", type=int, default=None, help="multi-process run: this process's index, from 0")


def mesh_from_args(args):
  """Join the multi-process job when asked, then the mesh of ``--mesh`` (None without one); a mesh the devices
  cannot hold is a one-line ValueError, before any model loads."""
  from jkv import sharding
  multi = (args.coordinator, args.num_processes, args.process_id)
  if any(x is not None for x in multi):
    if not all(x is not None for x in multi):
      raise ValueError("a multi-process run needs --coordinator, --num-processes and --process-id together")
    sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
  return sharding.make_mesh(args.mesh)


def is_lead_process() -> bool:
  """Process 0 of a multi-process run (or the only process): the one that prints results."""
  import jax
  return jax.process_index() == 0


def _progress(msg):
  print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- commands


def _utf8(text: str, what: str) -> str:
  """``text`` unless it holds undecodable bytes (lone surrogates from surrogateescape, e.g. a Latin-1 argument)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    bad = text[e.start].encode("utf-8", "surrogateescape")
    raise ValueError(f"{what} is not valid UTF-8 (byte {bad!r} at character {e.start})") from None
  return text


def _prompts(args) -> list:
  if args.prompt:
    return [_utf8(p, "the prompt") for p in args.prompt]
  try:
    text = sys.stdin.read()
  except UnicodeDecodeError as e:
    raise ValueError(f"standard input is not valid UTF-8 ({e.reason} at byte {e.start})") from None
  return [_utf8(text, "standard input")]


def cmd_generate(args):
  from jkv import context_parallel
  from jkv import generate as gen
  from jkv.api import encode_text
  from jkv.load import open_model
  from jkv.sampling import make_sampler

  from jkv import sharding

  method = method_from_args(args)
  sampler = make_sampler(args.temperature, args.top_k, args.top_p)
  prompts = _prompts(args)
  if not any(p.strip() for p in prompts):
    raise ValueError("empty prompt: give PROMPT arguments or text on standard input")
  if args.mesh and args.stream:
    raise ValueError("--stream runs on one device; drop --stream to generate on a --mesh")
  source = open_model(args.model, args.dtype)  # config and tokenizer: no device yet
  tok = source.tokenizer
  if tok is None:
    raise ValueError(f"model {args.model} has no tokenizer; jkv generate needs one")
  ids = [encode_text(tok, p, not args.raw, starts=args.cache is None, ends=args.save_cache is None) for p in prompts]
  size_pinned_host_pool(_host_copy_bytes(source.config, method, ids, args))
  mesh = mesh_from_args(args)
  context_parallel.check(method, mesh)
  _progress(f"loading model {args.model} ...")
  model = source.load()
  sharding.check_mesh(mesh, model.config, len(prompts))
  saved = dict(cache=args.cache, save_cache=args.save_cache)
  if args.stream and not args.json and len(ids) == 1:
    gen.plan_capacity(model.config, method, [len(ids[0])], args.max_new_tokens, 1, args.capacity)
    decoder = tok.stream_decoder(skip_special_tokens=True)
    wrote = False
    try:
      for t in gen.stream(model.params, model.config, ids[0], method=method, max_new_tokens=args.max_new_tokens,
                          sampler=sampler, seed=args.seed, eos_ids=tok.eos_ids,
                          attention_impl=args.attention_impl, prefill_chunk=args.prefill_chunk, **saved):
        piece = decoder.push(t)
        wrote = wrote or bool(piece)
        print(piece, end="", flush=True)
      print(decoder.finish(), end="")
      wrote = True
    finally:
      if wrote:  # end the text's line, so that an error or interrupt line starts its own
        print(flush=True)
    return 0
  _progress(f"generating with {method.name} ...")
  res = gen.generate(model.params, model.config, ids, method=method, max_new_tokens=args.max_new_tokens,
                     sampler=sampler, seed=args.seed, capacity=args.capacity, eos_ids=tok.eos_ids,
                     attention_impl=args.attention_impl, prefill_tokens=args.prefill_tokens,
                     prefill_chunk=args.prefill_chunk, mesh=mesh, **saved)
  if not is_lead_process():
    return 0
  # Whole characters: a sequence that stopped inside one holds back its last tokens (counted in held_back_tokens).
  texts, held_back = zip(*(tok.decode_whole(t, skip_special_tokens=True) for t in res.tokens))
  if args.json:
    one = (lambda x: x[0]) if len(texts) == 1 else list
    print(json.dumps(dict(text=one(texts), tokens=one(res.tokens), held_back_tokens=one(held_back),
                          **res.stats)))  # the stats name the mesh and the method's settings as they ran
  else:
    for t in texts:
      print(t)
    s = res.stats
    _progress(f"kv cache: {s['kv_bytes']:,} bytes vs {s['dense_kv_bytes']:,} dense "
              f"({s['dense_kv_bytes'] / max(s['kv_bytes'], 1):.2f}x); prefill {s['prefill_s']:.3f} s; "
              f"decode {s['decode_tokens_per_s']:.1f} tokens/s; compile {s['compile_s']:.1f} s")
    if s["cache_loaded"]:
      _progress(f"cache loaded from {s['cache_loaded']['directory']}: {s['held_tokens']} tokens held, "
                f"{s['cache_loaded']['load_s']:.3f} s")
    if s["cache_saved"]:
      c = s["cache_saved"]
      held = c["held_bytes"] + c["held_host_bytes"]
      _progress(f"cache saved to {c['directory']}: {c['disk_bytes']:,} bytes on disk, {held:,} held, "
                f"{c['save_s']:.3f} s")
  return 0


def cmd_convert(args):
  from jkv.load import convert
  # The checkpoint is written beside the target and renamed into place once verified; an interrupt removes it.
  with kept_on_interrupt(f"nothing written to {args.out}"):
    model = convert(args.src, args.out, args.dtype, progress=_progress)
  if args.json:
    print(json.dumps(dict(out=args.out, config=dataclasses.asdict(model.config))))
  else:
    print(f"saved {args.src} as a jkv checkpoint in {args.out}")
  return 0


def cmd_info(args):
  import numpy as np

  from jkv import memory
  from jkv.attention import choose_impl
  from jkv.cache import CacheSpec, dense_kv_bytes
  from jkv.load import load_model

  from jkv import sharding

  method = method_from_args(args)
  mesh = mesh_from_args(args)
  model = load_model(args.model, args.dtype)
  cfg = model.config
  sharding.check_mesh(mesh, cfg)
  n = args.tokens
  multiple = method.capacity_multiple()
  spec = CacheSpec.for_model(cfg, 1, -(-n // multiple) * multiple)
  method = method.for_impl(spec, choose_impl())  # as it would run on this machine (KIVI's mma decided)
  method.check(spec)
  held = method.held_bytes(spec, None, np.array([n]))
  dense = dense_kv_bytes(spec, np.array([n]))
  # The largest batch of --tokens-token sequences (the prompt and what is generated) on this device, or on one of
  # --device-gib GiB: every sequence's cache is allocated at capacity, beside the weights and one prefill. With a
  # --mesh, every device of the mesh holds that much: its share of the weights and of the cache.
  mem = memory.available_memory()  # a CPU's is the machine's
  device_bytes = int(args.device_gib * 2**30) if args.device_gib else (mem["limit"] if mem else None)
  weight_bytes = sharding.param_bytes_per_device(cfg, mesh)
  batch = None if device_bytes is None else memory.largest_batch(
      cfg, method, spec.capacity, n, device_bytes=device_bytes, weight_bytes=weight_bytes, mesh=mesh,
      host_bytes=memory.pinned_host_limit())
  # The longest single sequence: its cache beside the weights and a chunked prefill (jkv.prefill).
  longest = None if device_bytes is None else memory.longest_context(
      cfg, method, device_bytes=device_bytes, weight_bytes=weight_bytes, mesh=mesh,
      host_bytes=memory.pinned_host_limit())
  info = dict(config=dataclasses.asdict(cfg), method=method.name, method_config=dataclasses.asdict(method),
              tokens=n, kv_bytes=held.device, kv_host_bytes=held.host, dense_kv_bytes=dense,
              kv_bytes_per_token=held.device / n, dense_kv_bytes_per_token=dense / n,
              compression=dense / max(held.device, 1), device_bytes=device_bytes, largest_batch=batch,
              longest_context=longest, model_context=cfg.max_position, mesh=sharding.mesh_label(mesh))
  from jkv.evaluation import frontier  # what the committed frontier measured within this method's bytes
  measured = args.model == "default" and args.dtype == "float32"
  info["frontier"] = frontier.advice(held.device / dense) if measured else []
  if args.json:
    print(json.dumps(info))
  else:
    for k, v in info["config"].items():
      print(f"{k:>16}: {v}")
    print(f"{'method':>16}: {method}")
    print(f"{'kv bytes/token':>16}: {held.device / n:,.1f} at {n} tokens (dense {dense / n:,.1f}; "
          f"{dense / max(held.device, 1):.2f}x)" + (f"; host {held.host / n:,.1f}" if held.host else ""))
    per = f" per device of mesh {sharding.mesh_label(mesh)}" if mesh is not None else ""
    per += "" if args.device_gib else memory.allocator_limit_note()
    print(f"{'largest batch':>16}: " + (f"{batch} sequences of {n} tokens in {device_bytes / 2**30:.1f} GiB{per}"
                                         if batch is not None else "unknown (this device reports no memory "
                                                                   "size; give --device-gib)"))
    if longest is not None:
      limit = (f"; this model's own context is {cfg.max_position}" if cfg.max_position < longest else "")
      print(f"{'longest context':>16}: {longest} tokens in one sequence, prefilled in chunks, in "
            f"{device_bytes / 2**30:.1f} GiB{per}{limit}")
    for line in info["frontier"]:
      print(f"{'frontier':>16}: {line}")
  return 0


def _version() -> str:
  try:
    return importlib.metadata.version("jkv")
  except importlib.metadata.PackageNotFoundError:  # run from a source tree (PYTHONPATH=.) without installing
    return "unknown (not installed)"


def build_parser():
  parser = _Parser(prog="jkv", description="LLM inference with a compressed KV cache")
  parser.add_argument("--version", action="version", version=f"jkv {_version()}")
  sub = parser.add_subparsers(dest="command", required=True)

  g = sub.add_parser("generate", help="generate text for one or more prompts")
  g.add_argument("prompt", nargs="*", help="prompt text (several run as one batch); standard input if none")
  add_model_args(g)
  add_method_args(g)
  g.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most (default: 64)")
  g.add_argument("--temperature", type=temperature, default=0.0, help="sampling temperature; 0 means greedy "
                                                                       "(default: 0)")
  g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (needs a "
                                                         "temperature; default: all)")
  g.add_argument("--top-p", type=finite_float, default=None, help="sample within this probability mass, in (0, 1] "
                                                                  "(needs a temperature; default: all)")
  g.add_argument("--seed", type=seed, default=0, help="random seed of the sampling, 0 to 2**63 - 1 (default: 0)")
  g.add_argument("--capacity", type=positive_int, default=None,
                 help="cache capacity in tokens (default: fitted to the prompts and --max-new-tokens)")
  g.add_argument("--prefill-tokens", type=positive_int, default=None,
                 help="prompt tokens one prefill call may process: a batch is prefilled in sub-batches within "
                      "it, and in chunks where not one prompt fits (default: what the device's free memory holds)")
  g.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="TOKENS",
                 help="prefill the prompts in chunks of this many tokens (rounded up to the method's block), each "
                      "attending the cache as the method holds it (default: whole prompts where they fit a call)")
  g.add_argument("--save-cache", default=None, metavar="DIR",
                 help="save the cache as the prompts' prefill leaves it in DIR (new), to ask them questions later "
                      "with --cache; in the chat template the prompt starts the user's message")
  g.add_argument("--cache", default=None, metavar="DIR",
                 help="continue a cache saved with --save-cache (same model, method and settings) instead of "
                      "prefilling it again: each prompt ends the user's message it started, one per saved prompt "
                      "(any number after one)")
  g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
  g.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
  g.add_argument("--json", action="store_true", help=JSON_HELP)
  g.set_defaults(fn=cmd_generate)

  c = sub.add_parser("convert", help="convert a Hugging Face directory or GGUF file into a jkv checkpoint")
  c.add_argument("src", help="'default', a Hugging Face directory, a .gguf file or a jkv checkpoint")
  c.add_argument("out", help="directory to create (it must not exist, or be empty)")
  c.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype to store the parameters in "
                                                                    "(default: float32)")
  c.add_argument("--json", action="store_true", help=JSON_HELP)
  add_verbose_arg(c)
  c.set_defaults(fn=cmd_convert)

  i = sub.add_parser("info", help="model config and KV bytes per token for a method")
  add_model_args(i)
  add_method_args(i)
  i.add_argument("--tokens", type=positive_int, default=4096,
                 help="sequence length (prompt + generated tokens) the bytes and the largest batch are counted at "
                      "(default: 4096)")
  i.add_argument("--device-gib", type=device_gib, default=None,
                 help="device memory in GiB for the largest batch (default: what this device reports)")
  i.add_argument("--json", action="store_true", help=JSON_HELP)
  i.set_defaults(fn=cmd_info)

  from jkv.evaluation import cli as eval_cli  # eval and compare live with the harness
  eval_cli.add_commands(sub, sys.modules[__name__])
  return parser


# ------------------------------------------------------------------------------------------------- main


def _close_progress_bars():
  """Close live tqdm bars (an exception skipped their ``close``), so that the next stderr line starts a line."""
  from tqdm import tqdm
  for bar in list(tqdm._instances):
    bar.close()


def _say(line: str) -> None:
  _close_progress_bars()
  sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
  lines = [l for l in str(e).splitlines() if l.strip()]
  return lines[0] if lines else type(e).__name__


def _importing(frame) -> bool:
  """Whether the main thread, at ``frame``, is inside an import."""
  while frame is not None:
    if frame.f_code.co_filename == "<frozen importlib._bootstrap>":
      return True
    frame = frame.f_back
  return False


def _say_interrupted(e: Optional[BaseException] = None):
  """The one line of an interrupted run, with what the command kept (``kept_on_interrupt``). Warnings and asyncio's
  log are silenced first: an interrupted checkpoint save abandons orbax's coroutines and tasks, and their 'never
  awaited' RuntimeWarning and 'Task was destroyed but it is pending' error, printed whenever they are collected,
  would come after the line."""
  warnings.simplefilter("ignore")
  logging.getLogger("asyncio").disabled = True
  notes = []
  while e is not None:  # the KeyboardInterrupt, or what it caused
    notes += getattr(e, "__notes__", [])
    e = e.__cause__ or e.__context__
  _say("; ".join(["jkv: interrupted"] + notes))


@contextlib.contextmanager
def kept_on_interrupt(what: str):
  """Ctrl-C inside ends in one line that says ``what`` the command kept of its output (nothing half-written)."""
  try:
    yield
  except KeyboardInterrupt as e:
    e.add_note(what)
    raise


class _ProgramInterrupts:
  """Ctrl-C while ``jkv`` runs as a program.

  The first SIGINT raises KeyboardInterrupt, as Python's own handler does, so that cleanups run while the stack
  unwinds (a convert removes its partial directory); ``main`` then says so in one line. Measured with SIGINT sent
  to ``jkv generate`` at random times, where Python's own handling goes wrong, and what is done here instead:

  - 2 of 19 interrupts during XLA compilation crashed interpreter shutdown afterwards (SIGSEGV: work still in
    flight): an interrupted run ends with ``os._exit`` once its cleanups ran.
  - 2 of 19 landed in jax's garbage collection callback, where Python prints the exception and drops it
    (generation went on and exited 0): an interrupt dropped that way is sent again a moment later.
  - 6 of 30 sent in the first 2.5 s landed inside the import of a C extension, which turned them into ImportError
    or aborted the process (jaxlib: ``terminate called after throwing nanobind::python_error``): during an import
    the interrupt waits, sent again every 10 ms until the import is done.

  With all three, 60 of 60 interrupts (30 in the first 2.5 s, 30 at random up to 11 s) ended in one line and exit
  130. A second SIGINT ends the process at once, for cleanups that hang.
  """

  def __init__(self):
    self.count = 0
    self.pending = False  # an interrupt waits to be raised (it was dropped, or arrived during an import)
    self.previous = None
    self.previous_hook = None

  def __enter__(self):
    # Not when SIGINT is ignored (a background job must not react to the terminal's Ctrl-C), nor off the main thread.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
      self.previous = signal.signal(signal.SIGINT, self._handle)
      self.previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    return self

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGINT, self.previous)
      sys.unraisablehook = self.previous_hook

  def _handle(self, signum, frame):
    if self.pending:  # the interrupt that waited, sent again
      self.pending = False
    else:
      self.count += 1
      if self.count > 1:
        _say_interrupted()
        os._exit(130)
    if _importing(frame):
      self._raise_later()
      return
    raise KeyboardInterrupt

  def _unraisable(self, unraisable):
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
      return self.previous_hook(unraisable)
    self._raise_later()

  def _raise_later(self):
    """Send SIGINT again in 10 ms, from another thread: a signal sent to oneself is handled inside ``os.kill``,
    and one sent at once can be handled while the caller still waits for the thread to start, where it would be
    dropped again."""
    self.pending = True
    timer = threading.Timer(0.01, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()


def _caused_by_interrupt(e: BaseException) -> bool:
  """Whether ``e`` is a KeyboardInterrupt or was raised because of one: a C extension turns an interrupt during its
  import into ImportError (seen for numpy's, 2 of 30 interrupts in the first second)."""
  while e is not None:
    if isinstance(e, KeyboardInterrupt):
      return True
    e = e.__cause__ or e.__context__
  return False


def _out_of_device_memory(e: BaseException) -> bool:
  """Whether ``e`` is jkv's DeviceMemoryError or XLA's own out-of-memory error (jkv.memory is imported by then:
  both come from running jax)."""
  memory = sys.modules.get("jkv.memory")
  return memory is not None and (isinstance(e, memory.DeviceMemoryError) or memory.is_out_of_memory(e))


def _run(argv) -> int:
  """Parse ``argv`` and run the command; any failure becomes one line on stderr and an exit status."""
  args = None
  try:
    args = build_parser().parse_args(argv)
    return args.fn(args)
  except SystemExit as e:  # --help, --version, or a bad flag (already said in one line)
    return e.code
  except BaseException as e:
    if _caused_by_interrupt(e):
      _say_interrupted(e)
      return 130
    if getattr(args, "verbose", False):  # the whole error first: XLA's allocator report, a traceback
      _close_progress_bars()
      traceback.print_exception(e, file=sys.stderr)
    if _out_of_device_memory(e):
      line = _first_line(e)
      _say(f"jkv: error: {line if line.startswith('out of device memory') else 'out of device memory: ' + line}")
      return 1
    if isinstance(e, MemoryError):
      _say(f"jkv: error: out of host memory{': ' + _first_line(e) if str(e) else ''}")
      return 1
    if isinstance(e, (ValueError, OSError, RuntimeError, NotImplementedError)):
      _say(f"jkv: error: {_first_line(e)}")
      return 2
    # Anything else is a failure of jkv's, not of the input: one line still, the traceback with --verbose.
    _say(f"jkv: error: internal error, {type(e).__name__}: {_first_line(e)} (--verbose shows where)")
    return 1


def quiet_xla_logs(argv) -> None:
  """XLA's C++ log lines only with ``--verbose``: set before jax is imported, the only time XLA reads it. Out of
  device memory, XLA's allocator logs its whole state (dozens of lines) before the error that jkv reports in one
  line; every failure reaches the user as that one line, so nothing is lost. A value the user set is kept."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if "--verbose" in argv else "3")


PINNED_HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"  # (jkv.memory's name: not imported before jax may start)
_pool_limit_set = None  # the value size_pinned_host_pool last set (any other in the environment is the user's)


def size_pinned_host_pool(host_bytes: Optional[int] = None) -> None:
  """Size XLA's pool of pinned host memory for host-resident arrays (SpeCache's 16-bit copy; XLA's default is 64
  GiB), which XLA reads once, when the GPU client starts. The pool grows by regions of powers of two up to its limit
  (``jkv.memory.pinned_pool_take``), so a copy of over half of it pins all of it.

  Without ``host_bytes`` (the program's start, before any command knows its cache): 90% of the machine's memory.
  With them (``generate``, once it has the prompts' capacity, before any device): a pool that holds the copy and
  little more (``jkv.memory.pinned_pool_limit_gib``); 0 keeps the start's. A value the user set is kept, and so is
  any once the GPU client has started (``jkv.memory.guard`` then refuses a copy the pool would not hold well,
  naming the value to set)."""
  global _pool_limit_set
  if os.environ.get(PINNED_HOST_LIMIT_ENV, _pool_limit_set) != _pool_limit_set:
    return
  if host_bytes is None:
    try:
      total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # no such sysconf names: XLA's default stays
      return
    limit = max(1, int(0.9 * total) >> 30)
  else:
    from jax._src import xla_bridge  # no public form tells whether a backend started
    if not host_bytes or xla_bridge.backends_are_initialized():
      return
    from jkv.memory import pinned_pool_limit_gib
    limit = pinned_pool_limit_gib(host_bytes)
  _pool_limit_set = os.environ[PINNED_HOST_LIMIT_ENV] = str(limit)


def _host_copy_bytes(cfg, method, ids, args) -> int:
  """Host bytes of the cache ``generate`` will allocate for these prompts (every device's share): the most tokens
  its plan gives the cache (``generate.plan_generation``), bounded without a device. The capacity planned for the
  prompts (after a loaded cache's tokens), grown as a prefill grows it (``jkv.prefill``): past the width of the
  chunks (``--prefill-chunk``'s exactly; a continuation's whole bucket; else chunks as even as the free memory
  allows, at most a chunk multiple over each, and far fewer than 63) by one chunk multiple, and split over ``seq``."""
  from jkv import generate as gen
  from jkv import memory, saved_cache, sharding
  from jkv.prefill import bucket, round_up
  multiple, batch = method.chunk_multiple(), len(ids)
  held, lengths = [0] * batch, [len(i) for i in ids]
  if args.cache is not None:
    saved = saved_cache.open_saved(args.cache)
    held = saved.check_batch(batch)
    lengths = [len(tail) + n for tail, n in zip(saved.tails(batch), lengths)]
  longest = max(lengths)
  capacity = gen.plan_capacity(cfg, method, [h + n for h, n in zip(held, lengths)], args.max_new_tokens,
                               min(gen.DECODE_CHUNK, args.max_new_tokens), args.capacity,
                               continued=args.cache is not None)
  if args.prefill_chunk:
    size = round_up(args.prefill_chunk, multiple)
    width = -(-longest // size) * size
  else:
    width = max(round_up(bucket(longest), multiple) if args.cache else 0, longest + 63 * multiple)
  seq = sharding.parse_mesh(args.mesh).get(sharding.SEQ_AXIS, 1) if args.mesh else 1
  tokens = max(capacity, max(held) + width + multiple) + seq * method.capacity_multiple()
  return memory.host_cache_bytes(method, cfg, batch, tokens)


def main(argv=None) -> int:
  """Run ``jkv ARGV`` and return its exit status: 0, 2 for bad input (one line), 1 out of memory or an internal
  error (one line), 130 when interrupted.

  With ``argv`` None, ``jkv`` runs as the program (the console script, ``python -m jkv.cli``): Ctrl-C is
  handled as ``_ProgramInterrupts`` says, from before jax is imported, and an interrupted run ends the process
  itself (exit 130).
  """
  if argv is not None:
    return _run(argv)
  quiet_xla_logs(sys.argv[1:])
  size_pinned_host_pool()
  with _ProgramInterrupts() as interrupts:
    rc = _run(None)
    if rc != 130 and interrupts.count:  # an interrupt was dropped and the command ran to its end
      _say_interrupted()
      rc = 130
  if rc == 130:
    sys.stdout.flush()
    os._exit(130)  # skip interpreter shutdown: XLA work still in flight can crash it
  return rc


if __name__ == "__main__":
  sys.exit(main())
