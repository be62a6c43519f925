"""The frontier sweep's machinery on a tiny model: the Pareto front against brute force, bytes per token against
the cache's own arrays, resuming a killed sweep, the reports, and one-line refusals."""

import json
import os

import jax
import numpy as np
import pytest

from jkv import methods as methods_lib
from jkv.cache import CacheSpec, KVCache
from jkv.cli import main
from jkv.evaluation import compare as compare_lib
from jkv.evaluation import frontier
from jkv.evaluation import perplexity as ppl_lib

PLAN = ppl_lib.WindowPlan(context=64, scored=8, num_windows=2, batch_size=2)
TEXTS = ["dense", "kivi:bits=4,residual=32", "kivi:bits=2,residual=32"]


def brute_front(points):
  """Indices of the points no other point dominates (<= on both coordinates, < on one)."""
  dominated = lambda a, b: b[0] <= a[0] and b[1] <= a[1] and (b[0] < a[0] or b[1] < a[1])
  return [i for i, p in enumerate(points) if not any(dominated(p, q) for q in points)]


@pytest.mark.parametrize("seed", range(20))
def test_pareto_front_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 40))
  # Few distinct values, so ties on one coordinate and repeated points are common.
  points = [tuple(p) for p in rng.integers(0, 6, size=(n, 2)).astype(float)]
  assert frontier.pareto_front(points) == brute_front(points)


def test_pareto_front_literal():
  points = [(3, 5), (1, 9), (2, 5), (2, 5), (4, 1), (5, 1), (1, 10)]
  # (3, 5) loses to (2, 5); (5, 1) to (4, 1); (1, 10) to (1, 9); the two (2, 5) tie and both stay.
  assert frontier.pareto_front(points) == [1, 2, 3, 4]


def test_sweep_specs_dedupe_include_defaults_and_presets():
  specs = frontier.sweep_specs(["ott", "zipcache"])
  keys = [frontier.config_key(s.method()) for s in specs]
  assert len(keys) == len(set(keys))
  key = lambda name, **options: frontier.config_key(methods_lib.make_method(name, **options))
  assert keys[0] == key("ott") and key("ott", preset="paper") in keys
  assert key("zipcache") in keys and key("zipcache", preset="paper") in keys
  with pytest.raises(ValueError, match="no frontier sweep for nosuch"):
    frontier.sweep_specs(["nosuch"])


def test_presets_make_methods_and_label():
  paper = methods_lib.make_method("ott", preset="paper")
  assert (paper.group_size, paper.residual, paper.pool_size) == (128, 32, 3)
  assert methods_lib.make_method("ott", preset="paper", pool_size=5).pool_size == 5  # options override a preset
  spec = compare_lib.MethodSpec.parse("zipcache:preset=paper")
  assert spec.label == "zipcache:preset=paper" and spec.method().salient_ratio == 0.6
  row = dict(name="ott", settings=dict(vars(paper)))
  assert frontier.label(row) == "ott:preset=paper"
  with pytest.raises(ValueError, match="method 'ott' has no preset 'nosuch'; its presets: paper"):
    compare_lib.MethodSpec.parse("ott:preset=nosuch")
  with pytest.raises(ValueError, match="method 'kivi' has no preset 'paper'; its presets: none"):
    methods_lib.make_method("kivi", preset="paper")


@pytest.fixture(scope="module")
def tiny_ids(tiny_llama):
  _, m = tiny_llama
  return np.random.default_rng(1).integers(2, m.config.vocab_size, 1000).tolist()


def _meta(command="jkv frontier (test)"):
  return dict(command=command, model="tiny", dtype="float32", text="random ids", ppl=vars(PLAN),
              environment=compare_lib.environment())


class Killed(Exception):
  pass


def test_sweep_resumes_after_a_kill_and_bytes_come_from_the_state(tiny_llama, tiny_ids, tmp_path):
  _, m = tiny_llama
  path = str(tmp_path / "sweep.json")
  specs = compare_lib.parse_methods(TEXTS + ["kivi:residual=32,bits=2"])  # the last one repeats the third
  calls = []

  def killed_after_one(*args, **kwargs):
    if calls:
      raise Killed  # the process dies while measuring the second configuration
    calls.append(args[1][0].label)
    return compare_lib.compare(*args, **kwargs)

  with pytest.raises(Killed):
    frontier.sweep(m, specs, token_ids=tiny_ids, plan=PLAN, path=path, meta=_meta(), progress=False,
                   measure=killed_after_one)
  with open(path) as f:
    kept = json.load(f)
  assert [r["method"] for r in kept["rows"]] == ["dense"]
  assert not [p for p in os.listdir(tmp_path) if p != "sweep.json"]  # no temporary file left behind

  measured = []

  def counting(*args, **kwargs):
    measured.append(args[1][0].label)
    return compare_lib.compare(*args, **kwargs)

  data = frontier.sweep(m, specs, token_ids=tiny_ids, plan=PLAN, path=path, meta=_meta("again"), progress=False,
                        measure=counting)
  assert measured == TEXTS[1:]  # dense is not measured again, and the repeated setting only once
  assert data["meta"]["commands"] == ["jkv frontier (test)", "again"]
  rows = data["rows"]
  assert [r["method"] for r in rows] == TEXTS
  # Resumed rows are the rows a sweep in one go gives.
  whole = compare_lib.compare(m, compare_lib.parse_methods(TEXTS), token_ids=tiny_ids, ppl=PLAN, passkey=None,
                              baseline=None, progress=False)
  assert [r["ppl"] for r in rows] == pytest.approx([r["ppl"] for r in whole], rel=1e-6)
  assert [r["kv_bytes"] for r in rows] == [r["kv_bytes"] for r in whole]
  # A third run has nothing left to measure.
  frontier.sweep(m, specs, token_ids=tiny_ids, plan=PLAN, path=path, meta=_meta(), progress=False,
                 measure=lambda *a, **k: pytest.fail("measured again"))

  n = PLAN.context + PLAN.scored
  cfg = m.config
  # Dense: the bytes of the dense cache's own arrays at capacity n, per token.
  cache = KVCache.create(methods_lib.make_method("dense"), CacheSpec.for_model(cfg, 1, n))
  dense_arrays = sum(x.nbytes for x in jax.tree.leaves(cache.state))
  annotated = frontier.annotate(rows)
  assert annotated[0]["bytes_per_token"] == dense_arrays / n
  assert [t[0] for t in rows[0]["held_trace"]] == list(range(PLAN.context + 1, n + 1))
  # KIVI (G = 32, R = 32), after each scored step: keys quantized in whole blocks of R tokens, the rest exact;
  # values quantized but for the newest R; a float16 scale and zero per 32 tokens of a key channel and per 32
  # channels of a value; exact ones in float32; one int32 length. Averaged over the steps, as the ppl is.
  def kivi_bytes(bits, tokens):
    n_k, n_v = 32 * (tokens // 32), tokens - 32
    per_channel = (n_k + n_v) * (bits / 8 + 2 * 2 / 32) + (2 * tokens - n_k - n_v) * 4
    return cfg.num_layers * cfg.kv_heads * cfg.head_dim * per_channel + 4
  for r, bits in zip(annotated[1:], (4, 2)):
    expected = np.mean([kivi_bytes(bits, t) / t for t in range(PLAN.context + 1, n + 1)])
    assert r["bytes_per_token"] == pytest.approx(expected, rel=1e-12)
    # The sawtooth is real: at 65 tokens one key is exact, at 72 eight (the trace is not one value repeated).
    assert r["held_trace"][-1][1] - r["held_trace"][0][1] == pytest.approx(kivi_bytes(bits, 72) - kivi_bytes(bits, 65))

  # The front and the marks follow the rows.
  front = frontier.pareto_front([(r["bytes_per_token"], r["ppl"]) for r in annotated])
  assert [i for i, r in enumerate(annotated) if r["on_front"]] == front
  assert [r["default"] for r in annotated] == [True, False, False]
  # jkv info's advice names the best configuration within a budget, from a sweep file.
  (_, best), = frontier.best_within(annotated, (0.5,))
  line, = frontier.advice(0.5, committed=((PLAN.context, path), (2048, str(tmp_path / "absent.json"))))
  assert f"the lowest perplexity measured is {best['label']} (" in line
  prefix = str(tmp_path / "out")
  frontier.write_outputs(annotated, data["meta"], prefix)
  report = open(prefix + ".md").read()
  assert "| `kivi:residual=32` |" in report and "again" in report
  assert os.path.getsize(prefix + ".png") > 10_000


def test_sweep_refuses_a_file_of_other_settings(tmp_path):
  path = str(tmp_path / "s.json")
  frontier.write_json(path, dict(meta=_meta(), rows=[]))
  other = dict(_meta(), ppl=dict(vars(PLAN), context=128))
  with pytest.raises(ValueError, match="was measured with ppl="):
    frontier.load_sweep(path, other)
  with open(path, "w") as f:
    f.write("{half a fi")
  with pytest.raises(ValueError, match="is not a frontier sweep file"):
    frontier.load_sweep(path, _meta())


def test_best_within_budget():
  rows = [dict(name="dense", bytes_per_token=100.0, ppl=10.0), dict(name="a", bytes_per_token=30.0, ppl=12.0),
          dict(name="b", bytes_per_token=20.0, ppl=13.0), dict(name="c", bytes_per_token=10.0, ppl=30.0)]
  best = dict(frontier.best_within(rows, budgets=(0.05, 0.2, 0.25, 0.5)))
  assert best[0.05] is None and best[0.2]["name"] == "b" and best[0.25]["name"] == "b" and best[0.5]["name"] == "a"


@pytest.mark.parametrize("argv, message", [
    (["--methods", "nosuch"], "no frontier sweep for nosuch"),
    (["--add", "ott:preset=nosuch"], "has no preset 'nosuch'"),
    (["--add", "kivi:bits=3"], "kivi bits=3 is not supported"),
    (["--output", "/nonexistent/dir/f"], "no directory /nonexistent/dir"),
])
def test_frontier_cli_rejects_bad_input_before_loading(capsys, argv, message):
  assert main(["frontier", "--model", "/nonexistent"] + argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err


def test_info_names_the_committed_frontiers_choice_within_the_methods_bytes(capsys, default_model_once):
  assert main(["info", "--json", "--method", "kivi", "--tokens", "576"]) == 0
  info = json.loads(capsys.readouterr().out)
  context, path = frontier.COMMITTED[0]
  with open(path) as f:
    rows = frontier.annotate(json.load(f)["rows"])
  (_, best), = frontier.best_within(rows, (info["kv_bytes"] / info["dense_kv_bytes"],))
  assert f"{context} + 64 tokens: within" in info["frontier"][0]
  assert f"the lowest perplexity measured is {best['label']} (" in info["frontier"][0]
