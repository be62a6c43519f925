"""Load a model by name or path, and convert one into a jkv checkpoint.

``load_model`` accepts, in this order:

- ``"default"``: SmolLM2-135M-Instruct (``jkv.hub``), read from its GGUF;
- a directory written by ``jkv convert`` (``jkv_checkpoint.json``): restored as saved, no conversion;
- a Hugging Face directory (``config.json`` + safetensors);
- a ``.gguf`` file.

Whatever the source, every parameter is checked finite before the model is handed out: a NaN or Inf weight makes
every output garbage without any error further on.
"""

import dataclasses
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

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

  A jkv checkpoint is cast to ``dtype`` when it was saved in another one. Raises ValueError naming the tensor
  when a parameter is not finite.
  """
  model = _read(name_or_path, dtype)
  check_finite(model.params)
  return model


def _read(name_or_path: str, dtype: str) -> Model:
  path = hub.default_model_path() if name_or_path == "default" else os.fspath(name_or_path)
  if os.path.isdir(path) or not os.path.exists(path):
    problem = checkpoint.leftover(path)  # before anything else: a partial directory may hold a marker already
    if problem:
      raise FileNotFoundError(f"{path} is not a complete model: {problem}")
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


@jax.jit
def _all_finite(params: params_lib.Params):
  return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), params)


def check_finite(params: params_lib.Params) -> None:
  """Raise ValueError (one line) naming the first parameter that holds NaN or Inf, and where in it."""
  flags = jax.device_get(_all_finite(params))  # one reduction per leaf on the device, one transfer
  for (path, ok), leaf in zip(jax.tree_util.tree_flatten_with_path(flags)[0], jax.tree.leaves(params)):
    if not ok:
      values = np.asarray(leaf, np.float32)
      where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
      count = int(np.sum(~np.isfinite(values)))
      # Named with its dtype: a file can be damaged, or hold values beyond the range of the dtype asked for.
      raise ValueError(f"parameter params{jax.tree_util.keystr(path)} holds {count} non-finite {leaf.dtype} "
                       f"value(s), the first {values[where]} at index {where}")


def convert(src: str, out: str, dtype: str = "float32", progress: Callable[[str], None] = lambda msg: None) -> Model:
  """Load ``src`` (anything ``load_model`` takes) and save it as a self-contained jkv checkpoint at ``out``.

  ``out`` is checked first (not a leftover of an interrupted run, empty, writable), so that a bad target fails
  before the source is read; ``progress`` receives one line per stage.
  """
  checkpoint.check_target(out)
  progress(f"loading {src} ...")
  model = _read(src, dtype)
  progress("checking that every parameter is finite ...")
  check_finite(model.params)
  checkpoint.save(out, model.config, model.params, model.tokenizer, progress=progress)
  return model
