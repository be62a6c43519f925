"""The one-hand API (``jkv.Model``) against the lower-level path, its one-line errors, and the README's code."""

import pathlib
import re

import pytest

import jkv
from jkv.generate import generate
from jkv.methods import make_method

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model(default_model):
  return jkv.Model.wrap(default_model)


def test_import_loads_no_jax_until_used():
  import subprocess
  import sys
  code = "import sys, jkv; assert 'jax' not in sys.modules; jkv.Model; assert 'jax' in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_matches_lower_level(model):
  tok = model.tokenizer
  prompts = [QUESTION, "Name a prime number."]
  ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_bos=False) for p in prompts]
  low = generate(model.params, model.config, ids, method=make_method("kivi", bits=2, residual=32),
                 max_new_tokens=12, eos_ids=tok.eos_ids)
  out = model.generate(prompts, method="kivi", bits=2, residual=32, max_new_tokens=12)
  assert out.prompt_tokens == ids
  assert out.tokens == low.tokens
  assert out.texts == [tok.decode(t, skip_special_tokens=True) for t in low.tokens]
  assert "Paris" in out.texts[0]
  s = out.stats
  assert s.method == "kivi" and s.kv_host_bytes == 0
  assert s.kv_device_bytes == low.stats["kv_bytes"] and s.dense_kv_bytes == low.stats["dense_kv_bytes"]
  assert s.kv_device_bytes < s.dense_kv_bytes and s.compression > 1
  assert s.as_dict()["compression"] == s.compression and "raw" not in s.as_dict()


def test_prompt_forms_agree(model):
  tok = model.tokenizer
  messages = [{"role": "user", "content": QUESTION}]
  ids = tok.encode(tok.apply_chat_template(messages), add_bos=False)
  assert model.encode(QUESTION) == ids
  assert model.encode(messages) == ids
  assert model.encode(ids) == ids
  assert model.encode(QUESTION, chat=False) == tok.encode(QUESTION)
  a = model.generate(QUESTION, max_new_tokens=6)  # a single string is a batch of one
  b = model.generate(messages, method=make_method("dense"), max_new_tokens=6)  # one conversation, a method object
  c = model.generate([ids], max_new_tokens=6)
  assert a.tokens == b.tokens == c.tokens and len(a.texts) == 1


@pytest.mark.parametrize("call, message", [
    (dict(method="kivi", bitz=2), "method 'kivi' has no option bitz"),
    (dict(method="nope"), "unknown cache method 'nope'"),
    (dict(method="kivi", bits=3), "bits"),
    (dict(method=make_method("kivi"), bits=2), "go with a method name"),
    (dict(method=42), "method must be a method name"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
])
def test_bad_input_is_one_line(model, call, message):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    model.generate([QUESTION], **call)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompts, message", [
    ([], "non-empty list of prompts"),
    (None, "non-empty list of prompts"),
    ([1, 2, 3], "one list of token ids"),
    ([3.5], "a prompt must be a string"),
    ([[{"role": "user", "content": "hi"}, 7]], "a prompt must be a string"),
])
def test_bad_prompts_are_one_line(model, prompts, message):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    model.generate(prompts)
  assert "\n" not in str(e.value)


def test_no_tokenizer_takes_ids_only(tiny_llama):
  _, loaded = tiny_llama
  model = jkv.Model.wrap(loaded)
  if model.tokenizer is None:
    with pytest.raises(ValueError, match="no tokenizer"):
      model.generate(["hello"])
    out = model.generate([[5, 6, 7, 8]], method="kivi", bits=2, max_new_tokens=4)
    assert out.texts is None and len(out.tokens) == 1


def test_device_info():
  info = jkv.device_info()
  assert info["platform"] in ("cpu", "gpu", "tpu") and isinstance(info["pallas"], bool)


def readme_python_block() -> str:
  text = README.read_text()
  section = text[text.index("## Python\n"):]
  section = section[:section.index("\n## ")]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks, "README's Python section has no python code block"
  return blocks[0]


def test_readme_python_section_runs(default_model, monkeypatch, capsys):
  from jkv import load as load_lib
  monkeypatch.setattr(load_lib, "load_model", lambda name, dtype="float32": default_model)  # loaded once already
  exec(compile(readme_python_block(), str(README), "exec"), {})
  printed = capsys.readouterr().out
  assert "Paris" in printed
