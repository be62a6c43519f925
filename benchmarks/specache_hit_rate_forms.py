"""SpeCache's speculation hit rate with k past every candidate (which must be exactly 1), in several forms of the
same program: where a GPU loses it (docs/methods/specache.md, 'Open on GPUs').

The model and prompts are ``tests/test_specache.py``'s ``test_generate_and_perplexity_through_the_model``'s: the
tiny random Llama of ``tests/tiny_llama.py`` (built by transformers, loaded by jkv in float32), two
prompts of 40 and 90 tokens, 24 new tokens, SpeCache(fetch_rows=512, residual=32). Each form runs in a process of
its own (XLA's flags are read at start; the patches stay in it) and prints one JSON line; the driver writes them
into ``results/specache_hit_rate_forms.json`` with the device, jax version and date. On one H100 (2026-12-07, jax
0.11.2, scratch versions of the first two forms) the plain program gave 0.998779 and the one with a debug callback
on the selection's inputs and outputs gave 1.0.

    python benchmarks/specache_hit_rate_forms.py                              # every form
    python benchmarks/specache_hit_rate_forms.py --forms plain verify_triton  # these, in this order
    python benchmarks/specache_hit_rate_forms.py --form plain                 # one, in this process
    python benchmarks/specache_hit_rate_forms.py --forms plain --hlo /tmp/hlo # with its XLA Triton fusions
"""
import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

XLA_FLAGS = {"no_command_buffers": "--xla_gpu_enable_command_buffer=",
             "verify_triton": "--xla_gpu_verify_triton_fusion_numerics=true",
             "no_triton_multi_output": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=false"}
# XLA passes turned off through jkv's own compiler options: the model's jitted functions pass
# xla_disable_hlo_passes (MODEL_COMPILER_OPTIONS), which replaces the list XLA_FLAGS gives (checked by compiling for
# an H100 with benchmarks/deviceless_step.py's device: 82 fusions either way with priority-fusion in XLA_FLAGS, 501
# with it here).
PASSES_OFF = {"no_priority_fusion": "priority-fusion",
              "no_block_level_triton": "fusion-block-level-rewriter",
              "no_xla_triton": "triton-softmax-rewriter,fusion-block-level-rewriter"}
FORMS = {
    "plain": "generate as it is",
    "callback": "a debug callback on each selection's inputs and outputs (keeps them alive and in order)",
    "barrier": "an optimization barrier on each selection's inputs",
    "fetched_read_once": "an optimization barrier on the step's read of its layer's fetched positions (one snapshot "
                         "for the window's exclusion, the selection and the hit count, before _keep updates them)",
    "fetch_at_use": "SpeCache(prefetch=False): each layer fetches its rows when it attends",
    "rows_one_by_one": "the fetched rows copied one by one (gather_host_rows_one_by_one), not the Pallas kernel",
    "device_copy": "the 16-bit copy in device memory instead of pinned host memory",
    "no_command_buffers": f"XLA_FLAGS={XLA_FLAGS['no_command_buffers']} (no CUDA graphs)",
    "verify_triton": f"XLA_FLAGS={XLA_FLAGS['verify_triton']} (XLA checks each of its Triton fusions against its "
                     "reference emitter as it compiles)",
    "no_triton_multi_output": f"XLA_FLAGS={XLA_FLAGS['no_triton_multi_output']}",
    "no_priority_fusion": "XLA's main fusion pass off (priority-fusion)",
    "no_block_level_triton": "XLA's fusion-block-level-rewriter off: no reduction or loop fusion becomes a Triton "
                             "fusion (the top k's rank counts are Triton reductions on an H100)",
    "no_xla_triton": "no Triton fusion of XLA's own: fusion-block-level-rewriter and triton-softmax-rewriter off",
    "held_barrier": "the window's and fetched rows' candidates behind an optimization barrier once concatenated "
                    "(no concatenate, reduce, concatenate chain for one fusion: jax#40588's pattern)",
    "sorts": "every top k by lax.top_k (XLA's sort), no rank counting",
    "rank_keys_once": "the rank top-k's integer keys behind an optimization barrier (each score's key computed once "
                      "for both sides of the pairwise comparison)",
}
OUT = pathlib.Path(__file__).parent / "results" / "specache_hit_rate_forms.json"


def tiny_llama():
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
  from tiny_llama import save_tiny_llama
  from jkv.load import load_model
  path = tempfile.mkdtemp()
  save_tiny_llama(path)
  return load_model(path, "float32")


def patch(form: str) -> dict:
  """Apply ``form``'s change to SpeCache; returns the method's options."""
  import dataclasses
  import jax
  if form in PASSES_OFF:  # read when jkv.generate's functions are jitted
    if "jkv.generate" in sys.modules:
      raise RuntimeError(f"form {form} must be applied before jkv.generate is imported")
    from jkv.xla_options import MODEL_COMPILER_OPTIONS
    MODEL_COMPILER_OPTIONS["xla_disable_hlo_passes"] += "," + PASSES_OFF[form]
  from jkv.methods import specache as sp
  select = sp.SpeCache._select
  if form == "callback":
    def selected(mass, bound, k, first_slot=None):
      idx, ok = select(mass, bound, k, first_slot)
      jax.debug.callback(lambda *_: None, idx, ok, mass, bound)
      return idx, ok
    sp.SpeCache._select = staticmethod(selected)
  elif form == "barrier":
    sp.SpeCache._select = staticmethod(
        lambda mass, bound, k, first_slot=None: select(*jax.lax.optimization_barrier((mass, bound)), k, first_slot))
  elif form == "fetched_read_once":
    fetched = sp.SpeCache._fetched
    sp.SpeCache._fetched = staticmethod(lambda state, layer: jax.lax.optimization_barrier(fetched(state, layer)))
  elif form == "sorts":
    top_k = sp.top_k
    sp.top_k = lambda scores, k: top_k(scores, k, rank_pairs=0)
  elif form == "held_barrier":
    held_candidates = sp.SpeCache._held_candidates
    sp.SpeCache._held_candidates = staticmethod(
        lambda held, bound: jax.lax.optimization_barrier(held_candidates(held, bound)))
  elif form == "rank_keys_once":
    keys = sp.order_keys
    sp.order_keys = lambda scores: jax.lax.optimization_barrier(keys(scores))
  elif form == "rows_one_by_one":
    sp.gather_rows_pallas = sp.gather_host_rows_one_by_one
  elif form == "device_copy":
    abstract = sp.SpeCache.abstract

    def on_device(self, spec):
      state = abstract(self, spec)
      return state.replace(host_kv=dataclasses.replace(state.host_kv, memory_kind="device"))
    sp.SpeCache.abstract = on_device
    sp.to_host = sp.to_device = lambda x: x
  return {"prefetch": False} if form == "fetch_at_use" else {}


def run_form(form: str) -> dict:
  import jax
  import numpy as np
  options = patch(form)
  from jkv import generate as gen
  from jkv.methods.specache import SpeCache
  m = tiny_llama()
  rng = np.random.default_rng(7)
  prompts = [rng.integers(2, m.config.vocab_size, n).tolist() for n in (40, 90)]
  res = gen.generate(m.params, m.config, prompts, method=SpeCache(fetch_rows=512, residual=32, **options),
                     max_new_tokens=24, eos_ids=(), chunk=8)
  return {"form": form, "what": FORMS[form], "hit_rate": res.stats["method_stats"]["speculation_hit_rate"],
          "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def triton_fusions(dump: pathlib.Path) -> dict:
  """XLA's Triton fusions in the largest optimized module ``--xla_dump_to`` wrote into ``dump`` (generate's decode
  chunk): how many, and those whose computation holds a concatenate (jax#40588's pattern), by name."""
  modules = sorted(dump.glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size)
  if not modules:
    return {}
  text = modules[-1].read_text()
  called = re.findall(r'calls=%?([\w.\-]+).*?"kind":"__triton', text)
  bodies = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", text, flags=re.M | re.S))
  concat = [name for name in called if "concatenate(" in bodies.get(name, "")]
  return {"module": modules[-1].name, "triton_fusions": len(called), "with_concatenate": concat}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--form", choices=sorted(FORMS), help="run this form alone and print its record")
  parser.add_argument("--forms", nargs="+", choices=sorted(FORMS), default=list(FORMS),
                      help="the forms to run, in this order (default: every form)")
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  parser.add_argument("--hlo", type=pathlib.Path, help="dump each form's optimized HLO under this folder and record "
                                                       "its Triton fusions (``triton_fusions``)")
  args = parser.parse_args()
  if args.form:
    print(json.dumps(run_form(args.form)))
    return
  records = []
  for form in args.forms:
    env = dict(os.environ)
    if form in XLA_FLAGS:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + XLA_FLAGS[form]).strip()
    if args.hlo:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={args.hlo / form}").strip()
    proc = subprocess.run([sys.executable, __file__, "--form", form], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    record = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
        "form": form, "what": FORMS[form], "error": proc.stderr.strip().splitlines()[-3:]}
    flagged = [line for line in proc.stderr.splitlines() if "numerics" in line or "does not match" in line]
    if flagged:  # what XLA's own checks said (verify_triton)
      record["xla_said"] = flagged[:5]
    if args.hlo:
      record["hlo"] = triton_fusions(args.hlo / form)
    print(f"{form:24s} {record.get('hit_rate', record.get('error'))}", flush=True)
    records.append(record)
    # Written after every form, so that a run cut short keeps what it measured.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    if os.environ.get("OUT"):  # the device machine's folder of files to bring back
      (pathlib.Path(os.environ["OUT"]) / args.out.name).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
  main()
