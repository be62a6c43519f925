"""What chunked prefill costs in quality: perplexity with each method's default, its contexts prefilled whole against
prefilled in chunks, on the same windows of the default model (SmolLM2-135M-Instruct, fp32, pydoc_data.topics).

Every scored token is predicted through the decode path over the compressed cache (``jkv eval ppl``); only how
the context got into the cache differs. Records (one per method, context and chunk) are merged into
benchmarks/results/chunked_prefill_quality.json after each run, so a run cut short keeps what it measured.

    python benchmarks/chunked_prefill_quality.py --context 8000 --chunk 1024      # 8k: the model's full context
    python benchmarks/chunked_prefill_quality.py --context 2048 --chunk 512
    python benchmarks/chunked_prefill_quality.py --passkey --context 8000 --chunk 1024   # pass-key retrieval
    python benchmarks/chunked_prefill_quality.py --table

``--passkey`` measures pass-key retrieval instead (``jkv eval passkey``'s grid at one length, ``--context``: five
depths, ``--trials`` keys each), the prompts prefilled whole against in chunks.
"""

import argparse
import json
import pathlib
import sys

from generate_decode import now
from records import save, write_readme_section

HERE = pathlib.Path(__file__).resolve().parent
METHODS = ("dense", "kivi", "zipcache", "ott", "specache")  # each at its defaults
RECORD_KEY = lambda r: (r.get("metric", "ppl"), r["method"], r["context"], r["prefill_chunk"], r["device"])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--scored", type=int, default=128)
  parser.add_argument("--windows", type=int, default=6)
  parser.add_argument("--chunk", type=int, default=512, help="the chunked runs' prefill chunk")
  parser.add_argument("--methods", nargs="+", default=list(METHODS),
                      help="method specs, as jkv compare takes them (name or name:option=value,...)")
  parser.add_argument("--passkey", action="store_true", help="pass-key retrieval at --context instead of perplexity")
  parser.add_argument("--trials", type=int, default=4, help="--passkey: keys per depth")
  parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "chunked_prefill_quality.json")
  parser.add_argument("--table", action="store_true", help="render --out into benchmarks/README.md and exit")
  args = parser.parse_args()
  if args.table:
    write_readme_section("chunked_prefill_quality", markdown_table(json.loads(args.out.read_text())),
                         "## Chunked prefill: quality")
    return
  import jax
  from jkv.evaluation import perplexity as ppl_lib
  from jkv.load import load_model
  from jkv.evaluation.compare import MethodSpec
  model = load_model("default", "float32")
  if args.passkey:
    return passkey(model, args)
  ids = model.tokenizer.encode(ppl_lib.default_text(), add_bos=False)
  for name in args.methods:
    for chunk in (None, args.chunk):
      plan = ppl_lib.WindowPlan(context=args.context, scored=args.scored, num_windows=args.windows, batch_size=3,
                                prefill_chunk=chunk)
      res = ppl_lib.perplexity(model.params, model.config, ids, method=MethodSpec.parse(name).method(), plan=plan,
                               progress=False)
      record = dict(method=name, method_config=res.method_config, context=args.context, scored=args.scored,
                    windows=args.windows, prefill_chunk=chunk, ppl=res.ppl, nll=res.nll, window_nll=res.window_nll,
                    kv_bytes=res.kv_bytes, device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                    date=now(), model="SmolLM2-135M-Instruct fp32", text="pydoc_data.topics")
      print(f"{name:>9} context {args.context} {'whole' if chunk is None else f'chunks of {chunk}'}: "
            f"ppl {res.ppl:.4f}", flush=True)
      save(args.out, [record], RECORD_KEY)


def passkey(model, args):
  """Pass-key accuracy per method, whole against chunked prefill, on the same keys; a record per run."""
  import jax
  from jkv.evaluation.passkey import PasskeyGrid, run_passkey
  from jkv.evaluation.compare import MethodSpec
  for name in args.methods:
    for chunk in (None, args.chunk):
      grid = PasskeyGrid(lengths=(args.context,), trials=args.trials, prefill_chunk=chunk)
      res = run_passkey(model.params, model.config, model.tokenizer, method=MethodSpec.parse(name).method(), grid=grid,
                        progress=False)
      record = dict(metric="passkey", method=name, context=args.context, prefill_chunk=chunk,
                    depths=res.depths, accuracy=res.accuracy[0], mean_accuracy=res.mean_accuracy,
                    trials=args.trials, device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                    date=now(), model="SmolLM2-135M-Instruct fp32")
      print(f"{name:>9} pass-key at {args.context} {'whole' if chunk is None else f'chunks of {chunk}'}: "
            f"{res.mean_accuracy:.2f} (by depth {res.accuracy[0]})", flush=True)
      save(args.out, [record], RECORD_KEY)


def markdown_table(records) -> str:
  passkeys = [r for r in records if r.get("metric") == "passkey"]
  records = [r for r in records if r.get("metric", "ppl") == "ppl"]
  by = {(r["method"], r["context"], r["prefill_chunk"] is None): r for r in records}
  lines = ["| method (defaults) | context | chunk | ppl whole | ppl chunked | change | device | date |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
  for (method, context, whole), r in sorted(by.items()):
    if not whole or (method, context, False) not in by:
      continue
    c = by[(method, context, False)]
    lines.append(f"| {method} | {context} | {c['prefill_chunk']} | {r['ppl']:.4f} | {c['ppl']:.4f} | "
                 f"{100 * (c['ppl'] / r['ppl'] - 1):+.2f}% | {c['device']} | {c['date'][:10]} |")
  by = {(r["method"], r["context"], r["prefill_chunk"] is None): r for r in passkeys}
  if by:
    lines += ["", "| method (defaults) | pass-key length | chunk | accuracy whole | accuracy chunked | keys | device | "
              "date |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
  for (method, context, whole), r in sorted(by.items()):
    if whole and (method, context, False) in by:
      c = by[(method, context, False)]
      lines.append(f"| {method} | {context} | {c['prefill_chunk']} | {r['mean_accuracy']:.2f} | "
                   f"{c['mean_accuracy']:.2f} | {len(r['depths']) * r['trials']} | {c['device']} | "
                   f"{c['date'][:10]} |")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
