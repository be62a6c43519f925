"""Hugging Face checkpoints (``config.json`` + safetensors) -> ``(ModelConfig, Params)``.

This module also holds the one key table of jkv's conversion: HF tensor names -> jkv parameter paths, each with a
per-tensor function that asserts the HF shape before it transposes or reshapes. The GGUF reader
(``jkv_convert.gguf_file``) renames GGUF tensors to HF names, undoes llama.cpp's q/k row permutation, and feeds the
same table through ``assemble``; so both formats give the same tensors in the same layout.

HF layouts (``torch.nn.Linear.weight`` is ``[out, in]``) and the jkv layouts they map to::

  model.embed_tokens.weight   [vocab, embed]              -> embedding [vocab, embed]
  q_proj.weight               [q_heads*head_dim, embed]    -> qkv [L, embed, kv_heads, :g, head_dim]
  k_proj/v_proj.weight        [kv_heads*head_dim, embed]   -> qkv [L, embed, kv_heads, g / g + 1, head_dim]
  q/k/v_proj.bias (Qwen2)     [heads*head_dim]             -> qkv_bias [L, kv_heads, (as qkv), head_dim]
  o_proj.weight               [embed, q_heads*head_dim]    -> o [L, q_heads, head_dim, embed]
  gate_proj/up_proj.weight    [ffw, embed]                 -> gate_up [L, embed, 0 / 1, ffw]
  down_proj.weight            [embed, ffw]                 -> w_down [L, ffw, embed]
  lm_head.weight              [vocab, embed]               -> lm_head [embed, vocab] (None when tied)
"""

import dataclasses
import json
import os
import re
from typing import Callable, Iterable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from jkv import params as params_lib
from jkv.config import DTYPES, ModelConfig, RopeScaling

HF_ARCHITECTURES = {  # config.json "architectures"[0] -> (model_type, jkv architecture)
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
}


# ---------------------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def config_from_hf(hf: dict, dtype: str = "float32", generation: Optional[dict] = None) -> ModelConfig:
  """Map a HF ``config.json`` dict (transformers 4.x or 5.x spelling) to a ``ModelConfig``.

  ``generation`` is ``generation_config.json`` when there is one: its ``eos_token_id`` (often a list for chat
  models) is what generation stops on, so it takes precedence over config.json's. A required key that is
  missing is a one-line ValueError naming it.
  """
  try:
    return _config_from_hf(hf, dtype, generation)
  except KeyError as e:
    raise ValueError(f"config.json has no {e.args[0]!r}, which jkv needs to build the model") from None


def _config_from_hf(hf: dict, dtype: str, generation: Optional[dict]) -> ModelConfig:
  archs = hf.get("architectures") or []
  if archs:
    arch = archs[0]
  else:  # a config saved without "architectures": go by model_type
    arch = {model_type: a for a, (model_type, _) in HF_ARCHITECTURES.items()}.get(hf.get("model_type"))
  if arch not in HF_ARCHITECTURES:
    raise ValueError(f"unsupported architecture {arch or '(none given)'} (model_type {hf.get('model_type')!r}); "
                     f"jkv converts {', '.join(HF_ARCHITECTURES)}")
  model_type, architecture = HF_ARCHITECTURES[arch]
  if hf.get("model_type") != model_type:
    raise ValueError(f"config.json names {arch} but model_type {hf.get('model_type')!r} (expected {model_type!r})")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; jkv's MLP is SwiGLU (silu)")
  if hf.get("mlp_bias"):
    raise ValueError("unsupported mlp_bias=true: jkv's MLP has no biases")
  if architecture != "qwen2" and hf.get("attention_bias"):
    raise ValueError("unsupported attention_bias=true (it adds an o_proj bias, which jkv does not have)")

  q_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // q_heads
  # transformers 5 writes rope_theta and the scaling into "rope_parameters"; 4.x writes them at the top level.
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "llama3":
    rope_scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                               high_freq_factor=float(rope["high_freq_factor"]),
                               original_max_position=int(rope["original_max_position_embeddings"]))
  elif rope_type == "default":
    rope_scaling = None
  else:
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; jkv supports default and llama3")

  max_position = hf["max_position_embeddings"]
  window = _sliding_window(hf)
  if window is not None and window < max_position:
    # jkv attends the full context. A sliding-window model is the same model for every context that fits in the
    # window, so the context jkv offers is clamped to the window rather than silently differing beyond it.
    max_position = window

  eos = (generation or {}).get("eos_token_id", hf.get("eos_token_id"))
  return ModelConfig(
      architecture=architecture,
      vocab_size=hf["vocab_size"],
      embed=hf["hidden_size"],
      ffw_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      q_heads=q_heads,
      kv_heads=hf.get("num_key_value_heads") or q_heads,
      head_dim=head_dim,
      max_position=max_position,
      rope_theta=float(rope_theta),
      rope_scaling=rope_scaling,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=architecture == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype,
      bos_id=hf.get("bos_token_id"),
      eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
  )


def _sliding_window(hf: dict) -> Optional[int]:
  """The attention window a HF config applies to any layer, or None (Mistral: ``sliding_window``; Qwen2: only with
  ``use_sliding_window``)."""
  if hf["model_type"] == "qwen2" and not (hf.get("use_sliding_window")
                                          or "sliding_attention" in (hf.get("layer_types") or ())):
    return None
  return hf.get("sliding_window")


# ---------------------------------------------------------------------------------------------------------------
# The key table: HF name -> (jkv path, per-tensor function). Per-layer paths start with "layers.".


def _expect(w, shape, name):
  if tuple(w.shape) != tuple(shape):
    raise ValueError(f"tensor {name} has shape {tuple(w.shape)}, expected {tuple(shape)} from the config")


def _embedding(w, cfg, name):  # [vocab, embed] -> [vocab, embed]
  _expect(w, (cfg.vocab_size, cfg.embed), name)
  return w


def _lm_head(w, cfg, name):  # [vocab, embed] -> [embed, vocab]
  _expect(w, (cfg.vocab_size, cfg.embed), name)
  return w.T


def _norm(w, cfg, name):  # [embed]
  _expect(w, (cfg.embed,), name)
  return w


def _heads_in(heads: str):
  """q/k/v projections: [heads*head_dim, embed] -> [embed, kv_heads, heads / kv_heads, head_dim] (query head
  g h + j of KV head h; a key or value head is one per KV head)."""

  def f(w, cfg, name):
    h = getattr(cfg, heads)
    _expect(w, (h * cfg.head_dim, cfg.embed), name)
    return w.T.reshape(cfg.embed, cfg.kv_heads, h // cfg.kv_heads, cfg.head_dim)

  return f


def _heads_bias(heads: str):
  """q/k/v biases: [heads*head_dim] -> [kv_heads, heads / kv_heads, head_dim]."""

  def f(w, cfg, name):
    h = getattr(cfg, heads)
    _expect(w, (h * cfg.head_dim,), name)
    return w.reshape(cfg.kv_heads, h // cfg.kv_heads, cfg.head_dim)

  return f


def _heads_out(w, cfg, name):  # o_proj: [embed, q_heads*head_dim] -> [q_heads, head_dim, embed]
  _expect(w, (cfg.embed, cfg.q_heads * cfg.head_dim), name)
  return w.T.reshape(cfg.q_heads, cfg.head_dim, cfg.embed)


def _ffw_in(w, cfg, name):  # gate/up: [ffw, embed] -> [embed, 1, ffw]
  _expect(w, (cfg.ffw_size, cfg.embed), name)
  return w.T[:, None]


def _ffw_out(w, cfg, name):  # down: [embed, ffw] -> [ffw, embed]
  _expect(w, (cfg.embed, cfg.ffw_size), name)
  return w.T


# Where a HF tensor goes in a jkv leaf that holds several (``jkv.params.Layers``: the projections that share an
# input): its name, and its indices along the second-to-last axis of the leaf's layer slot (qkv [embed, kv_heads,
# g + 2, D], qkv_bias [kv_heads, g + 2, D], gate_up [embed, 2, ffw]), from the config.
_PARTS = {
    "q": lambda cfg: slice(0, cfg.q_per_kv),
    "k": lambda cfg: slice(cfg.q_per_kv, cfg.q_per_kv + 1),
    "v": lambda cfg: slice(cfg.q_per_kv + 1, cfg.q_per_kv + 2),
    "gate": lambda cfg: slice(0, 1),
    "up": lambda cfg: slice(1, 2),
}
_LAYER = r"model\.layers\.(\d+)\."
KEY_TABLE: tuple[tuple[str, Optional[str], Optional[str], Optional[Callable]], ...] = (
    (r"model\.embed_tokens\.weight", "embedding", None, _embedding),
    (r"model\.norm\.weight", "final_norm", None, _norm),
    (r"lm_head\.weight", "lm_head", None, _lm_head),
    (_LAYER + r"input_layernorm\.weight", "layers.attn_norm", None, _norm),
    (_LAYER + r"self_attn\.q_proj\.weight", "layers.qkv", "q", _heads_in("q_heads")),
    (_LAYER + r"self_attn\.k_proj\.weight", "layers.qkv", "k", _heads_in("kv_heads")),
    (_LAYER + r"self_attn\.v_proj\.weight", "layers.qkv", "v", _heads_in("kv_heads")),
    (_LAYER + r"self_attn\.q_proj\.bias", "layers.qkv_bias", "q", _heads_bias("q_heads")),
    (_LAYER + r"self_attn\.k_proj\.bias", "layers.qkv_bias", "k", _heads_bias("kv_heads")),
    (_LAYER + r"self_attn\.v_proj\.bias", "layers.qkv_bias", "v", _heads_bias("kv_heads")),
    (_LAYER + r"self_attn\.o_proj\.weight", "layers.o", None, _heads_out),
    (_LAYER + r"post_attention_layernorm\.weight", "layers.mlp_norm", None, _norm),
    (_LAYER + r"mlp\.gate_proj\.weight", "layers.gate_up", "gate", _ffw_in),
    (_LAYER + r"mlp\.up_proj\.weight", "layers.gate_up", "up", _ffw_in),
    (_LAYER + r"mlp\.down_proj\.weight", "layers.w_down", None, _ffw_out),
    (_LAYER + r"self_attn\.rotary_emb\.inv_freq", None, None, None),  # old checkpoints store RoPE buffers
)
_COMPILED = tuple((re.compile(pattern), path, part, fn) for pattern, path, part, fn in KEY_TABLE)


def assemble(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], source: str) -> params_lib.Params:
  """Build ``Params`` from ``(HF name, array in HF layout)`` pairs through the key table.

  Every array is checked against its HF shape, converted to ``cfg.dtype`` and written into its slot of the
  preallocated host arrays (per-layer tensors at their layer index): no list of pieces and stacked copy of each.
  Fails naming ``source`` on an unknown, duplicate or missing tensor. A stored ``lm_head.weight`` is dropped when
  the config ties the embeddings (as transformers does).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(params_lib.abstract(cfg))
  target = {".".join(k.name for k in path): leaf for path, leaf in flat}  # "layers.qkv" -> leaf; no None leaves
  dtype = np.dtype(cfg.jnp_dtype)
  arrays = {path: np.zeros(leaf.shape, dtype) for path, leaf in target.items()}
  # filled[path, part][i]: layer i of a per-layer leaf (or the whole leaf, i = 0) has that part written.
  filled = {(path, part): np.zeros(cfg.num_layers if path.startswith("layers.") else 1, bool)
            for _, path, part, _ in KEY_TABLE if path in target}
  for name, array in tensors:
    for regex, path, part, fn in _COMPILED:
      m = regex.fullmatch(name)
      if m:
        break
    else:
      raise ValueError(f"{source}: unknown tensor {name!r} (not in jkv's key table)")
    if path is None or (path == "lm_head" and cfg.tie_embeddings):
      continue
    if path not in target:
      raise ValueError(f"{source}: tensor {name!r} does not fit this {cfg.architecture} config "
                       f"(no {path} with qkv_bias={cfg.qkv_bias})")
    layer = int(m.group(1)) if m.groups() else None
    if layer is not None and not 0 <= layer < cfg.num_layers:
      raise ValueError(f"{source}: tensor {name!r} is for layer {layer}, but the config has {cfg.num_layers}")
    slot = 0 if layer is None else layer
    if filled[path, part][slot]:
      raise ValueError(f"{source}: duplicate tensor {name!r}")
    value = fn(np.asarray(array), cfg, name)
    destination = arrays[path] if layer is None else arrays[path][layer]
    if part is None:
      destination[...] = value
    else:
      destination[..., _PARTS[part](cfg), :] = value
    filled[path, part][slot] = True

  for (path, part), done in filled.items():
    if not done.all():
      where = f" for layers {np.flatnonzero(~done).tolist()}" if path.startswith("layers.") else ""
      raise ValueError(f"{source}: missing tensor for {path}{'' if part is None else f' ({part})'}{where}")
  return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(arrays.pop(path)) for path in target])


# ---------------------------------------------------------------------------------------------------------------
# Reading a HF directory


def _read_json(directory: str, name: str, required: bool) -> Optional[dict]:
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    if required:
      raise FileNotFoundError(f"no {name} in {directory}")
    return None
  try:
    with open(path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(data, dict):  # every file read here is a JSON object of named fields
    raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object of named fields")
  return data


def _shard_files(directory: str) -> list[str]:
  """The safetensors files of a HF directory: the shards an index names, or ``model.safetensors``."""
  index = _read_json(directory, "model.safetensors.index.json", required=False)
  if index is not None:
    names = sorted(set(index["weight_map"].values()))
  elif os.path.isfile(os.path.join(directory, "model.safetensors")):
    names = ["model.safetensors"]
  else:
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
  paths = [os.path.join(directory, n) for n in names]
  for p in paths:
    if not os.path.isfile(p):
      raise FileNotFoundError(f"missing safetensors shard {p}")
  return paths


def _read_tensors(paths: list[str]) -> Iterator[tuple[str, jax.Array]]:
  """Every ``(name, array)`` of the given files; a corrupt or truncated file raises a one-line ValueError."""
  for path in paths:
    try:
      # The flax framework reads bfloat16 too (numpy has no bf16 of its own); the arrays stay on the host.
      with safe_open(path, framework="flax") as f:
        for name in f.keys():
          with jax.default_device(jax.devices("cpu")[0]):
            array = f.get_tensor(name)
          yield name, array
    except (SafetensorError, OSError, ValueError) as e:
      raise ValueError(f"cannot read {path}: {e} (corrupt or truncated safetensors file?)") from None


def _tensor_names(paths: list[str]) -> set[str]:
  names = set()
  for path in paths:
    try:
      with safe_open(path, framework="flax") as f:
        names.update(f.keys())
    except (SafetensorError, OSError) as e:
      raise ValueError(f"cannot read {path}: {e} (corrupt or truncated safetensors file?)") from None
  return names


def load_hf(directory: str, dtype: str = "float32") -> tuple[ModelConfig, params_lib.Params]:
  """Read a HF Llama / Mistral / Qwen2 directory (single or sharded safetensors) as ``dtype`` parameters."""
  cfg, read_params = open_hf(directory, dtype)
  return cfg, read_params()


def open_hf(directory: str, dtype: str = "float32") -> tuple[ModelConfig, Callable[[], params_lib.Params]]:
  """A HF directory's config (from config.json and the safetensors headers) and a function that reads its
  parameters: nothing of jax runs until it is called."""
  if dtype not in DTYPES:
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no such model directory: {directory}")
  hf = _read_json(directory, "config.json", required=True)
  cfg = config_from_hf(hf, dtype, _read_json(directory, "generation_config.json", required=False))
  paths = _shard_files(directory)
  if not cfg.tie_embeddings and "lm_head.weight" not in _tensor_names(paths):
    cfg = dataclasses.replace(cfg, tie_embeddings=True)  # no lm_head stored: the output projection is the embedding
  return cfg, lambda: assemble(cfg, _read_tensors(paths), directory)
