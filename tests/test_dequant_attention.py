"""The fused decode kernel (stacked cache read in place) against its reference, and the reference against brute force.

The kernel runs in Pallas interpret mode on CPU (``INTERPRET = True``); the GPU subclass reruns every case compiled,
where a CUDA GPU of compute capability >= 8.0 is present. Inputs are random; the store holds keys and values
quantized and packed with the project's quantizer, so the kernel is held to the reference on the same dequantized
cache. Poison, so that a wrong read cannot hide: every layer other than the one asked for is NaN (scales and
full-precision K/V), store slots past ``length`` have NaN scales, and segment slots that no row of the KV head
may attend hold NaN keys and values.
"""

import dataclasses
import functools

import jax
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
class Case:
  """One kernel configuration. ``bits`` None: no store (dense decoding). One batch row per entry of ``lengths``
  (store lengths) or, without a store, of the first segment's ``valid``."""
  bits: int | None
  num_layers: int
  head_dim: int
  q_per_kv: int
  t_rows: int
  lengths: tuple[int, ...] = ()
  segments: tuple[Seg, ...] = ()
  dtype: type = jnp.float32
  capacity: int = 256
  group_size: int = 32
  block_k: int = 128
  k_splits: int = 2
  block_s: int = 64
  s_splits: int = 16
  mass_rows: tuple[int, ...] = ()
  v_bits: int | None = None

  @property
  def batch(self):
    return len(self.lengths) if self.bits else len(self.segments[0].valid)

  def __str__(self):
    store = f"{self.bits}x{self.v_bits or self.bits}bit_C{self.capacity}_len{'-'.join(map(str, self.lengths))}" \
        if self.bits else "dense"
    return (f"{store}_L{self.num_layers}_D{self.head_dim}_g{self.q_per_kv}_T{self.t_rows}_"
            f"seg{'-'.join(map(str, self.segments)) or 0}_{jnp.dtype(self.dtype).name}_"
            f"bk{self.block_k}_ks{self.k_splits}_bs{self.block_s}_ss{self.s_splits}"
            f"{'_mass' + '-'.join(map(str, self.mass_rows)) if self.mass_rows else ''}")


# A deliberate sweep, without the full product that interpret mode cannot afford: store or not (dense); L in
# {1, 3}, every layer index; bits 2/4/8 and mixed; D 64/128; g 1/3/4/8; T 1/2; store lengths 0, 1, G - 1, 100,
# C; dense lengths 1, 3, 63, 65 and the capacity; segments stacked or per step, masks per position or per head,
# ragged tails, split over several programs; fp32, fp16, bf16; the token-mass statistic in three cases.
CAUSAL = (1, 3, 63, 65, 256)
CASES = [
    # KIVI: the store plus its exact window (a per-step segment)
    Case(2, 3, 64, 4, 1, (1, 31, 256), (Seg(40, stacked=False),), mass_rows=(0,)),
    Case(4, 1, 128, 3, 2, (100, 0), (Seg(65, per_head=True), Seg(5, stacked=False)), dtype=jnp.bfloat16,
         capacity=512, k_splits=3, s_splits=2),
    Case(8, 3, 64, 8, 2, (256, 17), (Seg(128, stacked=False), Seg(20, per_head=True)), dtype=jnp.float16,
         block_k=64, k_splits=4, mass_rows=(1,)),
    # dense: stacked segments only, causal lengths, split over programs
    Case(None, 3, 64, 4, 1, segments=(Seg(256, valid=CAUSAL),), dtype=jnp.bfloat16, block_s=32, s_splits=3),
    Case(None, 1, 128, 1, 2, segments=(Seg(256, valid=CAUSAL),), block_s=64, s_splits=16, mass_rows=(0, 1)),
    Case(None, 3, 64, 3, 2, segments=(Seg(200, per_head=True, valid=(200, 3, 64)), Seg(3, stacked=False)),
         dtype=jnp.float16, block_s=32, s_splits=4),
]


@functools.partial(jax.jit, static_argnames=("bits", "v_bits", "group_size"))
def _quantize_layers(k, v, *, bits, v_bits, group_size):
  """[L, B, H, C, D] keys and values -> the KIVI-layout packed arrays (spec §2.8), stacked."""
  k_codes, k_scale, k_zero = quantization.quantize(jnp.swapaxes(k, -1, -2), bits=bits, axis=-1,
                                                   group_size=group_size)
  v_codes, v_scale, v_zero = quantization.quantize(v, bits=v_bits, axis=-1, group_size=group_size)
  return (quantization.pack(k_codes, bits=bits, axis=-1), k_scale, k_zero,
          quantization.pack(v_codes, bits=v_bits, axis=-1), v_scale, v_zero)


def _make_store(rng, case: Case, layer: int, kv_heads: int):
  shape = (case.num_layers, case.batch, kv_heads, case.capacity, case.head_dim)
  k = rng.normal(size=shape)
  k[..., rng.choice(case.head_dim, 3, replace=False)] *= 8.0  # a few outlier channels, as in real keys
  v = rng.normal(size=shape)
  v_bits = case.v_bits or case.bits
  k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = _quantize_layers(
      jnp.asarray(k, case.dtype), jnp.asarray(v, case.dtype), bits=case.bits, v_bits=v_bits,
      group_size=case.group_size)
  other = (np.arange(case.num_layers) != layer)[:, None, None, None, None]
  lens = np.asarray(case.lengths)[None, :, None, None, None]
  key_groups = np.arange(k_scale.shape[-1]) * case.group_size >= lens  # groups wholly past length
  value_rows = np.arange(case.capacity)[:, None] >= lens
  k_scale = jnp.where(other | key_groups, jnp.nan, k_scale).astype(k_scale.dtype)
  v_scale = jnp.where(other | value_rows, jnp.nan, v_scale).astype(v_scale.dtype)
  return QuantizedStore(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, jnp.asarray(case.lengths, jnp.int32),
                        k_bits=case.bits, v_bits=v_bits, k_group=case.group_size, v_group=case.group_size)


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
  """(q, stores, segments) with every layer but ``layer`` poisoned (stores: one store, or none for dense)."""
  rng = np.random.default_rng(seed)
  kv_heads = 2
  q = jnp.asarray(rng.normal(size=(case.batch, kv_heads, case.t_rows, case.q_per_kv, case.head_dim)), case.dtype)
  stores = (_make_store(rng, case, layer, kv_heads),) if case.bits else ()
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
                            block_s=case.block_s, s_splits=case.s_splits, interpret=self.INTERPRET, **kwargs)

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

  def test_rows_without_keys_give_zero(self):
    """k_bits != v_bits; rows with no valid key anywhere (store length 0, segment masked) return exactly 0, with
    lse = MASK_VALUE; a dense-only call where a whole batch row is masked does the same."""
    case = Case(4, 1, 64, 4, 2, (0, 77), (Seg(16, stacked=False),), v_bits=2, block_k=64)
    q, stores, ((seg_k, seg_v, mask),) = make_inputs(case, 0)
    mask = mask.at[0, 1].set(False)  # batch row 0, query position 1: nothing to attend
    seg_k = seg_k.at[0].set(jnp.where(mask[0].any(0)[None, :, None], seg_k[0], jnp.nan))
    args = (q, jnp.int32(0), stores, ((seg_k, seg_v, mask),))
    o, lse = decode_attention(*args, return_lse=True, block_k=64, k_splits=2, interpret=self.INTERPRET)
    ref_o, ref_lse = decode_attention_reference(*args, return_lse=True)
    np.testing.assert_array_equal(np.asarray(o[0, :, 1]), 0.0)
    np.testing.assert_array_equal(np.asarray(lse[0, :, 1]), np.float32(MASK_VALUE))
    np.testing.assert_array_equal(np.asarray(ref_lse[0, :, 1]), np.float32(MASK_VALUE))
    assert max(_relative_errors(o, ref_o)) <= 1e-4

    dense = Case(None, 3, 64, 2, 1, segments=(Seg(64, valid=(0, 5)),))
    q, _, segments = make_inputs(dense, 2)
    o, lse = decode_attention(q, jnp.int32(2), (), segments, return_lse=True, interpret=self.INTERPRET)
    np.testing.assert_array_equal(np.asarray(o[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(lse[0]), np.float32(MASK_VALUE))
    assert np.all(np.asarray(lse[1]) > -1e3)


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
class TestDecodeAttentionGpu(TestDecodeAttentionInterpret):
  INTERPRET = False


def _abstract_inputs(*, bits, dtype, num_layers, batch, kv_heads, t_rows, q_per_kv, head_dim, capacity,
                     segment_lens, group_size=32):
  """ShapeDtypeStructs for decode_attention: a stacked store (bits None: no store) and stacked segments (per-head
  masks), plus one per-step segment of 129 tokens (ragged)."""
  spec = jax.ShapeDtypeStruct
  lead = (num_layers, batch, kv_heads)
  stores = ()
  if bits:
    per_word = 32 // bits
    k_meta = spec((*lead, head_dim, capacity // group_size), jnp.float16)
    v_meta = spec((*lead, capacity, head_dim // group_size), jnp.float16)
    stores = (QuantizedStore(spec((*lead, head_dim, capacity // per_word), jnp.uint32), k_meta, k_meta,
                             spec((*lead, capacity, head_dim // per_word), jnp.uint32), v_meta, v_meta,
                             spec((batch,), jnp.int32), k_bits=bits, v_bits=bits, k_group=group_size,
                             v_group=group_size),)
  segments = tuple((spec((*lead, s, head_dim), dtype), spec((*lead, s, head_dim), dtype),
                    spec((batch, kv_heads, t_rows, s), jnp.bool_)) for s in segment_lens)
  segments += ((spec((batch, kv_heads, 129, head_dim), dtype), spec((batch, kv_heads, 129, head_dim), dtype),
                spec((batch, t_rows, 129), jnp.bool_)),)
  q = spec((batch, kv_heads, t_rows, q_per_kv, head_dim), dtype)
  return q, spec((), jnp.int32), stores, segments


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


# (bits, dtype, L, T, g, D, capacity, stacked segment lengths, tunables): the benchmark's shapes and the corners.
LOWERING_CASES = [
    (2, jnp.bfloat16, 32, 1, 4, 128, 4096, (), dict(block_k=256, k_splits=16)),
    (4, jnp.bfloat16, 3, 1, 4, 128, 4096, (), dict(block_k=512, k_splits=32, num_stages=2)),
    (8, jnp.float16, 3, 4, 8, 128, 2048, (100,), dict(block_k=128, k_splits=8, token_mass_rows=(0, 3))),
    (2, jnp.float32, 2, 2, 3, 64, 1024, (5,), dict(block_k=256, k_splits=3)),
    (None, jnp.bfloat16, 32, 1, 4, 128, 0, (8192,), dict(block_s=128, s_splits=16, num_stages=3)),
    (None, jnp.float16, 3, 2, 4, 128, 0, (1000, 65), dict(block_s=64, s_splits=8, return_lse=True)),
]


@pytest.mark.parametrize("case", LOWERING_CASES,
                         ids=lambda c: f"{c[0] or 'dense'}bit_{jnp.dtype(c[1]).name}_L{c[2]}_T{c[3]}_g{c[4]}")
def test_lowers_to_triton(case, monkeypatch):
  """Lowering for CUDA runs on any machine and catches what the Triton lowering rejects before a GPU run:
  unsupported primitives, tiles that are not powers of two, dots smaller than 16; the Triton module is verified.
  The stacked arrays go into the kernel whole: the lowered program slices none of them."""
  bits, dtype, num_layers, t_rows, q_per_kv, head_dim, capacity, segment_lens, tunables = case
  verified = _verify_triton_modules(monkeypatch)
  args = _abstract_inputs(bits=bits, dtype=dtype, num_layers=num_layers, batch=2, kv_heads=8, t_rows=t_rows,
                          q_per_kv=q_per_kv, head_dim=head_dim, capacity=capacity, segment_lens=segment_lens)
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
  q, _, stores, segments = _abstract_inputs(bits=2, dtype=jnp.bfloat16, num_layers=num_layers, batch=batch,
                                           kv_heads=kv_heads, t_rows=1, q_per_kv=4, head_dim=head_dim,
                                           capacity=capacity, segment_lens=(capacity,))

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
  case = Case(2, 2, 64, 3, 2, (45, 96), (Seg(7, per_head=True), Seg(5, stacked=False)), capacity=96)
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


def test_reference_token_mass_and_one_bit():
  """The reference's token mass is the softmax column sums of the chosen rows over the g heads; 1-bit codes
  (SpeCache's width) are accepted by the reference, refused by the kernel."""
  case = Case(1, 1, 64, 4, 3, (64, 10), (Seg(9, stacked=False),), capacity=64)
  q, stores, segments = make_inputs(case, 0)
  o, lse, ((store_mass,), (seg_mass,)) = decode_attention_reference(q, 0, stores, segments, return_lse=True,
                                                                    token_mass_rows=(2, 0))
  assert store_mass.shape == (2, 2, 2, 64) and seg_mass.shape == (2, 2, 2, 9)
  np.testing.assert_allclose(np.asarray(store_mass).sum(-1) + np.asarray(seg_mass).sum(-1), 4.0, rtol=1e-5)
  assert np.all(np.asarray(store_mass)[1, :, :, 10:] == 0)  # past length
  seg_visible = np.asarray(segments[0][2])[:, [2, 0]]  # [B, R, S]
  assert np.all(np.asarray(seg_mass)[~np.broadcast_to(seg_visible[:, None], seg_mass.shape)] == 0)
  with pytest.raises(ValueError, match="the Pallas kernel does not support 1-bit codes yet"):
    decode_attention(q, 0, stores, segments, interpret=True)


def test_bad_arguments_raise():
  case = Case(2, 3, 64, 4, 1, (10, 20), (Seg(8),))
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
