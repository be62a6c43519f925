"""Pass-key retrieval (Mohtashami & Jaggi's template, as in KIVI's Appendix B, arXiv:2402.02750) over a grid of
lengths and depths.

A prompt is built by tokens, so that its length in tokens is exactly the one asked for: an instruction, the
filler repeated, the key sentence inserted at the requested depth (a fraction of the filler, moved to the nearest
sentence boundary), more filler, then the question. The model answers greedily through ``jkv.generate`` and the
first 5-digit number in its answer is compared with the key.
"""

import dataclasses
import re
import time
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from jkv import generate as gen
from jkv import sharding
from jkv.cache import CacheMethod
from jkv.config import ModelConfig
from jkv.evaluation.perplexity import mean_stats
from jkv.methods.dense import Dense
from jkv.params import Params

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
KEY_DIGITS = 5
MAX_NEW_TOKENS = 8  # " 12345" is 6 tokens for the default model (one per digit)


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
  ids: list  # the prompt's token ids, exactly ``length`` of them
  key: str
  depth: float  # requested fraction of the filler before the key sentence
  filler_start: int  # token index where the filler starts (after the instruction)
  needle_start: int  # token index where the key sentence starts
  needle_len: int
  filler_tokens: int  # filler tokens in the prompt (before + after the key sentence)


@dataclasses.dataclass(frozen=True)
class PasskeyGrid:
  """Context lengths (tokens) x depths (fraction of the filler before the key), ``trials`` keys per cell."""

  lengths: tuple = (1024, 2048, 4096, 7168)
  depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
  trials: int = 2
  seed: int = 0
  batch_size: int = 5  # prompts generated together (all prompts of one length have the same shape)
  max_batch_tokens: int = 8192  # fewer prompts per batch at long lengths (prefill attention is O(T^2) memory)
  chat: bool = False  # wrap the prompt in the model's chat template
  prefill_chunk: Optional[int] = None  # chunked prefill in chunks of this many tokens (None: the plan's default)

  def validate(self, cfg: Optional[ModelConfig] = None, tokenizer=None) -> None:
    """Raise ValueError (one line) for a grid that cannot run; every length is checked before any runs.

    With ``cfg`` the lengths are checked against the model's context, with ``tokenizer`` each length against
    the tokens its instruction, key sentence and question take (built, as the run builds it, for every key).
    """
    if not self.lengths or not self.depths:
      raise ValueError("pass-key grid needs at least one length and one depth")
    if any(n < 1 for n in self.lengths):
      raise ValueError(f"pass-key lengths must be >= 1, got {list(self.lengths)}")
    if any(not 0.0 <= d <= 1.0 for d in self.depths):
      raise ValueError(f"pass-key depths must lie in [0, 1], got {list(self.depths)}")
    if self.trials < 1 or self.batch_size < 1:
      raise ValueError(f"pass-key trials and batch_size must be >= 1, got {self.trials} and {self.batch_size}")
    if cfg is not None and max(self.lengths) + MAX_NEW_TOKENS > cfg.max_position:
      raise ValueError(f"pass-key length {max(self.lengths)} plus {MAX_NEW_TOKENS} answer tokens exceeds the "
                       f"model's context of {cfg.max_position} tokens")
    if tokenizer is not None:
      for length, keys in zip(self.lengths, self.keys()):
        for key in sorted(set(keys.flat)):
          build_prompt(tokenizer, length, 0.0, key, chat=self.chat)  # a short length raises, naming itself

  def keys(self) -> np.ndarray:
    """[len(lengths), len(depths), trials] keys, fixed by ``seed``."""
    rng = np.random.default_rng(self.seed)
    return rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS,
                        size=(len(self.lengths), len(self.depths), self.trials))


def _filler_ids(tokenizer, n: int) -> tuple[list, list]:
  """At least n filler tokens and the token offsets where its sentences start."""
  pieces = [tokenizer.encode(" " + s.strip().rstrip(".") + ".", add_bos=False) for s in FILLER.split(". ")]
  ids, bounds = [], []
  while len(ids) < n:
    for p in pieces:
      bounds.append(len(ids))
      ids.extend(p)
  bounds.append(len(ids))
  return ids, bounds


def build_prompt(tokenizer, length: int, depth: float, key, *, chat: bool = False) -> PasskeyPrompt:
  """A pass-key prompt of exactly ``length`` tokens with the key sentence at ``depth`` of the filler.

  The filler before the key ends on a sentence boundary (the one nearest depth x filler tokens); the filler
  after it is cut at the token that makes the length exact. With ``chat`` the haystack and question are the
  user turn of the model's chat template and the answer starts in the assistant turn.
  """
  key = str(key)
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"pass-key depth must lie in [0, 1], got {depth}")
  if chat:
    if tokenizer.chat_template is None:
      raise ValueError("chat=True, but the tokenizer has no chat template")
    marker = "\x00HAYSTACK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    before_text, after_text = text.split(marker)
    head = tokenizer.encode(before_text + INSTRUCTION, add_bos=False)
    tail = tokenizer.encode(QUESTION, add_bos=False) + tokenizer.encode(after_text + "The pass key is",
                                                                         add_bos=False)
  else:
    head = tokenizer.encode(INSTRUCTION, add_bos=None)
    tail = tokenizer.encode(QUESTION, add_bos=False)
  needle = tokenizer.encode(NEEDLE.format(key=key), add_bos=False)
  budget = length - len(head) - len(needle) - len(tail)
  if budget < 0:
    raise ValueError(f"pass-key length {length} is too short: instruction, key and question alone take "
                     f"{length - budget} tokens")
  filler, bounds = _filler_ids(tokenizer, 2 * budget + 64)
  target = depth * budget
  cut = min((b for b in bounds if b <= budget), key=lambda b: abs(b - target))
  ids = head + filler[:cut] + needle + filler[cut:budget] + tail
  assert len(ids) == length
  return PasskeyPrompt(ids=ids, key=key, depth=depth, filler_start=len(head), needle_start=len(head) + cut, needle_len=len(needle),
                       filler_tokens=budget)


def parse_key(text: str) -> Optional[str]:
  """The first 5-digit number in ``text`` (not part of a longer number), or None."""
  m = re.search(r"(?<!\d)\d{%d}(?!\d)" % KEY_DIGITS, text)
  return m.group(0) if m else None


@dataclasses.dataclass
class PasskeyResult:
  lengths: list
  depths: list
  accuracy: list  # [len(lengths)][len(depths)] fraction of trials retrieved
  mean_accuracy: float
  answers: list  # per prompt: dict(length, depth, key, answer, correct)
  decode_tokens_per_s: float
  seconds: float
  method_stats: dict = dataclasses.field(default_factory=dict)  # generate's ``method_stats``, mean over batches

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@sharding.under_mesh
def run_passkey(params: Params, cfg: ModelConfig, tokenizer, *, method: CacheMethod = Dense(),
                grid: PasskeyGrid = PasskeyGrid(), progress: Optional[bool] = None,
                attention_impl: str = "auto", mesh=None) -> PasskeyResult:
  """Accuracy of greedy pass-key retrieval per (length, depth) cell under ``method``.

  ``mesh``: as in ``jkv.generate.generate``; a batch is padded to a multiple of its data axis with repeats of its
  last prompt, whose extra answers are dropped."""
  grid.validate(cfg, tokenizer)
  sharding.check_mesh(mesh, cfg)
  params = sharding.shard_params(params, cfg, mesh)  # once, not per batch
  t_start = time.perf_counter()
  keys = grid.keys()
  correct = np.zeros(keys.shape, bool)
  answers, tokens, decode_s, stats = [], 0, 0.0, []
  bar = tqdm(total=keys.size, desc=f"passkey {method.name}", unit="prompt", leave=False,
             disable=progress is False)
  for li, length in enumerate(grid.lengths):
    cells = [(di, t) for di in range(len(grid.depths)) for t in range(grid.trials)]
    per_batch = max(1, min(grid.batch_size, grid.max_batch_tokens // length))
    for i in range(0, len(cells), per_batch):
      batch = cells[i:i + per_batch]
      prompts = [build_prompt(tokenizer, length, grid.depths[di], keys[li, di, t], chat=grid.chat)
                 for di, t in batch]
      ids = [p.ids for p in prompts]
      ids += ids[-1:] * (sharding.round_batch(len(ids), mesh) - len(ids))
      res = gen.generate(params, cfg, ids, method=method, max_new_tokens=MAX_NEW_TOKENS,
                         chunk=MAX_NEW_TOKENS, eos_ids=(), attention_impl=attention_impl,
                         prefill_chunk=grid.prefill_chunk, mesh=mesh)
      tokens += len(batch) * (MAX_NEW_TOKENS - 1)
      decode_s += res.stats["decode_s"]
      stats.append(res.stats["method_stats"])
      for (di, t), p, out in zip(batch, prompts, res.tokens):
        text = tokenizer.decode(out, skip_special_tokens=True)
        ok = parse_key(text) == p.key
        correct[li, di, t] = ok
        answers.append(dict(length=length, depth=grid.depths[di], key=p.key, answer=text, correct=bool(ok)))
      bar.update(len(batch))
  bar.close()
  acc = correct.mean(axis=2)
  return PasskeyResult(lengths=list(grid.lengths), depths=list(grid.depths), accuracy=acc.tolist(),
                       mean_accuracy=float(acc.mean()), answers=answers,
                       decode_tokens_per_s=tokens / max(decode_s, 1e-9), seconds=time.perf_counter() - t_start,
                       method_stats=mean_stats(stats))


def plot_heatmap(result: PasskeyResult, path: str, title: str = "") -> None:
  """Accuracy per (depth, length) cell as a needle-in-a-haystack heat map (green retrieved, red missed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  acc = np.asarray(result.accuracy).T  # [depths, lengths]
  fig, ax = plt.subplots(figsize=(1.3 * len(result.lengths) + 2.5, 0.5 * len(result.depths) + 1.8))
  im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
  ax.set_xticks(range(len(result.lengths)), [str(n) for n in result.lengths])
  ax.set_yticks(range(len(result.depths)), [f"{d:.0%}" for d in result.depths])
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("depth of the key")
  for (i, j), v in np.ndenumerate(acc):
    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
  fig.colorbar(im, ax=ax, label="retrieval accuracy")
  ax.set_title(title or f"pass-key retrieval (mean {result.mean_accuracy:.2f})")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
