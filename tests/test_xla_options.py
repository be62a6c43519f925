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


@pytest.mark.parametrize("rows", [1, 3])
def test_a_projection_of_a_lone_row_equals_the_float32_product(rows):
  """jkv.model's fp32-output projection of bf16 rows (a lone row takes a zero second row, see the next test) gives
  the product of a float32 reference, shaped [B, T, F], whatever the row count."""
  from jkv.model import _einsum32
  kx, kw = jax.random.split(jax.random.key(rows))
  x = jax.random.normal(kx, (1, rows, 256), jnp.bfloat16)
  w = jax.random.normal(kw, (256, 384), jnp.bfloat16)
  got = jax.jit(lambda x, w: _einsum32("bte,ef->btf", x, w))(x, w)
  assert got.shape == (1, rows, 384) and got.dtype == jnp.float32
  want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-2)


@pytest.mark.skipif(not _has_cuda_gpu(), reason="needs a CUDA GPU (XLA's vector-matrix product on cuBLAS)")
def test_a_lone_row_reads_its_bf16_weights_without_converting_them():
  """One bf16 row times a bf16 matrix, accumulated and returned in fp32: XLA drops the row's unit axes and converts
  the whole matrix to fp32 first (a [256, 512] f32 convert the test can see); jkv.model's projection, given a
  second row, compiles to a matrix product that reads the bf16 matrix as it is."""
  from jkv.model import _einsum32
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (1, 1, 256), jnp.bfloat16)
  w = jax.random.normal(kw, (256, 512), jnp.bfloat16)
  plain = lambda x, w: jnp.einsum("bte,ef->btf", x, w, preferred_element_type=jnp.float32)
  jkv_projection = lambda x, w: _einsum32("bte,ef->btf", x, w)
  compile = lambda f: jax.jit(f, compiler_options=MODEL_COMPILER_OPTIONS).lower(x, w).compile()
  compiled = [compile(plain), compile(jkv_projection)]
  assert "f32[256,512]" in compiled[0].as_text()
  assert "f32[256,512]" not in compiled[1].as_text()
  want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
  for c in compiled:
    np.testing.assert_allclose(np.asarray(c(x, w)), want, rtol=1e-3, atol=1e-2)
