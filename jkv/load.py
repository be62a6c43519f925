"""Load a model by name or path, and convert one into a jkv checkpoint.

``load_model`` accepts, in this order:

- ``"default"``: SmolLM2-135M-Instruct (``jkv.hub``), read from its GGUF;
- a directory written by ``jkv convert`` (``jkv_checkpoint.json``): restored as saved, no conversion;
- a Hugging Face directory (``config.json`` + safetensors);
- a ``.gguf`` file.
"""

import dataclasses
import os
from typing import Optional

from jkv import hub
from jkv import params as params_lib
from jkv.config import ModelConfig
from jkv.tokenizer import Tokenizer
from jkv_convert import checkpoint, gguf_file, hf_safetensors


@dataclasses.dataclass(frozen=True)
class Model:
  """A loaded model: its static config, its parameter tree and (when the source has one) its tokenizer."""

  config: ModelConfig
  params: params_lib.Params
  tokenizer: Optional[Tokenizer]


def load_model(name_or_path: str, dtype: str = "float32") -> Model:
  """Load ``"default"``, a jkv checkpoint, a Hugging Face directory or a ``.gguf`` file as ``dtype`` parameters.

  A jkv checkpoint is cast to ``dtype`` when it was saved in another one.
  """
  path = hub.default_model_path() if name_or_path == "default" else os.fspath(name_or_path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no such model: {path} (give 'default', a Hugging Face directory, a .gguf file "
                            "or a directory written by `jkv convert`)")
  if os.path.isdir(path) and checkpoint.is_checkpoint(path):
    cfg, params, tokenizer = checkpoint.restore(path)
    if cfg.dtype != dtype:
      cfg = dataclasses.replace(cfg, dtype=dtype)
      params = params_lib.cast(params, cfg.jnp_dtype)
    return Model(cfg, params, tokenizer)
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
    cfg, params = hf_safetensors.load_hf(path, dtype)
    return Model(cfg, params, Tokenizer.from_hf_dir(path))
  if os.path.isfile(path) and path.endswith(".gguf"):
    reader = gguf_file.open_gguf(path)
    cfg = gguf_file.config_from_gguf(reader, dtype)
    return Model(cfg, gguf_file.params_from_gguf(reader, cfg), gguf_file.tokenizer_from_gguf(reader))
  raise ValueError(f"cannot tell what model {path} is: expected a Hugging Face directory (with config.json), "
                   "a .gguf file, or a directory written by `jkv convert`")


def convert(src: str, out: str, dtype: str = "float32") -> Model:
  """Load ``src`` (anything ``load_model`` takes) and save it as a self-contained jkv checkpoint at ``out``."""
  model = load_model(src, dtype)
  checkpoint.save(out, model.config, model.params, model.tokenizer)
  return model
