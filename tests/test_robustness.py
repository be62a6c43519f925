"""Out of device memory as one helpful line, and text in whole characters.

The device's memory is faked (``jkv.memory.device_memory`` reports what a test says; on CPU it reports nothing), so
the refusal and its numbers run here as they do on a GPU. Commands run in-process through ``jkv.cli.main``.
"""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

import jkv
from jkv import cli
from jkv import generate as gen
from jkv import prefill as prefill_lib
from jkv import load as load_lib
from jkv import memory
from jkv import sharding
from jkv.methods import make_method
from jkv.tokenizer import REPLACEMENT
from tests.conftest import random_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
# What XLA raised on the H100, with the start of the allocator report its message carries.
XLA_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.55GiB.\nBufferAssignment OOM Debugging.\n"
           "BufferAssignment stats:\n             parameter allocation:    1.00GiB\n")


def run(capsys, *argv):
  """``jkv ARGV`` in-process: (exit status, stdout, stderr)."""
  capsys.readouterr()
  rc = cli.main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err


def out_of_memory_line(result):
  """Exit 1, nothing on stdout, and the last stderr line the only error line: ``jkv: error: out of device memory``."""
  rc, out, err = result
  assert rc == 1 and out == "", (rc, out, err)
  lines = err.strip("\n").splitlines()
  assert lines[-1].startswith("jkv: error: out of device memory: "), err
  assert sum("error" in l for l in lines) == 1 and "Traceback" not in err and "BufferAssignment" not in err, err
  return lines[-1]


def raising(error):
  """A stand-in for a function: it raises ``error``."""
  def fail(*args, **kwargs):
    raise error
  return fail


def fake_device(monkeypatch, limit, in_use):
  """Make jkv see a device of ``limit`` bytes with ``in_use`` bytes taken (the weights, on a real device)."""
  monkeypatch.setattr(memory, "device_memory", lambda device=None: dict(limit=limit, in_use=in_use, peak=in_use))


# ------------------------------------------------------------------------------------------------- the Python API


def test_a_cache_that_cannot_fit_is_refused_before_allocation(tiny_llama, monkeypatch):
  _, m = tiny_llama
  cfg, method = m.config, make_method("kivi", bits=2, residual=32)
  prompts = random_prompts(cfg.vocab_size, [20] * 64)
  capacity = gen.plan_capacity(cfg, method, [20], 1000, 32)
  need = memory.cache_bytes(method, cfg, 64, capacity)
  # A tiny model's cache is small beside the 6 GiB jkv keeps for XLA's work: keep proportionately less.
  monkeypatch.setattr(memory, "RESERVE_BYTES", need // 8)
  free = memory.RESERVE_BYTES + need // 2  # the reserve, and room for about half the cache
  fake_device(monkeypatch, limit=free + GIB, in_use=GIB)
  monkeypatch.setattr(sharding, "create_cache", lambda *a: pytest.fail("allocated before the check"))
  with pytest.raises(memory.DeviceMemoryError) as e:
    gen.generate(m.params, cfg, prompts, method=method, max_new_tokens=1000)
  err = e.value
  assert isinstance(err, MemoryError) and "\n" not in str(err)
  assert err.need_bytes == need and err.free_bytes == free
  # What fits is what jkv.memory counts: the cache beside one prefill (a prompt padded to 32 tokens: activations,
  # and a sub-batch's fresh sequence at the cache's capacity, per token rounded up) and the reserve, one more does not.
  room = lambda cap: free - memory.RESERVE_BYTES - 32 * (memory.prefill_bytes_per_token(cfg)
                                                         + -(-memory.cache_bytes(method, cfg, 1, cap) // 32))
  assert 0 < err.largest_batch < 64
  assert memory.cache_bytes(method, cfg, err.largest_batch, capacity) <= room(capacity)
  assert memory.cache_bytes(method, cfg, err.largest_batch + 1, capacity) > room(capacity)
  assert 32 < err.largest_capacity < capacity and err.largest_capacity % method.capacity_multiple() == 0
  assert memory.cache_bytes(method, cfg, 64, err.largest_capacity) <= room(err.largest_capacity)
  longer = err.largest_capacity + method.capacity_multiple()
  assert memory.cache_bytes(method, cfg, 64, longer) > room(longer)
  for words in (f"64 sequences of {capacity} tokens with kivi ({need / GIB:.2f} GiB) does not fit",
                f"has {free / GIB:.2f} GiB free of {(free + GIB) / GIB:.2f} GiB",
                f"at most {err.largest_batch} sequences of {capacity} tokens fit, or 64 of {err.largest_capacity}"):
    assert words in str(err), str(err)
  # The same through the one-hand API, which raises the error as it is and exports its type.
  with pytest.raises(jkv.DeviceMemoryError, match="does not fit"):
    jkv.Model.wrap(m).generate(prompts, method="kivi", bits=2, residual=32, max_new_tokens=1000)


def test_when_not_one_sequence_fits_the_error_says_so(tiny_llama, monkeypatch):
  _, m = tiny_llama
  fake_device(monkeypatch, limit=GIB, in_use=GIB - (1 << 20))  # 1 MiB free: less than the reserve
  with pytest.raises(memory.DeviceMemoryError, match="not one sequence fits beside a prefill") as e:
    list(gen.stream(m.params, m.config, [5] * 40, max_new_tokens=2000))
  assert e.value.largest_batch == e.value.largest_capacity == 0


def test_a_later_allocation_failure_is_the_same_error(tiny_llama, monkeypatch):
  """XLA ran out beside a cache that fit (prefill activations): one line, XLA's report kept as the cause."""
  _, m = tiny_llama
  fake_device(monkeypatch, limit=64 * GIB, in_use=GIB)
  monkeypatch.setattr(prefill_lib.Prefill, "__call__", raising(jax.errors.JaxRuntimeError(XLA_OOM)))
  with pytest.raises(memory.DeviceMemoryError) as e:
    gen.generate(m.params, m.config, [[3, 4, 5]], max_new_tokens=4)
  assert "\n" not in str(e.value)
  assert "fit, but XLA ran out beside it (Out of memory while trying to allocate 2.55GiB)" in str(e.value)
  assert "BufferAssignment" in str(e.value.__cause__)
  assert e.value.largest_batch > 1
  # Other XLA errors pass through untouched.
  monkeypatch.setattr(prefill_lib.Prefill, "__call__", raising(jax.errors.JaxRuntimeError("INTERNAL: not memory")))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    gen.generate(m.params, m.config, [[3, 4, 5]], max_new_tokens=4)


# ------------------------------------------------------------------------------------------------- the CLI


@pytest.mark.usefixtures("default_model_once")
@pytest.mark.parametrize("argv", [
    ["generate", "a", "b", "c", "d", "--max-new-tokens", "4000", "--json"],
    ["generate", "a", "--max-new-tokens", "8000", "--stream"],
    ["eval", "ppl", "--windows", "2", "--context", "64", "--scored", "4000"],
    ["eval", "passkey", "--lengths", "7000", "--trials", "1", "--depths", "0.5"],
    ["compare", "--methods", "dense", "kivi", "--output", "", "--no-passkey", "--windows", "2", "--context", "64",
     "--scored", "4000"],
], ids=["generate", "stream", "eval-ppl", "eval-passkey", "compare"])
def test_every_command_refuses_in_one_line(capsys, monkeypatch, argv):
  # 0.25 GiB free beside the weights; the default model's dense fp32 cache takes 46,080 bytes a token, so each
  # command asks for 0.35 GiB or more. Nothing fits beside the reserve, and the line says so.
  fake_device(monkeypatch, limit=2 * GIB, in_use=2 * GIB - GIB // 4)
  line = out_of_memory_line(run(capsys, *argv))
  for words in ("tokens with dense", "does not fit", "has 0.25 GiB free of 2.00 GiB", "not one sequence fits"):
    assert words in line, line


@pytest.mark.usefixtures("default_model_once")
def test_a_later_failure_is_one_line_and_the_report_only_with_verbose(capsys, monkeypatch):
  fake_device(monkeypatch, limit=80 * GIB, in_use=GIB)
  monkeypatch.setattr(prefill_lib.Prefill, "__call__", raising(jax.errors.JaxRuntimeError(XLA_OOM)))
  line = out_of_memory_line(run(capsys, "generate", "hi", "--max-new-tokens", "4"))
  assert "XLA ran out beside it (Out of memory while trying to allocate 2.55GiB)" in line
  rc, out, err = run(capsys, "generate", "hi", "--max-new-tokens", "4", "--verbose")
  assert rc == 1 and "BufferAssignment stats:" in err  # the report, then the one line, last
  assert err.strip().splitlines()[-1] == line
  # XLA's own error outside any cache (weights that do not fit) is one line too.
  monkeypatch.setattr(load_lib, "load_model", raising(jax.errors.JaxRuntimeError(XLA_OOM)))
  line = out_of_memory_line(run(capsys, "info"))
  assert line == "jkv: error: out of device memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.55GiB."


def test_xla_logs_only_with_verbose(monkeypatch, tmp_path):
  """The allocator report XLA logs out of memory comes through its C++ log, whose level XLA reads once, when jax is
  imported: the program sets it before that. In a fresh process (a one-device mesh starts the backend, which logs
  at INFO, the report's level), those lines appear with --verbose and not without."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  # Both processes at once (each mostly starting Python and jax on one core).
  procs = [subprocess.Popen([sys.executable, "-m", "jkv.cli", "info", "--model", "/nonexistent", "--mesh", "data=1",
                             *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for flags in (["--verbose"], [])]
  try:
    verbose, quiet = (p.communicate(timeout=120)[1] for p in procs)
  finally:
    for p in procs:
      p.kill()
  for p, err in zip(procs, (verbose, quiet)):
    assert p.returncode == 2 and "no such model" in err.splitlines()[-1], err
  info_line = re.compile(r"^I\d{4} \d\d:\d\d:\d\d", re.MULTILINE)  # absl's INFO lines: I1125 12:03:31.261201 ...
  assert info_line.search(verbose)
  assert not info_line.search(quiet)
  for argv, level in ((["generate", "x"], "3"), (["generate", "x", "--verbose"], "0")):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    cli.quiet_xla_logs(argv)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == level
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")  # the user's own choice stays
  cli.quiet_xla_logs(["generate", "x"])
  assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"


def test_the_cli_sizes_the_pinned_host_pool_to_the_machine_unless_told(monkeypatch):
  """The console script raises XLA's pinned-host cap (64 GiB by default) to 90% of the machine's memory, which
  ``jkv.memory.pinned_host_limit`` then reads on a GPU; a value the user set is kept."""
  from jkv import memory
  monkeypatch.delenv(memory.PINNED_HOST_LIMIT_ENV, raising=False)
  cli.size_pinned_host_pool()
  want = int(0.9 * memory.host_memory()["limit"]) >> 30
  assert abs(int(os.environ[memory.PINNED_HOST_LIMIT_ENV]) - want) <= 1  # sysconf's total against /proc/meminfo's
  monkeypatch.setenv(memory.PINNED_HOST_LIMIT_ENV, "7")
  cli.size_pinned_host_pool()
  assert os.environ[memory.PINNED_HOST_LIMIT_ENV] == "7"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert memory.pinned_host_limit() == 7 << 30


# ------------------------------------------------------------------------------------------------- whole characters

THANKS = 'Say "thank you" in Japanese, Chinese and Korean.'  # the default model answers in kana


def test_decode_whole_holds_back_a_cut_character(default_model):
  tok = default_model.tokenizer
  ids = tok.encode("谢谢")  # byte-level BPE: three byte tokens per character
  assert len(ids) == 6 and tok.decode(ids[:5]).endswith(REPLACEMENT)
  assert [tok.decode_whole(ids[:n]) for n in range(7)] == [
      ("", 0), ("", 1), ("", 2), ("谢", 0), ("谢", 1), ("谢", 2), ("谢谢", 0)]
  emoji = tok.encode("ok 🎉")
  assert tok.decode_whole(emoji[:-1]) == ("ok", 2)  # the space went with the emoji's first bytes, in one token
  middle = tok.encode("a\ufffdb")  # a U+FFFD the text holds, not at the end: kept
  assert tok.decode_whole(middle) == ("a\ufffdb", 0)
  decoder = tok.stream_decoder()
  assert "".join([decoder.push(i) for i in ids[:5]] + [decoder.finish()]) == "谢"


@pytest.fixture(scope="module")
def cut_answer(default_model):
  """(n, tokens): the default model's greedy answer to THANKS cut at n tokens, the last of which holds only the
  first bytes of a character: the issue's case. Its first 16 tokens hold several such cuts (kana take three bytes);
  every run of the test below decodes n tokens at about 20 a second on a CPU, so n stays that short."""
  tok = default_model.tokenizer
  tokens = jkv.Model.wrap(default_model).generate(THANKS, max_new_tokens=16).tokens[0]
  cut = [n for n in range(2, len(tokens) + 1) if tok.decode(tokens[:n], skip_special_tokens=True).endswith(REPLACEMENT)]
  assert cut, "the answer holds no character that byte tokens split"
  return cut[-1], tokens[:cut[-1]]


@pytest.mark.usefixtures("default_model_once")
def test_generation_that_stops_inside_a_character_prints_whole_characters(capsys, default_model, cut_answer):
  n, tokens = cut_answer
  tok = default_model.tokenizer
  rc, out, err = run(capsys, "generate", THANKS, "--max-new-tokens", str(n), "--json")
  assert rc == 0, err
  res = json.loads(out)
  assert res["tokens"] == tokens and 1 <= res["held_back_tokens"] <= 3
  assert REPLACEMENT not in res["text"]
  assert res["text"] == tok.decode(tokens[:n - res["held_back_tokens"]], skip_special_tokens=True)
  for flags in ([], ["--stream"]):
    rc, out, err = run(capsys, "generate", THANKS, "--max-new-tokens", str(n), *flags)
    assert rc == 0 and out == res["text"] + "\n", (flags, out, err)
  assert jkv.Model.wrap(default_model).generate(THANKS, max_new_tokens=n).texts == [res["text"]]


# ------------------------------------------------------------------------------------------------- hostile use


def test_on_a_cpu_the_cache_is_held_to_the_machines_memory(tiny_llama, monkeypatch):
  """jax reports no memory for a CPU, whose device memory is the machine's: there the guard reads that."""
  _, m = tiny_llama
  monkeypatch.setattr(memory, "device_memory", lambda device=None: None)
  monkeypatch.setattr(memory, "host_memory", lambda: dict(limit=4 * GIB, in_use=4 * GIB - (1 << 20), peak=0))
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with pytest.raises(memory.DeviceMemoryError, match=r"has 0\.00 GiB free of 4\.00 GiB"):
    gen.generate(m.params, m.config, [[3, 4, 5]] * 8, max_new_tokens=1000)


def test_a_gpus_refusal_names_the_fraction_that_limits_its_memory(tiny_llama, monkeypatch):
  """XLA's allocator takes 75% of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: the one-line refusal
  says so where the variable is unset, and not where it is set or off a GPU."""
  _, m = tiny_llama
  monkeypatch.setattr(memory, "device_memory", lambda device=None: dict(limit=4 * GIB, in_use=4 * GIB - (1 << 20),
                                                                        peak=0))
  monkeypatch.delenv(memory.MEMORY_FRACTION_ENV, raising=False)
  for backend, env, named in (("gpu", None, True), ("gpu", "0.9", False), ("cpu", None, False)):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    if env:
      monkeypatch.setenv(memory.MEMORY_FRACTION_ENV, env)
    with pytest.raises(memory.DeviceMemoryError) as caught:
      gen.generate(m.params, m.config, [[3, 4, 5]] * 8, max_new_tokens=1000)
    line = str(caught.value)
    assert "\n" not in line and re.search(r"free of 4\.00 GiB[;(]", line.replace(" (", "(")), line
    assert ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in line) == named, (backend, env, line)
    monkeypatch.delenv(memory.MEMORY_FRACTION_ENV, raising=False)


@pytest.mark.usefixtures("default_model_once")
def test_info_counts_a_cpus_largest_batch_in_the_machines_memory(capsys, monkeypatch):
  monkeypatch.setattr(memory, "device_memory", lambda device=None: None)
  monkeypatch.setattr(memory, "host_memory", lambda: dict(limit=16 * GIB, in_use=4 * GIB, peak=0))
  monkeypatch.setattr(memory.jax, "default_backend", lambda: "cpu")  # a CPU, also where the tests run on a GPU
  rc, out, err = run(capsys, "info", "--json", "--tokens", "4096")
  assert rc == 0, err
  info = json.loads(out)
  assert info["device_bytes"] == 16 * GIB and info["largest_batch"] > 0  # was None: "give --device-gib"
  rc, out, _ = run(capsys, "info", "--json", "--tokens", "4096", "--device-gib", "16")
  assert json.loads(out)["largest_batch"] == info["largest_batch"]  # the same count as for a device of that size


@pytest.mark.parametrize("name, options", [("ott", dict(group_size=4096)), ("kivi", dict(residual=4096))])
def test_a_method_block_longer_than_the_context_is_one_line(tiny_llama, name, options):
  """A group or window past the model's context made a cache of that many tokens for a few (ott --group-size
  100000: 10 GB of host memory for 40 tokens on the default model)."""
  _, m = tiny_llama
  with pytest.raises(ValueError, match=f"blocks of 4096 .* more than the model's context of {m.config.max_position}"):
    gen.generate(m.params, m.config, [[3, 4, 5]], method=make_method(name, **options), max_new_tokens=4)


COMPARE = ["compare", "--methods", "dense", "kivi", "--no-passkey", "--windows", "1", "--context", "16", "--scored", "2"]


@pytest.mark.usefixtures("default_model_once")
@pytest.mark.parametrize("where", ["while the methods run", "while the outputs are written"])
def test_an_interrupted_compare_writes_nothing_and_says_so(capsys, monkeypatch, tmp_path, where):
  from jkv.evaluation import compare as compare_lib
  from jkv.evaluation import perplexity as ppl_lib
  prefix = tmp_path / "cmp"
  (tmp_path / "cmp.json").write_text('{"rows": "an earlier run"}')
  if where == "while the methods run":
    monkeypatch.setattr(ppl_lib, "perplexity", raising(KeyboardInterrupt))
  else:  # the table and JSON are written (under their temporary names), the plot is under way
    def half_a_plot(rows, path, title=""):
      with open(path, "wb") as f:
        f.write(b"\x89PNG")
      raise KeyboardInterrupt
    monkeypatch.setattr(compare_lib, "plot", half_a_plot)
  rc, out, err = run(capsys, *COMPARE, "--output", str(prefix))
  assert rc == 130 and "Traceback" not in err
  assert err.strip().splitlines()[-1] == (f"jkv: interrupted; nothing written ({prefix}.json, .md and .png come once "
                                          "every method has run)")
  assert os.listdir(tmp_path) == ["cmp.json"] and "an earlier run" in (tmp_path / "cmp.json").read_text()


@pytest.mark.usefixtures("default_model_once")
def test_an_interrupted_frontier_keeps_what_it_measured_and_says_so(capsys, monkeypatch, tmp_path):
  """Ctrl-C during the second configuration: the sweep file holds the first (and a rerun resumes there), the line
  says so, and no table or plot is written."""
  from jkv.evaluation import frontier
  calls = []
  real = frontier.held_trace
  def second_interrupted(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(*args, **kwargs)
  monkeypatch.setattr(frontier, "held_trace", second_interrupted)
  prefix = tmp_path / "front"
  rc, _, err = run(capsys, "frontier", "--methods", "dense", "--add", "kivi", "--windows", "1", "--context", "16",
                   "--scored", "2", "--output", str(prefix))
  assert rc == 130 and "Traceback" not in err, err
  assert err.strip().splitlines()[-1] == (f"jkv: interrupted; {prefix}.json keeps every configuration measured so "
                                          f"far (the same command resumes there); {prefix}.md and .png not written")
  assert os.listdir(tmp_path) == ["front.json"] and len(json.loads((tmp_path / "front.json").read_text())["rows"]) == 1


@pytest.mark.usefixtures("default_model_once")
def test_an_interrupted_passkey_plot_leaves_no_image(capsys, monkeypatch, tmp_path):
  from jkv.evaluation import passkey as passkey_lib
  def half_a_plot(result, path, title=""):
    with open(path, "wb") as f:
      f.write(b"\x89PNG")
    raise KeyboardInterrupt
  monkeypatch.setattr(passkey_lib, "plot_heatmap", half_a_plot)
  plot = tmp_path / "p.png"
  rc, _, err = run(capsys, "eval", "passkey", "--lengths", "80", "--trials", "1", "--depths", "0.5", "--plot", str(plot))
  assert rc == 130 and err.strip().splitlines()[-1] == f"jkv: interrupted; {plot} not written"
  assert os.listdir(tmp_path) == []


def test_a_failure_of_jkvs_own_is_one_line_and_the_traceback_with_verbose(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(load_lib, "load_model", raising(TypeError("unhashable type: 'list'")))
  rc, out, err = run(capsys, "info", "--model", str(tmp_path))
  assert rc == 1 and err.strip().splitlines() == [
      "jkv: error: internal error, TypeError: unhashable type: 'list' (--verbose shows where)"]
  rc, out, err = run(capsys, "info", "--model", str(tmp_path), "--verbose")
  assert rc == 1 and "Traceback" in err and err.strip().splitlines()[-1].startswith("jkv: error: internal error")


# ------------------------------------------------------------------------------------------------- sweep, past limits


PAST_LIMITS = [
    # A temperature past float32's range became inf (numpy's overflow warning, two lines, in the output); one below
    # its smallest normal became 0, and the logits divided by it inf.
    (["generate", "hi", "--temperature", "1e308"], ["--temperature", "must be 0 or lie in", "got 1e308"]),
    (["generate", "hi", "--temperature", "1e-300"], ["--temperature", "got 1e-300"]),
    (["generate", "hi", "--temperature", "-0.5"], ["--temperature", "got -0.5"]),
    # Bad --model inputs: none, a device file, a plain file that is no model, a directory that holds none.
    (["info", "--model", ""], ["no such model"]),
    (["info", "--model", os.devnull], ["cannot tell what model", os.devnull]),
    (["info", "--model", __file__], ["cannot tell what model", "test_robustness.py"]),
    (["info", "--model", os.path.dirname(__file__)], ["cannot tell what model", "tests"]),
    # Values that argparse read as options ("expected one argument"): what reads as a negative number is a value.
    (["info", "--method", "zipcache", "--random-probes", "-inf"], ["random_probes=-inf must lie in [0, 1]"]),
    (["generate", "hi", "--temperature", "-1e-3"], ["--temperature", "got -1e-3"]),
    (["generate", "hi", "--top-p", "-.5e+2", "--temperature", "1"], ["top_p must be in (0, 1], got -50.0"]),
    (["info", "--method", "zipcache", "--salient-ratio", "nan"], ["salient_ratio=nan"]),
    (["info", "--method", "zipcache", "--recent-probes=-inf"], ["recent_probes=-inf"]),
    (["info", "--method", "kivi", "--group-size", str(2**31 - 1)], ["group_size=2147483647"]),
    (["info", "--method", "ott", "--pool-size", "-1"], ["pool_size=-1"]),
    # Slots past the cache's capacity: refused as values, not as terabytes of memory.
    (["info", "--tokens", "4096", "--method", "ott", "--pool-size", str(2**31 - 1)], ["pool_size=2147483647 exceeds"]),
    (["info", "--tokens", "4096", "--method", "ott", "--aux-size", str(2**31 - 1)], ["aux_size=2147483647 exceeds"]),
    (["info", "--tokens", "4096", "--method", "zipcache", "--interval", str(2**31 - 1)],
     ["interval=2147483647 exceeds"]),
    (["info", "--method", "specache", "--bits", "8"], ["bits=8"]),
    (["info", "--method", "kivi", "--preset", "nope"], ["has no preset 'nope'"]),
    (["info", "--method", ""], ["unknown cache method ''"]),
    (["info", "--mesh", "data=0"], ["--mesh", "must be >= 1"]),
    (["info", "--num-processes", "2", "--process-id", "5", "--coordinator", "localhost:1"], ["process id 5"]),
]


@pytest.mark.usefixtures("default_model_once")
@pytest.mark.parametrize("argv, words", PAST_LIMITS, ids=[" ".join(argv) for argv, _ in PAST_LIMITS])
def test_options_past_their_limits_are_one_line(capsys, argv, words):
  rc, out, err = run(capsys, *argv)
  assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
  lines = err.strip("\n").splitlines()
  assert len(lines) == 1 and lines[0].startswith("jkv: error: "), err
  for w in words:
    assert w in lines[0], lines[0]


@pytest.mark.usefixtures("default_model_once")
@pytest.mark.parametrize("flags, words", [
    # A capacity at int32's limit: the cache it makes is refused before it is allocated, whatever the machine
    # (terabytes for a few tokens), not allocated in part or overflowed.
    (["--capacity", str(2**31 - 1)], ["2147483647 tokens with dense", "does not fit"]),
], ids=["capacity"])
def test_sizes_at_the_int32_limit_are_refused_in_one_line(capsys, flags, words):
  line = out_of_memory_line(run(capsys, "generate", "hi", "--max-new-tokens", "2", *flags))
  for w in words:
    assert w in line, line


@pytest.mark.usefixtures("default_model_once")
@pytest.mark.parametrize("flags", [
    ["--method", "ott", "--pool-size", "0"],  # no outlier pool: KIVI with OTT's layout
    ["--method", "ott", "--no-pool-layers", "1000"],  # more layers without a pool than the model has
    ["--method", "specache", "--fetch-rows", "0"],  # nothing prefetched
    ["--method", "specache", "--fetch-rows", str(2**31 - 1)],  # more rows than the cache holds: all of them
    ["--method", "kivi", "--residual", "8192"],  # a residual of the model's whole context
    ["--prefill-tokens", "1"],  # a prefill budget below one prompt: one prompt a call
    ["--top-k", str(10**20), "--temperature", "1"],  # more than the vocabulary: all of it
    ["--temperature", "3.4e38"],  # float32's largest: uniform sampling, no overflow
], ids=["ott-pool-0", "ott-no-pool-layers-1000", "specache-fetch-0", "specache-fetch-max", "kivi-residual-context",
        "prefill-tokens-1", "top-k-huge", "temperature-max"])
def test_options_at_their_limits_run(capsys, flags):
  """Values at the edge of what an option accepts run, with no warning or traceback on stderr."""
  rc, out, err = run(capsys, "generate", "hi", "--max-new-tokens", "2", "--json", *flags)
  assert rc == 0, err
  assert len(json.loads(out)["tokens"]) >= 1
  assert all(l.startswith(("loading model", "generating with")) for l in err.strip().splitlines()), err


# ------------------------------------------------------------------------------------------------- the GPU script


@pytest.fixture(scope="module")
def robustness_gpu():
  """benchmarks/robustness_gpu.py as a module (it imports the standard library only): the checks its GPU run makes."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("robustness_gpu", os.path.join(REPO, "benchmarks", "robustness_gpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_gpu_script_reads_the_refusal_jkv_writes(tiny_llama, monkeypatch, robustness_gpu):
  """benchmarks/robustness_gpu.py asks for the issue's prompt and reads the numbers of jkv's out-of-memory line (it
  runs the advised batch and context, and batches either side of the free memory): held to the line
  jkv.memory writes, and its judgement of a failure's output to this file's."""
  assert robustness_gpu.THANKS == THANKS
  _, m = tiny_llama
  method = make_method("kivi", bits=2, residual=32)
  request = memory.CacheRequest(m.config, method, 64, 2048, 32)
  monkeypatch.setattr(memory, "RESERVE_BYTES", request.need_bytes // 8)
  mem = dict(limit=GIB + request.need_bytes // 2 + memory.RESERVE_BYTES, in_use=GIB)
  err = request.error(f"{request} does not fit", mem)
  got = robustness_gpu.parse_refusal(f"jkv: error: {err}")
  assert (got["batch"], got["capacity"], got["method"]) == (64, 2048, "kivi")
  assert (got["largest_batch"], got["largest_capacity"]) == (err.largest_batch, err.largest_capacity) != (0, 0)
  assert got["free_gib"] == round(err.free_bytes / GIB, 2) and got["need_gib"] == round(err.need_bytes / GIB, 2)
  per_sequence = memory.cache_bytes(method, m.config, 2, 2048) - memory.cache_bytes(method, m.config, 1, 2048)
  base = memory.cache_bytes(method, m.config, 1, 2048) - per_sequence
  under, over = robustness_gpu.batch_bounds(got, per_sequence, base)
  assert memory.cache_bytes(method, m.config, under, 2048) <= err.free_bytes
  assert memory.cache_bytes(method, m.config, over, 2048) > err.free_bytes and over - under <= 2 + GIB // 100 // per_sequence
  nothing = request.error(f"{request} does not fit", dict(limit=GIB, in_use=GIB - 1))
  assert "not one sequence fits" in str(nothing)
  assert robustness_gpu.parse_refusal(f"jkv: error: {nothing}")["largest_batch"] == 0
  line = f"jkv: error: {err}"
  assert robustness_gpu.one_line_failure(1, "", f"loading model default ...\n{line}\n", 1) == []
  assert robustness_gpu.one_line_failure(1, "", f"[1/2] dense\nppl dense:   0%|  | 0/9 [00:00<?, ?tok/s]\n{line}\n", 1) == []
  assert len(robustness_gpu.one_line_failure(2, "x", f"Traceback\nW0 allocator\n{line}\n", 1)) == 4
