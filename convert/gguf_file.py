"""GGUF files (llama.cpp) -> ``(ModelConfig, Params)`` and the tokenizer they carry.

The tensors are dequantized with ``gguf.quants.dequantize`` (Q4_1, Q8_0, F16, F32, ...), renamed to Hugging Face
names and fed through the one key table in ``jkv_convert.hf_safetensors``. Two layout facts:

- ggml lists a tensor's dimensions innermost first: a tensor of ``shape [576, 49152]`` dequantizes to a numpy
  array ``[49152, 576]``, which is already HF's ``[out, in]``.
- llama.cpp's converter permutes the rows of q and k within each head for its interleaved RoPE
  (``llama`` architecture only; ``qwen2`` files use the NeoX form and are not permuted). jkv uses HF's
  rotate-half RoPE, so the permutation is undone here, as transformers' GGUF loader does.
"""

import os
import re
from typing import Iterator, Optional

import gguf
import numpy as np

from jkv import params as params_lib
from jkv.config import DTYPES, ModelConfig
from jkv.tokenizer import Tokenizer
from jkv_convert import hf_safetensors

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # general.architecture -> jkv architecture

# GGUF tensor name -> HF tensor name ("{}" is the layer index).
_GGUF_TO_HF = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{}.self_attn.q_proj.{}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{}.self_attn.k_proj.{}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{}.self_attn.v_proj.{}"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{}.mlp.down_proj.weight"),
)
_GGUF_TO_HF_COMPILED = tuple((re.compile(p), hf) for p, hf in _GGUF_TO_HF)
_REQUIRED = object()  # a metadata key without a default


def open_gguf(path: str) -> gguf.GGUFReader:
  """Open a GGUF file (memory-mapped; a few seconds for a large vocabulary); clear errors for a missing or bad
  file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such GGUF file: {path}")
  try:
    return gguf.GGUFReader(path)
  except (ValueError, OSError, IndexError, KeyError) as e:
    raise ValueError(f"cannot read GGUF file {path}: {e}") from None


def _field(reader: gguf.GGUFReader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _architecture(reader: gguf.GGUFReader) -> str:
  arch = _field(reader, "general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise ValueError(f"unsupported GGUF architecture {arch!r}; jkv reads {', '.join(GGUF_ARCHITECTURES)}")
  return arch


def config_from_gguf(reader: gguf.GGUFReader, dtype: str = "float32") -> ModelConfig:
  """The ``ModelConfig`` a GGUF's ``{arch}.*`` metadata describes (vocabulary size from ``token_embd``)."""
  if dtype not in DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
  arch = _architecture(reader)
  source = reader.data.filename

  def meta(key, default=_REQUIRED):
    value = _field(reader, f"{arch}.{key}", default)
    if value is _REQUIRED:
      raise ValueError(f"{source}: missing metadata {arch}.{key}")
    return value

  names = {t.name: t for t in reader.tensors}
  if "rope_freqs.weight" in names or meta("rope.scaling.type", "none") != "none":
    raise ValueError(f"{source}: RoPE scaling stored in GGUF form (rope_freqs / rope.scaling.type) "
                     "is not supported; convert the Hugging Face directory instead")
  embed, q_heads = meta("embedding_length"), meta("attention.head_count")
  head_dim = meta("attention.key_length", embed // q_heads)
  rope_dim = meta("rope.dimension_count", head_dim)
  if rope_dim != head_dim:
    raise ValueError(f"{source}: partial RoPE (rope.dimension_count={rope_dim} < head_dim={head_dim}) is not supported")
  if "token_embd.weight" not in names:
    raise ValueError(f"{source}: no token_embd.weight tensor")
  return ModelConfig(
      architecture=GGUF_ARCHITECTURES[arch],
      vocab_size=int(names["token_embd.weight"].shape[1]),  # ggml order: [embed, vocab]
      embed=embed,
      ffw_size=meta("feed_forward_length"),
      num_layers=meta("block_count"),
      q_heads=q_heads,
      kv_heads=meta("attention.head_count_kv", q_heads),
      head_dim=head_dim,
      max_position=meta("context_length"),
      rope_theta=float(meta("rope.freq_base", 10000.0)),
      norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
      qkv_bias=arch == "qwen2",
      tie_embeddings="output.weight" not in names,
      dtype=dtype,
      bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_ids=_eos_ids(reader),
  )


def _eos_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
  """The ids generation stops on: end of sequence, then end of turn / message where the file names them."""
  ids = (_field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom"))
  return tuple(dict.fromkeys(i for i in ids if i is not None))


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k permutation: within each head, rows [even..., odd...] interleaved back to halves.

  ``w``: [heads*head_dim, ...] (a weight [rows, embed] or a bias [rows]); same shape out. llama.cpp's converter
  applies ``w.reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2)``; this is its inverse.
  """
  head_dim = w.shape[0] // heads
  return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(reader: gguf.GGUFReader, cfg: ModelConfig, arch: str) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF name, float32 array in HF layout)`` for every tensor of the file."""
  for t in reader.tensors:
    for regex, hf in _GGUF_TO_HF_COMPILED:
      m = regex.fullmatch(t.name)
      if m:
        break
    else:
      raise ValueError(f"{reader.data.filename}: unknown GGUF tensor {t.name!r}")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    expected = tuple(int(d) for d in reversed(t.shape))  # ggml lists dimensions innermost first
    if w.shape != expected:
      raise ValueError(f"{t.name}: dequantized to {w.shape}, expected {expected} from the GGUF header")
    if arch == "llama" and re.search(r"\.attn_[qk]\.", t.name):
      w = unpermute_rows(w, cfg.q_heads if ".attn_q." in t.name else cfg.kv_heads)
    yield hf.format(*m.groups()), np.asarray(w, np.float32)


def params_from_gguf(reader: gguf.GGUFReader, cfg: ModelConfig) -> params_lib.Params:
  """Dequantize every tensor into the ``cfg.dtype`` parameter tree."""
  return hf_safetensors.assemble(cfg, _hf_tensors(reader, cfg, _architecture(reader)), reader.data.filename)


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Optional[Tokenizer]:
  """The tokenizer a GGUF's ``tokenizer.*`` fields describe, or None when it has no vocabulary."""
  tokens = _field(reader, "tokenizer.ggml.tokens")
  if tokens is None:
    return None
  return Tokenizer.from_gguf_fields(
      model=_field(reader, "tokenizer.ggml.model"),
      pre=_field(reader, "tokenizer.ggml.pre"),
      tokens=tokens,
      token_types=_field(reader, "tokenizer.ggml.token_type", []),
      merges=_field(reader, "tokenizer.ggml.merges", []),
      bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_ids=_eos_ids(reader),
      add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
      chat_template=_field(reader, "tokenizer.chat_template"),
  )


def load_gguf(path: str, dtype: str = "float32") -> tuple[ModelConfig, params_lib.Params]:
  """Read a llama / qwen2 GGUF file as ``dtype`` parameters."""
  reader = open_gguf(path)
  cfg = config_from_gguf(reader, dtype)
  return cfg, params_from_gguf(reader, cfg)
