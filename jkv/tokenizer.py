"""Text <-> token ids, and chat prompts, over the ``tokenizers`` library (no transformers, no torch).

Two sources: a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``) and the ``tokenizer.ggml.*``
fields of a GGUF file. ``jkv_convert.gguf_file`` reads those fields and hands plain Python data to
``Tokenizer.from_gguf_fields``, which rebuilds the byte-level BPE tokenizer the way transformers' GGUF loader does,
so both give the same ids.
"""

import datetime
import functools
import json
import os
from typing import Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

REPLACEMENT = "\ufffd"  # what a decoder makes of bytes that are no (complete) UTF-8 character
MAX_CUT_BYTES = 3  # a UTF-8 character is at most 4 bytes: one cut short leaves at most 3

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# How text is split before BPE, by tokenizer.ggml.pre, where it differs from GPT-2's own byte-level split.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@functools.cache
def _byte_spelling() -> dict[int, str]:
  """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  spelling, extra = {}, 0
  for b in range(256):
    if b in printable:
      spelling[b] = chr(b)
    else:
      spelling[b] = chr(256 + extra)
      extra += 1
  return spelling


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  """The jinja2 environment transformers renders chat templates in (same whitespace rules and helpers)."""

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


class Tokenizer:
  """A ``tokenizers.Tokenizer`` plus what generation needs: BOS/EOS ids and the chat template.

  ``encode`` never lets the backend add special tokens by itself; BOS is added here when asked (by default when
  the source says so: ``add_bos_token``). Special tokens written in the text (``<|im_start|>``) become their ids.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: Optional[int], eos_ids: Sequence[int],
               add_bos: bool = False, chat_template: Optional[str] = None):
    self.backend = backend
    self.bos_id = bos_id
    self.eos_ids = tuple(eos_ids)
    self.add_bos = add_bos
    self.chat_template = chat_template

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of ``text``; ``add_bos`` None follows the source's default."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos):
      if self.bos_id is None:
        raise ValueError("add_bos=True, but this tokenizer has no BOS token")
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_whole(self, ids: Sequence[int], skip_special_tokens: bool = False) -> tuple[str, int]:
    """Text of ``ids`` in whole characters, and how many final tokens were held back to keep it so.

    Generation can stop inside a character (byte-level BPE spells a CJK character or an emoji in two to four byte
    tokens); decoded, the unfinished bytes become U+FFFD. The last tokens are held back while the text ends in
    U+FFFD: at most ``MAX_CUT_BYTES`` of them, the most bytes a character cut short can leave (each token holds
    at least one byte). A U+FFFD that stays after that many is the tokens' own and is kept.
    """
    ids = [int(i) for i in ids]
    for held in range(min(MAX_CUT_BYTES, len(ids)) + 1):
      text = self.decode(ids[:len(ids) - held], skip_special_tokens)
      if not text.endswith(REPLACEMENT):
        return text, held
    return self.decode(ids, skip_special_tokens), 0

  def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
    """An incremental decoder for tokens that arrive one at a time (``jkv generate --stream``)."""
    return StreamDecoder(self, skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """Render ``[{"role": ..., "content": ...}, ...]`` into the prompt text the model was tuned on."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template; pass plain text prompts instead")
    template = _chat_environment().from_string(self.chat_template)
    token = lambda i: None if i is None else self.backend.id_to_token(i)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           bos_token=token(self.bos_id) or "",
                           eos_token=token(self.eos_ids[0] if self.eos_ids else None) or "")

  # -- construction ---------------------------------------------------------------------------------------------

  @classmethod
  def from_gguf_fields(cls, *, model: str, pre: Optional[str], tokens: Sequence[str], token_types: Sequence[int],
                       merges: Sequence[str], bos_id: Optional[int], eos_ids: Sequence[int], add_bos: bool,
                       chat_template: Optional[str]) -> "Tokenizer":
    """A byte-level BPE tokenizer from a GGUF's ``tokenizer.ggml.*`` fields (``model`` must be ``gpt2``).

    Control tokens (token_type 3) become special tokens and user-defined ones (4) plain added tokens, so that both
    stay whole in text; ``pre`` picks the split regex the merges were learned with.
    """
    if model != "gpt2":
      raise ValueError(f"GGUF tokenizer model {model!r} is not supported; jkv builds byte-level BPE ('gpt2') "
                       "tokenizers only (convert from the Hugging Face directory instead)")
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet are written as text in some files: spell them in bytes, as transformers does.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    backend = tokenizers.Tokenizer(bpe)
    split = _PRE_SPLITS.get(pre)
    if split is None:
      backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
      backend.pre_tokenizer = pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(split), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
      ])
    backend.decoder = decoders.ByteLevel()
    # A "control" token outside the byte alphabet is a llama.cpp mislabel; transformers skips it, and so do we.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab])
    return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, chat_template=chat_template)

  @classmethod
  def from_hf_dir(cls, path: str) -> Optional["Tokenizer"]:
    """The tokenizer of a Hugging Face directory, or None when it has no ``tokenizer.json``."""
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
      return None
    backend = tokenizers.Tokenizer.from_file(tokenizer_json)
    config = {}
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
      with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
      chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):  # transformers 5 writes it apart
      with open(os.path.join(path, "chat_template.jinja")) as f:
        chat_template = f.read()

    def token_id(key):
      token = config.get(key)
      token = token.get("content") if isinstance(token, dict) else token
      return None if token is None else backend.token_to_id(token)

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # no flag: does the backend's post-processor put BOS first?
      add_bos = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
    return cls(backend, bos_id=bos_id, eos_ids=() if eos_id is None else (eos_id,), add_bos=bool(add_bos),
               chat_template=chat_template)

  def to_dict(self) -> dict:
    """Everything this tokenizer is, as JSON-able data (a converted checkpoint stores it)."""
    return {"backend": json.loads(self.backend.to_str()), "bos_id": self.bos_id, "eos_ids": list(self.eos_ids),
            "add_bos": self.add_bos, "chat_template": self.chat_template}

  @classmethod
  def from_dict(cls, data: dict) -> "Tokenizer":
    return cls(tokenizers.Tokenizer.from_str(json.dumps(data["backend"])), bos_id=data["bos_id"],
               eos_ids=data["eos_ids"], add_bos=data["add_bos"], chat_template=data["chat_template"])


class StreamDecoder:
  """Text of a token stream, piece by piece, never cutting a character in two.

  One token can hold part of a character (byte-level BPE spells an emoji in three or four byte tokens), and its
  text alone decodes to U+FFFD. ``push`` therefore holds back text that ends in U+FFFD until a later token
  completes the character; ``finish`` gives what is still held but bytes that never completed (a stream that
  stopped inside a character). The pieces joined equal ``Tokenizer.decode_whole`` of all the tokens. Each call decodes only the tokens since the last
  printed piece plus the one before it (``_prefix``), so that decoders which treat the first token specially (a
  leading space stripped) give the same text as in the middle of a sequence; the cost per token stays constant.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
    self._decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    self._decode_whole = functools.partial(tokenizer.decode_whole, skip_special_tokens=skip_special_tokens)
    self._ids: list[int] = []
    self._prefix = 0  # ids[_prefix:_read] decode to text already given out
    self._read = 0  # ids[_read:] are not given out yet

  def push(self, token_id: int) -> str:
    """Add one token; returns the new text that is safe to print (possibly "")."""
    self._ids.append(int(token_id))
    shown = self._decode(self._ids[self._prefix:self._read])
    text = self._decode(self._ids[self._prefix:])
    if len(text) <= len(shown) or text.endswith(REPLACEMENT):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return text[len(shown):]

  def finish(self) -> str:
    """The text still held back at the end of the stream, in whole characters (``Tokenizer.decode_whole``)."""
    shown = self._decode(self._ids[self._prefix:self._read])
    text, _ = self._decode_whole(self._ids[self._prefix:])
    self._prefix = self._read = len(self._ids)
    return text[len(shown):]
