"""Where a kernel's instructions go: the SASS opcode mix of one Nsight Compute profile, per code element.

Reads the source page that ``ncu --import REPORT --page source --print-source sass --csv`` prints (a profile
taken with ``--set full``, as profile_kernel.py's docstring shows) and sums, per opcode, the warp-level
instructions executed and the warp stall samples. With ``--codes N`` (the code elements the kernel reads:
B * Hkv * tokens * D for keys, as many for values) it also gives thread instructions per code.

    python benchmarks/ncu_opcodes.py sass.csv --codes 534773760 --top 20
    python benchmarks/ncu_opcodes.py sass.csv --hotspots 12    # also the instructions warps wait at most
"""

import argparse
import collections
import csv
import sys


def instructions(path):
  """(the column index of each header name, the rows of SASS instructions) of a SASS source-page CSV."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  header_at = next(i for i, row in enumerate(rows) if "Instructions Executed" in row)
  col = {name: i for i, name in enumerate(rows[header_at])}
  return col, [row for row in rows[header_at + 1:] if len(row) >= len(col) and row[col["Source"]].strip()]


def _count(row, col, name):
  return int(float(row[col[name]].replace(",", "") or 0))


def opcode_mix(path):
  """{opcode: (warp instructions executed, stall samples)} and the totals, from a SASS source-page CSV."""
  col, rows = instructions(path)
  executed, stalls = collections.Counter(), collections.Counter()
  for row in rows:
    words = row[col["Source"]].split()
    opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]  # drop a predicate, modifiers
    executed[opcode] += _count(row, col, "Instructions Executed")
    stalls[opcode] += _count(row, col, "Warp Stall Sampling (All Samples)")
  return executed, stalls


def hotspots(path, top):
  """The ``top`` SASS instructions by warp stall samples: (address, source, samples, executions, the two largest
  stall reasons with their samples)."""
  col, rows = instructions(path)
  reasons = [name for name in col if name.startswith("stall_") and "Not Issued" not in name]
  found = [(row[col["Address"]], row[col["Source"]].strip(), _count(row, col, "Warp Stall Sampling (All Samples)"),
            _count(row, col, "Instructions Executed"),
            sorted(((_count(row, col, r), r[len("stall_"):]) for r in reasons), reverse=True)[:2]) for row in rows]
  return sorted(found, key=lambda f: -f[2])[:top]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("csv")
  parser.add_argument("--codes", type=int, help="code elements the kernel reads (for instructions per code)")
  parser.add_argument("--top", type=int, default=20)
  parser.add_argument("--hotspots", type=int, default=0, help="also list this many instructions by stall samples")
  args = parser.parse_args()
  executed, stalls = opcode_mix(args.csv)
  total, total_stalls = sum(executed.values()), max(sum(stalls.values()), 1)
  per_code = f", {32 * total / args.codes:.2f} thread instructions per code" if args.codes else ""
  print(f"{total} warp instructions executed{per_code}")
  print("| opcode | share of instructions | per code | share of stall samples |")
  print("| --- | ---: | ---: | ---: |")
  for opcode, n in executed.most_common(args.top):
    code = f"{32 * n / args.codes:.2f}" if args.codes else "–"
    print(f"| {opcode} | {100 * n / total:.1f}% | {code} | {100 * stalls[opcode] / total_stalls:.1f}% |")
  if args.hotspots:
    print(f"\n{sum(stalls.values())} stall samples; the instructions with the most")
    print("| address | instruction | share of stall samples | executions (warps) | largest reasons |")
    print("| --- | --- | ---: | ---: | --- |")
    for address, source, samples, runs, why in hotspots(args.csv, args.hotspots):
      reasons = ", ".join(f"{r} {n}" for n, r in why if n)
      print(f"| {address[-5:]} | `{source}` | {100 * samples / total_stalls:.1f}% | {runs} | {reasons} |")


if __name__ == "__main__":
  sys.exit(main())
