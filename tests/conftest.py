"""Shared fixtures: the real default model (jkv and transformers from the same GGUF) and a tiny random Llama."""

import contextlib
import functools
import os

# The suite's programs, and those of the processes it starts, are compiled without LLVM's optimizations: they run
# for a few steps of small shapes, so optimizing machine code is only compile time, which is most of the suite's
# time on CI's 2-core CPU (16% less wall time for the generate, KIVI, API and chunked-prefill modules). XLA's own
# passes run the same at every backend level, but the arithmetic is not always the same: on a Xeon with AVX-512
# FP16 and AMX (2026-12-08) one program's bf16 model over OTT's fp16-metadata cache gave logits up to 0.18 apart
# at the two levels (1e-5 with float32 metadata), its 2-bit codes flipping where an input moved by a rounding.
# JKV_TESTS_OPTIMIZED=1 keeps LLVM's optimizations, for the comparisons that hold only with them on such a CPU
# (test_context_parallel.py's OPTIMIZED). Set before jax starts its CPU client; not on a machine with an NVIDIA
# driver, whose GPU kernels the flag would compile unoptimized too.
if not os.path.exists("/dev/nvidiactl") and not os.environ.get("JKV_TESTS_OPTIMIZED"):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# The suite runs in several processes (pyproject's addopts): on a GPU each would take 75% of its memory at start.
if os.environ.get("PYTEST_XDIST_WORKER"):
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import gguf
import jax
import numpy as np
import pytest
import torch
import transformers

from jkv import hub
from jkv import load as load_lib
from jkv.load import load_model
from tiny_llama import save_tiny_llama


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module. One CI process compiles thousands of programs; kept
  for the whole session, XLA's CPU compiler crashed once (a segmentation fault inside backend_compile) in the
  last module of a clean-clone run; that module passes when run alone. A module's next call of a shared jitted
  function just compiles again."""
  yield
  jax.clear_caches()


@pytest.fixture(autouse=True)
def _no_device_output_folder(monkeypatch):
  """The benchmarks' records also go under $OUT where it is set (the device machine's folder of files to bring
  back); tests that run them write their own temporary records, which must not land there."""
  monkeypatch.delenv("OUT", raising=False)


@pytest.fixture(scope="session")
def default_model():
  """SmolLM2-135M-Instruct in fp32, loaded by jkv."""
  return load_model("default", "float32")


_gguf_readers = {}


@contextlib.contextmanager
def gguf_parsed_once():
  """transformers' GGUF loading (model and tokenizer) with the file parsed once per session: its loader builds a
  ``gguf.GGUFReader`` for the config, another for the weights and another for a tokenizer (5 s each, most of it
  reading the vocabulary's fields), and a tensor-name map of 400 entries for each of 400 tensors (6 s in all). Both
  are pure functions of their arguments, so the same reader and map serve every call; what transformers does with
  them is unchanged. jkv's own loader, outside this context, reads the file itself."""
  real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

  def reader(path, *args, **kwargs):
    key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
    if key not in _gguf_readers:
      _gguf_readers[key] = real_reader(path, *args, **kwargs)
    return _gguf_readers[key]

  gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_name_map)
  try:
    yield
  finally:
    gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


@pytest.fixture(scope="session")
def hf_default_model():
  """The same GGUF loaded by transformers (it dequantizes with the same gguf routines)."""
  path = hub.default_model_path()
  with gguf_parsed_once():
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
  """``tiny_llama.save_tiny_llama``'s model, saved by transformers and loaded by jkv in float32. Returns
  (transformers model, jkv Model)."""
  path = tmp_path_factory.mktemp("tiny_llama")
  return save_tiny_llama(path), load_model(str(path), "float32")


def random_prompts(vocab, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, vocab, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def default_model_once(request):
  """Make ``jkv.load.open_model("default")`` (and so ``load_model``) load once: CLI tests call ``cli.main`` many
  times, and each call would otherwise load the model again (~5 s). In float32 (the CLI's default) it returns the
  session's ``default_model``, so the six modules that run the CLI on it do not each load their own copy; other
  dtypes load once per module."""
  real, loaded = load_lib.open_model, {"float32": request.getfixturevalue("default_model")}  # before the patch

  def open_once(name, dtype="float32"):
    if name != "default":
      return real(name, dtype)
    if dtype not in loaded:
      loaded[dtype] = real(name, dtype).load()
    model = loaded[dtype]
    return load_lib.ModelSource(model.config, model.tokenizer, lambda: model.params)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(load_lib, "open_model", open_once)
    yield


def has_pallas_gpu() -> bool:
  """A CUDA GPU of compute capability >= 8.0, where the Pallas Triton kernels run compiled."""
  try:
    device = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  return float(getattr(device, "compute_capability", "0")) >= 8.0
