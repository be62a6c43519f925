"""The layer-copy kernel (pallas_kernels/host_layer_copy.py) against its plain-jnp reference, and
``jkv.saved_cache``'s host-array read built on it.

The kernel runs in Pallas interpret mode on CPU; the GPU class reruns every case compiled, on a ``pinned_host``
operand as SpeCache holds it, where a CUDA GPU of compute capability >= 8.0 is present. Inputs are random normal
with ragged lengths: a block read in part, a sequence with nothing held, one held to the capacity.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import saved_cache
from jkv_kernels.host_layer_copy import copy_layer, copy_layer_reference
from conftest import has_pallas_gpu

# (dtype, L, B, H, C, W, block_rows, layer): C that 64 does not divide (rows halve to 32, 16), a layer index past
# the last (clipped), one sequence per batch row with its own length.
CASES = [
    (jnp.float32, 3, 3, 2, 96, 32, 64, 2),
    (jnp.bfloat16, 2, 3, 1, 80, 64, 64, 0),
    (jnp.bfloat16, 4, 3, 2, 128, 16, 32, 7),
]


def _case_id(case):
  dtype, L, B, H, C, W, block_rows, layer = case
  return f"{jnp.dtype(dtype).name}_L{L}_B{B}_H{H}_C{C}_W{W}_br{block_rows}_layer{layer}"


class TestCopyLayerInterpret:
  INTERPRET = True

  def _kv(self, rng, dtype, shape):
    """Random values in numpy, and the array the kernel reads (a ``pinned_host`` one on a GPU)."""
    values = np.asarray(jnp.asarray(rng.normal(size=shape), dtype))
    if self.INTERPRET:
      return values, jnp.asarray(values)
    return values, jax.device_put(values, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                             memory_kind="pinned_host"))

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_matches_the_reference(self, case):
    dtype, L, B, H, C, W, block_rows, layer = case
    rng = np.random.default_rng(C + W)
    values, kv = self._kv(rng, dtype, (L, B, H, C, W))
    lengths = jnp.asarray([C - 27, 0, C][:B], jnp.int32)
    got = copy_layer(kv, jnp.int32(layer), lengths, block_rows=block_rows, interpret=self.INTERPRET)
    assert got.sharding.memory_kind in (None, "device")
    want = copy_layer_reference(values, layer, lengths, block_rows=block_rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    held = np.asarray(lengths)[:, None, None, None] > np.arange(C)[None, None, :, None]
    np.testing.assert_array_equal(np.where(held, np.asarray(got), 0),  # the held rows are the layer's own
                                  np.where(held, values[min(layer, L - 1)], 0))

  def test_a_saved_host_array_is_its_prefix_and_stays_donatable(self, monkeypatch):
    """``saved_cache._host_prefix`` through the kernel (the GPU path; in interpret mode here) returns the front
    of a host array cut on every axis, and the array can then be donated to a jitted call."""
    if self.INTERPRET:
      monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
      monkeypatch.setattr(saved_cache, "copy_layer", functools.partial(copy_layer, interpret=True))
    rng = np.random.default_rng(3)
    values, kv = self._kv(rng, jnp.bfloat16, (3, 2, 2, 96, 32))
    want = values[:2, :2, :1, :70, :]  # never read from kv itself: a view of it would hold it undonatable
    got = saved_cache._host_prefix(kv, want.shape)
    np.testing.assert_array_equal(got, want)
    doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(kv)
    np.testing.assert_array_equal(np.asarray(doubled)[:2, :2, :1, :70], want * 2)


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestCopyLayerGpu(TestCopyLayerInterpret):
  INTERPRET = False
