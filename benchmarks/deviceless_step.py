"""A decode step compiled for an H100 on a machine with no GPU: the kernels XLA makes of it, each named.

jax's CUDA plugin compiles for a GPU it does not have, given the GPU's description (a ``GpuTargetConfigProto``:
``targets/h100_sxm.txtpb``, what a GPU run's ``--xla_dump_to`` writes as ``*.gpu_target_config.pbtxt``), through
``jax.experimental.topologies``. This script builds jkv.generate's decode chunk (``jkv.generate._decode_chunk``)
over abstract arguments (the random Llama-3-8B shape's parameters, a method's cache at batch B and ``--context``
tokens with ``benchmarks/long_context.py``'s settings, as ``benchmarks/profile_decode_step.py`` builds it; nothing is
allocated), compiles it with jkv's
MODEL_COMPILER_OPTIONS for that GPU and reads the optimized HLO: every kernel of the layer loop's body (fusions,
custom calls: the Pallas kernels, cuBLAS, copies), with its kind and the jax operations it came from, counted per
layer and per step. No time is measured: a kernel count is what the profiler's trace would list, not what it would
take. Run it where a GPU is scarce, to see what a change does to the step's kernels before a GPU times it.

What differs from the GPU's own compilation:
- The CPU is jax's default device, so what jkv reads off the device is set to the target's: the compute capability
  (``jkv.attention._gpu_capability``: impl "pallas" and the Hopper kernel) and the GPU Pallas's Triton lowering
  asks for (``gpu_info.get_gpu_info``).
- A compile-only device has no host memory space: SpeCache's 16-bit copy is compiled in device memory
  (``specache_hit_rate_forms.patch("device_copy")``), so its row writes and fetches are device copies here.
- XLA does not autotune without the GPU; it picks by its cost model where it would measure.

Setup (once; jax 0.11.2, as on the GPU machines, needs Python 3.12; ~4 GB):

    python3.12 -m venv /tmp/gv && /tmp/gv/bin/pip install 'jax[cuda13]==0.11.2' flax orbax-checkpoint safetensors \\
        gguf tokenizers jinja2 tqdm matplotlib
    PYTHONPATH=<a folder with jkv, jkv_kernels, jkv_convert linked> /tmp/gv/bin/python \\
        benchmarks/deviceless_step.py --method specache1 --batch 1 --context 131072
"""
import os

# Before jax starts: the CPU is the platform that runs; the CUDA plugin loads (to compile) without a driver.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
TARGETS = {"h100": HERE / "targets" / "h100_sxm.txtpb"}
KERNEL_OPS = ("fusion", "custom-call", "copy", "copy-start", "sort", "scatter", "gather", "all-reduce")


def target_device(target: str):
  """A compile-only CUDA device described by ``TARGETS[target]``; the jax pieces that ask the running device what
  GPU they lower for are told it (above)."""
  from jax.experimental import topologies
  from jax._src.pallas.triton import gpu_info
  import jkv.attention
  text = TARGETS[target].read_text()
  major = int(re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)", text).group(1))
  minor = re.search(r"cuda_compute_capability\s*\{[^}]*minor:\s*(\d+)", text)
  jkv.attention._gpu_capability = lambda: float(f"{major}.{minor.group(1) if minor else 0}")
  version = {"h100": gpu_info.GpuVersion.H100}[target]
  gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(version)
  return topologies.get_topology_desc(target, "cuda", target_config=text, topology="1x1x1").devices[0]


def abstract_args(cfg, method, batch: int, context: int, steps: int, device):
  """``_decode_chunk``'s arguments as ShapeDtypeStructs on ``device``: parameters, the cache (as
  ``jkv.sharding.create_cache`` makes it, with the capacity ``profile_decode_step.trace_decode`` gives it) and the
  per-sequence arrays generate carries."""
  from jkv import generate as gen
  from jkv import params as params_lib
  from jkv.attention import choose_impl
  from jkv.cache import CacheSpec, KVCache
  capacity = gen.round_up(context + steps, method.capacity_multiple())
  spec = CacheSpec.for_model(cfg, batch, capacity, steps)
  impl = choose_impl()
  params = jax.eval_shape(lambda: params_lib.init_random(cfg, jax.random.key(0)))
  cache = jax.eval_shape(lambda: KVCache.create(method, spec, impl))
  rows = jax.eval_shape(lambda: (jnp.ones((batch,), jnp.int32), jnp.zeros((batch, method.speculative_rows), jnp.int32),
                                 jnp.zeros((batch,), bool), jnp.zeros((batch,), bool),
                                 jnp.zeros((batch, 2), jnp.int32), jax.random.key(0),
                                 jnp.asarray((-1,), jnp.int32), jnp.int32(0)))
  on = jax.sharding.SingleDeviceSharding(device)
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)
  return jax.tree.map(place, (params, cache, *rows)), impl


def computations(hlo: str) -> dict:
  """{computation name: its instruction lines} of an HLO module's text."""
  return {name: body.splitlines() for name, body in
          re.findall(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, flags=re.M | re.S)}


def kernels(lines) -> list:
  """The instructions of one computation that launch work on the GPU: (name, op, kind, what) where kind is a
  fusion's kind (kLoop, kInput, the backend's "__triton" or "__custom_fusion") or a custom call's target, and what
  the jax operation its metadata names."""
  out = []
  for line in lines:
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\(", line)
    if not m or m.group(2) not in KERNEL_OPS:
      continue
    kind = re.search(r'"kind":"(__\w+)"', line) or re.search(r"kind=(k\w+)", line) or re.search(
        r'custom_call_target="([^"]+)"', line)
    what = re.search(r'op_name="([^"]+)"', line)
    out.append(dict(name=m.group(1), op=m.group(2), kind=kind.group(1) if kind else "",
                    what=re.sub(r"^jit\(_decode_chunk\)/(while/body/|eval_jaxpr/)*", "", what.group(1)) if what
                    else ""))
  return out


def loops(hlo: str) -> dict:
  """The decode chunk's loops by the kernels their bodies launch: the step loop's body (``step``) and the layer
  loop's (``layer``: the body with the most kernels), with the conditionals' branches and the inner loops' bodies
  each holds ({computation: kernels}; an inner loop's name starts "loop " and its kernels run once a trip)."""
  comps = computations(hlo)
  bodies = [b for b in re.findall(r"body=%?([\w.\-]+)", hlo) if b in comps]
  counted = {b: kernels(comps[b]) for b in bodies}
  layer = max(counted, key=lambda b: len(counted[b]))
  step = next((b for b in bodies if b != layer and re.search(rf"body=%?{re.escape(layer)}\b", "\n".join(comps[b]))),
              None)

  def branches(body):
    names = re.findall(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)",
                       "\n".join(comps[body]))
    flat = [n.strip().lstrip("%") for group in names for part in group for n in part.split(",") if n.strip()]
    inner = [n for n in re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", "\n".join(comps[body])) if n != layer]
    return {n: kernels(comps[n]) for n in flat if n in comps} | {f"loop {n}": counted[n] for n in inner}
  return {"layer": (layer, counted[layer], branches(layer)),
          "step": (step, counted.get(step, []), branches(step) if step else {})}


def summary(found) -> dict:
  """Counts of kernels by (op, kind)."""
  return dict(collections.Counter(f"{k['op']}:{k['kind']}" for k in found).most_common())


RECORD_KEY = lambda r: (r["method"], r["batch"], r["context"], tuple(r["forms"]), json.dumps(r["compiler_options"],
                                                                                     sort_keys=True),
                        r["jax_version"], r["commit"])  # a change's record beside the one before it
OUT = HERE / "results" / "deviceless_step.json"


def methods() -> dict:
  """The settings of ``long_context.py``'s B = 1 decode records (their times are what these counts explain), and
  SpeCache-1 with nothing fetched beside them."""
  from long_context import METHODS
  return {**METHODS, "specache1_k0": ("specache", dict(METHODS["specache1"][1], fetch_rows=0))}


def compile_record(label: str, args, device, extra: dict) -> tuple:
  """Compile ``label``'s decode chunk for ``device`` (forms and options already applied); returns its record and
  the optimized HLO."""
  from generate_decode import LLAMA3_8B, SMOKE
  from jkv.config import ModelConfig
  from jkv.methods import make_method
  from jkv.sampling import Greedy
  from jkv.xla_options import MODEL_COMPILER_OPTIONS
  from jkv import generate as gen
  cfg = ModelConfig(**(SMOKE if args.smoke else LLAMA3_8B))
  name, options = methods()[label]
  abstract, impl = abstract_args(cfg, make_method(name, **options), args.batch, args.context, args.steps, device)
  hlo = gen._decode_chunk.lower(*abstract, cfg=cfg, sampler=Greedy(), steps=args.steps).compile(extra or None).as_text()
  found = loops(hlo)
  _, layer, layer_branches = found["layer"]
  _, step, step_branches = found["step"]
  per_step = cfg.num_layers * len(layer) + len(step)
  record = dict(
      method=label, method_config=options, batch=args.batch, context=args.context, steps=args.steps,
      model="tiny smoke model" if args.smoke else "random Llama-3-8B shape", layers=cfg.num_layers, impl=impl,
      forms=args.form, compiler_options=dict(MODEL_COMPILER_OPTIONS, **extra), target=args.target,
      device=device.device_kind + " (compiled only: no GPU)", jax_version=jax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit(),
      kernels_per_layer=len(layer), kernels_per_step=per_step, kernels_per_step_outside_layers=len(step),
      layer_branch_kernels={k: len(v) for k, v in layer_branches.items()},
      step_branch_kernels={k: len(v) for k, v in step_branches.items()},
      layer_summary=summary(layer), step_summary=summary(step), layer=layer, layer_branches=layer_branches,
      step=step)
  return record, hlo


def commit() -> str:
  """The last commit that changed the jkv imported (its ``jkv`` and ``pallas_kernels``: the compiled program is
  their code), "-dirty" when they have changes not committed."""
  import jkv
  root = pathlib.Path(jkv.__file__).resolve().parents[1]
  git = lambda *a: subprocess.run(["git", *a, "--", "jkv", "pallas_kernels"], cwd=root, capture_output=True,
                                  text=True).stdout.strip()
  return git("log", "-1", "--format=%h") + ("-dirty" if git("status", "--porcelain") else "")


def table(records) -> str:
  """A markdown table of the records: kernels a layer, a step, and where they come from."""
  rows = ["| method | batch | context | forms | commit | kernels a layer (in its conditionals' branches) | a step "
          "(outside the layers) | a layer's kinds |", "| --- | ---: | ---: | --- | --- | ---: | ---: | --- |"]
  for r in records:
    kinds = ", ".join(f"{n} {k}" for k, n in r["layer_summary"].items())
    rows.append(f"| {r['method']} | {r['batch']} | {r['context']:,} | {' '.join(r['forms']) or '-'} | {r['commit']} | "
                f"{r['kernels_per_layer']} ({' + '.join(map(str, r['layer_branch_kernels'].values())) or '-'}) | "
                f"{r['kernels_per_step']:,} ({r['kernels_per_step_outside_layers']}) | "
                f"{kinds} |")
  return "\n".join(rows)


def main():
  import specache_hit_rate_forms as forms
  from records import save, write_readme_section
  from jkv.xla_options import MODEL_COMPILER_OPTIONS
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--methods", nargs="+", choices=sorted(methods()), default=["dense", "kivi2_mma", "specache1"])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--context", type=int, default=131072)
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--smoke", action="store_true", help="the tiny model of the smoke runs")
  parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
  parser.add_argument("--form", action="append", default=[],
                      choices=sorted(set(forms.FORMS) - set(forms.XLA_FLAGS) - set(forms.PASSES_OFF)),
                      help="apply one of specache_hit_rate_forms.py's program changes first (repeatable; its forms "
                           "that turn XLA passes off are --compiler-option xla_disable_hlo_passes=... here)")
  parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                      help="an XLA option on top of MODEL_COMPILER_OPTIONS (repeatable)")
  parser.add_argument("--list", action="store_true", help="print every kernel of each method's layer")
  parser.add_argument("--hlo", type=pathlib.Path, help="write each method's optimized HLO into this folder")
  parser.add_argument("--out", type=pathlib.Path, default=OUT, help="merge the records into this JSON list")
  parser.add_argument("--table", action="store_true",
                      help="print the table of the records in --out, write it into benchmarks/README.md, and stop")
  args = parser.parse_args()
  if args.table:
    text = table(json.loads(args.out.read_text()))
    write_readme_section("deviceless_step", text, "## Kernels a decode step launches, compiled without a GPU "
                         "(`deviceless_step.py`)")
    print(text)
    return

  device = target_device(args.target)
  forms.patch("device_copy")
  for form in args.form:
    forms.patch(form)
  extra = {}
  for item in args.compiler_option:
    key, value = item.split("=", 1)
    known = MODEL_COMPILER_OPTIONS.get(key)
    # xla_disable_hlo_passes is one list: an option replaces jkv's, so jkv's passes stay off beside the new ones
    extra[key] = (f"{known},{value}" if key == "xla_disable_hlo_passes" and known
                  else {"true": True, "false": False}.get(value.lower(), value))
  records = []
  for label in args.methods:
    record, hlo = compile_record(label, args, device, extra)
    records.append(record)
    if args.hlo:
      args.hlo.mkdir(parents=True, exist_ok=True)
      (args.hlo / f"{label}.hlo.txt").write_text(hlo)
    print(f"{label} B={args.batch} context={args.context}: {record['kernels_per_layer']} kernels a layer "
          f"{record['layer_summary']}, {record['kernels_per_step']} a step", flush=True)
    listed = [("layer", record["layer"])] + [(f"branch {b}", ks) for b, ks in record["layer_branches"].items()]
    for where, ks in listed if args.list else []:
      print(f" {where}:")
      for k in ks:
        print(f"  {k['op']:12s} {k['kind']:22s} {k['name'][:40]:40s} {k['what'][:90]}")
  save(args.out, records, RECORD_KEY)
  print(table(records))


if __name__ == "__main__":
  main()
