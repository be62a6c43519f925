"""Model configuration: one frozen dataclass, static under jit."""

import dataclasses
from typing import Optional

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3`` in HF configs)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (Llama, Mistral, Qwen2).

  Frozen and hashable, so it rides through ``jax.jit`` as a static argument.
  """

  architecture: str  # one of SUPPORTED_ARCHITECTURES
  vocab_size: int
  embed: int  # d_model
  ffw_size: int  # SwiGLU hidden size
  num_layers: int
  q_heads: int
  kv_heads: int
  head_dim: int
  max_position: int  # the context length the model was trained for
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  norm_eps: float = 1e-5
  qkv_bias: bool = False  # Qwen2
  tie_embeddings: bool = False
  dtype: str = "float32"  # activation and weight dtype: float32, bfloat16 or float16
  bos_id: Optional[int] = None
  eos_ids: tuple = ()

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f"unsupported architecture {self.architecture!r}; jkv supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    if self.q_heads % self.kv_heads:
      raise ValueError(f"q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}")
    if self.dtype not in DTYPES:
      raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")

  @property
  def jnp_dtype(self):
    return DTYPES[self.dtype]

  @property
  def q_per_kv(self) -> int:
    return self.q_heads // self.kv_heads

  def dense_kv_bytes_per_token(self, dtype_bytes: Optional[int] = None) -> int:
    """Bytes of an uncompressed K and V cache per token (all layers), in the model dtype unless given."""
    if dtype_bytes is None:
      dtype_bytes = jnp.dtype(self.jnp_dtype).itemsize
    return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes
