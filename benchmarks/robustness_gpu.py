"""Out-of-memory and bad-input handling on the GPU, as a user meets it: the ``jkv`` command line in subprocesses,
with the default model.

    PYTHONPATH=. JKV_CACHE=<model cache> python benchmarks/robustness_gpu.py      # on the GPU (about 8 minutes)
    python benchmarks/robustness_gpu.py --cpu-smoke                              # anywhere: a simulated device

Each case runs one ``jkv`` command, checks what a user sees (exit status, stdout, stderr: one ``jkv: error:``
line, last, after progress lines only, no traceback, no allocator report) and records it; the results go to
``--output`` (JSON, default ``benchmarks/results/robustness_gpu_<device>.json``) and a markdown table beside it
(and to $OUT, where the device machine brings files back). The exit status is 1 when a case failed.

The cases (``--cases`` picks some by name):

- ``oom`` / ``oom_verbose``: an H100's earlier out-of-memory command, 1024 prompts with ``--max-new-tokens 4000``
  (189 GiB of dense cache), refused before anything is allocated (``jkv.DeviceMemoryError``: "... does not fit"), in
  one line; with ``--verbose`` the same line comes last, after the whole error.
- ``oom_ppl`` / ``oom_compare``: the same refusal from ``jkv eval ppl`` and ``jkv compare`` (windows of a long text
  decoded together).
- ``thanks_json`` / ``thanks_stream``: the issue's prompt (the one tests/test_robustness.py uses) with
  ``--max-new-tokens 24``: no U+FFFD in the JSON text or the streamed text.
- ``thanks_cut_json`` / ``thanks_cut_stream``: the same at a length this device's answer ends inside a character
  (found from its 48-token answer), so that the holding back is exercised whatever the GPU generates.
- ``advice_batch`` / ``advice_context``: the largest batch (and context) the refusal names do run (with
  ``--capacity``, the refused cache's size, and 4 new tokens).
- ``over_cache`` / ``under_cache`` (+ ``_verbose``): a batch one past what the device's free memory holds of the
  cache is refused up front; the largest whose cache alone fits (past the reserve for XLA's work) runs, or fails
  later as XLA's out-of-memory error in one line (the allocator report only with ``--verbose``).
- ``device_gib`` / ``device_gib_past``: ``jkv info --device-gib`` beyond the device counts a larger batch than the
  device's own; past its limit, one line.
- ``mesh_too_large``: ``--mesh`` over more devices than there are, one line.
- ``interrupt``: Ctrl-C (SIGINT) during a long generation on the device: exit 130, one line, no crash.

``--cpu-smoke`` (automatic where jax sees no GPU) runs every case on the CPU against a simulated device of a few
GiB (``jkv.memory.device_memory`` reports it, as the tests fake it, and the reserve shrinks with it), so the
whole script is checked end to end in a few minutes; its numbers say nothing about a GPU.

Only the standard library is imported here: the GPU belongs to the ``jkv`` processes (a CPU helper process reads
the tokenizer and the cache's byte counts).
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 2**30
THANKS = 'Say "thank you" in Japanese, Chinese and Korean.'  # tests/test_robustness.py's THANKS (a test holds them equal)
REPLACEMENT = "\ufffd"
PROGRESS = ("loading model ", "generating with ", "wrote ")
PROGRESS_LINE = re.compile(r"\d+%\|.*\||^\[\d+/\d+\] ")  # a tqdm bar; jkv compare's "[1/2] dense"
OOM_PROMPTS = 1024
OOM_NEW_TOKENS = 4000
# --cpu-smoke: a device of SMOKE_FREE free bytes beside SMOKE_IN_USE (the weights, on a GPU), with a reserve for XLA's
# work of SMOKE_RESERVE instead of jkv.memory's 6 GiB: about 10 sequences of 4 k tokens fit, 11 caches alone.
SMOKE_IN_USE, SMOKE_FREE, SMOKE_RESERVE = GIB // 2, 2 * GIB, GIB // 4
# Runs the CLI as the ``jkv`` program does, with the simulated device (--cpu-smoke only).
SHIM = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if "--verbose" in sys.argv[1:] else "3")
from jkv import cli, memory
limit, in_use, reserve = map(int, os.environ["JKV_SIMULATED_DEVICE"].split(","))
memory.device_memory = lambda device=None: dict(limit=limit, in_use=in_use, peak=in_use)
memory.RESERVE_BYTES = reserve
sys.exit(cli.main())
"""
# The refusal's numbers (jkv.memory.CacheRequest.error).
ASKED = re.compile(r"the cache of (\d+) sequences? of (\d+) tokens with (\S+) \(([\d.]+) GiB\)")
FREE = re.compile(r"has ([\d.]+) GiB free of ([\d.]+) GiB")
FITS = re.compile(r"at most (\d+) sequences of (\d+) tokens fit, or (\d+) of (\d+) tokens")


def parse_refusal(line: str) -> dict:
  """The numbers of an out-of-memory line: batch, capacity, method, need_gib, free_gib, limit_gib, and where some
  fit, largest_batch and largest_capacity (0 when the line says not one sequence fits); {} if it is no such line."""
  asked, free = ASKED.search(line), FREE.search(line)
  if not (asked and free):
    return {}
  out = dict(batch=int(asked[1]), capacity=int(asked[2]), method=asked[3], need_gib=float(asked[4]),
             free_gib=float(free[1]), limit_gib=float(free[2]), largest_batch=0, largest_capacity=0)
  fits = FITS.search(line)
  if fits:
    out.update(largest_batch=int(fits[1]), largest_capacity=int(fits[4]))
  return out


def stderr_summary(err: str) -> dict:
  lines = [l for l in err.splitlines() if l.strip()]
  errors = [l for l in lines if l.startswith("jkv: error:")]
  return dict(stderr_lines=len(lines), first_stderr_line=lines[0] if lines else "",
              last_stderr_line=lines[-1] if lines else "", error_lines=len(errors))


def one_line_failure(rc: int, out: str, err: str, rc_want: int, starts: str = "jkv: error: ") -> list:
  """What is wrong with a failure as a user sees it ([] if nothing): exit ``rc_want``, nothing on stdout, one error
  line, last, starting ``starts``, every other line a progress line, no traceback, no allocator report."""
  lines = [l for l in err.splitlines() if l.strip()]
  problems = []
  if rc != rc_want:
    problems.append(f"exit {rc}, not {rc_want}")
  if out.strip():
    problems.append(f"stdout not empty: {out.strip()[:80]!r}")
  if not lines or not lines[-1].startswith(starts):
    problems.append(f"last stderr line does not start {starts!r}")
  if sum(l.startswith("jkv: ") for l in lines) != 1:
    problems.append(f"{sum(l.startswith('jkv: ') for l in lines)} jkv lines")
  other = [l for l in lines[:-1] if not (l.startswith(PROGRESS) or PROGRESS_LINE.search(l))]
  if other:
    problems.append(f"{len(other)} stderr lines besides progress and the error")
  if "Traceback" in err or "BufferAssignment" in err:
    problems.append("traceback or allocator report without --verbose")
  return problems


# ------------------------------------------------------------------------------------------------- running jkv


class Runner:
  """Runs ``jkv ARGV`` in a subprocess (as ``python -m jkv.cli``, or through SHIM with a simulated device) and keeps
  a record of each case."""

  def __init__(self, python: str, env: dict, simulated: str, timeout: float):
    self.python, self.simulated, self.timeout = python, simulated, timeout
    self.env = dict(env)
    if simulated:
      self.env["JKV_SIMULATED_DEVICE"] = simulated
    self.cases = []

  def command(self, argv) -> list:
    return [self.python, "-c", SHIM, *argv] if self.simulated else [self.python, "-m", "jkv.cli", *argv]

  def run(self, argv, interrupt_after=None):
    """(rc, stdout, stderr, seconds); with ``interrupt_after``, SIGINT that many seconds after the command's
    'generating with' progress line."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(self.command(argv), cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                            errors="surrogateescape")
    err_lines, started = [], threading.Event()

    def read_stderr():
      for line in proc.stderr:
        err_lines.append(line)
        if line.startswith("generating with"):
          started.set()
    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    out_box = []
    writer = threading.Thread(target=lambda: out_box.append(proc.stdout.read()), daemon=True)
    writer.start()
    try:
      if interrupt_after is not None:
        while proc.poll() is None and not started.wait(0.1) and time.perf_counter() - t0 < self.timeout:
          pass
        if started.is_set():
          time.sleep(interrupt_after)
          if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
      proc.wait(max(1.0, self.timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      err_lines.append(f"[robustness_gpu: killed after {self.timeout:.0f} s]\n")
    reader.join(10)
    writer.join(10)
    return proc.returncode, "".join(out_box), "".join(err_lines), time.perf_counter() - t0

  def case(self, name, argv, check, *, shown=None, interrupt_after=None, note=""):
    """Run ``argv``, judge it with ``check(rc, out, err) -> (problems, details)``, record and print the case."""
    rc, out, err, seconds = self.run(argv, interrupt_after)
    try:
      problems, details = check(rc, out, err)
    except Exception as e:  # a check that cannot read the output is a failed case, not a failed script
      problems, details = [f"check failed: {type(e).__name__}: {e}"], {}
    record = dict(case=name, command=command_line(shown or argv), rc=rc, seconds=round(seconds, 1),
                  **stderr_summary(err), passed=not problems, problems=problems, note=note, **details)
    if problems:
      record["stderr_tail"] = err[-3000:]
      record["stdout_head"] = out[:1000]
    self.cases.append(record)
    status = "pass" if not problems else "FAIL: " + "; ".join(problems)
    print(f"[{name}] rc={rc} {seconds:.1f}s {status}\n    {record['last_stderr_line'][:300]}", flush=True)
    return record, out, err

  def skip(self, name, why):
    self.cases.append(dict(case=name, command="", rc=None, seconds=0, stderr_lines=0, first_stderr_line="",
                           last_stderr_line="", error_lines=0, passed=None, problems=[], note=f"skipped: {why}"))
    print(f"[{name}] skipped: {why}", flush=True)


def command_line(argv) -> str:
  """The command as a shell would take it; ``<...>`` stands for arguments left out (1024 prompts)."""
  return " ".join(["jkv"] + [a if a.startswith("<") and a.endswith(">") else shlex.quote(a) for a in argv])


def refused_up_front(rc, out, err):
  problems = one_line_failure(rc, out, err, 1, "jkv: error: out of device memory: ")
  last = stderr_summary(err)["last_stderr_line"]
  if "does not fit" not in last:
    problems.append("not refused before allocation ('does not fit')")
  return problems, dict(refusal=parse_refusal(last))


def verbose_failure(line):
  """A check: the same out-of-memory failure with --verbose: exit 1, ``line``'s refusal last (its free memory may
  differ by what the process holds), the whole error before it."""
  def check(rc, out, err):
    last = stderr_summary(err)["last_stderr_line"]
    problems = [] if rc == 1 else [f"exit {rc}, not 1"]
    if not last.startswith("jkv: error: out of device memory: "):
      problems.append("last stderr line is not the out-of-memory line")
    if FREE.sub("", last) != FREE.sub("", line):
      problems.append("last line differs from the line without --verbose")
    if "Traceback" not in err:
      problems.append("no whole error (traceback) before the line")
    return problems, {}
  return check


def succeeded(rc, out, err):
  problems = [] if rc == 0 else [f"exit {rc}, not 0"]
  if "Traceback" in err:
    problems.append("traceback")
  return problems, {}


def whole_characters(mode):
  def check(rc, out, err):
    problems, details = succeeded(rc, out, err)
    if mode == "json":
      res = json.loads(out)
      text = res["text"]
      details = dict(text=text, new_tokens=len(res["tokens"]), held_back_tokens=res["held_back_tokens"],
                     tokens=res["tokens"])
    else:
      text = out.rstrip("\n")
      details = dict(text=text)
    if REPLACEMENT in text:
      problems.append("U+FFFD in the text")
    return problems, details
  return check


# ------------------------------------------------------------------------------------------------- helpers


def probe(python: str, env: dict) -> dict:
  """The device as jax sees it, from a process of its own (it lets the GPU go when it exits)."""
  code = ("import json, jax; d = jax.devices()[0]; s = d.memory_stats() or {}; "
          "print(json.dumps(dict(platform=d.platform, device=d.device_kind, devices=len(jax.devices()), "
          "jax_version=jax.__version__, bytes_limit=s.get('bytes_limit'))))")
  proc = subprocess.run([python, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  if proc.returncode:
    raise SystemExit(f"robustness_gpu: jax did not start: {proc.stderr.strip().splitlines()[-1:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_helper(python: str, env: dict, request: dict) -> dict:
  """The default model's dense cache bytes at a capacity and where a token list ends inside a character, from a
  CPU process (``--helper``)."""
  proc = subprocess.run([python, str(pathlib.Path(__file__).resolve()), "--helper", json.dumps(request)], cwd=REPO,
                        env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
  if proc.returncode:
    raise RuntimeError(f"helper failed: {proc.stderr[-2000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def helper_main(request: dict) -> None:
  from jkv import memory
  from jkv.load import load_model
  from jkv.methods import make_method
  model = load_model("default", "float32")
  out = {}
  if "capacity" in request:
    one, two = (memory.cache_bytes(make_method("dense"), model.config, b, request["capacity"]) for b in (1, 2))
    out.update(per_sequence=two - one, base=2 * one - two)
  if "tokens" in request:
    tokens, tok = request["tokens"], model.tokenizer
    out["cuts"] = [n for n in range(1, len(tokens) + 1)
                   if tok.decode(tokens[:n], skip_special_tokens=True).endswith(REPLACEMENT)]
  print(json.dumps(out))


def batch_bounds(refusal: dict, per_sequence: int, base: int) -> tuple:
  """(under, over): the largest batch whose cache alone surely fits the free memory the refusal names (rounded to
  0.01 GiB), and the smallest that surely does not."""
  lo, hi = (refusal["free_gib"] - 0.005) * GIB, (refusal["free_gib"] + 0.005) * GIB
  return int((lo - base) // per_sequence), int(math.floor((hi - base) / per_sequence)) + 1


def text_file(tokens: int) -> str:
  """A file of at least ``tokens`` tokens of the default model: the stdlib's pydoc_data.topics (113,108 tokens, the
  default perplexity text) repeated."""
  import tempfile
  import pydoc_data.topics
  topics = "\n\n".join(pydoc_data.topics.topics.values())
  path = os.path.join(tempfile.mkdtemp(prefix="robustness_gpu_"), "text.txt")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n\n".join([topics] * (tokens // 100_000 + 1)))
  return path


def oom_prompts(n: int) -> list:
  return [f"Write a short story about the number {i}." for i in range(n)]


# ------------------------------------------------------------------------------------------------- the cases


def run_cases(r: Runner, env: dict, info: dict, smoke: bool, wanted) -> None:
  want = lambda name: wanted is None or name in wanted
  prompts = oom_prompts(OOM_PROMPTS)
  oom_argv = ["generate", *prompts, "--max-new-tokens", str(OOM_NEW_TOKENS)]
  oom_shown = ["generate", f"<{OOM_PROMPTS} prompts: 'Write a short story about the number i.'>", "--max-new-tokens", str(OOM_NEW_TOKENS)]

  refusal, line = {}, ""
  if want("oom") or any(want(n) for n in ("oom_verbose", "advice_batch", "advice_context", "over_cache",
                                           "under_cache")):
    rec, _, _ = r.case("oom", oom_argv, refused_up_front, shown=oom_shown)
    refusal, line = rec.get("refusal", {}), rec["last_stderr_line"]
  if want("oom_verbose") and line:
    r.case("oom_verbose", oom_argv + ["--verbose"], verbose_failure(line), shown=oom_shown + ["--verbose"])

  # eval ppl and compare: windows whose caches together exceed the device (pass-key retrieval cannot: it batches
  # what fits, and one sequence of the model's whole context fits any GPU).
  if want("oom_ppl") or want("oom_compare"):
    windows, context, scored = (8, 4096, 3000) if smoke else (256, 4096, 4000)
    text = text_file(windows * (context + scored))
    plan = ["--text-file", text, "--windows", str(windows), "--batch-size", str(windows), "--context", str(context),
            "--scored", str(scored)]
    shown = [a if a != text else "<pydoc_data.topics repeated>" for a in plan]
    if want("oom_ppl"):
      r.case("oom_ppl", ["eval", "ppl", *plan], refused_up_front, shown=["eval", "ppl", *shown])
    if want("oom_compare"):
      more = ["--methods", "dense", "kivi", "--no-passkey", "--output", ""]
      r.case("oom_compare", ["compare", *more, *plan], refused_up_front, shown=["compare", *more, *shown])

  # Whole characters: the command, then a length at which this device's answer is cut inside a character.
  json_text = None
  if want("thanks_json"):
    rec, _, _ = r.case("thanks_json", ["generate", THANKS, "--max-new-tokens", "24", "--json"], whole_characters("json"))
    json_text = rec.get("text")
  if want("thanks_stream"):
    rec, _, _ = r.case("thanks_stream", ["generate", THANKS, "--max-new-tokens", "24", "--stream"],
                       whole_characters("stream"))
    if json_text is not None:
      rec["same_as_json"] = rec.get("text") == json_text
  if want("thanks_cut_json") or want("thanks_cut_stream"):
    rec, _, _ = r.case("thanks_48", ["generate", THANKS, "--max-new-tokens", "48", "--json"], whole_characters("json"))
    cuts = cpu_helper(r.python, env, dict(tokens=rec["tokens"]))["cuts"] if rec.get("tokens") else []
    rec["cuts"] = cuts
    if not cuts:
      r.skip("thanks_cut_json", "this device's 48-token answer splits no character")
    else:
      n = str(cuts[-1])
      cut, _, _ = r.case("thanks_cut_json", ["generate", THANKS, "--max-new-tokens", n, "--json"],
                         whole_characters("json"), note=f"{n} tokens end inside a character")
      if cut.get("held_back_tokens") == 0:
        cut["problems"].append("no tokens held back where the answer ends inside a character")
        cut["passed"] = False
      stream, _, _ = r.case("thanks_cut_stream", ["generate", THANKS, "--max-new-tokens", n, "--stream"],
                            whole_characters("stream"))
      stream["same_as_json"] = stream.get("text") == cut.get("text")

  # The refusal's advice, and batches on either side of the free memory it names.
  if refusal and refusal.get("largest_batch"):
    capacity = refusal["capacity"]
    if want("advice_batch"):
      b = refusal["largest_batch"]
      r.case("advice_batch", ["generate", *prompts[:b], "--capacity", str(capacity), "--max-new-tokens", "4"],
             succeeded, shown=["generate", f"<{b} prompts>", "--capacity", str(capacity), "--max-new-tokens", "4"],
             note=f"the largest batch the refusal names: {b} sequences of {capacity} tokens")
    c = refusal["largest_capacity"]
    if want("advice_context") and c < 64:
      r.skip("advice_context", f"the refusal's context for {OOM_PROMPTS} sequences, {c} tokens, holds no prompt")
    elif want("advice_context"):
      r.case("advice_context", ["generate", *prompts, "--capacity", str(c), "--max-new-tokens", "4"], succeeded,
             shown=["generate", f"<{OOM_PROMPTS} prompts>", "--capacity", str(c), "--max-new-tokens", "4"],
             note=f"the longest context the refusal names for {OOM_PROMPTS} sequences: {c} tokens")
    if want("over_cache") or want("under_cache"):
      sizes = cpu_helper(r.python, env, dict(capacity=capacity))
      under, over = batch_bounds(refusal, sizes["per_sequence"], sizes["base"])
      argv = lambda b, *more: ["generate", *oom_prompts(b), "--capacity", str(capacity), "--max-new-tokens", "4", *more]
      shown = lambda b, *more: ["generate", f"<{b} prompts>", "--capacity", str(capacity), "--max-new-tokens", "4",
                                *more]
      if want("over_cache"):
        r.case("over_cache", argv(over), refused_up_front, shown=shown(over),
               note=f"{over} sequences: the smallest batch whose cache alone exceeds {refusal['free_gib']} GiB free")

      def ran_or_one_line(rc, out, err):
        if rc == 0:
          return succeeded(rc, out, err)[0], dict(outcome="ran")
        return (one_line_failure(rc, out, err, 1, "jkv: error: out of device memory: "),
                dict(outcome="out of memory after allocation"))
      if want("under_cache"):
        rec, _, _ = r.case("under_cache", argv(under), ran_or_one_line, shown=shown(under),
                           note=f"{under} sequences: the largest whose cache alone fits {refusal['free_gib']} GiB "
                                "free, past jkv's reserve: runs, or fails later in one line")
        if rec["rc"] == 1:
          r.case("under_cache_verbose", argv(under, "--verbose"), verbose_failure(rec["last_stderr_line"]),
                 shown=shown(under, "--verbose"))
  elif refusal:
    r.skip("advice_batch", "the refusal says not one sequence fits")

  # jkv info: a device larger than this one, and past the flag's limit.
  if want("device_gib"):
    def larger(rc, out, err):
      problems, _ = succeeded(rc, out, err)
      rc0, out0, err0, _ = r.run(["info", "--json", "--tokens", "4096"])
      own, big = json.loads(out0)["largest_batch"] if rc0 == 0 else None, json.loads(out)["largest_batch"]
      if own is None or not big > own:
        problems.append(f"largest batch of a PiB device {big} is not above the device's own {own}")
      return problems, dict(largest_batch=big, device_largest_batch=own)
    r.case("device_gib", ["info", "--json", "--tokens", "4096", "--device-gib", "1048576"], larger)
  if want("device_gib_past"):
    r.case("device_gib_past", ["info", "--device-gib", "1048577"],
           lambda rc, out, err: (one_line_failure(rc, out, err, 2, "jkv: error: argument --device-gib"), {}))
  if want("mesh_too_large"):
    n = info["devices"] + 1
    r.case("mesh_too_large", ["generate", "Hi", "--mesh", f"data={n}"],
           lambda rc, out, err: (one_line_failure(rc, out, err, 2, "jkv: error: mesh data="), {}))

  # Ctrl-C during a long generation on the device.
  if want("interrupt"):
    batch, new = (1, 2000) if smoke else (8, 8000 - 64)
    def interrupted(rc, out, err):
      problems = one_line_failure(rc, out, err, 130, "jkv: interrupted")
      return [p for p in problems if not p.startswith("stdout")], {}  # text already printed may stay
    r.case("interrupt", ["generate", *oom_prompts(batch), "--max-new-tokens", str(new)], interrupted,
           shown=["generate", f"<{batch} prompts>", "--max-new-tokens", str(new)], interrupt_after=5.0,
           note="SIGINT 5 s after 'generating with'")


# ------------------------------------------------------------------------------------------------- output


def slug(kind: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")


def markdown(results: dict) -> str:
  head = (f"Robustness on {results['device']} ({results['mode']}), jax {results['jax_version']}, "
          f"{results['date']}: {results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped.\n\n")
  rows = ["| case | command | exit | stderr lines | first stderr line | last stderr line | result |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
  cell = lambda s, n=120: (s if len(s) <= n else s[:n - 3] + "...").replace("|", "\\|")
  for c in results["cases"]:
    result = "skipped" if c["passed"] is None else "pass" if c["passed"] else "FAIL: " + "; ".join(c["problems"])
    rows.append(f"| {c['case']} | `{cell(c['command'], 90)}` | {c['rc']} | {c['stderr_lines']} | "
                f"{cell(c['first_stderr_line'])} | {cell(c['last_stderr_line'], 200)} | {cell(result)} |")
  return head + "\n".join(rows) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--output", type=pathlib.Path, default=None,
                      help="results JSON; a .md table is written beside it (default: "
                           "benchmarks/results/robustness_gpu_<device>.json)")
  parser.add_argument("--cpu-smoke", action="store_true",
                      help="run on the CPU against a simulated device (automatic where jax sees no GPU)")
  parser.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                      help="run only these cases; the other cases of an earlier run on this device stay in --output")
  parser.add_argument("--timeout", type=float, default=300, help="seconds one command may run (default: 300)")
  parser.add_argument("--python", default=sys.executable, help="interpreter that runs jkv (default: this one)")
  parser.add_argument("--helper", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.helper is not None:
    helper_main(json.loads(args.helper))
    return 0

  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  if args.cpu_smoke:
    env["JAX_PLATFORMS"] = "cpu"
  info = probe(args.python, env)
  smoke = args.cpu_smoke or info["platform"] == "cpu"
  if smoke:
    env["JAX_PLATFORMS"] = "cpu"
  simulated = f"{SMOKE_IN_USE + SMOKE_FREE},{SMOKE_IN_USE},{SMOKE_RESERVE}" if smoke else ""
  r = Runner(args.python, env, simulated, args.timeout)
  t0 = time.perf_counter()
  run_cases(r, env, info, smoke, set(args.cases) if args.cases else None)
  device = info["device"] + (" (simulated: CPU smoke)" if smoke else "")
  out = args.output or RESULTS / f"robustness_gpu_{slug(device if not smoke else 'cpu_smoke')}.json"
  cases = r.cases
  if args.cases and out.exists():  # a run of some cases keeps the other cases of an earlier run on this device
    earlier = json.loads(out.read_text(encoding="utf-8"))
    if earlier.get("device") == device:
      ran = {c["case"] for c in r.cases}
      cases = [c for c in earlier["cases"] if c["case"] not in ran] + r.cases
  done = [c for c in cases if c["passed"] is not None]
  results = dict(device=device, platform=info["platform"], devices=info["devices"], bytes_limit=info["bytes_limit"],
                 mode="cpu-smoke" if smoke else "gpu", jax_version=info["jax_version"],
                 python=platform.python_version(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                 seconds=round(time.perf_counter() - t0, 1),
                 simulated_device=dict(limit=SMOKE_IN_USE + SMOKE_FREE, in_use=SMOKE_IN_USE,
                                       reserve=SMOKE_RESERVE) if smoke else None,
                 env={k: v for k, v in env.items() if k.startswith(("XLA_", "JAX_", "TF_CPP"))},
                 passed=sum(c["passed"] for c in done), failed=sum(not c["passed"] for c in done),
                 skipped=len(cases) - len(done), cases=cases)
  table = markdown(results)
  targets = [out] + ([pathlib.Path(os.environ["OUT"], out.name)] if os.environ.get("OUT") else [])
  for path in targets:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    path.with_suffix(".md").write_text(table, encoding="utf-8")
  print(table)
  print(f"wrote {out} and {out.with_suffix('.md')}")
  return 1 if results["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
