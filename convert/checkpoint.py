"""Save and restore a converted model: orbax-checkpoint for the parameters, one JSON for the rest.

Layout of a checkpoint directory::

  jkv_checkpoint.json   {"format": 1, "config": ModelConfig fields, "tokenizer": Tokenizer.to_dict() or null}
  params/               orbax PyTree checkpoint of Params

Restoring reads straight into the tree ``jkv.params.abstract(cfg)`` describes: no random init, no conversion.
"""

import dataclasses
import json
import os
from typing import Optional

import jax
import orbax.checkpoint as ocp

from jkv import params as params_lib
from jkv.config import ModelConfig, RopeScaling
from jkv.tokenizer import Tokenizer

MARKER = "jkv_checkpoint.json"
FORMAT = 1


def is_checkpoint(path: str) -> bool:
  """Whether ``path`` is a directory written by ``save``."""
  return os.path.isfile(os.path.join(path, MARKER))


def save(directory: str, cfg: ModelConfig, params: params_lib.Params, tokenizer: Optional[Tokenizer] = None):
  """Write ``(cfg, params, tokenizer)`` to a new ``directory`` (it must not exist or be empty)."""
  directory = os.path.abspath(directory)
  if os.path.exists(directory) and os.listdir(directory):
    raise FileExistsError(f"checkpoint directory {directory} exists and is not empty")
  os.makedirs(directory, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(directory, "params"), params)
  meta = {"format": FORMAT, "config": dataclasses.asdict(cfg),
          "tokenizer": None if tokenizer is None else tokenizer.to_dict()}
  with open(os.path.join(directory, MARKER), "w") as f:
    json.dump(meta, f)


def restore(directory: str) -> tuple[ModelConfig, params_lib.Params, Optional[Tokenizer]]:
  """Read a directory written by ``save``; the parameters come back in the saved dtype."""
  directory = os.path.abspath(directory)
  if not is_checkpoint(directory):
    raise FileNotFoundError(f"{directory} is not a jkv checkpoint (no {MARKER})")
  with open(os.path.join(directory, MARKER)) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{directory}: checkpoint format {meta.get('format')!r}, this jkv reads format {FORMAT}")
  fields = dict(meta["config"])
  if fields["rope_scaling"] is not None:
    fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
  fields["eos_ids"] = tuple(fields["eos_ids"])
  cfg = ModelConfig(**fields)
  # Name the device: the sharding recorded at save time names the saving machine's device (say a CPU).
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), params_lib.abstract(cfg))
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(os.path.join(directory, "params"), target)
  tokenizer = None if meta["tokenizer"] is None else Tokenizer.from_dict(meta["tokenizer"])
  return cfg, params, tokenizer
