"""A round of kernel work measured: two builds of the Mosaic GPU kernel timed alternately, a process at a time.

Earlier kernel work showed why two back-to-back runs of mgpu_decode.py are not enough: cuDNN moved by 5% between
them, and in one run a quarter-filled cache took longer than the full one. Here each repeat runs one process per
build, the two in turn (before first in even repeats, after first in odd ones), each timing KIVI-2 and KIVI-4 (the
kernel alone, and KIVI's whole attention call with its window) and cuDNN dense (``mgpu_decode.py --impls``; a
build is its ``jkv_kernels`` and the ``jkv`` beside it) at each shape of ``--shapes`` (B = 8, L = 32768 by
default; 256x4608 is a largest-batch decode step of Llama-3-8B in generate_decode.py). A build's time is the
median over repeats of each process's median, and every repeat's value is kept, so drift shows as spread instead
of as a change.

    git archive HEAD pallas_kernels jkv | tar -x -C /tmp/before  # the build before, copied out before the run
    python benchmarks/mgpu_ab.py --before /tmp/before/pallas_kernels --round 6 --change <name> [--repeats 3] \
        [--shapes 8x32768 256x4608]

writes ``results/mgpu_changes/<n>_{before,after}_<change>.json`` (``mgpu_decode.py --rounds`` tabulates them;
under $OUT too on the device machine). The after build is this tree's pallas_kernels. The first process of each
build also runs ``mgpu_decode.py``'s check against the reference.
"""

import argparse
import itertools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from records import kernel_record_key, save

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
IMPLS = ("mgpu_kivi2", "mgpu_kivi4", "cudnn_dense", "mgpu_kivi2_window", "mgpu_kivi4_window")


def import_root(kernels: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
  """A directory where ``jkv_kernels`` is ``kernels`` and ``jkv`` the ``jkv`` beside it (this tree's where there is
  none): put first on PYTHONPATH, it makes one process import that build."""
  root.mkdir(parents=True, exist_ok=True)
  beside = kernels.parent / "jkv"
  for name, target in (("jkv_kernels", kernels), ("jkv", beside if beside.is_dir() else REPO / "jkv")):
    (root / name).symlink_to(target.resolve(), target_is_directory=True)
  return root


def time_build(root: pathlib.Path, out: pathlib.Path, shape: tuple[int, int], check: bool, impls=IMPLS) -> list:
  """One process of mgpu_decode.py over the build under ``root`` at ``shape`` (B, L): its records of ``impls``
  (check first, if asked)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
  env.pop("OUT", None)  # the repeats' files stay here; the combined ones go to $OUT
  command = [sys.executable, str(HERE / "mgpu_decode.py"), "--batches", str(shape[0]), "--seq-lens", str(shape[1]),
             "--no-variants", "--impls", *impls, "--check" if check else "--no-check", "--out", str(out)]
  subprocess.run(command, env=env, check=True)
  return json.loads(out.read_text())


def shape_arg(text: str) -> tuple[int, int]:
  batch, _, seq_len = text.partition("x")
  try:
    return int(batch), int(seq_len)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not BxL (e.g. 8x32768)") from None


def combine(repeats: list) -> list:
  """Each timed record of the first repeat with ``median_us`` the median over the repeats (and GB/s from it),
  every repeat's median in ``repeat_us``; the check records as the first repeat gave them."""
  combined = []
  for record in repeats[0]:
    if record.get("median_us") is None:
      combined.append(record)
      continue
    values = [r["median_us"] for run in repeats for r in run if kernel_record_key(r) == kernel_record_key(record)]
    median = statistics.median(values)
    combined.append(dict(record, median_us=round(median, 2), repeat_us=[round(v, 2) for v in values],
                         gbps=round(record["bytes_read"] / (median * 1e-6) / 1e9, 1)))
  return combined


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--before", type=pathlib.Path, required=True, help="the pallas_kernels directory before")
  parser.add_argument("--after", type=pathlib.Path, default=REPO / "pallas_kernels", help="(default: this tree's)")
  parser.add_argument("--round", type=int, required=True)
  parser.add_argument("--change", required=True, help="the change's name (words joined by _)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--shapes", type=shape_arg, nargs="+", default=[(8, 32768)], metavar="BxL")
  parser.add_argument("--out-dir", type=pathlib.Path, default=HERE / "results" / "mgpu_changes")
  parser.add_argument("--impls", nargs="+", choices=IMPLS, default=IMPLS, help="time only these")
  args = parser.parse_args()
  for label, path in (("--before", args.before), ("--after", args.after)):
    if not (path / "mgpu_decode_attention.py").is_file():
      parser.error(f"{label} {path} is not a pallas_kernels directory (no mgpu_decode_attention.py)")
  builds = ("before", "after")
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    roots = {b: import_root(getattr(args, b), tmp / b) for b in builds}
    runs = {b: [] for b in builds}
    for repeat in range(args.repeats):
      for build in (builds if repeat % 2 == 0 else builds[::-1]):
        runs[build].append([record for i, shape in enumerate(args.shapes) for record in time_build(
            roots[build], tmp / f"{build}_{repeat}_{i}.json", shape, check=repeat == 0 and i == 0,
            impls=args.impls)])
  for build in builds:
    save(args.out_dir / f"{args.round}_{build}_{args.change}.json", combine(runs[build]), kernel_record_key)
  print(f"round {args.round}, {args.change}: µs per call in each repeat (before | after)")
  for (batch, seq_len), impl in itertools.product(args.shapes, args.impls):
    cell = lambda b: [r for r in combine(runs[b]) if (r["impl"], r["batch"], r["seq_len"]) == (impl, batch, seq_len)
                      and set(r["config"]) <= {"splits"}][0]
    before, after = cell("before"), cell("after")
    print(f"  {impl:>12} B={batch} L={seq_len} {before['repeat_us']} | {after['repeat_us']}  median "
          f"{before['median_us']:.1f} -> {after['median_us']:.1f} ({before['median_us'] / after['median_us']:.3f}x)")


if __name__ == "__main__":
  main()
