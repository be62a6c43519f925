"""OTT (docs/methods/ott.md, arXiv:2505.10938): selection against brute force and a token-by-token oracle, exactly-once
attention with a lossless quantizer, pool size 0 as KIVI on OTT's schedule, planted outliers, forced overflow,
batch independence, the fused kernel with pools and holes, memory.

The oracle (``OracleSequence``) follows docs/methods/ott.md (schedule, competition, attention) with Python lists
and sets, independently of the method.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import cli
from jkv.attention import hopper_kernel_available
from jkv.cache import CacheSpec, KVCache, StepContext
from jkv.evaluation.compare import MethodSpec
from jkv.methods import make_method
from jkv.methods.ott import Ott, compete
from jkv_kernels.attention_reference import gqa_attention_reference
from jkv_kernels.dequant_attention import QuantizedStore
from jkv_kernels.mma_layout import MmaStore, pack_mma_store, read_mma_store
from jkv_kernels.quantization import dequantize, unpack
import quant_oracle
from conftest import has_pallas_gpu


def _spec(batch, capacity, *, heads=2, head_dim=32, layers=3, dtype=jnp.float32):
  return CacheSpec(num_layers=layers, batch=batch, capacity=capacity, kv_heads=heads, head_dim=head_dim,
                   q_per_kv=2, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("method", "impl"))
def _prefill_jit(method, state, layer, k, v, lengths, impl):
  T = k.shape[2]
  positions = jnp.where(jnp.arange(T)[None] < lengths[:, None], jnp.arange(T)[None], -1)
  return method.prefill(state, layer, None, k, v, StepContext(lengths=lengths, positions=positions, impl=impl))


def _prefill(method, state, layer, k, v, lengths, impl="xla"):
  """Prefill right-padded prompts k, v [B, H, T, D] with ``lengths`` valid tokens each (the layer is traced, as
  in the model's layer scan, so one compilation serves every layer)."""
  return _prefill_jit(method, state, jnp.int32(layer), jnp.asarray(k), jnp.asarray(v),
                      jnp.asarray(lengths, jnp.int32), impl)


@functools.partial(jax.jit, static_argnames=("method", "impl"))
def _step(method, state, layer, q, k, v, held, impl="xla"):
  """One decode step: q [B, H, T, g, D], k, v [B, H, T, D], rows at positions held [B] + [0, T)."""
  positions = held[:, None] + jnp.arange(k.shape[2])[None]
  return method.step(state, layer, q, k, v, StepContext(lengths=held, positions=positions, impl=impl))


def _rows(x, positions, width=1):
  """x [B, H, n, ...] -> [B, H, width, ...]: rows positions[b] + [0, width) of each sequence."""
  return jnp.asarray(np.stack([x[b, :, p:p + width] for b, p in enumerate(positions)]))


def _grid_keys_values(rng, batch, heads, n, head_dim, group, value_group):
  """Lossless data at 8 bits: integers in [0, 255] / 64, with 0 and 255 in every key group (per channel, from
  rows at offsets 0 and 1 of each group of ``group`` tokens) and every value group (per token, channels 0 and 1
  of each group of ``value_group``). Other key entries lie in [1, 100], so the extreme rows have the largest L1
  norms and never enter a pool; integer sums make exact ties in the norms, which the tie rule must break."""
  k = rng.integers(1, 101, size=(batch, heads, n, head_dim)).astype(np.float32)
  even = np.arange(head_dim) % 2 == 0
  k[:, :, 0::group] = np.where(even, 0.0, 255.0)
  k[:, :, 1::group] = np.where(even, 255.0, 0.0)
  v = rng.integers(0, 256, size=(batch, heads, n, head_dim)).astype(np.float32)
  v[..., 0::value_group] = 0.0
  v[..., 1::value_group] = 255.0
  return k / 64.0, v / 64.0


# ------------------------------------------------------------------------------------------------ the oracle


class OracleSequence:
  """One sequence, one layer: docs/methods/ott.md ('Schedule and state') with explicit lists, per KV head. ``k``
  [H, n, D] holds every token the sequence will see; ``selection`` is 'oneshot' or 'sequential' (prefill). A full
  buffer is quantized when the next token arrives (as the method does; quantizing right after the step that
  filled it attends would change nothing that any step attends to)."""

  def __init__(self, k, prompt_len, *, G, R, N, A, selection):
    self.score = np.abs(k).sum(-1, dtype=np.float32)  # [H, n]
    self.G, self.R, self.N, self.A = G, R, N, A
    H = k.shape[0]
    self.pool = [[] for _ in range(H)]  # positions, ascending by (score, position)
    self.aux = [[] for _ in range(H)]
    self.holes = [set() for _ in range(H)]
    self.frozen = [False] * H
    n_q = G * max(0, (prompt_len - 1 - R) // G)  # the buffer keeps R + 1 to G + R of the prompt's tokens
    self.n_q, self.fp = n_q, list(range(n_q, prompt_len))
    if selection == "oneshot" and N:
      for h in range(H):
        self.pool[h] = sorted(range(n_q), key=lambda t: (self.score[h, t], t))[:N]
        self.holes[h] = set(self.pool[h])
    else:
      for s in range(0, n_q, G):
        self._quantize_block(list(range(s, s + G)))

  def _quantize_block(self, block):
    for h in range(len(self.pool)):
      if self.N and not self.frozen[h]:
        ranked = sorted(self.pool[h] + block, key=lambda t: (self.score[h, t], t))[:self.N]
        self.aux[h] += [t for t in self.pool[h] if t not in ranked]
        self.holes[h] |= {t for t in ranked if t in block}
        self.pool[h] = ranked
        if len(self.aux[h]) > self.A - self.N:
          self.frozen[h] = True

  def step(self, position):
    """The token at ``position`` arrives: quantize the oldest G tokens if the buffer is full, then append."""
    if len(self.fp) == self.G + self.R:
      self._quantize_block(self.fp[:self.G])
      self.fp = self.fp[self.G:]
      self.n_q += self.G
    self.fp.append(position)


def _host(state, layer):
  """The pool fields of one layer as numpy arrays (one transfer per step)."""
  return {name: np.asarray(getattr(state, name)[layer])
          for name in ("pool_pos", "pool_score", "aux_count", "frozen", "valid")}


def _check_state_against_oracle(method, host, b, oracle, n):
  """Pools, holes, counters, the schedule and the partition for sequence b holding n tokens; ``host`` from
  ``_host``."""
  G, R, N = method.group_size, method.residual, method.pool_size
  n_q = G * max(0, (n - 1 - R) // G)
  assert n_q == oracle.n_q and n - n_q == len(oracle.fp) and min(n, R + 1) <= n - n_q <= G + R
  pos = host["pool_pos"][b]
  for h in range(pos.shape[0]):
    pool, aux = pos[h, :N], pos[h, N:]
    assert list(pool[pool >= 0]) == oracle.pool[h]  # same tokens, same (score, position) order
    assert sorted(aux[aux >= 0]) == sorted(oracle.aux[h])
    assert host["aux_count"][b, h] == len(oracle.aux[h]) <= method.aux_size
    assert host["frozen"][b, h] == oracle.frozen[h]
    holes = set(np.flatnonzero(~host["valid"][b, h, :n_q])) if N else set()
    assert holes == oracle.holes[h] == set(pos[h][pos[h] >= 0])
    kept = [t for t in range(n_q) if t not in holes]
    parts = kept + list(pos[h][pos[h] >= 0]) + list(range(n_q, n))
    assert sorted(parts) == list(range(n))  # disjoint, and every token somewhere


# ------------------------------------------------------------------------------------------------ selection


def test_compete_equals_brute_force():
  """The new pool is the N_l smallest finite scores of pool ∪ block by (score, position); evicted
  = old pool minus new; admitted = new pool ∩ block. Random pools with empty slots, ties and +inf pads."""
  rng = np.random.default_rng(0)
  B, H, N, M = 4, 3, 4, 12
  for trial in range(20):
    capacity = trial % (N + 1)
    block_score = rng.integers(0, 6, size=(B, H, M)).astype(np.float32)  # many ties
    block_score[rng.random((B, H, M)) < 0.2] = np.inf
    block_pos = np.broadcast_to(100 + np.arange(M), (B, H, M)).astype(np.int32)
    pool_score = np.sort(rng.integers(0, 6, size=(B, H, N)).astype(np.float32), axis=-1)
    filled = np.arange(N) < rng.integers(0, capacity + 1, size=(B, H, 1))
    pool_score = np.where(filled, pool_score, np.inf)
    pool_pos = np.where(filled, np.argsort(rng.random((B, H, N)), axis=-1) * 7, -1).astype(np.int32)
    order = np.lexsort((pool_pos, pool_score), axis=-1)  # keep the pool sorted by (score, position)
    pool_score, pool_pos = np.take_along_axis(pool_score, order, -1), np.take_along_axis(pool_pos, order, -1)
    got = compete(*map(jnp.asarray, (pool_score, pool_pos, block_score, block_pos)), jnp.int32(capacity))
    order, win, kept, admitted = map(np.asarray, got)
    for b in range(B):
      for h in range(H):
        cands = [(pool_score[b, h, i], pool_pos[b, h, i]) for i in range(N) if pool_pos[b, h, i] >= 0]
        cands += [(block_score[b, h, j], block_pos[b, h, j]) for j in range(M) if np.isfinite(block_score[b, h, j])]
        best = [p for _, p in sorted(cands)[:capacity]]
        cand_pos = np.concatenate([pool_pos[b, h], block_pos[b, h]])
        assert list(cand_pos[order[b, h][win[b, h]]]) == best
        assert set(pool_pos[b, h][kept[b, h]]) == set(best) & set(pool_pos[b, h][pool_pos[b, h] >= 0])
        assert set(block_pos[b, h][admitted[b, h]]) == set(best) & set(block_pos[b, h])


# ------------------------------------------------------------------------------------------------ exactly once


@pytest.mark.parametrize("pool_size, selection", [(1, "sequential"), (3, "oneshot")])
def test_lossless_quantizer_equals_dense_attention_and_the_oracle(pool_size, selection):
  """With 8-bit codes of data on the 8-bit grid the
  quantizer is the identity, so OTT must equal dense attention over every token (a token counted twice, missed
  or a hole left unmasked would show), after prefills of 1, R-1, R, R+G-1, R+G and many G tokens in one ragged
  batch and 3G decode steps. Pools, holes, counters and the partition equal the token-by-token oracle after
  every step, in layer 2 and in layer 1 (no pool: the oracle with N = 0); the auxiliary pool is small enough
  that heads freeze. One compilation serves every step and both layers."""
  G, R, A, D = 16, 8, 4, 32
  method = Ott(bits=8, group_size=G, residual=R, pool_size=pool_size, aux_size=A, prefill_selection=selection)
  lengths = np.array([1, R - 1, R, R + G - 1, R + G, 5 * G + 3])
  B, steps = len(lengths), 3 * G
  rng = np.random.default_rng(pool_size)
  n = int(lengths.max()) + steps
  k, v = _grid_keys_values(rng, B, 2, n, D, G, min(G, D))
  q = rng.normal(size=(B, 2, n, 2, D)).astype(np.float32)
  T = int(lengths.max())
  state = method.init(_spec(B, n + G))
  oracles = {}
  for layer, N in ((1, 0), (2, pool_size)):
    state = _prefill(method, state, layer, k[:, :, :T], v[:, :, :T], lengths)
    oracles[layer] = [OracleSequence(k[b], lengths[b], G=G, R=R, N=N, A=A, selection=selection) for b in range(B)]
  compiled = _step._cache_size()
  max_score = np.full((B, 2), np.inf)
  reference = jax.jit(gqa_attention_reference)
  for t in range(steps):
    held = lengths + t
    mask = np.arange(n)[None, None, :] <= held[:, None, None]
    ref = reference(_rows(q, held), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    for layer in (1, 2):
      out, state = _step(method, state, layer, _rows(q, held), _rows(k, held), _rows(v, held),
                         jnp.asarray(held, jnp.int32))
      np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
      host = _host(state, layer)
      for b in range(B):
        oracles[layer][b].step(int(held[b]))
        _check_state_against_oracle(method, host, b, oracles[layer][b], int(held[b]) + 1)
    score = np.max(host["pool_score"], axis=-1, initial=-np.inf)  # layer 2
    full = np.isfinite(score)  # once the pool is full its largest score never rises
    assert np.all(score[full] <= max_score[full])
    max_score = np.where(full, score, max_score)
  if pool_size == 3:
    assert host["frozen"].any() and not host["frozen"].all()
  assert _step._cache_size() == compiled + 1


# ------------------------------------------------------------------------------------------------ KIVI


def _kivi_blocks(k, v, n_q, G, Gv, bits):
  """Independent KIVI quantization of positions [0, n_q) of one sequence (k, v [H, n, D]; the numpy oracle): keys
  per channel over groups of G tokens, values per token over Gv channels. Returns (codes, scale, zero) for keys
  [H, D, n_q] and values [H, n_q, D], and the dequantized k, v [H, n_q, D] (float64)."""
  k_t = np.swapaxes(np.asarray(k)[:, :n_q], 1, 2)
  kq = quant_oracle.quantize(k_t, bits=bits, axis=2, group_size=G)
  vq = quant_oracle.quantize(np.asarray(v)[:, :n_q], bits=bits, axis=2, group_size=Gv)
  k_hat = np.swapaxes(quant_oracle.fake_quant(k_t, bits=bits, axis=2, group_size=G), 1, 2)
  return kq, vq, k_hat, quant_oracle.fake_quant(np.asarray(v)[:, :n_q], bits=bits, axis=2, group_size=Gv)


def test_pool_size_zero_is_kivi_on_otts_schedule():
  """With no pool, codes, scales and zeros are bit-identical to KIVI quantization of the raw
  blocks (keys and values every G steps, the R newest tokens exact), and every step's attention equals the
  one-shot oracle (positions below q dequantized, the rest exact) on a ragged batch crossing block events."""
  G, R, D, bits = 32, 16, 64, 2
  method = Ott(bits=bits, group_size=G, residual=R, pool_size=0)
  lengths = np.array([40, 100])
  steps = 70
  rng = np.random.default_rng(7)
  n = int(lengths.max()) + steps
  k = rng.normal(size=(2, 2, n, D)).astype(np.float32)
  k[..., 5] *= 12.0  # an outlier channel
  v = rng.normal(size=(2, 2, n, D)).astype(np.float32)
  q = rng.normal(size=(2, 2, n, 2, D)).astype(np.float32)
  state = _prefill(method, method.init(_spec(2, n + G, head_dim=D)), 1, k[:, :, :100], v[:, :, :100], lengths)
  whole = G * (n // G)  # quantizing every block at once gives each block's codes: blocks are independent
  (kc, ks, kz), (vc, vs, vz), k_hat, v_hat = _kivi_blocks(k.reshape(-1, n, D), v.reshape(-1, n, D), whole, G,
                                                          method.value_group_for(D), bits)
  pad = lambda x: np.pad(np.asarray(x).reshape(2, 2, whole, D), ((0, 0), (0, 0), (0, n - whole), (0, 0)))
  k_hat, v_hat = pad(k_hat), pad(v_hat)
  reference = jax.jit(gqa_attention_reference)
  outs, refs = [], []
  for t in range(steps):
    held = lengths + t
    out, state = _step(method, state, 1, _rows(q, held), _rows(k, held), _rows(v, held), jnp.asarray(held, jnp.int32))
    n_q = G * (np.maximum(held - R, 0) // G)  # at attention, holding held + 1 tokens
    quantized = (np.arange(n)[None] < n_q[:, None])[:, None, :, None]
    keys, values = np.where(quantized, k_hat, k), np.where(quantized, v_hat, v)
    mask = np.arange(n)[None, None, :] <= held[:, None, None]
    outs.append(np.asarray(out))
    refs.append(np.asarray(reference(_rows(q, held), jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32),
                                     jnp.asarray(mask))))
  per_row = lambda x: np.asarray(x).reshape(2, 2, *x.shape[1:])
  kc, ks, kz, vc, vs, vz = map(per_row, (kc, ks, kz, vc, vs, vz))
  for b in range(2):
    n_q = G * max(0, (held[b] - R) // G)  # at rest with held + 1 tokens
    np.testing.assert_array_equal(np.asarray(unpack(state.k_codes[1, b], bits=bits, axis=2))[:, :, :n_q],
                                  kc[b, :, :, :n_q])
    np.testing.assert_array_equal(np.asarray(state.k_scale[1, b, :, :, :n_q // G]), ks[b, :, :, :n_q // G])
    np.testing.assert_array_equal(np.asarray(state.k_zero[1, b, :, :, :n_q // G]), kz[b, :, :, :n_q // G])
    np.testing.assert_array_equal(np.asarray(unpack(state.v_codes[1, b], bits=bits, axis=2))[:, :n_q],
                                  vc[b, :, :n_q])
    np.testing.assert_array_equal(np.asarray(state.v_scale[1, b, :, :n_q]), vs[b, :, :n_q])
    np.testing.assert_array_equal(np.asarray(state.v_zero[1, b, :, :n_q]), vz[b, :, :n_q])
  # The store holds the oracle's codes and metadata (above), so every step reads the oracle's values.
  for t, (out, ref) in enumerate(zip(outs, refs)):
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5, err_msg=f"step {t}")


# ------------------------------------------------------------------------------------------------ outliers


def _planted(rng, n=1024, head_dim=128, planted=(0, 300, 700), heads=2):
  """N(0, 1) keys with four outlier channels ~U(13, 17); the planted tokens are scaled by 0.1 with
  their outlier channels ~U(0, 1). Returns k, v [1, heads, n, D] and the outlier channels."""
  k = rng.normal(size=(1, heads, n, head_dim)).astype(np.float32)
  channels = np.array([3, 40, 77, 101])
  k[..., channels] = rng.uniform(13, 17, size=(1, heads, n, 4))
  k[:, :, list(planted)] *= 0.1
  for t in planted:
    k[:, :, t, channels] = rng.uniform(0, 1, size=(1, heads, 4))
  return k, rng.normal(size=k.shape).astype(np.float32), channels


def test_planted_outliers_are_found_and_their_channels_quantize_10x_better():
  """The pool is exactly the planted tokens (token 0, sink-like, among them) with
  either prefill selection; the block of each holds a placeholder at the per-channel block mean, no key range
  widens, and the key quantization error over the outlier channels of the other tokens of those blocks falls
  by at least 10x against KIVI on the same blocks."""
  G, n, D, planted = 128, 1024, 128, (0, 300, 700)
  rng = np.random.default_rng(0)
  k, v, channels = _planted(rng, n, D, planted)
  methods = {s: make_method("ott", preset="paper", prefill_selection=s) for s in ("oneshot", "sequential")}
  states = {s: _prefill(m, m.init(_spec(1, n, head_dim=D)), 2, k, v, [n]) for s, m in methods.items()}
  n_q = G * ((n - 1 - 32) // G)
  for s, state in states.items():
    pos = np.asarray(state.pool_pos[2, 0])
    for h in range(2):
      assert list(pos[h, :3]) == sorted(planted, key=lambda t: np.abs(k[0, h, t]).sum())
      assert set(np.flatnonzero(~np.asarray(state.valid[2, 0, h, :n_q]))) == set(pos[h][pos[h] >= 0])
    # One-shot selection leaves the auxiliary pool empty; sequential selection parks earlier winners there.
    assert (np.asarray(state.aux_count[2]) == 0).all() == (s == "oneshot")
  state = states["oneshot"]
  k_hat = np.swapaxes(np.asarray(dequantize(unpack(state.k_codes[2, 0], bits=2, axis=2)[..., :n_q],
                                            state.k_scale[2, 0, :, :, :n_q // G], state.k_zero[2, 0, :, :, :n_q // G],
                                            axis=2, group_size=G, dtype=jnp.float32)), 1, 2)  # [H, n_q, D]
  (_, kivi_scale, _), _, kivi_hat, _ = _kivi_blocks(k[0], v[0], n_q, G, D, 2)
  kivi_hat, kivi_scale = np.asarray(kivi_hat), np.asarray(kivi_scale, np.float32)
  assert np.all(np.asarray(state.k_scale[2, 0, :, :, :n_q // G], np.float32) <= kivi_scale)
  for t in planted:
    block = slice(t // G * G, t // G * G + G)
    others = [p for p in range(block.start, block.stop) if p != t]
    mean = k[0, :, block].mean(axis=1)  # [H, D]
    scale = np.asarray(state.k_scale[2, 0, :, :, t // G], np.float32)
    assert np.all(np.abs(k_hat[:, t] - mean) <= scale / 2 + 1e-3)
    exact = k[0][:, others][..., channels]
    kivi_err = np.mean((kivi_hat[:, others][..., channels] - exact) ** 2)
    ott_err = np.mean((k_hat[:, others][..., channels] - exact) ** 2)
    assert kivi_err >= 10 * ott_err, (t, kivi_err, ott_err)


def test_forced_overflow_freezes_after_ten_evicting_events():
  """Every block brings N = 3 tokens of strictly smaller norms than the last block's. Each event
  then evicts 3; with A = 32 the head freezes after 10 evicting events (aux_count 30: the overflow rule). No token is
  lost, and the blocks after the freeze are bit-identical to KIVI quantization of their raw rows."""
  G, R, D, blocks = 16, 8, 32, 13
  method = Ott(group_size=G, residual=R, pool_size=3, aux_size=32, prefill_selection="sequential")
  n = blocks * G + R + 1  # the buffer keeps R + 1 tokens: all 13 blocks are quantized
  rng = np.random.default_rng(1)
  k = (rng.normal(size=(1, 1, n, D)) + 3.0).astype(np.float32)
  v = rng.normal(size=(1, 1, n, D)).astype(np.float32)
  offsets = np.array([2, 7, 11])
  for j in range(blocks):
    for i, o in enumerate(offsets):
      k[0, 0, j * G + o] = 0.25 * 0.5**j * (1 + 0.01 * i)
  spec = CacheSpec(num_layers=3, batch=1, capacity=n + G, kv_heads=1, head_dim=D, q_per_kv=1, dtype=jnp.float32)
  state = _prefill(method, method.init(spec), 2, k, v, [n])
  pos = np.asarray(state.pool_pos[2, 0, 0])
  planted = lambda blocks: [j * G + o for j in blocks for o in offsets]
  assert int(state.aux_count[2, 0, 0]) == 30 and bool(state.frozen[2, 0, 0])
  assert list(pos[:3]) == planted([10])  # the last block before the freeze holds the pool
  assert sorted(pos[3:][pos[3:] >= 0]) == planted(range(10))
  holes = np.flatnonzero(~np.asarray(state.valid[2, 0, 0, :blocks * G]))
  assert list(holes) == planted(range(11))
  (kc, ks, _), (vc, _, _), _, _ = _kivi_blocks(k[0], v[0], blocks * G, G, method.value_group_for(D), 2)
  late = slice(11 * G, blocks * G)
  np.testing.assert_array_equal(np.asarray(unpack(state.k_codes[2, 0], bits=2, axis=2))[:, :, late], kc[:, :, late])
  np.testing.assert_array_equal(np.asarray(state.k_scale[2, 0, :, :, 11:blocks]), ks[:, :, 11:])
  np.testing.assert_array_equal(np.asarray(unpack(state.v_codes[2, 0], bits=2, axis=2))[:, late], vc[:, late])


# ------------------------------------------------------------------------------------------------ batches


def _random_qkv(rng, batch, n, head_dim=64):
  k = rng.normal(size=(batch, 2, n, head_dim)).astype(np.float32)
  k[..., 5] *= 12.0
  k[:, :, ::23] *= 0.05  # low-norm tokens, so pools fill and evict
  v = rng.normal(size=(batch, 2, n, head_dim)).astype(np.float32)
  return rng.normal(size=(batch, 2, n, 2, head_dim)).astype(np.float32), k, v


def test_batch_rows_are_independent():
  """Sequences of different lengths step together, reaching block events at different steps. Rolling the batch
  (every sequence in another row, beside other sequences) changes no row's output or state: a row sees only
  its own sequence. The bytes held count the pools from the state."""
  G, R = 32, 16
  method = Ott(group_size=G, residual=R, pool_size=3, aux_size=4)
  lengths = np.array([40, 100, 161])
  rng = np.random.default_rng(3)
  q, k, v = _random_qkv(rng, 3, 256)
  T, steps = 161, 40
  spec = _spec(3, 256, head_dim=64)
  roll = lambda x: np.roll(x, 1, axis=0)
  states = [_prefill(method, method.init(spec), 2, x[:, :, :T], y[:, :, :T], n)
            for x, y, n in ((k, v, lengths), (roll(k), roll(v), roll(lengths)))]
  for t in range(steps):
    outs = []
    for i, (qq, kk, vv, n) in enumerate(((q, k, v, lengths), (roll(q), roll(k), roll(v), roll(lengths)))):
      held = n + t
      out, states[i] = _step(method, states[i], 2, _rows(qq, held), _rows(kk, held), _rows(vv, held),
                             jnp.asarray(held, jnp.int32))
      outs.append(np.asarray(out))
    np.testing.assert_allclose(roll(outs[0]), outs[1], rtol=1e-6, atol=1e-6)
  for name, array in vars(states[0]).items():
    np.testing.assert_array_equal(np.roll(np.asarray(array), 1, axis=1), np.asarray(getattr(states[1], name)),
                                  err_msg=name)
  state = states[0]
  pos = np.asarray(state.pool_pos)
  assert (pos[2, :, :, 3:] >= 0).any()  # evictions happened
  n = lengths + steps
  n_q = G * (np.maximum(n - 1 - R, 0) // G)
  pooled = int((pos >= 0).sum())
  expected = (3 * 2 * np.sum(n_q * (2 * 2 / 8 * 64 + 2 * 2 * 64 / G + 2 * 2 * 64 / min(G, 64) + 1)
                            + (n - n_q) * 2 * 4 * 64)
              + pooled * (2 * 4 * 64 + 4) + int((pos[..., :3] >= 0).sum()) * 4 + 1 * 2 * 3 * 5 + 4 * 3)
  assert method.held_bytes(spec, state, n).device == round(expected)


def _mma_and_library_runs(G, selection, impls, steps, dtype=jnp.float32):
  """OTT with its store in the MMA packing (impl ``impls[True]``) and in the library's layout (``impls[False]``)
  over one ragged batch with pools, evictions and holes, two rows a step: the outputs of each step and the
  final states."""
  rng = np.random.default_rng(12)
  q, k, v = _random_qkv(rng, 3, 512)
  lengths = np.array([40, 3 * G + 7, 200])  # block events at each sequence's own steps
  T = int(lengths.max())
  runs = {}
  for mma in (False, True):
    method = Ott(group_size=G, residual=16, pool_size=3, aux_size=8, prefill_selection=selection, mma=mma)
    state = _prefill(method, method.init(_spec(3, 512, head_dim=64, dtype=dtype)), 2, k[:, :, :T], v[:, :, :T],
                     lengths, impls[mma])
    outs = []
    for t in range(0, steps, 2):
      held = lengths + t
      rows = lambda x: _rows(x, held, 2).astype(dtype)
      out, state = _step(method, state, 2, rows(q), rows(k), rows(v), jnp.asarray(held, jnp.int32), impls[mma])
      outs.append(np.asarray(out, np.float64))
    runs[mma] = (np.stack(outs), state, method)
  return runs, lengths + steps


@pytest.mark.parametrize("G,selection", [(16, "oneshot"), (32, "sequential"), (128, "oneshot")])
def test_mma_packing_equals_the_library_layout(G, selection):
  """The MMA packing (block events merged into the tile that holds them: a quarter or half tile at G = 16, 32,
  two tiles at G = 128) against the library's layout, both read by the XLA path: every quantized token, hole and
  pool is the same (the packing of the library layout's store, bit for bit), so every step's output is the same
  up to the packing's fp16 rounding of its folded zero-points (z - M s, M <= 16: about s / 128 on a key or value,
  at this test's outlier-sized scales)."""
  runs, n = _mma_and_library_runs(G, selection, {False: "xla", True: "xla"}, steps=40)
  (ref, ref_state, method), (out, state, _) = runs[False], runs[True]
  assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 0.1 * np.abs(np.asarray(ref)).max()
  assert not np.asarray(ref_state.valid[2]).all()  # holes were made
  n_q = np.asarray(method.quantized(jnp.asarray(n)))
  D = 64
  library = QuantizedStore(ref_state.k_codes, ref_state.k_scale, ref_state.k_zero, ref_state.v_codes,
                           ref_state.v_scale, ref_state.v_zero, jnp.asarray(n_q), 2, 2, G, method.value_group_for(D))
  mma = MmaStore(state.k_tiles, state.k_meta, state.v_tiles, state.v_meta, jnp.asarray(n_q), 2, 2, G,
                 method.value_group_for(D))
  k, v = read_mma_store(mma, 2)
  # The packing of the library layout's store, read the same way (the fold of the zero-points rounds identically).
  k_ref, v_ref = read_mma_store(pack_mma_store(library), 2)
  for b in range(3):
    np.testing.assert_array_equal(np.asarray(k[b, :, :n_q[b]]), np.asarray(k_ref[b, :, :n_q[b]]))
    np.testing.assert_array_equal(np.asarray(v[b, :, :n_q[b]]), np.asarray(v_ref[b, :, :n_q[b]]))
  for name in ("valid", "k_fp", "v_fp", "pool_k", "pool_v", "pool_pos", "pool_score", "aux_count", "frozen"):
    np.testing.assert_array_equal(np.asarray(getattr(state, name)), np.asarray(getattr(ref_state, name)),
                                  err_msg=name)


def test_mma_left_open_follows_the_kernel_that_would_read_the_store(monkeypatch):
  """mma=None is the MMA packing exactly where the Hopper kernel would read it (impl pallas, the kernel takes
  the query rows) and the settings allow it (G dividing 64 or a multiple of it); mma=True with settings the
  packing does not take is a one-line error."""
  import jkv.attention as attention
  spec = _spec(2, 256, head_dim=64)
  monkeypatch.setattr(attention, "hopper_kernel_takes", lambda rows: True)
  assert Ott().for_impl(spec, "pallas").mma and Ott(group_size=128).for_impl(spec, "pallas").mma
  assert not Ott().for_impl(spec, "xla").mma
  assert not Ott(group_size=48).for_impl(spec, "pallas").mma and Ott(bits=8).for_impl(spec, "pallas").mma
  assert not Ott().for_impl(_spec(2, 256, head_dim=32), "pallas").mma  # D a multiple of 64
  # A capacity of 240 is 256 slots either way (whole tiles: the Triton kernel's blocks of 64 too), so the packing
  # allocates what planning counted with mma open.
  odd = _spec(2, 240, head_dim=64)
  assert Ott().for_impl(odd, "pallas").mma
  assert [Ott(mma=mma).abstract(odd).valid.shape[3] for mma in (False, True)] == [256, 256]
  monkeypatch.setattr(attention, "hopper_kernel_takes", lambda rows: False)
  assert not Ott().for_impl(spec, "pallas").mma
  with pytest.raises(ValueError, match="group_size=48 to divide 64"):
    Ott(group_size=48, mma=True)


@pytest.mark.skipif(not hopper_kernel_available(), reason="needs a Hopper GPU and Mosaic GPU")
def test_mma_packing_on_the_hopper_kernel_equals_the_library_layout():
  """With impl pallas on a Hopper GPU, OTT's MMA-packed store (holes masked in the kernel, the buffer in the same
  kernel, the pool segment merged from the Triton kernel) against the library's layout on the XLA path, in bf16:
  every step's output within 16-bit rounding."""
  runs, _ = _mma_and_library_runs(16, "oneshot", {False: "xla", True: "pallas"}, steps=24, dtype=jnp.bfloat16)
  (ref, _, _), (out, state, _) = runs[False], runs[True]
  assert not np.asarray(state.valid[2]).all()
  for step_out, step_ref in zip(out, ref):
    assert np.linalg.norm(step_out - step_ref) / np.linalg.norm(step_ref) <= 1e-2


# ------------------------------------------------------------------------------------------------ the kernel


class TestOttKernelInterpret:
  """The fused kernel (and the quantize-and-pack kernel of the block events) against the XLA path on a ragged
  batch whose pools, auxiliary pools and holes are all occupied, in a two-row step with a block event between
  its rows. The GPU subclass runs the same compiled."""

  IMPL = "interpret"

  def test_kernel_with_pools_and_holes_equals_xla_path(self):
    G, R, head_dim = 64, 16, 32  # value groups of D < G channels, as on the default model (G = 128, D = 64)
    method = Ott(group_size=G, residual=R, pool_size=3, aux_size=8, prefill_selection="sequential")
    rng = np.random.default_rng(11)
    q, k, v = _random_qkv(rng, 2, 6 * G, head_dim)
    lengths = np.array([3 * G + R - 1, 5 * G + 3])  # the first sequence's buffer fills before the second row
    k[0, :, 2 * G + 22] = 0.0  # the lowest norm: the event of block [2G, 3G) must admit it
    T = int(lengths.max())
    prefilled = _prefill(method, method.init(_spec(2, 6 * G, head_dim=head_dim)), 2, k[:, :, :T], v[:, :, :T],
                         lengths)
    rows = lambda x: _rows(x, lengths, 2)
    runs = {}
    for impl in ("xla", self.IMPL):
      runs[impl] = _step(method, prefilled, 2, rows(q), rows(k), rows(v), jnp.asarray(lengths, jnp.int32), impl)
    (ref, ref_state), (out, state) = runs["xla"], runs[self.IMPL]
    assert (np.asarray(ref_state.pool_pos[2])[..., 3:] >= 0).any() and not np.asarray(ref_state.valid[2]).all()
    # The event of the first sequence's block [2G, 3G) ran between its two rows.
    assert (np.asarray(ref_state.pool_pos[2, 0, :, 0]) == 2 * G + 22).all()
    assert not (np.asarray(prefilled.pool_pos[2, 0]) == 2 * G + 22).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-4)
    for name, array in vars(ref_state).items():  # the quantize-and-pack kernel is bit-exact
      np.testing.assert_array_equal(np.asarray(getattr(state, name)), np.asarray(array), err_msg=name)


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestOttKernelGpu(TestOttKernelInterpret):
  IMPL = "pallas"


# ------------------------------------------------------------------------------------------------ memory, settings


def test_memory_matches_the_first_principles_count():
  """Bytes of jkv's representation at Llama-2-7B shapes (32 layers, 32 KV heads, D = 128, fp16), G = 128,
  R = 32: per quantized token and head 2-bit K and V codes (64 bytes), fp16 scale and zero per 128 tokens of a key
  channel (4) and per 128 channels of a value (4), one bool of the hole mask; 512 bytes per buffered or pooled
  token, plus 4 per position and 4 per pool score; 5 bytes of counters per layer and head with a pool. Without a
  pool the asymptotic ratio to fp16 is 16 / (2 + 32/G) = 7.11x."""
  spec = CacheSpec(num_layers=32, batch=1, capacity=32768, kv_heads=32, head_dim=128, q_per_kv=1,
                   dtype=jnp.float16)
  paper = lambda **options: make_method("ott", preset="paper", **options)  # the paper's setting, not jkv's default
  heads = 32 * 32
  for n in (100, 1000, 4096, 32768):
    n_q = 128 * max(0, (n - 1 - 32) // 128)
    pooled, aux = min(3, n_q), min(32, max(n_q - 3, 0))
    plain = heads * (72 * n_q + 512 * (n - n_q)) + 4
    with_pool = plain + heads * n_q + 30 * 32 * (pooled * 520 + aux * 516 + 5)
    assert paper(pool_size=0).held_bytes(spec, None, np.array([n])).device == plain
    assert paper().held_bytes(spec, None, np.array([n])).device == with_pool
  big = np.array([1 << 24])
  dense = 2 * 2 * 128 * heads * big[0]
  assert dense / paper(pool_size=0).held_bytes(spec, None, big).device == pytest.approx(16 / (2 + 32 / 128), rel=1e-4)
  assert dense / paper().held_bytes(spec, None, big).device == pytest.approx(512 / 73, rel=1e-4)


def test_default_and_paper_preset_layouts_and_bytes_per_token():
  """The default (docs/frontier.md: 2-bit, G = 16, Gv = 32, R = 32, N = 8) and the paper preset, whose values are
  grouped as its keys (Gv = min(G, D), the layout benchmarks/kernel_decode.py times). Bytes per token once the
  pools are full, from first principles at D = 64 in fp16: 2-bit K and V codes (32 bytes), an fp16 scale and zero
  per G tokens of a key channel (4 * 64 / G) and per Gv channels of a value (4 * 64 / Gv), one hole bool with a
  pool: 57 for the default, 39 for the paper preset (G = 128, Gv = 64), 48 for KIVI-2 (G = 32, no holes)."""
  ott = Ott()
  assert (ott.bits, ott.group_size, ott.value_group_for(64), ott.residual, ott.pool_size) == (2, 16, 32, 32, 8)
  assert ott.value_group_for(128) == 32 and ott.value_group_for(16) == 16  # at most the head dim
  paper = make_method("ott", preset="paper")
  assert (paper.group_size, paper.residual, paper.pool_size) == (128, 32, 3)
  assert [paper.value_group_for(d) for d in (64, 128, 256)] == [64, 128, 128]
  spec = CacheSpec(num_layers=4, batch=1, capacity=1 << 16, kv_heads=2, head_dim=64, q_per_kv=1, dtype=jnp.float16)
  n, step = 10_001, 2048  # a multiple of every G and of KIVI's R: the buffers end in the same phase
  per_token = lambda m: (m.held_bytes(spec, None, np.array([n + step])).device
                         - m.held_bytes(spec, None, np.array([n])).device) / (step * 4 * 2)
  assert per_token(ott) == 57 and per_token(paper) == 39 and per_token(make_method("kivi")) == 48


@pytest.mark.parametrize("options, message", [
    (dict(bits=3), "bits=3 is not supported"),
    (dict(group_size=24), "group_size=24 must be a positive multiple of 16"),
    (dict(bits=1), r"group_size=16 must be a positive multiple of 32 \(1-bit codes pack 32 per word\); set "
                   "group_size=32"),  # the default G = 16 is too short for 1-bit words
    (dict(residual=-1), "residual=-1 non-negative"),
    (dict(pool_size=-1), "pool_size=-1 must be non-negative"),
    (dict(aux_size=-2), "aux_size=-2 must be non-negative"),
    (dict(prefill_selection="greedy"), "prefill_selection='greedy'"),
    (dict(group_size=32, value_group=48), "value group 48 must divide the head dim 64"),
])
def test_invalid_settings_are_rejected(options, message):
  with pytest.raises(ValueError, match=message):
    KVCache.create(make_method("ott", **options), _spec(1, 256, head_dim=64))


def test_too_many_rows_per_step_are_rejected():
  method = Ott(group_size=16, residual=1)
  state = method.init(_spec(1, 64))
  with pytest.raises(ValueError, match="steps of 4 rows need residual >= 2"):
    _step(method, state, 2, jnp.zeros((1, 2, 4, 2, 32)), jnp.zeros((1, 2, 4, 32)), jnp.zeros((1, 2, 4, 32)),
          jnp.zeros((1,), jnp.int32))


def test_cli_and_compare_build_ott_from_their_options():
  args = cli.build_parser().parse_args(["generate", "--method", "ott", "--pool-size", "8", "--aux-size", "16",
                                        "--group-size", "64", "--residual", "16", "--no-pool-layers", "0",
                                        "--prefill-selection", "sequential", "hello"])
  assert cli.method_from_args(args) == Ott(pool_size=8, aux_size=16, group_size=64, residual=16, no_pool_layers=0,
                                           prefill_selection="sequential")
  spec = MethodSpec.parse("ott:pool_size=1,value_group=32")
  assert spec.method() == Ott(pool_size=1, value_group=32) and spec.label == "ott:pool_size=1,value_group=32"
