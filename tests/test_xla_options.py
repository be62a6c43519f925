"""jkv's model compiler options do on a GPU what jkv/xla_options.py says they do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.xla_options import MODEL_COMPILER_OPTIONS


def _has_cuda_gpu() -> bool:
  return any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.skipif(not _has_cuda_gpu(), reason="needs a CUDA GPU (cuBLAS's padding pass)")
def test_a_batch_of_rows_that_is_not_a_multiple_of_8_goes_to_cublas_unpadded():
  """A bf16 projection of 307 rows: compiled with XLA's defaults its rows are padded to 312 before the dot (the pad
  the options remove: the test can tell), with jkv's options the compiled program has no pad; both give the
  product of a float32 reference within bf16's rounding."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (307, 256), jnp.bfloat16)
  w = jax.random.normal(kw, (256, 512), jnp.bfloat16)
  project = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
  defaults = {k: v for k, v in MODEL_COMPILER_OPTIONS.items() if k != "xla_disable_hlo_passes"}
  padded = jax.jit(project, compiler_options=defaults).lower(x, w).compile()
  unpadded = jax.jit(project, compiler_options=MODEL_COMPILER_OPTIONS).lower(x, w).compile()
  assert "[312," in padded.as_text()
  assert "[312," not in unpadded.as_text() and " pad(" not in unpadded.as_text()
  want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  for compiled in (padded, unpadded):
    np.testing.assert_allclose(np.asarray(compiled(x, w)), want, rtol=2e-2, atol=2e-2)
