"""The tokenizer built from the default model's GGUF fields, held against transformers' GGUF tokenizer."""

import os

import pytest
import transformers

from jkv import hub
from jkv.tokenizer import Tokenizer
from jkv_convert import gguf_file
from conftest import gguf_parsed_once

TEXT = ("Hello, world! Ça va? naïve café — déjà vu.\n\n  Indented\tline 12345 + 67.8 = 3.14159\n"
        "Emoji: 😀🚀 日本語 <|im_start|>user\nhi<|im_end|>\n<|endoftext|> trailing   spaces  ")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy? ünïcödé 😀"}]


@pytest.fixture(scope="module")
def gguf_path():
  return hub.default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
  return gguf_file.tokenizer_from_gguf(gguf_file.open_gguf(gguf_path))


@pytest.fixture(scope="module")
def reference(gguf_path):
  with gguf_parsed_once():  # the file as transformers parsed it for the reference model, where that ran already
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                                      gguf_file=os.path.basename(gguf_path))


def test_ids_match_transformers(ours, reference):
  expected = reference(TEXT, add_special_tokens=False)["input_ids"]
  assert ours.encode(TEXT, add_bos=False) == expected
  assert ours.encode(TEXT) == reference(TEXT)["input_ids"]  # default: the file's add_bos_token (False here)
  assert ours.encode("<|im_start|>")[0] == 1  # special tokens in text stay whole
  assert ours.encode("x", add_bos=True)[0] == ours.bos_id == 1


def test_decode_round_trip(ours, reference):
  ids = ours.encode(TEXT)
  assert ours.decode(ids) == TEXT == reference.decode(ids)
  assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_special_ids(ours):
  assert (ours.bos_id, ours.eos_ids) == (1, (2,))
  assert ours.vocab_size == 49152


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, reference, add_generation_prompt):
  expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
  assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected
  assert expected.startswith("<|im_start|>system\n")  # the template's default system prompt


def test_dict_round_trip(ours):
  again = Tokenizer.from_dict(ours.to_dict())
  assert again.encode(TEXT) == ours.encode(TEXT)
  assert again.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)


def test_hf_dir(ours, reference, tmp_path):
  """A tokenizer saved by transformers reads back through from_hf_dir with the same ids and template."""
  reference.save_pretrained(tmp_path)
  from_dir = Tokenizer.from_hf_dir(str(tmp_path))
  assert from_dir.encode(TEXT) == ours.encode(TEXT)
  assert from_dir.apply_chat_template(MESSAGES) == ours.apply_chat_template(MESSAGES)
  # The special ids are what transformers itself wrote (its GGUF loader's choice of end token differs between
  # versions: 5.17 saves id 1, 5.23 id 2).
  assert from_dir.bos_id == reference.bos_token_id and reference.eos_token_id in from_dir.eos_ids
  assert Tokenizer.from_hf_dir(str(tmp_path / "missing")) is None


def test_sentencepiece_gguf_is_refused():
  with pytest.raises(ValueError, match="'llama'.*byte-level"):
    Tokenizer.from_gguf_fields(model="llama", pre=None, tokens=["a"], token_types=[1], merges=[], bos_id=None,
                               eos_ids=(), add_bos=False, chat_template=None)


# --- streaming ---------------------------------------------------------------------------------------------


def _stream(tokenizer, ids, skip_special_tokens=False):
  decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
  return [decoder.push(i) for i in ids] + [decoder.finish()]


STREAMED = ["🎉🎂🎈🥳", " 🎉 ok 日本語", "Ça va? naïve café — déjà vu 😀🚀", TEXT]


@pytest.mark.parametrize("text", STREAMED)
def test_stream_decoder_never_splits_a_character(ours, text):
  """Byte-level BPE spells an emoji in several tokens, each of which alone decodes to U+FFFD."""
  ids = ours.encode(text, add_bos=False)
  pieces = _stream(ours, ids)
  assert "".join(pieces) == ours.decode(ids) == text
  assert not any("\ufffd" in p for p in pieces)
  if text == "🎉🎂🎈🥳":  # each emoji comes out with the token that completes it, not later
    assert [p for p in pieces if p] == ["🎉", "🎂", "🎈", "🥳"]
    assert [i for i, p in enumerate(pieces) if p] == [2, 5, 8, 11]


def test_stream_decoder_equals_decode_on_random_tokens(ours):
  """Random ids hold bytes that never form a character: they come out as U+FFFD (at the end at the latest), as in
  ``decode``, and the pieces still join to exactly ``decode_whole``'s text (``decode``'s, but bytes of a character
  the last tokens began and never finished)."""
  import numpy as np
  rng = np.random.default_rng(0)
  for _ in range(200):
    ids = rng.integers(0, ours.vocab_size, 12).tolist()
    for skip in (False, True):
      assert "".join(_stream(ours, ids, skip)) == ours.decode_whole(ids, skip_special_tokens=skip)[0]
