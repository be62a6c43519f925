"""The GPU benchmark scripts run end to end with their ``--smoke`` settings (a tiny model on the CPU), each in a
fresh process (two at a time), writing their JSON outside the tree: the commands the README's numbers come from keep
working between GPU sessions."""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SMOKE_KV_HEADS = 2  # benchmarks/generate_decode.py's SMOKE model


def _run(args, out, devices=1):
  # Without LLVM's optimizations: a smoke run is mostly compiling a tiny model's programs to run them a few times,
  # so optimizing their machine code is only compile time (the eight runs took 96 s one after another, 63 s so).
  # What the tests read (the records' fields, the tables) does not depend on how fast the code runs.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
  proc = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=BENCHMARKS, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  return json.loads(out.read_text()), proc.stdout


# The smoke runs the tests below read: (the script's arguments, the CPU devices it sees). Longest first.
RUNS = {
    # The three layouts test_generate_decode checks (KIVI-4's rows run the same code at other bits).
    "generate_decode": (["generate_decode.py", "--smoke", "--methods", "dense", "kivi2", "kivi2_mma"], 1),
    "profile": (["profile_decode_step.py", "--smoke", "--method", "specache1"], 1),
    "long context": (["long_context.py", "--part", "prefill", "--smoke", "--methods", "kivi2_mma", "--prefill-chunk",
                      "512"], 1),
    "long context decode": (["long_context.py", "--part", "decode", "--smoke", "--methods", "dense"], 1),
    "long context decode seq=2": (["long_context.py", "--part", "decode", "--smoke", "--methods", "dense", "--mesh",
                                   "seq=2"], 2),
    "staged prefill": (["staged_prefill.py", "--smoke", "--stages", "3"], 1),
    "run and table": (["sharded_decode.py", "--smoke", "--mesh", "data=2", "--new-tokens", "8"], 2),
    "mesh model=2": (["sharded_decode.py", "--smoke", "--profile", "--mesh", "model=2", "--batch", "4", "--steps", "2"],
                     2),
    "mesh data=2": (["sharded_decode.py", "--smoke", "--profile", "--mesh", "data=2", "--batch", "4", "--steps", "2"],
                    2),
    "one shard": (["sharded_decode.py", "--smoke", "--profile", "--one-shard-of", "data=2,model=2", "--batch", "4",
                   "--steps", "2"], 1),
}


def _runs_of(item):
  if item.originalname == "test_sharded_decode_profile_on_a_mesh":
    return [f"mesh {item.callspec.params['mesh']}"]
  return {"test_generate_decode": ["generate_decode"], "test_profile_decode_step": ["profile"],
          "test_long_context": ["long context"], "test_long_context_decode": ["long context decode"],
          "test_long_context_decode_over_seq": ["long context decode", "long context decode seq=2"],
          "test_staged_prefill": ["staged prefill"],
          "test_sharded_decode_run_and_table": ["run and table"],
          "test_sharded_decode_profile_of_one_shard": ["one shard"]}.get(item.originalname, [])


@pytest.fixture(scope="module")
def smoke(request, tmp_path_factory):
  """{run: a future of (record, stdout)} for the smoke runs this session's tests of this module read, run two at a
  time: each process, mostly compiling, leaves much of CI's second core idle (one after another they took 57 s,
  two at a time 42 s). A run that failed raises its error where a test reads it."""
  names = dict.fromkeys(n for item in request.session.items if item.path == request.path for n in _runs_of(item))
  out = tmp_path_factory.mktemp("smoke")
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    return {name: pool.submit(_run, RUNS[name][0], out / f"{i}.json", RUNS[name][1]) for i, name in enumerate(names)}


def test_profile_decode_step(smoke):
  record, _ = smoke["profile"].result()
  assert record["method"] == "specache1" and record["wall_ms_per_step"] > 0
  assert record["cache_memory_kinds"]["pinned_host"] == ["host_kv"]


@pytest.mark.parametrize("mesh, devices", [("model=2", 2), ("data=2", 2)])
def test_sharded_decode_profile_on_a_mesh(smoke, mesh, devices):
  record, _ = smoke[f"mesh {mesh}"].result()
  assert record["mesh"] == mesh and record["devices"] == devices and record["wall_ms_per_step"] > 0


def test_sharded_decode_profile_of_one_shard(smoke):
  record, out = smoke["one shard"].result()
  assert record["batch"] == 2 and record["kv_heads"] == SMOKE_KV_HEADS // 2
  assert "one device's share of data=2,model=2" in out


def test_sharded_decode_run_and_table(smoke):
  records, out = smoke["run and table"].result()
  assert [r["mesh"] for r in records] == ["data=2"] and records[0]["decode_tokens_per_s"] > 0
  assert "| data=2 | 2 |" in out


def test_generate_decode(smoke):
  records, _ = smoke["generate_decode"].result()
  assert {r["impl"] for r in records} == {"jkv_dense", "jkv_kivi2", "jkv_kivi2_mma"}
  assert all(r["decode_ms_per_step"] > 0 for r in records)


def test_ncu_opcodes_sums_a_sass_source_page(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  from ncu_opcodes import hotspots, opcode_mix
  header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_wait", "stall_wait (Not Issued)"]
  rows = [("0x0", "LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT", "5", "100", "1", "4", "9"),
          ("0x10", "@P0 LOP3.LUT R3, R3, 0x4b000000, RZ, 0xfc, !PT", "1", "60", "1", "0", "0"),
          ("0x20", "HADD2.F32 R4, -RZ, R5.H0_H0", "2", "1,040", "2", "0", "0"), ("0x30", "EXIT", "0", "", "", "", "")]
  path = tmp_path / "sass.csv"
  path.write_text("\n".join(",".join(f'"{x}"' for x in row) for row in [("Kernel Name", "k"), header, *rows]))
  executed, stalls = opcode_mix(path)
  assert executed == {"LOP3": 160, "HADD2": 1040, "EXIT": 0} and stalls == {"LOP3": 6, "HADD2": 2, "EXIT": 0}
  top = hotspots(path, 2)
  assert [(t[0], t[2], t[3]) for t in top] == [("0x0", 5, 100), ("0x20", 2, 1040)]
  assert top[0][4] == [(4, "wait"), (1, "long_sb")]  # the "Not Issued" column is not a reason of its own


def test_mgpu_ab_alternates_the_builds_and_keeps_every_repeat(tmp_path, monkeypatch):
  """benchmarks/mgpu_ab.py (the kernel itself needs a Hopper GPU): each repeat runs one process per build, the
  first build alternating, each importing its own jkv_kernels; a build's time is the median of its repeats."""
  monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
  import mgpu_ab
  before = tmp_path / "before"
  before.mkdir()
  (before / "mgpu_decode_attention.py").write_text("")
  times = {"before": iter([100.0, 130.0, 110.0]), "after": iter([90.0, 80.0, 200.0])}
  order = []

  def fake_run(command, env, check):
    kernels = pathlib.Path(env["PYTHONPATH"].split(os.pathsep)[0], "jkv_kernels").resolve()
    build = "before" if kernels == before.resolve() else "after"
    order.append((build, "--check" in command))
    timed = [{"impl": impl, "batch": 8, "seq_len": 32768, "config": {"splits": 8}, "bytes_read": 10**8,
              "median_us": next(times[build]) if impl == "mgpu_kivi2" else 50.0} for impl in mgpu_ab.IMPLS]
    pathlib.Path(command[command.index("--out") + 1]).write_text(json.dumps(timed))

  monkeypatch.setattr(mgpu_ab.subprocess, "run", fake_run)
  monkeypatch.delenv("OUT", raising=False)
  monkeypatch.setattr(sys, "argv", ["mgpu_ab.py", "--before", str(before), "--round", "7", "--change", "x",
                                    "--out-dir", str(tmp_path / "rounds")])
  mgpu_ab.main()
  assert order == [("before", True), ("after", True), ("after", False), ("before", False), ("before", False),
                   ("after", False)]
  for build, median, repeats in (("before", 110.0, [100.0, 130.0, 110.0]), ("after", 90.0, [90.0, 80.0, 200.0])):
    kivi2 = [r for r in json.loads((tmp_path / "rounds" / f"7_{build}_x.json").read_text())
             if r["impl"] == "mgpu_kivi2"][0]
    assert kivi2["median_us"] == median and kivi2["repeat_us"] == repeats
    assert kivi2["gbps"] == round(10**8 / (median * 1e-6) / 1e9, 1)


def test_gpu_suite_records_a_runs_counts_and_failures(tmp_path):
  """benchmarks/gpu_suite.py on the CPU over a small suite with a pass, a failure and a skip: the record has the
  counts and the failed test's id, the log sits beside it, and the exit status is pytest's."""
  suite = tmp_path / "suite"
  suite.mkdir()
  (suite / "test_some.py").write_text(
      "import pytest\n\ndef test_ok():\n  assert True\n\ndef test_wrong():\n  assert 1 == 2\n\n"
      "@pytest.mark.skip(reason='not here')\ndef test_later():\n  pass\n")
  out = tmp_path / "records" / "suite.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "gpu_suite.py", "--workers", "0", "--commit", "abc1234", "--pytest-args",
                         str(suite), "--out", str(out)], cwd=BENCHMARKS, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  (record,) = json.loads(out.read_text())
  assert (record["passed"], record["failed"], record["errors"], record["skipped"]) == (1, 1, 0, 1)
  assert len(record["failed_tests"]) == 1 and record["failed_tests"][0].endswith("test_some.py::test_wrong")
  assert record["commit"] == "abc1234" and record["device"] and record["exit_status"] == 1
  assert "assert 1 == 2" in (out.parent / record["log"]).read_text()


def test_a_saved_record_comes_back_from_the_device_with_the_runs_before_it(tmp_path, monkeypatch):
  """``records.save`` on the device machine ($OUT set): the copy the device tool brings back holds the records the
  tree carried and the new one (replacing a record of the same key), so it can replace the committed file."""
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import records
  out, device_out = tmp_path / "results" / "runs.json", tmp_path / "device_out"
  out.parent.mkdir()
  device_out.mkdir()
  committed = [{"date": "a", "passed": 1}, {"date": "b", "passed": 2}]
  out.write_text(json.dumps(committed))
  monkeypatch.setenv("OUT", str(device_out))
  key = lambda r: r["date"]
  records.save(out, [{"date": "b", "passed": 3}, {"date": "c", "passed": 4}], key)
  expected = [{"date": "a", "passed": 1}, {"date": "b", "passed": 3}, {"date": "c", "passed": 4}]
  assert json.loads((device_out / "runs.json").read_text()) == expected == json.loads(out.read_text())


def test_mgpu_builds_imports_each_build_as_its_own_package(tmp_path, monkeypatch):
  """benchmarks/mgpu_builds.py (the timing needs a Hopper GPU): a build is a renamed copy of its kernels, so two
  builds' modules are separate (each one's imports resolve inside its own package, and each packs its own
  inputs with its own ``mma_layout``); a build's arguments parse;
  the table gives each build's median over rounds."""
  monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
  import mgpu_builds
  kernels = BENCHMARKS.parent / "pallas_kernels"
  assert mgpu_builds.build_arg(f"blocks={kernels}:segment_depth=1,splits=3") == (
      "blocks", kernels, {"segment_depth": 1, "splits": 3})
  with pytest.raises(Exception, match="name=path"):
    mgpu_builds.build_arg("no path")
  monkeypatch.syspath_prepend(str(tmp_path))
  (a, a_layout), (b, b_layout) = (mgpu_builds.import_build(name, kernels, tmp_path) for name in ("a", "b"))
  assert a is not b and a.mgpu_decode_attention is not b.mgpu_decode_attention
  assert a.MmaStore.__module__ == "jkv_kernels_a.mma_layout" and b.MmaStore.__module__ == "jkv_kernels_b.mma_layout"
  assert a_layout.__name__ == "jkv_kernels_a.mma_layout" and a_layout.MmaStore is a.MmaStore  # packs for its build
  records = [{"batch": 8, "seq_len": 32768, "impl": "mgpu_kivi2", "median_us": t,
              "config": {"build": build, "arguments": {}, "round": r}}
             for r, (ta, tb) in enumerate([(100.0, 90.0), (130.0, 80.0), (110.0, 95.0)])
             for build, t in (("a", ta), ("b", tb))]
  rows = mgpu_builds.table(records).splitlines()[2:]
  assert rows == ["| 8 | 32768 | mgpu_kivi2 | a | {} | 110.0 | 100.0-130.0 | 3 |",
                  "| 8 | 32768 | mgpu_kivi2 | b | {} | 90.0 | 80.0-95.0 | 3 |"]


def test_long_context(smoke):
  """One prompt of 1500 tokens prefilled in chunks of 512 (three calls, the capacity a chunk past the last one),
  then decoded, recorded with the fields the long-context table reads."""
  (record,), out = smoke["long context"].result()
  assert record["part"] == "prefill" and record["impl"] == "kivi2_mma" and record["context"] == 1500
  assert record["prefill_chunk"] == 512 and record["prefill_calls"] == 3 and not record["synthetic_fill"]
  assert record["capacity"] >= 3 * 512 + 128 and record["prefill_tokens_per_s"] > 0
  assert record["decode_ms_per_step"] > 0 and record["floor_ms_per_step"] > 0
  assert "kivi2_mma" in out


def test_staged_prefill(smoke):
  """A 1500-token document in three stages, each continuing the cache the one before saved: the slices cover the
  document once, the first stage loads nothing and the last saves nothing and decodes, and the total prefill is the
  stages' sum."""
  records, out = smoke["staged prefill"].result()
  assert [r["stage"] for r in records] == [0, 1, 2] and all(r["stages"] == 3 for r in records)
  first, second = records[0]["tokens"], records[1]["tokens"]
  assert [r["tokens_before"] for r in records] == [0, first, first + second]
  assert sum(r["tokens"] for r in records) == 1500 and all(r["tokens"] > 0 for r in records)
  assert "load_s" not in records[0] and all(r["load_s"] > 0 for r in records[1:])
  assert all(r["save_s"] > 0 for r in records[:2]) and "save_s" not in records[2]
  assert records[2]["decode_ms_per_step"] > 0 and "decode_ms_per_step" not in records[0]
  assert records[2]["prefill_s_total"] == pytest.approx(sum(r["prefill_s"] for r in records))
  assert "stage 3/3" in out


def test_long_context_decode(smoke):
  """B = 1 decode over a synthetic fill at 64 tokens and at the longest context the smoke budget holds (8 MiB of
  cache beside the reserve): the longest is longer, its cache within the budget, both recorded as synthetic."""
  (short, longest), out = smoke["long context decode"].result()
  assert [r["context_asked"] for r in (short, longest)] == [64, "longest"]
  assert all(r["part"] == "decode" and r["synthetic_fill"] and r["decode_ms_per_step"] > 0 for r in (short, longest))
  assert short["context"] == 64 and longest["context"] > 64 and longest["kv_bytes"] <= 8 << 20
  assert longest["kv_bytes"] > short["kv_bytes"] and longest["floor_ms_per_step"] > short["floor_ms_per_step"]
  # The limit the longest was sized in, and XLA's memory fraction (unset here: its default), are on the record.
  assert longest["kv_bytes"] < longest["device_limit_bytes"] and longest["memory_fraction"] is None
  assert "the longest" in out


def test_long_context_decode_over_seq(smoke):
  """One sequence's tokens split over two devices (``--mesh seq=2``): the longest context the smoke budget holds per
  device is twice one device's (each holds half the tokens beside the same weights), and the step runs there."""
  (_, alone), _ = smoke["long context decode"].result()
  (short, longest), out = smoke["long context decode seq=2"].result()
  assert short["mesh"] == longest["mesh"] == "seq=2" and short["devices"] == 2
  assert longest["context_asked"] == "longest" and short["decode_ms_per_step"] > 0
  assert 1.9 * alone["context"] <= longest["context"] <= 2 * alone["context"] + 64
  assert "dense on seq=2" in out

