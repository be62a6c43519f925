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


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A model's config and tokenizer, read without its parameters: nothing reaches a device, so a caller can plan
  with them (say, size XLA's pinned host pool to a cache) before the GPU client starts. ``load`` reads the rest."""

  config: ModelConfig
  tokenizer: Optional[Tokenizer]
  read_params: Callable[[], params_lib.Params]

  def load(self) -> Model:
    """The model, every parameter checked finite (``check_finite``)."""
    params = self.read_params()
    check_finite(params)
    return Model(self.config, params, self.tokenizer)


def load_model(name_or_path: str, dtype: str = "float32") -> Model:
  """Load ``"default"``, a jkv checkpoint, a Hugging Face directory or a ``.gguf`` file as ``dtype`` parameters.

  A jkv checkpoint is cast to ``dtype`` when it was saved in another one. Raises ValueError naming the tensor
  when a parameter is not finite.
  """
  return open_model(name_or_path, dtype).load()


def open_model(name_or_path: str, dtype: str = "float32") -> ModelSource:
  """What ``load_model`` reads, less the parameters (``ModelSource``); the same errors for a missing, partial or
  unknown source."""
  path = hub.default_model_path() if name_or_path == "default" else os.fspath(name_or_path)
  if os.path.isdir(path) or not os.path.exists(path):
    problem = checkpoint.leftover(path)  # before anything else: a partial directory may hold a marker already
    if problem:
      raise FileNotFoundError(f"{path} is not a complete model: {problem}")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no such model: {path} (give 'default', a Hugging Face directory, a .gguf file "
                            "or a directory written by `jkv convert`)")
  if os.path.isdir(path) and checkpoint.is_checkpoint(path):
    saved, tokenizer = checkpoint.read_config(path)
    cfg = dataclasses.replace(saved, dtype=dtype)
    cast = lambda params: params if saved.dtype == dtype else params_lib.cast(params, cfg.jnp_dtype)
    return ModelSource(cfg, tokenizer, lambda: cast(checkpoint.restore_params(path, saved)))
  if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
    cfg, read_params = hf_safetensors.open_hf(path, dtype)
    return ModelSource(cfg, Tokenizer.from_hf_dir(path), read_params)
  if os.path.isfile(path) and path.endswith(".gguf"):
    reader = gguf_file.open_gguf(path)
    cfg = gguf_file.config_from_gguf(reader, dtype)
    return ModelSource(cfg, gguf_file.tokenizer_from_gguf(reader), lambda: gguf_file.params_from_gguf(reader, cfg))
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
  source = open_model(src, dtype)
  model = Model(source.config, source.read_params(), source.tokenizer)
  progress("checking that every parameter is finite ...")
  check_finite(model.params)
  checkpoint.save(out, model.config, model.params, model.tokenizer, progress=progress)
  return model
