"""The ``jkv`` command line: generate (JSON, batches, stdin, streaming), info, convert, and bad input.

Commands run in-process through ``jkv.cli.main`` (it returns the exit status), with the default model loaded once
for the module; one test runs the README's set-up command in a subprocess exactly as written.
"""

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from jkv import cli
from jkv.attention import hopper_kernel_available
from jkv.cache import CacheSpec
from jkv.methods.kivi import Kivi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRANCE = "What is the capital of France?"
# The default model, SmolLM2-135M-Instruct, as jkv runs it: 30 layers, 3 KV heads of D = 64, fp32 activations.
LAYERS, KV_HEADS, HEAD_DIM, ACT_BYTES = 30, 3, 64, 4
DENSE_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * ACT_BYTES  # 46,080
# Lines that may come before an error; the last is printed while another process unpacks the model into a fresh cache.
PROGRESS = ("loading model ", "generating with ", "jkv: another process is fetching the default model")


pytestmark = pytest.mark.usefixtures("default_model_once")


_results = {}


def jkv(capsys, *argv, memo=True):
  """Run ``jkv ARGV`` in-process; returns (exit status, stdout, stderr). Identical argv run once per module."""
  if memo and argv in _results:
    return _results[argv]
  capsys.readouterr()
  rc = cli.main(list(argv))
  out, err = capsys.readouterr()
  if memo:
    _results[argv] = (rc, out, err)
  return rc, out, err


def json_of(capsys, *argv):
  rc, out, err = jkv(capsys, *argv)
  assert rc == 0, err
  assert out.count("\n") == 1, out  # exactly one JSON object on one line
  return json.loads(out)


def held_tokens(res, max_new_tokens):
  """Tokens the cache holds per sequence, as generate.py counts them (``held = lens + decoded_steps``): the prompt
  plus the decode steps the batch ran, capped at the tokens asked for but the last (never fed back). With
  max_new_tokens <= 32 one decode chunk covers them all, and it runs unless every sequence ended at its first
  token. A sequence that stopped at end-of-sequence still counts the steps run past it. Checked against the dense
  byte count, exactly 46,080 bytes a token."""
  steps = max_new_tokens - 1 if any(res["new_tokens"]) else 0
  held = [p + steps for p in res["prompt_tokens"]]
  assert res["dense_kv_bytes"] == DENSE_BYTES_PER_TOKEN * sum(held)
  return np.array(held)


def spec_for(res):
  return CacheSpec(num_layers=LAYERS, batch=res["batch"], capacity=res["capacity"], kv_heads=KV_HEADS,
                   head_dim=HEAD_DIM, q_per_kv=3, dtype=jnp.float32)


# ------------------------------------------------------------------------------------------------- generate


def test_generate_json_dense(capsys):
  res = json_of(capsys, "generate", FRANCE, "--max-new-tokens", "16", "--json")
  for key in ("text", "tokens", "kv_bytes", "dense_kv_bytes", "prefill_s", "decode_tokens_per_s"):
    assert key in res
  assert isinstance(res["text"], str) and "Paris" in res["text"]
  assert isinstance(res["tokens"], list) and 1 <= len(res["tokens"]) <= 16
  assert all(isinstance(t, int) for t in res["tokens"])
  assert res["method"] == "dense" and res["method_config"] == {}
  assert res["new_tokens"] == [len(res["tokens"])]
  held_tokens(res, 16)
  assert res["kv_bytes"] == res["dense_kv_bytes"]
  assert res["prefill_s"] > 0 and res["decode_tokens_per_s"] > 0


def test_generate_json_kivi_2bit(capsys):
  res = json_of(capsys, "generate", FRANCE, "--method", "kivi", "--bits", "2", "--residual", "32",
                "--max-new-tokens", "16", "--json")
  assert "Paris" in res["text"]
  assert res["method"] == "kivi"
  assert res["method_config"]["bits"] == 2 and res["method_config"]["residual"] == 32
  assert res["method_config"]["mma"] is False  # decided as it ran: no Hopper kernel here (a CPU, or --residual 32)
  held = held_tokens(res, 16)
  assert res["kv_bytes"] < res["dense_kv_bytes"]
  assert res["kv_bytes"] == Kivi(bits=2, residual=32).held_bytes(spec_for(res), None, held).total
  # The same number from the formula in docs/methods/kivi.md, 'Bytes': fp16 scales, fp32 exact parts.
  n = int(held[0])
  n_k, n_v = 32 * (n // 32), max(n - 32, 0)
  per_row = (0.25 + 4 / 32) * n_k + (0.25 + 4 / 32) * n_v + ACT_BYTES * ((n - n_k) + (n - n_v))
  assert res["kv_bytes"] == round(LAYERS * KV_HEADS * HEAD_DIM * per_row) + 4


def test_generate_batch_of_prompts(capsys):
  single = json_of(capsys, "generate", FRANCE, "--max-new-tokens", "16", "--json")
  res = json_of(capsys, "generate", FRANCE, "What is the capital of Italy? Answer in one sentence.",
                "--max-new-tokens", "16", "--json")
  assert isinstance(res["text"], list) and len(res["text"]) == 2
  assert isinstance(res["tokens"], list) and len(res["tokens"]) == 2
  assert res["batch"] == 2 and len(res["prompt_tokens"]) == 2
  assert res["prompt_tokens"][0] < res["prompt_tokens"][1]
  assert "Paris" in res["text"][0] and "Rome" in res["text"][1]
  # Batching does not change a sequence's tokens (greedy): the first prompt gets what it gets alone.
  assert res["tokens"][0] == single["tokens"] and res["text"][0] == single["text"]
  held_tokens(res, 16)


def test_generate_reads_the_prompt_from_stdin(capsys, monkeypatch):
  single = json_of(capsys, "generate", FRANCE, "--max-new-tokens", "16", "--json")
  monkeypatch.setattr(sys, "stdin", io.StringIO(FRANCE))
  res = json_of(capsys, "generate", "--max-new-tokens", "16", "--json")
  assert "Paris" in res["text"]
  assert res["tokens"] == single["tokens"]


def test_stream_prints_the_same_text_as_greedy(capsys):
  rc, plain, err = jkv(capsys, "generate", FRANCE, "--max-new-tokens", "12")
  assert rc == 0, err
  assert "kv cache:" in err  # the stats line goes to stderr, never into the text
  rc, streamed, err = jkv(capsys, "generate", FRANCE, "--max-new-tokens", "12", "--stream")
  assert rc == 0, err
  assert "Paris" in streamed
  assert streamed == plain


def _build_requirement_reachable() -> bool:
  """Whether pip can fetch setuptools, which ``pip install -e .`` builds with (in an isolated environment, so from a
  package index or pip's find-links, never from what is installed); fails fast where no index answers."""
  with tempfile.TemporaryDirectory() as d:
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--timeout",
                           "5", "--retries", "0", "--quiet", "--dest", d, "setuptools>=64"],
                          capture_output=True, timeout=120)
  return proc.returncode == 0


def test_readme_command_in_a_fresh_process():
  """The README's set-up command, as written (the model is cached after the first fetch)."""
  if not _build_requirement_reachable():
    pytest.skip("no package index or find-links holds setuptools, which `pip install -e .` builds with (a machine "
                "without network, such as the GPU machine)")
  env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
  proc = subprocess.run('pip install -e . && jkv generate "What is the capital of France?" --method kivi --bits 2',
                        shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Paris" in proc.stdout
  assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------- info


def test_info_kivi_compression_matches_the_bytes_formula(capsys):
  info = json_of(capsys, "info", "--json", "--method", "kivi", "--bits", "2", "--tokens", "4096")
  cfg = info["config"]
  assert (cfg["num_layers"], cfg["kv_heads"], cfg["head_dim"], cfg["dtype"]) == (30, 3, 64, "float32")
  assert info["method"] == "kivi" and info["tokens"] == 4096
  # Decided as it would run here: the MMA packing only where the Hopper kernel runs (off on a CPU, on on an H100).
  assert info["method_config"]["mma"] is hopper_kernel_available()
  # The formula in docs/methods/kivi.md, 'Bytes', per (layer, KV head, channel), with b = 2, G = 32, R = 128 (the
  # default), σ = 2 (fp16 scales and zeros), ε = 4 (fp32 activations), N = 4096: nK = R⌊N/R⌋ = 4096 (rK = 0),
  # nV = N - R = 3968 (rV = 128).
  N, R, G, b, sigma, eps = 4096, 128, 32, 2, 2, 4
  n_k, n_v = R * (N // R), N - R
  per_row = (b / 8 + 2 * sigma / G) * n_k + (b / 8 + 2 * sigma / G) * n_v + eps * ((N - n_k) + (N - n_v))
  assert per_row == 1536 + 1488 + 512
  kv = LAYERS * KV_HEADS * HEAD_DIM * per_row + 4  # plus the int32 length (kivi.py kv_bytes docstring)
  dense = 2 * LAYERS * KV_HEADS * HEAD_DIM * eps * N
  assert info["kv_bytes"] == kv == 20_367_364
  assert info["dense_kv_bytes"] == dense == 188_743_680
  assert info["compression"] == pytest.approx(dense / kv, rel=1e-12)
  assert info["compression"] == pytest.approx(9.267, abs=1e-3)
  assert info["kv_bytes_per_token"] == pytest.approx(kv / N)


def test_info_dense_default(capsys):
  info = json_of(capsys, "info", "--json", "--tokens", "100")
  assert info["kv_bytes"] == info["dense_kv_bytes"] == 100 * DENSE_BYTES_PER_TOKEN
  assert info["compression"] == 1.0


def test_info_largest_batch_on_a_given_device(capsys):
  """On 1 GiB with the default model's fp32 weights: dense sequences of 4096 tokens take 4096 * 92160 bytes
  each; the batch is what fits beside the weights, a reserve and one prefill (jkv.memory), and KIVI-2's far
  smaller cache fits several times as many."""
  from jkv import memory
  dense = json_of(capsys, "info", "--json", "--tokens", "4096", "--device-gib", "8")
  kivi = json_of(capsys, "info", "--json", "--tokens", "4096", "--device-gib", "8", "--method", "kivi", "--bits", "2")
  assert dense["device_bytes"] == 8 * 2**30
  weights = 134_515_008 * 4  # SmolLM2-135M's parameter count, in fp32
  # Prefill activations per prompt token (jkv.memory.prefill_bytes_per_token): embed 576, 9 x 64 query and
  # 2 x 3 x 64 key/value features, ffw 1536, all fp32.
  prefill = 4 * (4 * 576 + 2 * 576 + 2 * 384 + 3 * 1536)
  sequence = 4096 * DENSE_BYTES_PER_TOKEN + 4  # one sequence's cache; prefill's sub-batch holds one fresh besides
  budget = 8 * 2**30 - weights - memory.RESERVE_BYTES - 4096 * prefill - sequence
  assert dense["largest_batch"] == budget // sequence
  assert kivi["largest_batch"] > 4 * dense["largest_batch"]


# ------------------------------------------------------------------------------------------------- convert


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
  """A tiny random Llama saved by transformers (config.json + model.safetensors, no tokenizer)."""
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=2048, eos_token_id=1, bos_token_id=0)
  path = tmp_path_factory.mktemp("tiny_hf")
  transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
  return path


def test_convert_then_info_reads_it_back(capsys, tiny_hf_dir, tmp_path):
  out_dir = str(tmp_path / "ckpt")
  conv = json_of(capsys, "convert", str(tiny_hf_dir), out_dir, "--json")
  assert conv["out"] == out_dir and os.path.isdir(out_dir)
  want = dict(architecture="llama", vocab_size=128, embed=96, ffw_size=160, num_layers=2, q_heads=6, kv_heads=2,
              head_dim=64, max_position=2048, dtype="float32", bos_id=0, eos_ids=[1])
  assert {k: conv["config"][k] for k in want} == want
  info = json_of(capsys, "info", "--model", out_dir, "--json", "--tokens", "64")
  assert info["config"] == conv["config"]
  assert info["dense_kv_bytes"] == 2 * 2 * 2 * 64 * 4 * 64
  # And the checkpoint reads back the same from the source directory.
  direct = json_of(capsys, "info", "--model", str(tiny_hf_dir), "--json", "--tokens", "64")
  assert direct["config"] == info["config"]
  # Plain (non-JSON) output says where it went.
  rc, text, err = jkv(capsys, "convert", str(tiny_hf_dir), str(tmp_path / "ckpt2"), memo=False)
  assert rc == 0, err
  assert "ckpt2" in text
  # A checkpoint without a tokenizer cannot generate text: one line, exit 2.
  assert_one_line_error(jkv(capsys, "generate", "hello", "--model", out_dir, memo=False), "no tokenizer")


def test_convert_into_a_non_empty_directory_is_bad_input(capsys, tiny_hf_dir, tmp_path):
  out_dir = tmp_path / "full"
  out_dir.mkdir()
  (out_dir / "something").write_text("x")
  assert_one_line_error(jkv(capsys, "convert", str(tiny_hf_dir), str(out_dir), memo=False), "not empty")


# ------------------------------------------------------------------------------------------------- bad input


def assert_one_line_error(result, *words):
  """Exit 2, nothing on stdout, no traceback, and one error line ``jkv: error: ...`` naming the problem (any other
  stderr line is a progress line that came before it)."""
  rc, out, err = result
  assert rc == 2, (rc, err)
  assert out == ""
  assert "Traceback" not in err
  lines = err.strip("\n").splitlines()
  errors = [l for l in lines if l.startswith("jkv: error:")]
  assert len(errors) == 1, err
  assert lines[-1] == errors[0], err
  assert all(l.startswith(PROGRESS) for l in lines[:-1]), err
  for w in words:
    assert w in errors[0], errors[0]


@pytest.mark.parametrize("flags, words", [
    (["--method", "nope"], ["unknown cache method 'nope'", "dense", "kivi"]),
    (["--method", "kivi", "--bits", "3"], ["bits=3"]),
    (["--method", "kivi", "--residual", "100"], ["residual=100", "multiple of group_size=32"]),
    (["--method", "kivi", "--group-size", "48", "--residual", "96"], ["group_size=48", "head dim 64"]),
    (["--model", "/nonexistent/jkv-model"], ["no such model", "/nonexistent/jkv-model"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--top-p", "1.5"], ["top_k/top_p need a temperature"]),
    (["--top-p", "1.5", "--temperature", "1"], ["top_p", "1.5"]),
    (["--top-k", "0", "--temperature", "1"], ["top_k", "0"]),
    (["--capacity", "16", "--max-new-tokens", "8"], ["exceeds the cache capacity of 16 tokens"]),
    (["--capacity", "64", "--max-new-tokens", "32"], ["prompt of 37 tokens", "max_new_tokens=32", "64"]),
], ids=["unknown-method", "kivi-bits-3", "kivi-residual-100", "kivi-group-48", "missing-model",
        "negative-temperature", "top-p-greedy", "top-p-1.5", "top-k-0", "capacity-16", "capacity-64"])
def test_bad_generate_flags(capsys, flags, words):
  assert_one_line_error(jkv(capsys, "generate", FRANCE, *flags, memo=False), *words)


def test_bad_info_flags(capsys):
  assert_one_line_error(jkv(capsys, "info", "--method", "kivi", "--bits", "3", memo=False), "bits=3")
  assert_one_line_error(jkv(capsys, "info", "--method", "nope", memo=False), "unknown cache method")


@pytest.mark.parametrize("prompts, stdin", [([""], None), (["  ", "\n"], None), ([], "")],
                         ids=["empty-arg", "blank-args", "empty-stdin"])
def test_empty_prompt(capsys, monkeypatch, prompts, stdin):
  if stdin is not None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
  assert_one_line_error(jkv(capsys, "generate", *prompts, memo=False), "empty prompt")


def _llama_config_json(path):
  import transformers
  config = transformers.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=64)
  config.architectures = ["LlamaForCausalLM"]
  config.to_json_file(str(path / "config.json"))


@pytest.mark.parametrize("command", ["generate", "info"])
def test_corrupt_safetensors(capsys, tmp_path, command):
  _llama_config_json(tmp_path)
  (tmp_path / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
  args = [command, "--model", str(tmp_path)] + (["hello"] if command == "generate" else [])
  assert_one_line_error(jkv(capsys, *args, memo=False), "model.safetensors")


def test_truncated_safetensors(capsys, tmp_path, tiny_hf_dir):
  for name in os.listdir(tiny_hf_dir):
    shutil.copy(tiny_hf_dir / name, tmp_path / name)
  weights = tmp_path / "model.safetensors"
  with open(weights, "r+b") as f:
    f.truncate(os.path.getsize(weights) // 2)
  assert_one_line_error(jkv(capsys, "info", "--model", str(tmp_path), memo=False), "model.safetensors")


def test_missing_weights(capsys, tmp_path):
  _llama_config_json(tmp_path)
  assert_one_line_error(jkv(capsys, "info", "--model", str(tmp_path), memo=False), "model.safetensors")


@pytest.mark.parametrize("command", ["generate", "info"])
def test_unsupported_architecture(capsys, tmp_path, command):
  (tmp_path / "config.json").write_text(json.dumps(dict(
      architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=64, n_layer=2, n_head=2, vocab_size=128)))
  args = [command, "--model", str(tmp_path)] + (["hello"] if command == "generate" else [])
  assert_one_line_error(jkv(capsys, *args, memo=False), "GPT2LMHeadModel", "unsupported architecture")


def test_config_missing_a_required_key(capsys, tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(dict(
      architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=96, intermediate_size=160,
      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, vocab_size=128)))
  (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
  assert_one_line_error(jkv(capsys, "info", "--model", str(tmp_path), memo=False), "max_position_embeddings")


@pytest.mark.parametrize("make, words", [
    (lambda d: (d / "m.gguf").write_bytes(b""), ["m.gguf", "empty file"]),
    (lambda d: (d / "m.gguf").write_bytes(np.random.default_rng(0).bytes(4096)), ["m.gguf", "GGUF magic invalid"]),
    (lambda d: (d / "m.gguf").mkdir(), ["cannot tell what model", "m.gguf"]),
    (lambda d: (d / "m").mkdir() or (d / "m" / "config.json").write_text("[1, 2]"), ["config.json holds a JSON list"]),
    (lambda d: (d / "m").mkdir() or (d / "m" / "config.json").write_text("{"), ["config.json is not valid JSON"]),
], ids=["empty-gguf", "random-gguf", "directory-named-gguf", "config-a-list", "config-not-json"])
def test_bad_model_files(capsys, tmp_path, make, words):
  """Files that are not what their name says, each one line naming it."""
  make(tmp_path)
  model = next(p for p in tmp_path.iterdir())
  assert_one_line_error(jkv(capsys, "info", "--model", str(model), memo=False), *words)
