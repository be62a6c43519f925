"""The fused decode kernel (stacked cache read in place) against its reference, and the reference against brute force.

The kernel runs in Pallas interpret mode on CPU (``INTERPRET = True``); the GPU subclass reruns every case compiled,
where a CUDA GPU of compute capability >= 8.0 is present. Inputs are random; each store holds keys and values
quantized and packed with the project's quantizer, so the kernel is held to the reference on the same dequantized
cache. Poison, so that a wrong read cannot hide: every layer other than the one asked for is NaN (scales, channel
scales and full-precision K/V); store slots past ``length`` and holes have NaN value scales and zeros, and key
groups with no attended slot NaN key scales; segment slots that no row of the KV head may attend hold NaN keys and
values.
"""

import dataclasses
import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import quantization
from jkv_kernels.attention_reference import MASK_VALUE
from jkv_kernels.dequant_attention import QuantizedStore, decode_attention, decode_attention_reference
from conftest import has_pallas_gpu

# ‖o - ref‖ / ‖ref‖, max |o - ref| / max |ref|, and max |lse - ref| budgets, by dtype. The kernel's dots take
# operands in the input dtype (dequantized keys and the probabilities are rounded to it: 8 significant bits in
# bf16, 11 in fp16); the reference is fp32 throughout.
TOLERANCE = {jnp.float32: (1e-5, 1e-4, 1e-5), jnp.float16: (2e-3, 5e-3, 3e-3), jnp.bfloat16: (1e-2, 3e-2, 2e-2)}


@dataclasses.dataclass(frozen=True)
class Seg:
  """One full-precision segment: S tokens; stacked over layers or per step; mask per position or per KV head;
  ``valid``: per batch row, mask keys [0, valid) causally (key s visible to position t iff s < valid - T + 1 + t),
  None for a random mask."""
  length: int
  stacked: bool = True
  per_head: bool = False
  valid: tuple[int, ...] | None = None

  def __str__(self):
    kind = ("L" if self.stacked else "") + ("H" if self.per_head else "") + ("c" if self.valid else "r")
    return f"{self.length}{kind}"


@dataclasses.dataclass(frozen=True)
class Store:
  """One quantized store: key/value widths and groupings, capacity C and one length per batch row; ``holes``
  None, "stacked" ([L, B, Hkv, C], read at the layer) or "step" ([B, Hkv, C]); a value channel scale or not."""
  bits: int
  lengths: tuple[int, ...] = ()
  v_bits: int | None = None
  capacity: int = 256
  k_group: int = 32
  v_group: int = 32
  holes: str | None = None
  channel_scale: bool = False

  def __str__(self):
    return (f"{self.bits}x{self.v_bits or self.bits}bit_C{self.capacity}_G{self.k_group}x{self.v_group}"
            f"{'_len' + '-'.join(map(str, self.lengths)) if self.lengths else ''}"
            f"{'_holes-' + self.holes if self.holes else ''}"
            f"{'_cscale' if self.channel_scale else ''}")


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel configuration. No store: dense decoding. One batch row per entry of the first store's
  ``lengths`` or, without a store, of the first segment's ``valid``."""
  num_layers: int
  head_dim: int
  q_per_kv: int
  t_rows: int
  stores: tuple[Store, ...] = ()
  segments: tuple[Seg, ...] = ()
  dtype: type = jnp.float32
  block_k: int = 128
  k_splits: int = 2
  block_s: int = 64
  s_splits: int | None = None  # None: the kernel's default (MIN_PROGRAMS over B * Hkv)
  mass_rows: tuple[int, ...] = ()
  tokens_major: bool | None = None  # the kernel's tile orientation (None: its choice by layout)

  @property
  def batch(self):
    return len(self.stores[0].lengths) if self.stores else len(self.segments[0].valid)

  def __str__(self):
    return (f"{'+'.join(map(str, self.stores)) or 'dense'}_L{self.num_layers}_D{self.head_dim}_g{self.q_per_kv}_"
            f"T{self.t_rows}_seg{'-'.join(map(str, self.segments)) or 0}_{jnp.dtype(self.dtype).name}_"
            f"bk{self.block_k}_ks{self.k_splits}_bs{self.block_s}_ss{self.s_splits}"
            f"{'_mass' + '-'.join(map(str, self.mass_rows)) if self.mass_rows else ''}"
            f"{'' if self.tokens_major is None else '_tokens' if self.tokens_major else '_rows'}")


# A deliberate sweep, without the full product that interpret mode cannot afford: stores or not (dense); L in
# {1, 2, 3}, every layer index; bits 1/2/4/8 and mixed; D 64/128; g 1/3/4/8; T 1/2; store lengths 0, 1, G - 1,
# 100, C; dense lengths 1, 3, 63, 65 and the capacity; segments stacked or per step, masks per position or per
# head, ragged tails, split over several programs; fp32, fp16, bf16; the token-mass statistic in five cases.
# Then the layouts of the other methods: two stores of different widths (ZipCache's pools, holes per step, value
# channel scale, v_group = D); OTT's KIVI-2 G=128 store read in blocks of 64 (a key group spans two blocks) with
# stacked holes beside its pools; key groups of 16 inside blocks of 64 (k_group != v_group); SpeCache's 1-bit
# store with per-step holes beside its fetched rows (a per-step segment with a per-head mask). The kernel picks
# tokens-major tiles for stores with holes and rows-major otherwise; cases marked _tokens / _rows force the other
# orientation, so each runs on stores, dense segments, ragged tails, holes, channel scales and the token mass.
CAUSAL = (1, 3, 63, 65, 256)
CASES = [
    # KIVI: the store plus its exact window (a per-step segment)
    Case(3, 64, 4, 1, (Store(2, (1, 31, 256)),), (Seg(40, stacked=False),), mass_rows=(0,)),
    Case(1, 128, 3, 2, (Store(4, (100, 0), capacity=512),), (Seg(65, per_head=True), Seg(5, stacked=False)),
         dtype=jnp.bfloat16, k_splits=3, s_splits=2, tokens_major=True),
    Case(3, 64, 8, 2, (Store(8, (256, 17)),), (Seg(128, stacked=False), Seg(20, per_head=True)), dtype=jnp.float16,
         block_k=64, k_splits=4, mass_rows=(1,), tokens_major=True),
    # dense: stacked segments only, causal lengths, split over programs
    Case(3, 64, 4, 1, segments=(Seg(256, valid=CAUSAL),), dtype=jnp.bfloat16, block_s=32, s_splits=3),
    Case(1, 128, 1, 2, segments=(Seg(256, valid=CAUSAL),), block_s=64, s_splits=16, mass_rows=(0, 1),
         tokens_major=True),
    Case(3, 64, 3, 2, segments=(Seg(200, per_head=True, valid=(200, 3, 64)), Seg(3, stacked=False)),
         dtype=jnp.float16, block_s=32, s_splits=4, tokens_major=True),
    # ZipCache: a 4-bit and a 2-bit pool (holes per step, channel scale, v_group = D), a window; mass over both
    Case(2, 64, 4, 1, (Store(4, (200, 70), k_group=32, v_group=64, holes="step", channel_scale=True),
                       Store(2, (128, 33), capacity=128, k_group=32, v_group=64, holes="step", channel_scale=True)),
         (Seg(24),), dtype=jnp.bfloat16, block_k=64, mass_rows=(0,)),
    # OTT: KIVI-2 G=128 in blocks of 64 with stacked holes (outlier placeholders), its pools and window
    Case(2, 128, 2, 1, (Store(2, (384, 130), capacity=384, k_group=128, v_group=64, holes="stacked"),),
         (Seg(3, per_head=True), Seg(32, per_head=True), Seg(16, stacked=False)), dtype=jnp.float16,
         block_k=64, k_splits=3, tokens_major=False),
    # key groups of 16 inside blocks of 64, 2-bit keys and 4-bit values grouped by 32, a channel scale
    Case(2, 64, 3, 2, (Store(2, (256, 45), v_bits=4, k_group=16, channel_scale=True),), (Seg(10, stacked=False),),
         block_k=64, tokens_major=True),
    # SpeCache: 1-bit G=32 with per-step holes (rows attended from their fetched copy), the fetched rows (per-step,
    # per-head mask), the window; two query rows (the speculative one's mass)
    Case(2, 64, 4, 2, (Store(1, (256, 100), holes="step"),),
         (Seg(64, stacked=False, per_head=True), Seg(16, stacked=False)), dtype=jnp.bfloat16, block_k=64,
         mass_rows=(1,)),
]


@functools.partial(jax.jit, static_argnames=("bits", "v_bits", "k_group", "v_group"))
def _quantize_layers(k, v, *, bits, v_bits, k_group, v_group):
  """[L, B, H, C, D] keys and values -> the KIVI-layout packed arrays, stacked."""
  k_codes, k_scale, k_zero = quantization.quantize(jnp.swapaxes(k, -1, -2), bits=bits, axis=-1,
                                                   group_size=k_group)
  v_codes, v_scale, v_zero = quantization.quantize(v, bits=v_bits, axis=-1, group_size=v_group)
  return (quantization.pack(k_codes, bits=bits, axis=-1), k_scale, k_zero,
          quantization.pack(v_codes, bits=v_bits, axis=-1), v_scale, v_zero)


def _make_holes(rng, spec: Store, shape):
  """valid [..., C]: about 30% random holes, plus one whole key group of holes per (b, h) where the store has
  several groups (so that some key scales are poisoned too)."""
  valid = rng.random(shape) >= 0.3
  n_groups = spec.capacity // spec.k_group
  if n_groups > 1:
    hole_group = rng.integers(n_groups, size=shape[:-1])
    valid &= (np.arange(spec.capacity) // spec.k_group) != hole_group[..., None]
  return valid


def _make_store(rng, case: Case, spec: Store, layer: int, kv_heads: int):
  capacity, batch = spec.capacity, case.batch
  shape = (case.num_layers, batch, kv_heads, capacity, case.head_dim)
  k = rng.normal(size=shape)
  k[..., rng.choice(case.head_dim, 3, replace=False)] *= 8.0  # a few outlier channels, as in real keys
  v = rng.normal(size=shape)
  v_bits = spec.v_bits or spec.bits
  k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = _quantize_layers(
      jnp.asarray(k, case.dtype), jnp.asarray(v, case.dtype), bits=spec.bits, v_bits=v_bits,
      k_group=spec.k_group, v_group=spec.v_group)
  # seen [B, H, C]: the slots attended at ``layer`` (below length, not a hole)
  seen = np.broadcast_to(np.arange(capacity) < np.asarray(spec.lengths)[:, None, None], (batch, kv_heads, capacity))
  valid = None
  if spec.holes:
    valid = _make_holes(rng, spec, ((case.num_layers,) if spec.holes == "stacked" else ()) + seen.shape)
    seen = seen & (valid[layer] if spec.holes == "stacked" else valid)
  other = (np.arange(case.num_layers) != layer)[:, None, None, None, None]
  unseen_groups = ~seen.reshape(batch, kv_heads, capacity // spec.k_group, spec.k_group).any(-1)
  k_poison = other | unseen_groups[None, :, :, None, :]
  v_poison = other | ~seen[None, ..., None]
  poison = lambda x, where: jnp.where(where, jnp.nan, x).astype(x.dtype)
  channel_scale = None
  if spec.channel_scale:
    scale = rng.uniform(0.5, 2.0, (case.num_layers, batch, kv_heads, case.head_dim))
    channel_scale = poison(jnp.asarray(scale, jnp.float16), other[..., 0])
  return QuantizedStore(
      k_codes, poison(k_scale, k_poison), k_zero, v_codes, poison(v_scale, v_poison), poison(v_zero, v_poison),
      jnp.asarray(spec.lengths, jnp.int32), k_bits=spec.bits, v_bits=v_bits, k_group=spec.k_group,
      v_group=spec.v_group, valid=None if valid is None else jnp.asarray(valid), v_channel_scale=channel_scale)


def _make_segment(rng, case: Case, seg: Seg, layer: int, kv_heads: int):
  batch, t_rows, length = case.batch, case.t_rows, seg.length
  if seg.valid is None:
    mask = rng.random((batch, kv_heads, t_rows, length) if seg.per_head else (batch, t_rows, length)) < 0.6
  else:  # causal: position t of row b sees keys s < valid[b] - T + 1 + t
    last = np.asarray(seg.valid)[:, None] - t_rows + 1 + np.arange(t_rows)[None, :]  # [B, T]
    mask = np.arange(length)[None, None, :] < last[:, :, None]
    if seg.per_head:  # head h of row b sees h fewer keys
      mask = mask[:, None] & (np.arange(length)[None, None, None, :]
                              < (last[:, None, :, None] - np.arange(kv_heads)[None, :, None, None]))
  seen = (mask.any(axis=-2) if mask.ndim == 4 else mask.any(axis=1)[:, None])  # [B, H or 1, S]
  shape = ((case.num_layers,) if seg.stacked else ()) + (batch, kv_heads, length, case.head_dim)
  poison = ~seen[..., None]
  if seg.stacked:
    poison = poison[None] | (np.arange(case.num_layers) != layer)[:, None, None, None, None]
  k = np.where(poison, np.nan, rng.normal(size=shape))
  v = np.where(poison, np.nan, rng.normal(size=shape))
  return jnp.asarray(k, case.dtype), jnp.asarray(v, case.dtype), jnp.asarray(mask)


def make_inputs(case: Case, layer: int, seed: int = 0):
  """(q, stores, segments) with every layer but ``layer`` poisoned (no store for dense)."""
  rng = np.random.default_rng(seed)
  kv_heads = 2
  q = jnp.asarray(rng.normal(size=(case.batch, kv_heads, case.t_rows, case.q_per_kv, case.head_dim)), case.dtype)
  stores = tuple(_make_store(rng, case, spec, layer, kv_heads) for spec in case.stores)
  segments = tuple(_make_segment(rng, case, seg, layer, kv_heads) for seg in case.segments)
  return q, stores, segments


def _relative_errors(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return (np.linalg.norm(out - ref) / np.linalg.norm(ref), np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _assert_close(out, ref, dtype, what):
  assert np.all(np.isfinite(np.asarray(out, np.float32))), f"{what}: not finite"
  norm_err, max_err = _relative_errors(out, ref)
  norm_tol, max_tol, _ = TOLERANCE[dtype]
  assert norm_err <= norm_tol and max_err <= max_tol, (what, norm_err, max_err)


class TestDecodeAttentionInterpret:
  INTERPRET = True

  def _run(self, q, layer, stores, segments, case: Case, **kwargs):
    return decode_attention(q, layer, stores, segments, block_k=case.block_k, k_splits=case.k_splits,
                            block_s=case.block_s, s_splits=case.s_splits, tokens_major=case.tokens_major,
                            interpret=self.INTERPRET, **kwargs)

  @pytest.mark.parametrize("case", CASES, ids=str)
  def test_matches_reference(self, case):
    """o and lse (and the token mass where asked for) at every layer index; the layer is traced: one compile."""
    stats = dict(return_lse=True, token_mass_rows=case.mass_rows)
    for layer in range(case.num_layers):
      q, stores, segments = make_inputs(case, layer, seed=layer)
      out = self._run(q, jnp.int32(layer), stores, segments, case, **stats)
      ref = decode_attention_reference(q, jnp.int32(layer), stores, segments, **stats)
      (o, lse, *mass), (ref_o, ref_lse, *ref_mass) = out, ref
      assert o.shape == q.shape and o.dtype == case.dtype and lse.shape == q.shape[:-1]
      assert np.all(np.isfinite(np.asarray(ref_o, np.float32)))
      _assert_close(o, ref_o, case.dtype, f"o at layer {layer}")
      np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=TOLERANCE[case.dtype][2], err_msg=f"lse {layer}")
      if case.mass_rows:
        (store_mass, segment_mass), (ref_store_mass, ref_segment_mass) = mass[0], ref_mass[0]
        assert len(store_mass) == len(ref_store_mass) == len(stores)
        pairs = list(zip(segment_mass, ref_segment_mass)) + list(zip(store_mass, ref_store_mass))
        for got, want in pairs:
          assert got.shape == want.shape == (*q.shape[:2], len(case.mass_rows), want.shape[-1])
          _assert_close(got, want, case.dtype, f"token mass at layer {layer}")
        # a chosen row's mass sums to g over all sources (a probability per query head), or 0 with no valid key
        total = sum(np.asarray(m, np.float64).sum(-1) for m, _ in pairs)
        has_keys = np.asarray(ref_lse)[:, :, list(case.mass_rows), 0] > MASK_VALUE / 2
        np.testing.assert_allclose(total, np.where(has_keys, case.q_per_kv, 0.0), rtol=1e-3, atol=1e-6)
        for got, store in zip(store_mass, stores):  # holes and slots past length receive exactly 0
          attended = np.asarray(store.slot_mask(layer))[:, :, None, :]
          assert np.all(np.asarray(got)[~np.broadcast_to(attended, got.shape)] == 0)

  @pytest.mark.parametrize("tokens_major", [False, True], ids=["rows", "tokens"])
  def test_rows_without_keys_give_zero(self, tokens_major):
    """k_bits != v_bits; rows with no valid key anywhere (a store of length 0, a store whose slots are all holes,
    the segment masked) return exactly 0, with lse = MASK_VALUE and zero token mass; a dense-only call where a
    whole batch row is masked does the same. In both tile orientations."""
    case = Case(1, 64, 4, 2, (Store(4, (0, 77), v_bits=2), Store(2, (64, 30), capacity=64, holes="step")),
                (Seg(16, stacked=False),), block_k=64)
    q, (store, holed), ((seg_k, seg_v, mask),) = make_inputs(case, 0)
    holed = dataclasses.replace(holed, valid=holed.valid.at[0].set(False))  # batch row 0: every slot a hole
    mask = mask.at[0, 1].set(False)  # batch row 0, query position 1: nothing to attend
    seg_k = seg_k.at[0].set(jnp.where(mask[0].any(0)[None, :, None], seg_k[0], jnp.nan))
    args = (q, jnp.int32(0), (store, holed), ((seg_k, seg_v, mask),))
    stats = dict(return_lse=True, token_mass_rows=(1,))
    o, lse, mass = decode_attention(*args, **stats, block_k=64, k_splits=2, tokens_major=tokens_major,
                                    interpret=self.INTERPRET)
    ref_o, ref_lse, ref_mass = decode_attention_reference(*args, **stats)
    np.testing.assert_array_equal(np.asarray(o[0, :, 1]), 0.0)
    np.testing.assert_array_equal(np.asarray(lse[0, :, 1]), np.float32(MASK_VALUE))
    np.testing.assert_array_equal(np.asarray(ref_lse[0, :, 1]), np.float32(MASK_VALUE))
    for got in jax.tree.leaves(mass):
      np.testing.assert_array_equal(np.asarray(got[0]), 0.0)
    assert max(_relative_errors(o, ref_o)) <= 1e-4
    for got, want in zip(jax.tree.leaves(mass), jax.tree.leaves(ref_mass)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)

    dense = Case(3, 64, 2, 1, segments=(Seg(64, valid=(0, 5)),))
    q, _, segments = make_inputs(dense, 2)
    o, lse = decode_attention(q, jnp.int32(2), (), segments, return_lse=True, tokens_major=tokens_major,
                              interpret=self.INTERPRET)
    np.testing.assert_array_equal(np.asarray(o[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(lse[0]), np.float32(MASK_VALUE))
    assert np.all(np.asarray(lse[1]) > -1e3)


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestDecodeAttentionGpu(TestDecodeAttentionInterpret):
  INTERPRET = False


def _abstract_inputs(*, stores, dtype, num_layers, batch, kv_heads, t_rows, q_per_kv, head_dim, segment_lens):
  """ShapeDtypeStructs for decode_attention: stacked stores (``Store`` specs; their lengths are not used) and
  stacked segments (per-head masks), plus one per-step segment of 129 tokens (ragged)."""
  spec = jax.ShapeDtypeStruct
  lead = (num_layers, batch, kv_heads)

  def store(s: Store):
    v_bits, capacity = s.v_bits or s.bits, s.capacity
    k_meta = spec((*lead, head_dim, capacity // s.k_group), jnp.float16)
    v_meta = spec((*lead, capacity, head_dim // s.v_group), jnp.float16)
    valid = {None: None, "stacked": spec((*lead, capacity), jnp.bool_),
             "step": spec((batch, kv_heads, capacity), jnp.bool_)}[s.holes]
    return QuantizedStore(spec((*lead, head_dim, capacity // (32 // s.bits)), jnp.uint32), k_meta, k_meta,
                          spec((*lead, capacity, head_dim // (32 // v_bits)), jnp.uint32), v_meta, v_meta,
                          spec((batch,), jnp.int32), k_bits=s.bits, v_bits=v_bits, k_group=s.k_group,
                          v_group=s.v_group, valid=valid,
                          v_channel_scale=spec((*lead, head_dim), jnp.float16) if s.channel_scale else None)

  segments = tuple((spec((*lead, s, head_dim), dtype), spec((*lead, s, head_dim), dtype),
                    spec((batch, kv_heads, t_rows, s), jnp.bool_)) for s in segment_lens)
  segments += ((spec((batch, kv_heads, 129, head_dim), dtype), spec((batch, kv_heads, 129, head_dim), dtype),
                spec((batch, t_rows, 129), jnp.bool_)),)
  q = spec((batch, kv_heads, t_rows, q_per_kv, head_dim), dtype)
  return q, spec((), jnp.int32), tuple(map(store, stores)), segments


def _assert_passed_whole(text, lead):
  """Every line of the lowered program that mentions a stacked array (a tensor type with the leading dims
  ``lead`` = (L, B, Hkv)) only passes it along: function signatures, calls, loops, returns and the Triton custom
  call. A slice, gather, copy or update of a stacked array would show up here as another op."""
  stacked = "tensor<" + "x".join(map(str, lead)) + "x"
  passing = ("func.func", "call @", "stablehlo.while", "stablehlo.return", "return ", "stablehlo.custom_call")
  lines = [line.strip() for line in text.splitlines() if stacked in line]
  assert any("stablehlo.custom_call" in line for line in lines)
  for line in lines:
    assert any(op in line for op in passing), line[:300]


def _verify_triton_modules(monkeypatch):
  """Make every Pallas Triton lowering also run the MLIR verifier on the module it builds (op and type rules a
  GPU compile would reject); returns the list of verified module count. Private jax API: skipped if it moved."""
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    lower = triton_lowering.lower_jaxpr_to_triton_module
  except (ImportError, AttributeError):
    return None
  verified = []

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    with result.module.context:
      assert result.module.operation.verify()
    verified.append(True)
    return result

  monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  return verified


# (stores, dtype, L, T, g, D, stacked segment lengths, tunables): the benchmark's shapes and the corners, then the
# other methods' layouts: ZipCache's two pools (per-step holes, channel scale, v_group = D, token mass), OTT's
# G=128 store in blocks of 64 with stacked holes (and token mass: the stacked holes are never sliced for it),
# SpeCache's 1-bit store with per-step holes and two query rows, key groups of 16 beside 1-bit values with
# stacked holes and a channel scale, and 1-bit keys in blocks of one word (32 tokens) inside groups of 64.
LOWERING_CASES = [
    ((Store(2, capacity=4096),), jnp.bfloat16, 32, 1, 4, 128, (), dict(block_k=256, k_splits=16)),
    ((Store(4, capacity=4096),), jnp.bfloat16, 3, 1, 4, 128, (), dict(block_k=512, k_splits=32, num_stages=2)),
    ((Store(8, capacity=2048),), jnp.float16, 3, 4, 8, 128, (100,),
     dict(block_k=128, k_splits=8, token_mass_rows=(0, 3))),
    ((Store(2, capacity=1024),), jnp.float32, 2, 2, 3, 64, (5,), dict(block_k=256, k_splits=3)),
    ((), jnp.bfloat16, 32, 1, 4, 128, (8192,), dict(block_s=128, s_splits=16, num_stages=3)),
    ((), jnp.float16, 3, 2, 4, 128, (1000, 65), dict(block_s=64, s_splits=8, return_lse=True)),
    ((Store(4, capacity=4096, v_group=128, holes="step", channel_scale=True),
      Store(2, capacity=2048, v_group=128, holes="step", channel_scale=True)), jnp.bfloat16, 32, 1, 4, 128, (100,),
     dict(block_k=64, k_splits=16, token_mass_rows=(0,))),
    ((Store(2, capacity=4096, k_group=128, v_group=128, holes="stacked"),), jnp.bfloat16, 32, 1, 4, 128, (3, 32),
     dict(block_k=64, token_mass_rows=(0,))),
    ((Store(1, capacity=4096, holes="step"),), jnp.bfloat16, 32, 2, 4, 128, (), dict(token_mass_rows=(1,))),
    ((Store(2, v_bits=1, capacity=1024, k_group=16, holes="stacked", channel_scale=True),), jnp.float16, 3, 2, 3, 64,
     (5,), dict(block_k=64, return_lse=True)),
    ((Store(1, capacity=1024, k_group=64),), jnp.float32, 2, 1, 4, 64, (), dict(block_k=32, k_splits=4)),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: f"{'+'.join(map(str, c[0])) or 'dense'}_"
                         f"{jnp.dtype(c[1]).name}_L{c[2]}_T{c[3]}_g{c[4]}")
def test_lowers_to_triton(case, monkeypatch):
  """Lowering for CUDA runs on any machine and catches what the Triton lowering rejects before a GPU run:
  unsupported primitives, tiles that are not powers of two, dots smaller than 16; the Triton module is verified.
  The stacked arrays go into the kernel whole: the lowered program slices none of them."""
  stores, dtype, num_layers, t_rows, q_per_kv, head_dim, segment_lens, tunables = case
  verified = _verify_triton_modules(monkeypatch)
  args = _abstract_inputs(stores=stores, dtype=dtype, num_layers=num_layers, batch=2, kv_heads=8, t_rows=t_rows,
                          q_per_kv=q_per_kv, head_dim=head_dim, segment_lens=segment_lens)
  lowered = decode_attention.trace(*args, **tunables).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "triton" in text
  assert verified is None or verified
  _assert_passed_whole(text, (num_layers, 2, 8))


def test_scan_over_layers_reads_the_carry_in_place():
  """A decode step's layer loop: lax.scan over layers with the stacked cache in the carry, the kernel entry called
  with the layer index. The lowered CUDA program never slices, gathers or copies the stacked arrays: they reach
  the Triton call as the loop's carried buffers."""
  num_layers, batch, kv_heads, capacity, head_dim = 4, 2, 8, 2048, 128
  q, _, stores, segments = _abstract_inputs(stores=(Store(2, capacity=capacity),), dtype=jnp.bfloat16,
                                           num_layers=num_layers, batch=batch, kv_heads=kv_heads, t_rows=1,
                                           q_per_kv=4, head_dim=head_dim, segment_lens=(capacity,))

  def step(q, stores, segments):
    def layer_body(carry, layer):
      stores, segments, x = carry
      o = decode_attention(x, layer, stores, segments)
      return (stores, segments, o), None
    (stores, segments, x), _ = jax.lax.scan(layer_body, (stores, segments, q),
                                            jnp.arange(num_layers, dtype=jnp.int32))
    return x

  text = jax.jit(step).trace(q, stores, segments).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.while" in text and "triton" in text
  _assert_passed_whole(text, (num_layers, batch, kv_heads))


def test_reference_matches_brute_force():
  """The reference against float64 numpy at layer 1 of 2: unpack bit by bit, dequantize, loop over heads and
  rows; a stacked segment with a per-head mask and a per-step segment."""
  case = Case(2, 64, 3, 2, (Store(2, (45, 96), capacity=96),), (Seg(7, per_head=True), Seg(5, stacked=False)))
  q, (store,), segments = make_inputs(case, layer=1)
  ref, lse = decode_attention_reference(q, jnp.int32(1), (store,), segments, return_lse=True)
  ref, lse = np.asarray(ref, np.float64), np.asarray(lse, np.float64)
  q = np.asarray(q, np.float64)
  k_scale, k_zero, v_scale, v_zero = (np.asarray(a[1], np.float64) for a in (store.k_scale, store.k_zero,
                                                                            store.v_scale, store.v_zero))
  k_words, v_words = np.asarray(store.k_codes[1]), np.asarray(store.v_codes[1])
  seg_k = [np.asarray(k[1] if k.ndim == 5 else k, np.float64) for k, _, _ in segments]
  seg_v = [np.asarray(v[1] if v.ndim == 5 else v, np.float64) for _, v, _ in segments]
  seg_mask = [np.asarray(m if m.ndim == 4 else m[:, None].repeat(2, axis=1)) for _, _, m in segments]
  code = lambda word, j: (int(word) >> (2 * j)) & 3  # code j of a word sits at bits [2j, 2j + 2)
  batch, kv_heads, t_rows, q_per_kv, head_dim = q.shape
  for b in range(batch):
    for h in range(kv_heads):
      length = int(store.length[b])
      keys = [[code(k_words[b, h, d, t // 16], t % 16) * k_scale[b, h, d, t // 32] + k_zero[b, h, d, t // 32]
               for d in range(head_dim)] for t in range(length)]
      values = [[code(v_words[b, h, t, d // 16], d % 16) * v_scale[b, h, t, d // 32] + v_zero[b, h, t, d // 32]
                 for d in range(head_dim)] for t in range(length)]
      for t in range(t_rows):
        all_k, all_v = list(keys), list(values)
        for sk, sv, sm in zip(seg_k, seg_v, seg_mask):
          all_k += [sk[b, h, s] for s in range(sk.shape[2]) if sm[b, h, t, s]]
          all_v += [sv[b, h, s] for s in range(sk.shape[2]) if sm[b, h, t, s]]
        all_k, all_v = np.array(all_k), np.array(all_v)
        for i in range(q_per_kv):
          logits = all_k @ q[b, h, t, i] / np.sqrt(head_dim)
          p = np.exp(logits - logits.max())
          np.testing.assert_allclose(ref[b, h, t, i], p @ all_v / p.sum(), rtol=1e-5, atol=1e-5)
          np.testing.assert_allclose(lse[b, h, t, i], logits.max() + np.log(p.sum()), rtol=1e-6)


def _all_eqns(jaxpr):
  """Every equation of a jaxpr, those of its sub-jaxprs (jit, cond, ...) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _all_eqns(sub)


def test_reference_token_mass_and_one_bit():
  """The reference's token mass is the softmax column sums of the chosen rows over the g heads; at 1 bit
  (SpeCache's width) the kernel gives the reference's output, lse and token mass."""
  case = Case(1, 64, 4, 3, (Store(1, (64, 10), capacity=64),), (Seg(9, stacked=False),))
  q, stores, segments = make_inputs(case, 0)
  stats = dict(return_lse=True, token_mass_rows=(2, 0))
  o, lse, mass = decode_attention_reference(q, 0, stores, segments, **stats)
  (store_mass,), (seg_mass,) = mass
  assert store_mass.shape == (2, 2, 2, 64) and seg_mass.shape == (2, 2, 2, 9)
  np.testing.assert_allclose(np.asarray(store_mass).sum(-1) + np.asarray(seg_mass).sum(-1), 4.0, rtol=1e-5)
  assert np.all(np.asarray(store_mass)[1, :, :, 10:] == 0)  # past length
  seg_visible = np.asarray(segments[0][2])[:, [2, 0]]  # [B, R, S]
  assert np.all(np.asarray(seg_mass)[~np.broadcast_to(seg_visible[:, None], seg_mass.shape)] == 0)

  got_o, got_lse, got_mass = decode_attention(q, 0, stores, segments, **stats, block_k=32, interpret=True)
  _assert_close(got_o, o, jnp.float32, "o at 1 bit")
  np.testing.assert_allclose(got_lse, lse, rtol=0, atol=TOLERANCE[jnp.float32][2])
  for got, want in zip(jax.tree.leaves(got_mass), jax.tree.leaves(mass)):
    _assert_close(got, want, jnp.float32, "token mass at 1 bit")
  # Without the stores' mass (ZipCache's probes) the kernel writes the segment's logits alone: one logits output.
  call = lambda **kw: decode_attention(q, 0, stores, segments, **stats, block_k=32, interpret=True, **kw)
  (store_none, (seg_alone,)) = call(store_mass=False)[2]
  assert store_none == ()
  _assert_close(seg_alone, mass[1][0], jnp.float32, "segment mass without the store's")
  def kernel_outputs(**kw):  # o, l, m and a logits array per source whose mass is asked
    jaxpr = jax.make_jaxpr(lambda: call(**kw))()
    calls = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    return [len(e.outvars) for e in calls]
  assert (kernel_outputs(), kernel_outputs(store_mass=False)) == ([5], [4])


def test_bad_arguments_raise():
  case = Case(3, 64, 4, 1, (Store(2, (10, 20)),), (Seg(8),))
  q, (store,), segments = make_inputs(case, 0)
  (k, v, mask), = segments
  call = lambda q=q, stores=(store,), segments=segments, **kw: decode_attention(q, jnp.int32(0), stores, segments,
                                                                                interpret=True, **kw)
  with pytest.raises(ValueError, match=r"stores\[0\].k_codes has shape \(3, 2, 2, 64, 8\), expected "
                                       r"\(3, 2, 2, 64, 16\)"):
    call(stores=(dataclasses.replace(store, k_codes=store.k_codes[..., :8]),))
  with pytest.raises(ValueError, match=r"stores\[0\].v_scale has shape"):
    call(stores=(dataclasses.replace(store, v_scale=store.v_scale[:, :, :, :128]),))
  with pytest.raises(ValueError, match=r"stores\[0\].length must be int32"):
    call(stores=(dataclasses.replace(store, length=store.length.astype(jnp.float32)),))
  with pytest.raises(ValueError, match="k_group 48 must divide the capacity"):
    call(stores=(dataclasses.replace(store, k_group=48),))
  with pytest.raises(ValueError, match=r"stores\[0\].valid"):
    call(stores=(dataclasses.replace(store, valid=jnp.ones((2, 2, 7), bool)),))
  with pytest.raises(ValueError, match="segment 0: mask"):
    call(segments=((k, v, mask[:, :, :4]),))
  with pytest.raises(ValueError, match="segment 0: k"):
    call(segments=((k[..., :32], v, mask),))
  with pytest.raises(ValueError, match="disagree on the number of layers"):
    call(segments=((k[:2], v[:2], mask),))
  with pytest.raises(ValueError, match="needs a store or at least one segment"):
    call(stores=(), segments=())
  with pytest.raises(ValueError, match="token_mass_rows"):
    call(token_mass_rows=(1,))
  with pytest.raises(ValueError, match="layer must be an integer scalar"):
    decode_attention(q, jnp.zeros(2, jnp.int32), (store,), segments, interpret=True)
  with pytest.raises(ValueError, match="block_k 48 must be a power of two"):
    call(block_k=48)
  # The kernel's own limits (the reference takes these stores): power-of-two key groups, whole 16-token blocks.
  odd = Case(1, 64, 4, 1, (Store(2, (10, 20), capacity=96, k_group=48), Store(8, (3, 5), capacity=24, k_group=8)))
  q, (odd_group, odd_capacity), _ = make_inputs(odd, 0)
  for bad, message in ((odd_group, r"stores\[0\]: k_group 48 must be a power of two"),
                       (odd_capacity, r"stores\[0\]: capacity 24 must be a multiple of 16")):
    decode_attention_reference(q, 0, (bad,))
    with pytest.raises(ValueError, match=message):
      decode_attention(q, 0, (bad,), interpret=True)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_in_register_dequantize_of_a_tile_inside_one_group(bits):
  """A kernel block shorter than a key group: the tile's words with the group's one scale column equal the plain
  unpack-then-dequantize of that slice of the group."""
  rng = np.random.default_rng(bits)
  per_word, group, tile = 32 // bits, 128, 32
  codes, scale, zero = quantization.quantize(jnp.asarray(rng.normal(size=(5, 256)), jnp.float32), bits=bits,
                                             axis=-1, group_size=group)
  words = quantization.pack(codes, bits=bits, axis=-1)
  expect = quantization.dequantize(codes, scale, zero, axis=-1, group_size=group, dtype=jnp.float32)
  start = 160  # tokens [160, 192): inside group 1
  got = quantization.dequantize_packed_last_axis(
      words[:, start // per_word:(start + tile) // per_word], scale[:, 1:2], zero[:, 1:2], bits=bits,
      group_size=group, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(expect[:, start:start + tile]))
