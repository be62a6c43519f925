"""Device memory: what prefill needs per prompt token, how many prompt tokens one prefill call may take, and the
largest batch a method's cache lets fit on a device.

The cache is allocated at capacity up front (``KVCache.create``), from the method's ``abstract`` description, so
what a batch costs is known before anything runs; prefill activations are bounded by running the batch in
sub-batches of at most ``prefill_token_budget`` prompt tokens (``jkv.generate``).
"""

from typing import Optional

import jax

from jkv import sharding
from jkv.cache import CacheMethod, CacheSpec, abstract_bytes
from jkv.config import ModelConfig

# Beyond weights, cache and prefill activations: XLA's workspace, cuDNN/cuBLAS handles, the decode step's own
# temporaries (logits of one token per sequence), and the holes the allocator leaves. Measured on the H100 with
# the cuBLAS decode (jkv.xla_options): at 3 GiB the dense run at the computed largest batch (95 sequences of 4608
# tokens, Llama-3-8B shape) ran out of memory asking for 2.55 GiB more right after prefill; at 95% of it (2.8 GiB
# more headroom) it ran. 6 GiB covers that.
RESERVE_BYTES = 6 << 30


def prefill_bytes_per_token(cfg: ModelConfig) -> int:
  """Peak live activation bytes per prompt token within one layer of prefill (an upper estimate).

  Counted in fp32, whatever the model dtype, because that is where the peak is: the fp32 residual stream, its
  normed copy and a temporary, q/k/v and the attention output, the fp32 K/V a method quantizes, and the MLP's
  gate, up and their product (fp32 accumulations). Measured on the H100 at the Llama-3-8B shape: 8.62 GiB of
  temporaries for 8 prompts of 4096 tokens, 276 KB per token, against 287 KB here.
  """
  E, F, D = cfg.embed, cfg.ffw_size, cfg.head_dim
  kv = 2 * cfg.kv_heads * D
  return 4 * (4 * E + 2 * cfg.q_heads * D + 2 * kv + 3 * F)


def device_memory(device=None) -> Optional[dict]:
  """{"limit", "in_use", "peak"} bytes of a device's memory, or None where jax does not report them (CPU)."""
  device = device or jax.local_devices()[0]  # addressable: with several processes devices()[0] may not be
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "bytes_limit" not in stats:
    return None
  return dict(limit=int(stats["bytes_limit"]), in_use=int(stats.get("bytes_in_use", 0)),
              peak=int(stats.get("peak_bytes_in_use", 0)))


def prefill_token_budget(cfg: ModelConfig, device=None) -> int:
  """Prompt tokens one prefill call may process: what the device's free memory holds of prefill activations
  (call after the cache and weights are allocated), or 2**16 where the device does not report its memory."""
  mem = device_memory(device)
  if mem is None:
    return 1 << 16
  free = mem["limit"] - mem["in_use"] - RESERVE_BYTES
  return max(1, (free // 2) // prefill_bytes_per_token(cfg))


def cache_bytes(method: CacheMethod, cfg: ModelConfig, batch: int, capacity: int, mesh=None) -> int:
  """Device bytes the cache allocates for ``batch`` sequences of ``capacity`` tokens (host arrays excluded); with a
  mesh, what one device of it holds (each array split over the mesh axes that shard it)."""
  abstract = method.abstract(CacheSpec.for_model(cfg, batch, capacity))
  if mesh is None:
    return abstract_bytes(abstract).device + 4 * batch
  return sharding.local_bytes(abstract, mesh).device + 4 * batch // sharding.axis_size(mesh, "data")


def largest_batch(cfg: ModelConfig, method: CacheMethod, capacity: int, prompt_tokens: int, *, device_bytes: int,
                  weight_bytes: int, mesh=None) -> int:
  """The most sequences of ``capacity`` tokens whose cache fits beside the weights, one prefill sub-batch of at
  least one prompt, and ``RESERVE_BYTES``, in ``device_bytes``; 0 when not even one fits.

  With a ``mesh`` (``jkv.sharding``), every device of it holds ``device_bytes``: its share of the cache beside
  ``weight_bytes`` (then its share of the weights: ``sharding.param_bytes_per_device``), and the batch is a
  multiple of the data axis. Prefill is counted whole on each device (an upper estimate)."""
  step = sharding.axis_size(mesh, "data")
  free = device_bytes - weight_bytes - RESERVE_BYTES - prefill_bytes_per_token(cfg) * prompt_tokens
  if free <= 0:
    return 0
  per_step = cache_bytes(method, cfg, step, capacity, mesh)  # one sequence per data shard
  batch = max(0, free // per_step) * step
  while batch > 0 and cache_bytes(method, cfg, batch, capacity, mesh) > free:  # exact, in case bytes are not linear
    batch -= step
  return int(batch)


def tree_bytes(tree) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(tree)))
