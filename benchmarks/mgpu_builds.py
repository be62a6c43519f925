"""Several builds of the Mosaic GPU kernel timed in one process, in rotation: KIVI-2 alone and with KIVI's window.

``mgpu_ab.py`` alternates two builds a process at a time (a few minutes per repeat); here every build is imported
into one process as a package of its own (a copy of its ``pallas_kernels`` whose ``jkv_kernels`` imports are
renamed ``jkv_kernels_<name>``), checked against the first build's output, and timed at each shape in turn,
``--rounds`` times (the order reversed every other round), on the same inputs (``mgpu_decode.window_inputs``:
KIVI-2, G = 32, bf16, every slot valid, a window of 129 bf16 tokens), the store packed by each build's own
``mma_layout`` (builds may differ in the packing). A build may carry keyword arguments of
``mgpu_decode_attention`` (``name=path:segment_depth=1``), so one tree's settings compare in the same run.
Each round's time is a record (config: build, arguments, round); the table gives each build's median.

    git archive 97ffc34 pallas_kernels | tar -x -C /tmp/round11         # a build from history
    python benchmarks/mgpu_builds.py --builds round11=/tmp/round11/pallas_kernels tree=pallas_kernels \\
        shallow=pallas_kernels:segment_depth=1 --shapes 8x32768 256x4608 --rounds 3 \\
        --out benchmarks/results/mgpu_builds_<name>.json                  # on an H100
    python benchmarks/mgpu_builds.py --table --out benchmarks/results/mgpu_builds_<name>.json
"""

import argparse
import importlib
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from kernel_decode import Settings, Shape, record, time_calls
from mgpu_ab import shape_arg
from mgpu_decode import bytes_read, window_bytes, window_inputs
from records import kernel_record_key, save

KINDS = {"mgpu_kivi2": False, "mgpu_kivi2_window": True}  # impl -> with KIVI's window as the segment


def build_arg(text: str) -> tuple[str, pathlib.Path, dict]:
  """name=path[:key=value,...] -> (name, path, keyword arguments; true/false/integers parsed)."""
  name, _, rest = text.partition("=")
  path, _, options = rest.partition(":")
  if not name.isidentifier() or not path:
    raise argparse.ArgumentTypeError(f"{text!r} is not name=path[:key=value,...]")
  parse = lambda v: {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
  kwargs = dict((k, parse(v)) for k, _, v in (item.partition("=") for item in options.split(",") if item))
  return name, pathlib.Path(path), kwargs


def import_build(name: str, kernels: pathlib.Path, root: pathlib.Path):
  """The build's ``mgpu_decode_attention`` and ``mma_layout`` modules, imported from package
  ``jkv_kernels_<name>``."""
  package = root / f"jkv_kernels_{name}"
  shutil.copytree(kernels, package, ignore=shutil.ignore_patterns("__pycache__"))
  for module in package.glob("*.py"):
    module.write_text(module.read_text().replace("jkv_kernels.", f"jkv_kernels_{name}."))
  return tuple(importlib.import_module(f"jkv_kernels_{name}.{module}")
               for module in ("mgpu_decode_attention", "mma_layout"))


def run(builds, shapes, rounds: int, settings: Settings) -> list[dict]:
  records = []
  device = jax.devices()[0]
  with tempfile.TemporaryDirectory() as root:
    sys.path.insert(0, root)
    modules = {name: import_build(name, path, pathlib.Path(root)) for name, path, _ in builds}
    for batch, seq_len in shapes:
      shape = Shape(batch, seq_len)
      unpacked = [window_inputs(shape, 2, seed, packed=False) for seed in range(3 if batch <= 8 else 2)]
      sets = {name: [(q, jax.block_until_ready(modules[name][1].pack_mma_store(s)), w) for q, s, w in unpacked]
              for name, _, _ in builds}
      calls = {}
      for name, _, kwargs in builds:
        attend = modules[name][0].mgpu_decode_attention
        for impl, window in KINDS.items():
          calls[name, impl] = jax.jit(lambda q, s, w, attend=attend, window=window, kwargs=kwargs: attend(
              q, 0, s, segment=w if window else None, **kwargs))
      first = {impl: np.asarray(calls[builds[0][0], impl](*sets[builds[0][0]][0]), np.float32) for impl in KINDS}
      for (name, impl), fn in calls.items():
        diff = float(np.max(np.abs(np.asarray(fn(*sets[name][0]), np.float32) - first[impl])))
        print(f"check B={batch} L={seq_len} {impl} {name}: max |o - {builds[0][0]}'s| = {diff:.2e}")
        if diff > 2e-2:
          raise SystemExit(f"build {name} disagrees with {builds[0][0]} on {impl} at B={batch} L={seq_len}")
      nbytes = {"mgpu_kivi2": bytes_read(shape, 2), "mgpu_kivi2_window": bytes_read(shape, 2) + window_bytes(shape)}
      arguments = {name: kwargs for name, _, kwargs in builds}
      for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(calls)[::-1]
        for name, impl in order:
          median_us, compile_s = time_calls(calls[name, impl], sets[name], settings)
          records.append(record(impl, batch, seq_len, median_us, nbytes[impl], device, compile_s=compile_s,
                                config={"build": name, "arguments": arguments[name], "round": r}))
          print(f"{impl:>18} B={batch:<3} L={seq_len:<6} {name:>12} round {r} {median_us:8.1f} µs", flush=True)
  return records


def table(records: list[dict]) -> str:
  """Each build's median over rounds (and the range), per shape and impl, in the order builds were given."""
  found = {}
  for r in records:
    key = (r["batch"], r["seq_len"], r["impl"], r["config"]["build"], json.dumps(r["config"]["arguments"]))
    found.setdefault(key, []).append(r["median_us"])
  lines = ["| B | L | impl | build | arguments | median µs | range | rounds |", "|---|---|---|---|---|---|---|---|"]
  for (batch, seq_len, impl, build, arguments), times in found.items():
    lines.append(f"| {batch} | {seq_len} | {impl} | {build} | {arguments} | {statistics.median(times):.1f} | "
                 f"{min(times):.1f}-{max(times):.1f} | {len(times)} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--builds", type=build_arg, nargs="+", help="name=path[:key=value,...]; the first is the check")
  parser.add_argument("--shapes", type=shape_arg, nargs="+", default=[(8, 32768), (256, 4608)], metavar="BxL")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
  args = parser.parse_args()
  if args.table:
    print(table(json.loads(args.out.read_text())))
    return
  if not args.builds:
    parser.error("--builds is required unless --table")
  records = run(args.builds, args.shapes, args.rounds, Settings())
  save(args.out, records, kernel_record_key)
  print(table(records))


if __name__ == "__main__":
  main()
