"""Nothing silently wrong, every bad input one line, interrupts and corrupt files handled.

Each test names the case of the issue it covers. Commands run in-process through ``jkv.cli.main`` where they can;
the interrupt tests run ``python -m jkv.cli`` in a subprocess, because only there is a real SIGINT, a real exit
status and a real interpreter shutdown.
"""

import argparse
import concurrent.futures
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jkv import cli
from jkv import load as load_lib
from jkv import methods
from jkv_convert import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRANCE = "What is the capital of France?"

pytestmark = pytest.mark.usefixtures("default_model_once")


def run(capsys, *argv):
  """``jkv ARGV`` in-process: (exit status, stdout, stderr)."""
  capsys.readouterr()
  rc = cli.main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err


def one_line_error(result, *words, rc=2):
  """The error contract: exit ``rc``, one stderr line ``jkv: error: ...`` naming ``words``, no traceback. Progress
  lines may come before it; nothing after it."""
  code, _, err = result
  assert code == rc, err
  assert "Traceback" not in err, err
  lines = err.strip("\n").splitlines()
  assert lines[-1].startswith("jkv: error: "), err
  assert sum(l.startswith("jkv: error") for l in lines) == 1, err
  for w in words:
    assert w in lines[-1], lines[-1]
  return lines[-1]


@pytest.fixture
def no_model(monkeypatch):
  """Fail the test if anything loads a model: checks that need no model must run before it loads."""
  def refuse(*args, **kwargs):
    raise AssertionError("the model was loaded before the input was checked")
  monkeypatch.setattr(load_lib, "load_model", refuse)
  monkeypatch.setattr(load_lib, "open_model", refuse)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
  """A tiny random Llama saved by transformers (config.json + model.safetensors, no tokenizer)."""
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
  path = tmp_path_factory.mktemp("tiny_hf")
  transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_hf_dir, tmp_path_factory):
  """The tiny model converted by jkv: a pristine checkpoint that tests copy before damaging."""
  out = tmp_path_factory.mktemp("ckpt") / "tiny"
  load_lib.convert(str(tiny_hf_dir), str(out))
  return out


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


def _largest_file(directory):
  files = [os.path.join(r, n) for r, _, names in os.walk(directory) for n in names]
  return max(files, key=os.path.getsize)


# ------------------------------------------------------------------------------- 1. corrupt checkpoints


def test_flipped_bytes_in_a_checkpoint_are_one_line_naming_the_file(capsys, tiny_ckpt, tmp_path):
  ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
  victim = _largest_file(ckpt / "params")
  with open(victim, "r+b") as f:
    f.seek(os.path.getsize(victim) // 2)
    data = f.read(16)
    f.seek(-16, os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))
  with pytest.raises(ValueError, match="sha256 mismatch") as e:
    load_lib.load_model(str(ckpt))
  assert os.path.relpath(victim, ckpt) in str(e.value) and "\n" not in str(e.value)
  one_line_error(run(capsys, "generate", "hi", "--model", str(ckpt)), os.path.basename(victim), "damaged")


def test_truncated_checkpoint_is_one_line_naming_the_file(capsys, tiny_ckpt, tmp_path):
  ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
  victim = _largest_file(ckpt / "params")
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  one_line_error(run(capsys, "generate", "hi", "--model", str(ckpt)), os.path.basename(victim), "truncated")


def test_damaged_checkpoint_json_is_one_line(tiny_ckpt, tmp_path):
  ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
  marker = ckpt / checkpoint.MARKER
  meta = json.loads(marker.read_text())
  meta["config"]["rope_theta"] = 20000.0  # a silently wrong model, were it read
  marker.write_text(json.dumps(meta))
  with pytest.raises(ValueError, match=f"{checkpoint.MARKER} is damaged"):
    load_lib.load_model(str(ckpt))
  marker.write_bytes(marker.read_bytes()[:1000])
  with pytest.raises(ValueError, match=f"{checkpoint.MARKER} is damaged"):
    load_lib.load_model(str(ckpt))


@pytest.mark.parametrize("fmt, message", [(1, "format 1 .*no checksums; convert the source again"),
                                          (2, "format 2 .*projections apart; convert the source again")])
def test_older_checkpoint_formats_are_refused_in_one_line(tiny_ckpt, tmp_path, fmt, message):
  ckpt = _copy(tiny_ckpt, tmp_path / "ckpt")
  marker = ckpt / checkpoint.MARKER
  meta = json.loads(marker.read_text())
  marker.write_text(json.dumps({"format": fmt, "config": meta["config"], "tokenizer": None}))
  with pytest.raises(ValueError, match=message) as e:
    load_lib.load_model(str(ckpt))
  assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------- atomic writes and leftovers


def test_an_interrupted_convert_leaves_nothing(capsys, tiny_hf_dir, tmp_path, monkeypatch):
  """Case 4 in-process: the interrupt lands after orbax wrote its files; the partial directory goes with it."""
  def interrupt(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(checkpoint, "file_digests", interrupt)
  out = tmp_path / "out"
  rc, _, err = run(capsys, "convert", str(tiny_hf_dir), str(out))
  assert rc == 130 and err.splitlines()[-1] == f"jkv: interrupted; nothing written to {out}" and "Traceback" not in err
  assert os.listdir(tmp_path) == []


def test_leftovers_of_an_interrupted_run_are_named(capsys, tiny_hf_dir, tmp_path):
  """Case 7: loading what a killed convert left says the leftover is one, and what to delete; the next convert to
  that directory removes it (no live process holds its lock) and writes the checkpoint."""
  out = tmp_path / "out"
  (tmp_path / "out.jkv-partial" / "params").mkdir(parents=True)
  one_line_error(run(capsys, "info", "--model", str(out)), "out.jkv-partial", "left over from an interrupted", "rm -r")
  rc, _, err = run(capsys, "convert", str(tiny_hf_dir), str(out))
  assert rc == 0 and "left over from an interrupted" in err, err
  assert sorted(os.listdir(tmp_path)) == ["out"] and checkpoint.is_checkpoint(str(out))
  # An older jkv wrote straight into the target, and orbax's own temporary directory was left there.
  old = tmp_path / "old"
  (old / "params.orbax-checkpoint-tmp-1731").mkdir(parents=True)
  result = run(capsys, "convert", str(tiny_hf_dir), str(old))
  one_line_error(result, "left over from an interrupted", str(old))
  assert "loading" not in result[2]  # refused before the source was read
  one_line_error(run(capsys, "info", "--model", str(old)), "left over from an interrupted")


def test_convert_shows_its_stages_and_writes_atomically(capsys, tiny_hf_dir, tmp_path):
  out = tmp_path / "out"
  rc, _, err = run(capsys, "convert", str(tiny_hf_dir), str(out))
  assert rc == 0, err
  stages = ["loading ", "checking ", "saving ", "verifying "]
  positions = [err.find(s) for s in stages]
  assert -1 not in positions and positions == sorted(positions), err
  assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial directory left beside it
  assert checkpoint.is_checkpoint(str(out))


def test_convert_into_a_non_empty_directory_is_refused_before_loading(capsys, tmp_path):
  """Case 6: the source does not even exist; the target is what is wrong, and it is checked first."""
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("x")
  one_line_error(run(capsys, "convert", str(tmp_path / "no-such-source"), str(tmp_path / "full")), "not empty")


# ------------------------------------------------------------------------------- 2. non-finite parameters


def _edit_safetensors(directory, edit):
  from safetensors.numpy import load_file, save_file
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def test_non_finite_weights_are_refused_at_load(capsys, tiny_hf_dir, tmp_path):
  hf = _copy(tiny_hf_dir, tmp_path / "hf")
  _edit_safetensors(hf, lambda t: t["model.layers.1.self_attn.q_proj.weight"].__setitem__((3, 5), np.nan))
  with pytest.raises(ValueError, match=r"params\.layers\.qkv holds 1 non-finite float32 value\(s\), the first nan "
                                       r"at index \(1, 5, ") as e:
    load_lib.load_model(str(hf))
  assert "\n" not in str(e.value)
  one_line_error(run(capsys, "info", "--model", str(hf)), "params.layers.qkv", "non-finite")  # (no tokenizer)
  _edit_safetensors(hf, lambda t: t["model.embed_tokens.weight"].__setitem__((7, 0), np.inf))
  with pytest.raises(ValueError, match=r"params\.embedding holds 1 non-finite float32 value\(s\), the first inf "
                                       r"at index \(7, 0\)"):
    load_lib.load_model(str(hf))


def test_non_finite_weights_in_a_checkpoint_are_refused(tiny_ckpt, tmp_path):
  model = load_lib.load_model(str(tiny_ckpt))
  params = model.params.replace(final_norm=model.params.final_norm.at[2].set(jnp.nan))
  checkpoint.save(str(tmp_path / "nan"), model.config, params)
  with pytest.raises(ValueError, match=r"params\.final_norm holds 1 non-finite"):
    load_lib.load_model(str(tmp_path / "nan"))
  with pytest.raises(ValueError, match=r"params\.final_norm holds 1 non-finite bfloat16"):
    load_lib.load_model(str(tmp_path / "nan"), dtype="bfloat16")


# ------------------------------------------------------------------------------- 3. streaming


def test_stream_never_splits_a_character(capsys):
  prompt = "Reply with only emoji: 🎉🎂🎈🥳"
  rc, plain, err = run(capsys, "generate", prompt, "--max-new-tokens", "12")
  assert rc == 0, err
  rc, streamed, err = run(capsys, "generate", prompt, "--max-new-tokens", "12", "--stream")
  assert rc == 0, err
  assert any(ord(c) > 0xFFFF for c in plain)  # the answer holds characters that byte tokens split
  assert "\ufffd" not in streamed
  assert streamed == plain


# ------------------------------------------------------------------------------- 4. Ctrl-C in a real process


def _interrupt_when(argv, line_start, timeout=300):
  """Run ``jkv ARGV`` in a new process, send SIGINT when a stderr line starts with ``line_start``; (rc, stderr)."""
  # ``python -m jkv.cli`` with Python's own SIGINT handler, as from a terminal: a CI job may run us with SIGINT
  # ignored, which a child inherits (and resetting it in preexec_fn would fork a process that runs jax threads).
  start = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "runpy.run_module('jkv.cli', run_name='__main__', alter_sys=True)")
  proc = subprocess.Popen([sys.executable, "-c", start, *argv], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  seen = []
  for line in proc.stderr:
    seen.append(line)
    if line.startswith(line_start):
      proc.send_signal(signal.SIGINT)
      break
  try:
    _, rest = proc.communicate(timeout=timeout)
  finally:
    proc.kill()
  return proc.returncode, "".join(seen) + rest


# The two interrupted commands: (argv, the stderr line that SIGINT follows). Each is a process that loads the model
# and compiles on one core mostly; the module runs those its selected tests read at once, on CI's two cores.
INTERRUPTED = {
    "test_ctrl_c_during_compilation_is_one_line_exit_130": (["generate", FRANCE, "--method", "kivi"],
                                                            "generating with"),
    "test_ctrl_c_during_convert_removes_the_partial_checkpoint": (["convert", "default", "{out}"], "saving to"),
}


@pytest.fixture(scope="module")
def interrupted(request, tmp_path_factory):
  """{test name: a future of (rc, stderr, out)}: ``_interrupt_when`` of each selected test's command, all started
  together; ``out`` is a fresh directory's path that "{out}" in the command stands for."""
  names = [item.originalname for item in request.session.items
           if item.path == request.path and item.originalname in INTERRUPTED]

  def run(name, out):
    argv, line_start = INTERRUPTED[name]
    return (*_interrupt_when([a.format(out=out) for a in argv], line_start), out)
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    return {name: pool.submit(run, name, tmp_path_factory.mktemp("interrupted") / "ckpt") for name in names}


def test_ctrl_c_during_compilation_is_one_line_exit_130(interrupted):
  rc, err, _ = interrupted["test_ctrl_c_during_compilation_is_one_line_exit_130"].result()
  assert rc == 130, err
  assert err.strip().splitlines()[-1] == "jkv: interrupted"
  assert "Traceback" not in err and "Exception ignored" not in err


def test_ctrl_c_during_convert_removes_the_partial_checkpoint(interrupted):
  rc, err, out = interrupted["test_ctrl_c_during_convert_removes_the_partial_checkpoint"].result()
  assert rc == 130, err
  assert err.strip().splitlines()[-1] == f"jkv: interrupted; nothing written to {out}" and "Traceback" not in err, err
  assert os.listdir(out.parent) == [], (os.listdir(out.parent), err)


@pytest.mark.parametrize("after_start", [True, False], ids=["thread-started", "thread-not-started"])
def test_an_interrupt_inside_thread_start_waits_for_the_save_or_cancels_it(monkeypatch, after_start):
  """A save interrupted while ``Thread.start`` waited for its thread: the save ran whole first, or never runs."""
  import threading
  start, log = threading.Thread.start, []

  def interrupted_start(thread):
    if after_start:
      start(thread)
    raise KeyboardInterrupt

  def save():
    log.append("began")
    time.sleep(0.3)
    log.append("ended")
  monkeypatch.setattr(threading.Thread, "start", interrupted_start)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.finished_before_interrupt(save)
  seen = list(log)
  time.sleep(0.5)
  assert seen == log and log in ([], ["began", "ended"]), (seen, log)


def _wait_for(sent):
  deadline = time.monotonic() + 10
  while not sent and time.monotonic() < deadline:  # sent from another thread
    time.sleep(0.01)
  return sent


@pytest.fixture
def program_interrupts(monkeypatch):
  """``_ProgramInterrupts`` entered without touching the real SIGINT handler; SIGINTs it sends land in a list."""
  interrupts, sent = cli._ProgramInterrupts(), []
  monkeypatch.setattr(signal, "signal", lambda *a: signal.default_int_handler)
  # As Python's own at start, whatever the runner left: a job started in the background by a shell without job
  # control (a CI's `cmd &`) ignores SIGINT, and ``_ProgramInterrupts`` leaves an ignored SIGINT alone.
  monkeypatch.setattr(signal, "getsignal", lambda signum: signal.default_int_handler)
  monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
  with interrupts:
    yield interrupts, sent
  assert sys.unraisablehook is not interrupts._unraisable


def test_interrupts_dropped_by_a_callback_are_raised_again(program_interrupts):
  """jax's gc callback ran when 2 of 19 interrupts arrived: Python dropped them with a traceback on stderr."""
  interrupts, sent = program_interrupts
  assert sys.unraisablehook == interrupts._unraisable
  interrupts._unraisable(type("Unraisable", (), {"exc_type": KeyboardInterrupt})())
  assert _wait_for(sent) == [signal.SIGINT] and interrupts.pending
  with pytest.raises(KeyboardInterrupt):
    interrupts._handle(signal.SIGINT, None)
  assert interrupts.count == 0  # raised again, not counted as a second Ctrl-C


def test_interrupts_wait_for_imports(program_interrupts, tmp_path, monkeypatch):
  """Raised inside a C extension's import, an interrupt became ImportError or aborted the process: it waits."""
  interrupts, sent = program_interrupts
  (tmp_path / "jkv_probe_import.py").write_text(
      "import signal, sys\nfrom jkv import cli\nIMPORTING = cli._importing(sys._getframe())\n"
      "cli.INTERRUPTS._handle(signal.SIGINT, sys._getframe())\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(cli, "INTERRUPTS", interrupts, raising=False)
  import jkv_probe_import  # the handler ran inside this import and did not raise
  monkeypatch.delitem(sys.modules, "jkv_probe_import")
  assert jkv_probe_import.IMPORTING and not cli._importing(sys._getframe())
  assert interrupts.count == 1 and interrupts.pending and _wait_for(sent) == [signal.SIGINT]
  with pytest.raises(KeyboardInterrupt):  # sent again, now outside the import: raised
    interrupts._handle(signal.SIGINT, sys._getframe())
  assert interrupts.count == 1


# ------------------------------------------------------------------------------- 5-7. bad input: one line


BAD_INPUT = [
    (["info", "--tokens", "0"], ["--tokens", "must be >= 1, got 0"]),
    # Past the limits: sizes beyond int32 (jax's positions and shapes) and method options too large for
    # jax, which overflowed in numpy with a traceback; a device of no or absurd memory.
    (["info", "--tokens", str(2 ** 31)], ["--tokens", "must be <= 2**31 - 1, got 2147483648"]),
    (["generate", FRANCE, "--capacity", str(10 ** 20)], ["--capacity", "must be <= 2**31 - 1"]),
    (["eval", "passkey", "--trials", str(10 ** 20)], ["--trials", "must be <= 2**31 - 1"]),
    (["info", "--method", "ott", "--residual", str(10 ** 20)], ["--residual", "must be <= 2**31 - 1"]),
    (["info", "--method", "zipcache", "--interval", str(-2 ** 40)], ["--interval", "must be >= -2147483648"]),
    (["info", "--device-gib", "0"], ["--device-gib", "must lie in (0, 1048576] GiB, got 0"]),
    (["info", "--device-gib", "-1"], ["--device-gib", "got -1"]),
    (["info", "--device-gib", "1e30"], ["--device-gib", "got 1e30"]),
    (["compare", "--methods", "kivi:bits=2,bits=4"], ["option bits is given twice"]),
    (["compare", "--methods", "dense", "kivi", "dense"], ["method dense is given twice"]),
    (["compare", "--methods", "dense", "kivi:bits=2", "--baseline", "kivi"],
     ["--baseline kivi is none of the methods compared: dense, kivi:bits=2"]),
    (["info", "--method", "kivi", "--tokens", "-5"], ["--tokens", "got -5"]),
    (["eval", "passkey", "--lengths", "0"], ["--lengths", "got 0"]),
    (["generate", FRANCE, "--stream", "--max-new-tokens", "-5"], ["--max-new-tokens", "got -5"]),
    (["generate", FRANCE, "--stream", "--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    (["generate", FRANCE, "--max-new-tokens", "0"], ["--max-new-tokens", "got 0"]),
    (["generate", FRANCE, "--seed", str(2 ** 64)], ["--seed", str(2 ** 64)]),
    (["generate", FRANCE, "--seed", "-1"], ["--seed", "got -1"]),
    (["eval", "ppl", "--seed", "-1"], ["--seed", "got -1"]),
    (["generate", FRANCE, "--capacity", "0"], ["--capacity", "got 0"]),
    (["generate", FRANCE, "--capacity", "-8"], ["--capacity", "got -8"]),
    (["generate", FRANCE, "--temperature", "nan"], ["--temperature", "nan"]),
    (["generate", FRANCE, "--max-new-tokens", "many"], ["--max-new-tokens", "expected an integer, got 'many'"]),
    (["generate", FRANCE, "--method", "kivi", "--residual", "0"], ["residual=0"]),
    (["generate", FRANCE, "--method", "kivi", "--bits", "3"], ["bits=3"]),
    (["generate", FRANCE, "--method", "fakequant", "--group-size", "0"], ["group_size=0"]),
    (["generate", FRANCE, "--method", "fakequant", "--group-size", "-32"], ["group_size=-32"]),
    (["generate", FRANCE, "--method", "fakequant", "--meta-dtype", "int8"], ["meta_dtype='int8'"]),
    (["generate", FRANCE, "--temperature", "1", "--top-p", "2"], ["top_p"]),
    (["generate", "bad \udcff byte"], ["prompt is not valid UTF-8", "xff"]),
    (["compare", "--output", "/nonexistent/cmp"], ["/nonexistent/cmp.json", "no directory /nonexistent"]),
    (["compare", "--methods", "dense", "kivi:bits=3"], ["bits=3"]),
    (["eval", "passkey", "--plot", "/nonexistent/p.png"], ["/nonexistent/p.png"]),
    (["nonsense"], ["invalid choice"]),
]


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize("argv, words", BAD_INPUT, ids=[" ".join(a).replace(FRANCE, "PROMPT") for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_before_the_model_loads(capsys, argv, words):
  one_line_error(run(capsys, *argv), *words)


@pytest.mark.usefixtures("no_model")
def test_invalid_utf8_on_stdin_is_one_line(capsys, monkeypatch):
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait"), encoding="utf-8"))
  one_line_error(run(capsys, "generate"), "standard input is not valid UTF-8", "byte 3")
  # In the C locale Python reads stdin with surrogateescape: the same bytes arrive as a lone surrogate.
  monkeypatch.setattr(sys, "stdin", io.StringIO("caf\udce9 au lait"))
  one_line_error(run(capsys, "generate"), "standard input is not valid UTF-8", "xe9")


def test_passkey_lengths_are_all_checked_before_any_runs(capsys, monkeypatch):
  from jkv import generate as gen
  monkeypatch.setattr(gen, "generate", lambda *a, **k: pytest.fail("generation ran before every length was checked"))
  one_line_error(run(capsys, "eval", "passkey", "--lengths", "80", "10", "--trials", "1", "--depths", "0.5"),
                 "pass-key length 10 is too short")
  one_line_error(run(capsys, "compare", "--methods", "dense", "--passkey-lengths", "80", "10", "--output", "",
                     "--windows", "1", "--context", "16", "--scored", "4"), "pass-key length 10 is too short")


def test_errors_start_their_own_line_after_a_progress_bar(capsys, monkeypatch):
  """Case 9: an exception skipped a bar's close; the error line used to be glued onto the bar."""
  from tqdm.auto import tqdm

  def fail(*args, **kwargs):
    bar = tqdm(total=10, desc="passkey kivi", file=sys.stderr)
    bar.update(3)
    raise ValueError("the disk is full")
  monkeypatch.setattr(load_lib.ModelSource, "load", fail)
  rc, _, err = run(capsys, "generate", FRANCE)
  assert rc == 2
  line = next(l for l in err.split("\n") if "jkv: error" in l)
  assert line.rsplit("\r", 1)[-1] == "jkv: error: the disk is full", repr(err)


def test_memory_error_and_interrupt_are_one_line(capsys, monkeypatch):
  def oom(*args, **kwargs):
    raise MemoryError
  monkeypatch.setattr(load_lib.ModelSource, "load", oom)
  one_line_error(run(capsys, "generate", FRANCE), "out of host memory", rc=1)

  def interrupt(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(load_lib.ModelSource, "load", interrupt)
  rc, _, err = run(capsys, "generate", FRANCE)
  assert rc == 130 and err.strip().splitlines()[-1] == "jkv: interrupted" and "Traceback" not in err

  def interrupted_import(*args, **kwargs):  # what numpy's C extension made of Ctrl-C during its import
    try:
      raise KeyboardInterrupt
    except KeyboardInterrupt as e:
      raise ImportError("Encountered an error while initializing the extension.") from e
  monkeypatch.setattr(load_lib.ModelSource, "load", interrupted_import)
  rc, _, err = run(capsys, "generate", FRANCE)
  assert rc == 130 and err.strip().splitlines() == ["loading model default ...", "jkv: interrupted"]


# ------------------------------------------------------------------------------- 9. help and version


def _all_parsers(parser):
  yield parser
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        yield from _all_parsers(sub)


def test_every_option_has_help_and_method_options_name_owner_and_default():
  parsers = list(_all_parsers(cli.build_parser()))
  assert len(parsers) >= 7  # jkv, generate, convert, info, eval, eval ppl, eval passkey, compare
  for parser in parsers:
    for action in parser._actions:
      if isinstance(action, argparse._SubParsersAction):
        continue  # the command itself: each command's parser has its help
      assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help"
  generate = next(p for p in parsers if p.prog == "jkv generate")
  helps = {a.option_strings[0]: a.help for a in generate._actions if a.option_strings}
  # Each method option names every method that has it, and each one's own default, read here from the configs.
  for flag, field in (("--residual", "residual"), ("--bits", "bits"), ("--group-size", "group_size")):
    owners = [n for n in methods.known_methods()
              if field in {f.name for f in dataclasses.fields(methods.method_class(n))}]
    defaults = {n: next(f.default for f in dataclasses.fields(methods.method_class(n)) if f.name == field)
                for n in owners}
    assert "kivi" in owners and len(owners) > 1
    if len(set(defaults.values())) == 1:
      expected = f"(methods: {', '.join(owners)}; default: {defaults[owners[0]]})"
    else:
      expected = f"(methods: {', '.join(owners)}; default: " + ", ".join(f"{defaults[n]} for {n}" for n in owners) + ")"
    assert expected in helps[flag], (flag, helps[flag])
  assert "(method: fakequant; default: channel)" in helps["--key-axis"]


def test_version(capsys):
  """The installed distribution's version; from a source tree that was never installed (PYTHONPATH=., as on the
  GPU machine), a version that says so."""
  from importlib.metadata import PackageNotFoundError, version
  try:
    expected = version("jkv")
  except PackageNotFoundError:
    expected = "unknown (not installed)"
  rc, out, _ = run(capsys, "--version")
  assert rc == 0 and out.strip() == f"jkv {expected}"
