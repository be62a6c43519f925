"""The API a notebook user holds in one hand: load a model, generate from text with a named cache method.

    import jkv
    model = jkv.Model.load("default")
    out = model.generate(["What is the capital of France?"], method="kivi", bits=2, max_new_tokens=32)
    out.texts, out.tokens, out.stats.kv_device_bytes, out.stats.dense_kv_bytes

Everything here is a thin layer over the lower-level functions, which stay public for people who want token ids
and pytrees: ``jkv.load.load_model``, ``jkv.methods.make_method``, ``jkv.generate.generate``,
``jkv.sampling.make_sampler``. Text prompts get the model's chat template unless ``chat=False``; a prompt may also
be a chat message list or a list of token ids.

A long document is prefilled once and asked many questions through a saved cache (``jkv.saved_cache``):

    model.generate([document], "kivi", save_cache="doc.cache", max_new_tokens=1)
    model.generate(["Who wrote it?", "When?"], "kivi", cache="doc.cache")

In the chat template the document starts the user's message and each question ends it (``encode_text``).
"""

import dataclasses
from typing import Optional, Sequence, Union

from jkv import generate as generate_lib
from jkv import load as load_lib
from jkv import methods as methods_lib
from jkv.attention import pallas_gpu_available
from jkv.cache import CacheMethod
from jkv.config import ModelConfig
from jkv.params import Params
from jkv.sampling import make_sampler
from jkv.tokenizer import Tokenizer

Prompt = Union[str, Sequence[dict], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Stats:
  """What one ``Model.generate`` call held and how long it took.

  Bytes are counted for the tokens the batch holds at the end (prompts plus generated tokens); the ratio of
  ``dense_kv_bytes`` to the device bytes is the compression, as in ``jkv compare``. Times are seconds of run
  time, compilation apart.
  """

  method: str  # the cache method's registered name
  kv_device_bytes: int  # bytes the cache holds on the accelerator
  kv_host_bytes: int  # bytes it holds in host memory (0 for every method that keeps nothing there)
  dense_kv_bytes: int  # bytes a dense cache in the model dtype would hold for the same tokens
  prefill_s: float  # prompt processing, up to the first token
  decode_s: float  # every token after the first (a speculative method's pre-decode pass: raw["pre_decode_s"])
  decode_tokens_per_s: float  # generated tokens per second over the batch while decoding
  compile_s: float  # tracing and compiling (near zero once the shapes were seen)
  peak_device_bytes: Optional[int]  # the device's peak memory where jax reports it, else None
  attention_impl: str  # "pallas", "xla" or "interpret"
  raw: dict = dataclasses.field(repr=False)  # every statistic ``jkv.generate.generate`` reported

  @property
  def kv_bytes(self) -> int:
    """Device bytes: what ``jkv.generate`` and ``jkv compare`` call ``kv_bytes`` (host bytes are counted apart)."""
    return self.kv_device_bytes

  @property
  def compression(self) -> float:
    """``dense_kv_bytes / kv_bytes``: how many times less device memory than the dense cache (1.0 for dense)."""
    return self.dense_kv_bytes / max(self.kv_bytes, 1)

  def as_dict(self) -> dict:
    """The fields and properties as a plain dict (without ``raw``), e.g. for a table."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "raw"}
    return dict(d, kv_bytes=self.kv_bytes, compression=self.compression)


@dataclasses.dataclass(frozen=True)
class Generation:
  """The result of ``Model.generate``: one entry per prompt in ``texts`` and ``tokens``."""

  texts: Optional[list]  # decoded text in whole characters (Tokenizer.decode_whole), special tokens skipped; None
  # when the model has no tokenizer
  tokens: list  # generated token ids per prompt, cut before the first end-of-sequence token
  prompt_tokens: list  # the token ids each prompt became (chat template applied)
  stats: Stats


@dataclasses.dataclass(frozen=True)
class Model:
  """A loaded model with ``generate``: the same ``config``, ``params`` and ``tokenizer`` as ``jkv.load.Model``."""

  config: ModelConfig
  params: Params
  tokenizer: Optional[Tokenizer]

  @classmethod
  def load(cls, name_or_path: str = "default", dtype: str = "float32") -> "Model":
    """Load ``"default"`` (SmolLM2-135M-Instruct), a Hugging Face directory, a ``.gguf`` file or a directory
    written by ``jkv.convert``, as ``dtype`` ("float32", "bfloat16" or "float16") parameters."""
    return cls.wrap(load_lib.load_model(name_or_path, dtype))

  @classmethod
  def wrap(cls, model) -> "Model":
    """This API's view of a ``jkv.load.Model`` (anything with config, params and tokenizer)."""
    return cls(model.config, model.params, model.tokenizer)

  def encode(self, prompt: Prompt, chat: bool = True, *, starts: bool = True, ends: bool = True) -> list:
    """The token ids ``generate`` feeds for one prompt: a string (in the chat template when ``chat`` and the
    model has one; ``starts`` and ``ends`` as ``encode_text``'s), a chat message list
    ``[{"role": ..., "content": ...}, ...]``, or token ids as they are."""
    if isinstance(prompt, str):
      return encode_text(self._tokenizer("a text prompt"), prompt, chat, starts=starts, ends=ends)
    items = list(prompt) if isinstance(prompt, Sequence) else []
    if items and all(isinstance(m, dict) for m in items):
      tok = self._tokenizer("a chat prompt")
      if tok.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; give text with chat=False, or token ids")
      return tok.encode(tok.apply_chat_template(items), add_bos=False)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
      return items
    raise ValueError(f"a prompt must be a string, a list of chat messages (dicts) or a list of token ids, got "
                     f"{_brief(prompt)}")

  def generate(self, prompts: Union[str, Sequence[Prompt]], method: Union[str, CacheMethod] = "dense", *,
               max_new_tokens: int = 64, chat: bool = True, temperature: float = 0.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
               attention_impl: str = "auto", capacity: Optional[int] = None,
               prefill_tokens: Optional[int] = None, prefill_chunk: Optional[int] = None, mesh=None,
               cache: Optional[str] = None, save_cache: Optional[str] = None, **method_options) -> Generation:
    """Generate for a batch of prompts with the KV cache method ``method`` and its options.

    Args:
      prompts: a list of prompts, each a string, a chat message list or a list of token ids (see ``encode``);
        a single string or a single chat message list is a batch of one.
      method: a registered method name (``jkv.known_methods()``: "dense", "kivi", "fakequant", ...) or a
        method object from ``jkv.make_method``.
      max_new_tokens: tokens generated per prompt at most (fewer when it ends).
      chat: wrap text prompts in the model's chat template (when it has one); False feeds the text raw.
      temperature, top_k, top_p: sampling; temperature 0 is greedy.
      seed: the sampling seed.
      attention_impl: "auto" (the Pallas kernels on a GPU of compute capability >= 8.0, XLA elsewhere),
        "pallas", "xla" or "interpret".
      capacity, prefill_tokens: cache capacity and prompt tokens per prefill call (default: planned from the
        prompts and the free memory).
      prefill_chunk: chunked prefill in chunks of this many tokens, each attending the cache as the method holds
        it (default: whole prompts wherever one fits a call; ``jkv.prefill``).
      mesh: run on a device mesh: a spec such as ``"data=2,model=4"`` (sequences over data; heads, the MLP and
        the cache's KV heads over model), a ``jax.sharding.Mesh`` from ``jkv.sharding.make_mesh``, or None (one
        device). The tokens are the same as on one device.
      save_cache: a directory to create, where the cache is saved as the prompts' prefill leaves it (a long
        document's, to be asked questions later); ``stats.raw["cache_saved"]`` says its bytes and GB/s.
      cache: a directory saved so by this model, method and settings: the prompts continue what it holds (one
        prompt per saved sequence, or any number after one), without prefilling it again.
      **method_options: the method's options, e.g. ``bits=2, group_size=32, residual=128`` for "kivi"; unknown
        or invalid ones raise a one-line ValueError.
    """
    method = self._method(method, method_options)
    batch = self._batch(prompts)
    ids = [self.encode(p, chat, starts=cache is None, ends=save_cache is None) for p in batch]
    eos = self.tokenizer.eos_ids if self.tokenizer is not None else None
    res = generate_lib.generate(self.params, self.config, ids, method=method, max_new_tokens=max_new_tokens,
                                sampler=make_sampler(temperature, top_k, top_p), seed=seed, capacity=capacity,
                                eos_ids=eos, attention_impl=attention_impl, prefill_tokens=prefill_tokens,
                                prefill_chunk=prefill_chunk, mesh=mesh, cache=cache, save_cache=save_cache)
    texts = None
    if self.tokenizer is not None:
      texts = [self.tokenizer.decode_whole(t, skip_special_tokens=True)[0] for t in res.tokens]
    return Generation(texts=texts, tokens=res.tokens, prompt_tokens=ids, stats=_stats(res.stats))

  def _tokenizer(self, what: str) -> Tokenizer:
    if self.tokenizer is None:
      raise ValueError(f"this model has no tokenizer, so {what} cannot be encoded; give token ids instead")
    return self.tokenizer

  @staticmethod
  def _method(method, options) -> CacheMethod:
    if isinstance(method, str):
      return methods_lib.make_method(method, **options)
    if not isinstance(method, CacheMethod):
      raise ValueError(f"method must be a method name ({', '.join(methods_lib.known_methods())}) or a method "
                       f"from jkv.make_method, got {_brief(method)}")
    if options:
      raise ValueError(f"options {', '.join(sorted(options))} go with a method name, not with a method object "
                       f"(give method={method.name!r} and the options, or set them in jkv.make_method)")
    return method

  @staticmethod
  def _batch(prompts) -> list:
    if isinstance(prompts, str):
      return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
      raise ValueError(f"prompts must be a non-empty list of prompts, got {_brief(prompts)}")
    if all(isinstance(p, dict) for p in prompts):
      return [prompts]  # one chat conversation
    if all(isinstance(p, int) for p in prompts):
      raise ValueError("prompts is one list of token ids; give a batch of them: [[id, id, ...]]")
    return list(prompts)


def encode_text(tokenizer: Tokenizer, text: str, chat: bool, *, starts: bool = True, ends: bool = True) -> list:
  """Token ids of one user message's ``text``, in the chat template when ``chat`` and the tokenizer has one (else
  as it is). With a saved cache a message is fed in parts: the template's start only where the text ``starts``
  the message (the cache is empty; False: a blank line joins it to what the cache holds, and no BOS), and its end,
  the assistant's turn, only where the text ``ends`` it (False: the cache is saved, for questions to end it)."""
  if not chat or tokenizer.chat_template is None:
    return tokenizer.encode(text if starts else "\n\n" + text, add_bos=None if starts else False)
  marker = "\x00jkv message\x00"
  before, after = tokenizer.apply_chat_template([{"role": "user", "content": marker}]).split(marker)
  return tokenizer.encode((before if starts else "\n\n") + text + (after if ends else ""), add_bos=False)


def _brief(x) -> str:
  text = repr(x)
  return f"{type(x).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _stats(raw: dict) -> Stats:
  return Stats(method=raw["method"], kv_device_bytes=int(raw["kv_bytes"]), kv_host_bytes=int(raw["kv_host_bytes"]),
               dense_kv_bytes=int(raw["dense_kv_bytes"]), prefill_s=raw["prefill_s"], decode_s=raw["decode_s"],
               decode_tokens_per_s=raw["decode_tokens_per_s"], compile_s=raw["compile_s"],
               peak_device_bytes=raw["peak_device_bytes"], attention_impl=raw["attention_impl"], raw=raw)


def convert(src: str, out: str, dtype: str = "float32") -> Model:
  """Convert ``src`` (a Hugging Face directory, a ``.gguf`` file or "default") into a self-contained jkv
  checkpoint directory ``out`` (which must not exist or be empty); returns the model, ready to generate."""
  return Model.wrap(load_lib.convert(src, out, dtype))


def device_info() -> dict:
  """The first jax device: ``platform``, ``name``, ``compute_capability`` (None off CUDA) and ``pallas`` (True
  where the fused Pallas kernels run: a CUDA GPU of compute capability >= 8.0; a T4 is 7.5); ``devices`` and
  ``processes``: how many there are (a ``mesh`` spans them all)."""
  import jax
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
  return dict(platform=device.platform, name=device.device_kind, compute_capability=cc,
              pallas=pallas_gpu_available(), jax_version=jax.__version__, devices=jax.device_count(),
              processes=jax.process_count())
