"""The whole test suite on a GPU machine, recorded: one run's counts, failures and log, kept beside earlier runs.

Clean whole-suite runs on the GPU, with their summaries committed, show that what CPU CI checks holds on the device
kernels too. This runs pytest over
``tests`` (or what ``--pytest-args`` names) with pytest-xdist workers and on-demand GPU memory
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``: preallocating workers run out of device memory), writes the log to
``results/pytest_<device>_<date>.txt`` and appends a record (date, commit, device, jax version, workers, passed,
failed, errors, skipped, seconds, the failed tests' ids) to ``results/gpu_suite_<device>.json`` (both under $OUT
too on the device machine), then prints the records as a table. The exit status is pytest's.

    python benchmarks/gpu_suite.py --commit "$(git rev-parse --short HEAD)"    # on the GPU machine
    python benchmarks/gpu_suite.py --table                                     # the committed runs

The device machine's copy of the tree has no git history, so the commit is given on the command line. On a machine
with several GPUs, ``--gpus 0,1`` gives each worker one of them (``pin_worker_gpu.py``), as on single-GPU machines.
"""

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import time

from records import save

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
RECORD_KEY = lambda r: r["date"]
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def device_info(env) -> dict:
  """The first device's kind and the jax version, asked of a fresh process in the suite's environment."""
  code = "import jax, json; d = jax.devices()[0]; print(json.dumps([d.device_kind, d.platform, jax.__version__]))"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
  kind, platform, version = json.loads(out.strip().splitlines()[-1])
  return dict(device=kind, platform=platform, jax_version=version)


def summarize(log: str) -> dict:
  """Counts from pytest's last summary line, and the ids of failed and erroring tests."""
  lines = [line for line in log.splitlines() if COUNT.search(line) and " in " in line]
  counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
  for n, what in COUNT.findall(lines[-1] if lines else ""):
    key = "errors" if what.startswith("error") else what
    if key in counts:
      counts[key] = int(n)
  failures = sorted({m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", log, re.M)})
  return dict(counts, failed_tests=failures, summary=lines[-1].strip("= ") if lines else None)


def table(records: list) -> str:
  rows = ["| date (UTC) | commit | device | jax | workers | passed | failed | errors | skipped | minutes |",
          "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in records:
    rows.append(f"| {r['date'][:16].replace('T', ' ')} | {r['commit']} | {r['device']} | {r['jax_version']} | "
                f"{r['workers']} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | "
                f"{r['seconds'] / 60:.1f} |")
  return "\n".join(rows)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--commit", default="unknown", help="the commit the tree is at (the device copy has no git)")
  parser.add_argument("--workers", type=int, default=6, help="pytest-xdist workers (0: none)")
  parser.add_argument("--pytest-args", nargs="+", default=["tests"], help="what pytest runs (default: tests)")
  parser.add_argument("--gpus", help="spread the workers over these GPUs, one each (e.g. 0,1); default: all see all")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds the suite may take")
  parser.add_argument("--out", type=pathlib.Path,
                      help="records JSON, the log beside it (default: results/gpu_suite_<device>.json)")
  parser.add_argument("--table", action="store_true", help="print the records of --out (or every device's) and exit")
  args = parser.parse_args()
  if args.table:
    for path in [args.out] if args.out else sorted((HERE / "results").glob("gpu_suite_*.json")):
      print(f"{path.name}\n\n{table(json.loads(path.read_text()))}\n")
    return 0
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if args.gpus:
    env.update(JKV_SUITE_GPUS=args.gpus, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])))
  info = device_info(env)
  slug = re.sub(r"[^a-z0-9]+", "_", info["device"].lower()).strip("_")
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *args.pytest_args]
  command += ["-n", str(args.workers)]  # always: pyproject's addopts run two workers unless told otherwise
  if args.workers and args.gpus:
    command += ["-p", "pin_worker_gpu"]
  start = time.perf_counter()
  try:
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    log, status = proc.stdout + proc.stderr, proc.returncode
  except subprocess.TimeoutExpired as e:
    log = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
    log, status = log + f"\ngpu_suite: the suite passed its {args.timeout:.0f} s limit\n", 124
  seconds = time.perf_counter() - start
  out = args.out or HERE / "results" / f"gpu_suite_{slug}.json"
  log_path = out.parent / f"pytest_{slug}_{date[:16].replace(':', '').replace('-', '')}.txt"
  record = dict(date=date, commit=args.commit, **info, workers=args.workers, gpus=args.gpus,
                pytest_args=args.pytest_args,
                exit_status=status, seconds=round(seconds, 1), log=log_path.name, **summarize(log))
  for path in [log_path] + ([pathlib.Path(os.environ["OUT"], log_path.name)] if os.environ.get("OUT") else []):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(log)
  records = save(out, [record], RECORD_KEY)
  print(record["summary"] or log[-2000:])
  print(table(records))
  return status


if __name__ == "__main__":
  sys.exit(main())
