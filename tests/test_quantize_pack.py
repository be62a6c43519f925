"""The fused quantize-and-pack kernel equals quantization.quantize + pack bit for bit (interpret mode on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels.quantization import dequantize, unpack
from jkv_kernels.quantize_pack import quantize_pack, quantize_pack_reference
from conftest import has_pallas_gpu

# (bits, leading shape, T, D, axis, dtype, block_t): the full product of bits {2, 4, 8}, both groupings, D {64, 128}
# and fp32/bf16 (the kernel compiles in about a second), with T a multiple of G that block_t does not divide
# (block_t is clamped), T that it does, and an odd T along channels (one token per program).
CASES = [
    (bits, lead, tokens, head_dim, axis, dtype, block_t)
    for bits, (lead, block_t) in zip((2, 4, 8), (((2, 3), 64), ((2,), 128), ((1, 2), 32)))
    for axis, tokens in ((-2, 96), (-1, 33 if bits == 8 else 64))
    for head_dim in (64, 128)
    for dtype in (jnp.float32, jnp.bfloat16)
]


def _case_id(case):
  bits, lead, tokens, head_dim, axis, dtype, block_t = case
  grouping = "tokens" if axis == -2 else "channels"
  lead = "x".join(map(str, lead))
  return f"{bits}bit_{grouping}_lead{lead}_T{tokens}_D{head_dim}_{jnp.dtype(dtype).name}_bt{block_t}"




class TestQuantizePackInterpret:
  INTERPRET = True

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_bit_exact(self, case):
    bits, lead, tokens, head_dim, axis, dtype, block_t = case
    rng = np.random.default_rng(bits)
    x = rng.normal(size=(*lead, tokens, head_dim)) * rng.uniform(0.1, 10.0, size=head_dim)
    x = jnp.asarray(x, dtype)
    out = quantize_pack(x, bits=bits, group_size=32, axis=axis, block_t=block_t,
                        interpret=self.INTERPRET)
    ref = quantize_pack_reference(x, bits=bits, group_size=32, axis=axis)
    for name, got, want in zip(("codes", "scale", "zero"), out, ref):
      assert got.shape == want.shape and got.dtype == want.dtype, name
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)

  @pytest.mark.parametrize("bits", [2, 4, 8])
  def test_bit_exact_on_decision_thresholds(self, bits):
    """Elements exactly on a decision threshold (c + 1/2) s of a pinned grid, or one fp32 ulp either side: where
    an approximate division (Triton's fp32 ``/``) would pick either neighbour, kernel and reference agree with the
    exact nearest code (ties to even) along both groupings."""
    rng = np.random.default_rng(bits)
    qmax, s0 = 2**bits - 1, np.float32(0.375)
    on = (rng.integers(0, qmax, size=(3, 64, 30)).astype(np.float32) + np.float32(0.5)) * s0
    x = np.stack([on, np.nextafter(on, np.float32(np.inf)), np.nextafter(on, np.float32(-np.inf))])
    x = np.concatenate([np.zeros((3, 3, 64, 1)), np.full((3, 3, 64, 1), qmax * s0), x], -1).astype(np.float32)
    x = jnp.asarray(x.reshape(9, 64, 32))  # [N, T, D]: every token's 32 channels form one group
    for axis, data in ((-1, x), (-2, jnp.swapaxes(x, -1, -2))):
      out = quantize_pack(data, bits=bits, group_size=32, axis=axis, interpret=self.INTERPRET)
      ref = quantize_pack_reference(data, bits=bits, group_size=32, axis=axis)
      for name, got, want in zip(("codes", "scale", "zero"), out, ref):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{name} along {axis}")
      codes = unpack(out[0], bits=bits, axis=-1)  # [N, 64, 32] both ways: keys come out channel-major
      np.testing.assert_array_equal(np.asarray(out[1], np.float32), s0)
      exact = np.clip(np.round(np.asarray(x, np.float64) / np.float64(s0)), 0, qmax)
      np.testing.assert_array_equal(np.asarray(codes), exact)

  def test_layouts_round_trip(self):
    """Keys come out as [..., D, T/P] (the k_codes layout) and dequantize back within half a step."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 64)), jnp.float32)
    codes, scale, zero = quantize_pack(x, bits=4, group_size=32, axis=-2, interpret=self.INTERPRET)
    assert codes.shape == (2, 64, 8) and scale.shape == (2, 64, 2)
    x_hat = dequantize(unpack(codes, bits=4, axis=-1), scale, zero, axis=-1, group_size=32, dtype=jnp.float32)
    step = jnp.repeat(scale.astype(jnp.float32), 32, axis=-1)
    assert np.all(np.abs(np.asarray(jnp.swapaxes(x_hat, -1, -2) - x)) <= np.asarray(jnp.swapaxes(step, -1, -2)))


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestQuantizePackGpu(TestQuantizePackInterpret):
  INTERPRET = False


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", [-2, -1])
def test_lowers_to_triton(bits, axis):
  """Lowering for CUDA runs on any machine and catches what the Triton lowering rejects before a GPU run."""
  x = jax.ShapeDtypeStruct((2, 8, 512, 128), jnp.bfloat16)
  lowered = quantize_pack.trace(x, bits=bits, group_size=32, axis=axis).lower(lowering_platforms=("cuda",))
  assert "triton" in lowered.as_text()


def test_bad_arguments_raise():
  x = jnp.ones((2, 48, 64))
  with pytest.raises(ValueError, match="bits must be one of"):
    quantize_pack(x, bits=3, group_size=16, axis=-1)
  with pytest.raises(ValueError, match="axis must be -2"):
    quantize_pack(x, bits=2, group_size=16, axis=0)
  with pytest.raises(ValueError, match="length 48"):
    quantize_pack(x, bits=2, group_size=32, axis=-2)
  with pytest.raises(ValueError, match="multiple of the 16 codes per word"):
    quantize_pack(x, bits=2, group_size=8, axis=-1)
