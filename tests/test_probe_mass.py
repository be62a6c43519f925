"""The two-pass probe-mass kernel (pallas_kernels/probe_mass.py) against the chunked XLA reference, the probe
counts against brute force, and ZipCache's prefill split with the kernel against the XLA path.

The kernel runs in Pallas interpret mode on CPU (``IMPL = "interpret"``); the GPU class reruns every case compiled
and adds a moderate prefill shape, where a CUDA GPU of compute capability >= 8.0 is present. Inputs are random
normal (queries scaled up, so that the softmax rows are far from uniform) with ragged lengths: T and P * g are
not multiples of the blocks, the batch rows' probes end at different positions, and some probes do not count.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.cache import CacheSpec, StepContext
from jkv.methods import saliency as sal
from jkv.methods.zipcache import ZipCache
from jkv_kernels.probe_mass import probe_mass, probe_mass_reference
from conftest import has_pallas_gpu
from test_dequant_attention import _verify_triton_modules

# (rtol, atol) of the mass, by dtype; masses are O(1) (each real probe row spreads a total of 1 over its keys).
# bf16 inputs are compared with the reference on the same values upcast: bf16 products are exact in fp32, so only
# the order of the fp32 sums differs (a little slack for the tensor cores' accumulation).
TOLERANCE = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1e-4, 1e-4)}

# (q_per_kv, dtype, T, P, D, block_rows, block_keys): T, P * g ragged against the blocks; D = 24 is zero-padded to
# a power of two; several row blocks and key blocks each (the sorted probes' bounds matter).
CASES = [
    (1, jnp.float32, 77, 13, 32, 16, 16),
    (4, jnp.float32, 50, 9, 24, 32, 16),
    (1, jnp.bfloat16, 61, 21, 32, 16, 32),
    (4, jnp.bfloat16, 77, 13, 32, 16, 16),
]


def _inputs(rng, batch, kv_heads, tokens, num_probes, q_per_kv, head_dim, dtype):
  """q, k in ``dtype``; rows [B, P] below each row's length (the second row's prompt is shorter) and ok [B, P]
  with about a quarter False (at least one False and one True per row)."""
  q = jnp.asarray(2 * rng.normal(size=(batch, kv_heads, tokens, q_per_kv, head_dim)), dtype)
  k = jnp.asarray(rng.normal(size=(batch, kv_heads, tokens, head_dim)), dtype)
  lengths = tokens - 17 * np.arange(batch)
  rows = jnp.asarray(rng.integers(0, lengths[:, None], size=(batch, num_probes)), jnp.int32)
  ok = rng.random((batch, num_probes)) < 0.75
  ok[:, 0], ok[:, 1] = True, False
  return q, k, rows, jnp.asarray(ok)


def _seen_brute_force(rows, ok, tokens):
  rows, ok = np.asarray(rows), np.asarray(ok)
  return np.array([[np.sum(ok[b] & (rows[b] >= j)) for j in range(tokens)] for b in range(rows.shape[0])])


def _case_id(case):
  q_per_kv, dtype, tokens, num_probes, head_dim, block_rows, block_keys = case
  return f"g{q_per_kv}_{jnp.dtype(dtype).name}_T{tokens}_P{num_probes}_D{head_dim}_br{block_rows}_bk{block_keys}"


class TestProbeMassInterpret:
  IMPL = "interpret"

  @pytest.mark.parametrize("case", CASES, ids=_case_id)
  def test_matches_the_reference(self, case):
    """Mass equals the chunked reference on the same (upcast) values, and each head's total is g per real probe
    (every probe row's softmax sums to 1): nothing is lost at the ragged edges or counted twice across blocks."""
    q_per_kv, dtype, tokens, num_probes, head_dim, block_rows, block_keys = case
    q, k, rows, ok = _inputs(np.random.default_rng(tokens + num_probes), 2, 2, tokens, num_probes, q_per_kv,
                             head_dim, dtype)
    got = probe_mass(q, k, rows, ok, block_rows=block_rows, block_keys=block_keys,
                     interpret=self.IMPL == "interpret")
    want = probe_mass_reference(q.astype(jnp.float32), k.astype(jnp.float32), rows, ok)
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)
    totals = q_per_kv * np.sum(np.asarray(ok), axis=1)[:, None]  # [B, 1]
    np.testing.assert_allclose(np.asarray(got).sum(axis=2), np.broadcast_to(totals, got.shape[:2]), rtol=1e-5)

  def test_zipcache_prefill_splits_as_the_xla_path(self):
    """ZipCache's prefill with the kernel stores exactly what it stores with the XLA path (the same salient set in
    the high pool, bit for bit), on a ragged batch whose scores are well separated at the split: the gap between
    the last salient score and the first other is ten times the kernel's tolerance, so the set is determined."""
    method, batch, tokens, lengths = ZipCache(interval=8, key_group=16, random_probes=0.3), 2, 64, (64, 45)
    spec = CacheSpec(num_layers=1, batch=batch, capacity=tokens, kv_heads=2, head_dim=32, q_per_kv=4,
                     dtype=jnp.float32)
    rng = np.random.default_rng(3)
    q = jnp.asarray(2 * rng.normal(size=(batch, 2, tokens, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(batch, 2, tokens, 32)), jnp.float32) for _ in range(2))
    n = jnp.asarray(lengths, jnp.int32)
    rows, ok = sal.prefill_probes(method._layer_key(0), n, tokens, method.recent_probes, method.random_probes)
    score = np.asarray(sal.saliency_scores(*sal.probe_mass(q, k, rows, ok), n, saliency=method.saliency,
                                           normalize_by=method.normalize_by))
    n_high = sal.ceil_fraction(sal.exact_fraction(method.salient_ratio), np.asarray(lengths))
    for b, count in enumerate(n_high):
      ranked = -np.sort(-score[b], axis=-1)  # [H, T], descending
      gap = ranked[:, count - 1] - ranked[:, count]
      assert np.all(gap > 10 * TOLERANCE[jnp.float32][1]), f"the split is not determined at this seed: {gap}"

    def prefill(impl):
      position = jnp.arange(tokens)[None]
      ctx = StepContext(lengths=n, positions=jnp.where(position < n[:, None], position, -1), impl=impl)
      chosen = method.for_impl(spec, impl)
      return jax.jit(lambda q, k, v: chosen.prefill(chosen.init(spec), 0, q, k, v, ctx))(q, k, v)

    want, got = prefill("xla"), prefill(self.IMPL)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), got, want)


def test_seen_counts_the_probes_at_or_after_each_token():
  """``seen`` (a histogram of the probe positions summed from the end) equals the brute-force count exactly."""
  _, k, rows, ok = _inputs(np.random.default_rng(7), 2, 1, 45, 11, 1, 16, jnp.float32)
  seen = sal.probes_at_or_after(rows, ok, 45)
  assert seen.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(seen), _seen_brute_force(rows, ok, 45))
  literal = sal.probes_at_or_after(jnp.asarray([[4, 1, 4]]), jnp.asarray([[True, True, False]]), 6)
  np.testing.assert_array_equal(np.asarray(literal), [[2, 2, 1, 1, 1, 0]])  # the probe at 4 that is not real: 0


# (dtype, g, D, T, P, tunables): the benchmark's layout at the default blocks; then fp32 with a zero-padded head
# dim, a key-block count that is not a power of two (47) and the other block sizes and launch parameters.
LOWERING_CASES = [
    (jnp.bfloat16, 4, 128, 4096, 410, {}),
    (jnp.float32, 3, 80, 3000, 37, dict(block_rows=64, block_keys=128, num_warps=8, num_stages=3)),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}_g{c[1]}_D{c[2]}_T{c[3]}")
def test_lowers_to_triton(case, monkeypatch):
  """Lowering for CUDA runs on any machine and catches what the Triton lowering rejects before a GPU run (tiles
  that are not powers of two, dots under 16, unsupported primitives); both passes' modules are verified."""
  dtype, q_per_kv, head_dim, tokens, num_probes, tunables = case
  verified = _verify_triton_modules(monkeypatch)
  spec = jax.ShapeDtypeStruct
  args = (spec((2, 8, tokens, q_per_kv, head_dim), dtype), spec((2, 8, tokens, head_dim), dtype),
          spec((2, num_probes), jnp.int32), spec((2, num_probes), jnp.bool_))
  text = probe_mass.trace(*args, **tunables).lower(lowering_platforms=("cuda",)).as_text()
  assert "probe_row_lse" in text and "probe_key_mass" in text
  assert verified is None or len(verified) == 2


def test_bad_inputs_are_rejected():
  q, k = jnp.ones((1, 2, 8, 1, 16)), jnp.ones((1, 2, 8, 16))
  rows, ok = jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool)
  with pytest.raises(ValueError, match="does not match"):
    probe_mass(q, k[:, :1], rows, ok, interpret=True)
  with pytest.raises(ValueError, match="rows and ok"):
    probe_mass(q, k, rows, ok[:, :2], interpret=True)
  with pytest.raises(ValueError, match="block_keys=48"):
    probe_mass(q, k, rows, ok, block_keys=48, interpret=True)


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestProbeMassGpu(TestProbeMassInterpret):
  IMPL = "pallas"

  def test_a_prefill_shape_matches_the_xla_path(self):
    """Llama-3-8B's head layout at 4k tokens, bf16, the default blocks and the default probes (5% recent + 5%
    random, P = 410), against the XLA path on the same values."""
    rng = np.random.default_rng(11)
    tokens = 4096
    q = jnp.asarray(2 * rng.normal(size=(1, 8, tokens, 4, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(1, 8, tokens, 128)), jnp.bfloat16)
    rows, ok = sal.prefill_probes(jax.random.key(0), jnp.asarray([tokens], jnp.int32), tokens, 0.05, 0.05)
    assert rows.shape == (1, 410)
    got, _ = sal.probe_mass(q, k, rows, ok, impl="pallas")
    want, _ = sal.probe_mass(q.astype(jnp.float32), k.astype(jnp.float32), rows, ok, impl="xla")
    rtol, atol = TOLERANCE[jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)
