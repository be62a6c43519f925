"""The MMA-ready packing (jkv_kernels.mma_layout) and the Mosaic GPU decode kernel (jkv_kernels.mgpu_decode_attention).

On the CPU: the packing keeps every code, scale and zero-point (dequantized back, it equals the store's own
dequantization up to the rounding of its folded zero-points); a thread's registers hold the codes the mma.sync
A fragment assigns to it (checked against the PTX ISA's description, independently of the packing code), and the
kernel's unpack emulated in numpy gives each register its keys and values; the kernel lowers to one Mosaic GPU
custom call for each width, grouping and step size. On a Hopper GPU (compute capability 9.0) the compiled kernel is
held to ``decode_attention_reference`` on the store the packing came from, on real quantized data with ragged
lengths.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv_kernels import mma_layout, quantization
from jkv_kernels.attention_reference import MASK_VALUE
from jkv_kernels.dequant_attention import QuantizedStore, decode_attention_reference
from jkv_kernels.mgpu_decode_attention import (TILE_COST, available, default_segment_depth, default_splits,
                                               default_step_tiles, hole_dtype, logit_columns, mgpu_decode_attention,
                                               mgpu_decode_partial, pool_splits, programs_per_sm,
                                               shared_memory_bytes, slot_probabilities, split_tiles)
from jkv_kernels.mma_layout import (MmaStore, check_mma_packing, field_plan, key_register_map, magic_half,
                                    quad_word_position, read_mma_tiles, register_slots, value_register_map,
                                    word_positions)

# The packing's functions compiled whole, as the methods run them (inside their jitted steps): run op by op, each
# test's new shapes compiled every one of their small ops anew, most of this module's CPU time.
pack_mma_store = jax.jit(mma_layout.pack_mma_store)
read_mma_store = jax.jit(mma_layout.read_mma_store)
merge_into_tiles = jax.jit(mma_layout.merge_into_tiles, static_argnames=("k_bits", "v_bits"))
read_key_tiles = jax.jit(mma_layout.read_key_tiles, static_argnames=("bits", "group"))
read_value_tiles = jax.jit(mma_layout.read_value_tiles, static_argnames=("bits", "group"))


def make_store(seed, *, k_bits, v_bits, k_group, v_group, dtype, layers=2, batch=3, kv_heads=2, capacity=512,
               head_dim=128, lengths=None):
  """A KIVI-layout store of quantized normal keys and values, stacked over ``layers``."""
  arrays = _quantized_arrays(jax.random.key(seed), k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group,
                             dtype=dtype, lead=(layers, batch, kv_heads), head_dim=head_dim, capacity=capacity)
  lengths = [capacity, capacity - 77, 100][:batch] if lengths is None else lengths
  return QuantizedStore(*arrays, jnp.asarray(lengths, jnp.int32), k_bits, v_bits, k_group, v_group)


@functools.partial(jax.jit, static_argnames=("k_bits", "v_bits", "k_group", "v_group", "dtype", "lead", "head_dim",
                                             "capacity"))
def _quantized_arrays(key, *, k_bits, v_bits, k_group, v_group, dtype, lead, head_dim, capacity):
  """``make_store``'s codes (packed), scales and zero-points, keys then values."""
  kk, kv = jax.random.split(key)
  k = jax.random.normal(kk, (*lead, head_dim, capacity), jnp.float32)
  v = jax.random.normal(kv, (*lead, capacity, head_dim), jnp.float32)
  k_codes, k_scale, k_zero = quantization.quantize(k, bits=k_bits, axis=4, group_size=k_group, meta_dtype=dtype)
  v_codes, v_scale, v_zero = quantization.quantize(v, bits=v_bits, axis=4, group_size=v_group, meta_dtype=dtype)
  return (quantization.pack(k_codes, bits=k_bits, axis=4), k_scale, k_zero,
          quantization.pack(v_codes, bits=v_bits, axis=4), v_scale, v_zero)


def largest_magic(bits):
  """The largest magic number M of ``bits``-bit codes: 4 for 1-bit codes, 256 for 8-bit ones, else 16."""
  return max(2.0 ** (10 - offset) for _, offset in field_plan(bits))


def fold_bound(scale, zero, bits):
  """The most the packing's folded zero-point z' = fp16(z - M s) moves a dequantized value."""
  as64 = lambda a: np.abs(np.asarray(a, np.float64))
  return 2.0**-11 * (as64(zero).max() + largest_magic(bits) * as64(scale).max()) * 1.001


def logit_bound(q, k_ref, scale, zero, bits):
  """The most the kernel moves a logit sm_scale * q . k, [B, Hkv, T, g, S] for q [B, Hkv, T, g, D] and the
  store's keys k_ref [B, Hkv, S, D]: each key it dequantizes lies within ``fold_bound`` of the store's and is
  rounded to fp16 (unit roundoff 2**-11, doubled for the fp32 accumulation); q (fp16 or bf16) is exact in fp16."""
  q_abs, k_abs = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(k_ref, np.float64))
  return q.shape[-1]**-0.5 * (np.einsum("bhtgd,bhsd->bhtgs", q_abs, k_abs) * 2.0**-10
                              + q_abs.sum(-1)[..., None] * fold_bound(scale, zero, bits))


# The kernel's o against the reference, relative (norm): the fold's rounding of the zero-points (``fold_bound``),
# fp16 p and a bf16 segment's products give about 0.5% on quantized normal keys and values (an H100).
O_TOLERANCE = 1e-2

CONFIGS = [  # k_bits, v_bits, k_group, v_group, head_dim, dtype
    (2, 2, 32, 32, 128, jnp.bfloat16),
    (4, 4, 32, 32, 128, jnp.float16),
    (1, 1, 32, 32, 128, jnp.bfloat16),
    (4, 2, 128, 32, 128, jnp.bfloat16),
    (2, 4, 64, 64, 64, jnp.float16),
    (2, 2, 16, 16, 64, jnp.bfloat16),
    (8, 8, 32, 32, 128, jnp.bfloat16),
]


@pytest.mark.parametrize("k_bits,v_bits,k_group,v_group,head_dim,dtype", CONFIGS)
def test_packing_keeps_every_code_and_scale(k_bits, v_bits, k_group, v_group, head_dim, dtype):
  """Read back, each key and value is the store's c s + z up to the fp16 rounding of the stored z' = z - M s
  (M <= 16, 4 for 1-bit codes): at most 2**-11 (|z| + 16 s); a misplaced code or scale would move it by about
  s."""
  store = make_store(1, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group, dtype=dtype,
                     head_dim=head_dim)
  packed = pack_mma_store(store)
  for layer in range(2):
    k_ref, v_ref, _ = store.read_layer(layer)
    k, v = read_mma_store(packed, layer)
    for x, ref, scale, zero, bits in ((k, k_ref, store.k_scale, store.k_zero, k_bits),
                                      (v, v_ref, store.v_scale, store.v_zero, v_bits)):
      bound = fold_bound(scale[layer], zero[layer], bits)
      assert np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64)).max() <= bound


@pytest.mark.parametrize("k_group", [32, 128])
def test_a_range_of_tiles_reads_as_the_same_tokens_of_the_store(k_group):
  store = make_store(7, k_bits=2, v_bits=4, k_group=k_group, v_group=32, dtype=jnp.bfloat16, capacity=512)
  packed = pack_mma_store(store)
  k_all, v_all = read_mma_store(packed, 1)
  for start, count in ((0, 2), (2, 2), (5, 1), (4, 4)):
    if count * 64 % k_group and count * 64 > k_group:
      continue
    k, v = jax.jit(lambda layer, first: read_mma_tiles(packed, layer, first, count))(1, start)
    tokens = slice(64 * start, 64 * (start + count))
    np.testing.assert_array_equal(np.asarray(k), np.asarray(k_all[:, :, tokens]))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(v_all[:, :, tokens]))


@pytest.mark.parametrize("bits,k_group,offsets,tokens,tiles", [
    (2, 16, [16, 48], 16, 1), (4, 32, [32, 0], 32, 1), (1, 32, [0, 32], 32, 2), (2, 64, [0, 0], 128, 2)])
def test_merging_tokens_into_tiles_replaces_them_and_keeps_the_rest(bits, k_group, offsets, tokens, tiles):
  """A block of new tokens merged into packed tiles at a per-sequence offset: read back, those tokens are the new
  block's and every other token (and key group) is the old tiles', for each width (1-bit words mix both halves
  of a value tile's tokens)."""
  config = dict(k_bits=bits, v_bits=bits, k_group=k_group, v_group=32, dtype=jnp.float16, layers=1, batch=2)
  old = make_store(40, capacity=64 * tiles, **config)
  new = make_store(41, capacity=tokens, **config)
  packed = pack_mma_store(old)
  first = lambda *arrays: tuple(a[0] for a in arrays)
  k_words, k_meta, v_words, v_meta = merge_into_tiles(
      packed.k_codes[0], packed.v_codes[0], packed.v_meta[0], first(new.k_codes, new.k_scale, new.k_zero),
      first(new.v_codes, new.v_scale, new.v_zero), jnp.asarray(offsets), k_bits=bits, v_bits=bits)
  meta = np.array(packed.k_meta[0])
  for b, offset in enumerate(offsets):
    meta[b, :, offset // k_group:(offset + tokens) // k_group] = k_meta[b]
  keys = read_key_tiles(k_words, jnp.asarray(meta), bits=bits, group=k_group)
  values = read_value_tiles(v_words, v_meta, bits=bits, group=32)
  k_old, v_old, _ = old.read_layer(0)
  k_new, v_new, _ = new.read_layer(0)
  bound = max(fold_bound(store.k_scale, store.k_zero, bits) + fold_bound(store.v_scale, store.v_zero, bits)
              for store in (old, new))
  close = lambda a, b: np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= bound)
  for b, offset in enumerate(offsets):
    span = slice(offset, offset + tokens)
    assert close(keys[b, :, span], k_new[b]) and close(values[b, :, span], v_new[b])
    rest = np.ones(64 * tiles, bool)
    rest[span] = False
    assert close(keys[b][:, rest], k_old[b][:, rest]) and close(values[b][:, rest], v_old[b][:, rest])


def test_register_maps_follow_the_ptx_mma_a_fragment():
  """PTX ISA, mma .m16n8k16 A fragment (16-bit): lane l of a warp holds, in its registers a0..a3 of a 16 x 16
  block, row l // 4 + 8 (r % 2) and columns 2 (l % 4) + 8 (r // 2), + 1. Keys: warp w's block kappa is its
  tokens 16 w .. 16 w + 15 by channels 16 kappa ..; values: block i is channels 16 i .. by the warp's tokens
  (register 4 kappa + r, 4 i + r). Every (token, channel) of a tile is held exactly once."""
  for head_dim in (64, 128):
    tau = np.arange(128)[:, None]
    warp, lane = tau // 32, tau % 32
    block, r = np.divmod(np.arange(head_dim // 4)[None, :], 4)
    across, down = 2 * (lane % 4) + 8 * (r // 2), lane // 4 + 8 * (r % 2)  # the fragment's column and row
    pair = lambda x, step: np.stack([x, x + step], -1)  # a register's two lanes: the next column
    for (tokens, channels), (want_tokens, want_channels) in (
        (key_register_map(head_dim), (pair(16 * warp + down, 0), pair(16 * block + across, 1))),
        (value_register_map(head_dim), (pair(16 * warp + across, 1), pair(16 * block + down, 0)))):
      assert tokens.shape == channels.shape == (128, head_dim // 4, 2)
      seen = np.zeros((64, head_dim), int)
      np.add.at(seen, (tokens.ravel(), channels.ravel()), 1)
      assert np.all(seen == 1)
      np.testing.assert_array_equal(tokens, want_tokens)
      np.testing.assert_array_equal(channels, want_channels)


def _fp16_halves(word):
  """A uint32 word -> its two fp16 halves (low first) as float64."""
  return np.array([int(word) & 0xFFFF, int(word) >> 16], np.uint16).view(np.float16).astype(np.float64)


def test_scale_words_sit_where_each_quad_reads_them():
  """The word at quad_word_position holds the scale pair the kernel's thread needs, in fp16: keys, word 2 j of
  quad q, of channels 2 q + 8 j (+1) of the group; values, word 4 g + 2 a of quad q in warp w's block of the tile,
  of tokens 16 w + 2 q + 8 a (+1) in channel group g. And a warp's 16-byte load of one chunk reads the four quads
  from four different 16-byte bank groups."""
  store = make_store(6, k_bits=2, v_bits=2, k_group=32, v_group=32, dtype=jnp.bfloat16, layers=1, batch=1,
                     kv_heads=1, capacity=128)
  packed = pack_mma_store(store)
  k_meta, v_meta = np.asarray(packed.k_meta[0, 0, 0]), np.asarray(packed.v_meta[0, 0, 0])
  k_scale = np.asarray(store.k_scale[0, 0, 0], np.float64)  # [D, groups]
  v_scale = np.asarray(store.v_scale[0, 0, 0], np.float64)  # [C, D / Gv]
  for q in range(4):
    for j in range(128 // 8):
      for group in range(4):
        np.testing.assert_array_equal(_fp16_halves(k_meta[group, quad_word_position(q, 2 * j)]),
                                      k_scale[2 * q + 8 * j:2 * q + 8 * j + 2, group])
    for warp in range(4):
      for a in range(2):
        for tile in range(2):
          for channel_group in range(4):
            token = 64 * tile + 16 * warp + 2 * q + 8 * a
            word = v_meta[tile, 64 * warp + quad_word_position(q, 4 * channel_group + 2 * a)]
            np.testing.assert_array_equal(_fp16_halves(word), v_scale[token:token + 2, channel_group])
  for chunk in range(32 // 4):
    assert len({quad_word_position(q, 4 * chunk) * 4 // 16 % 8 for q in range(4)}) == 4


@pytest.mark.parametrize("bits,head_dim", [(1, 64), (1, 128), (2, 64), (2, 128), (4, 64), (4, 128), (8, 64),
                                           (8, 128)])
def test_the_kernels_unpack_emulated_in_numpy_gives_each_register_its_keys_and_values(bits, head_dim):
  """The kernel's arithmetic emulated bit for bit: thread tau's register rho is word slot // F of its words
  (``register_slots``), shifted as ``field_plan`` says, ((word >> shift) & mask) | magic read as two fp16 lanes
  M + c, times the scale pair plus the z' pair of its quad's meta words, rounded once to fp16 (one fused
  multiply-add). For keys and values, every width, and a value group as wide as the head (one meta word
  serving every block of 16 channels), that is the store's c s + z at the (token, channel) the PTX layout gives
  the register, within the rounding of z' and of the result. The magic numbers are at most 16 (4 for 1-bit codes,
  256 for 8-bit ones: the field fills the mantissa's 8 upper bits) and clear of their field."""
  store = make_store(8, k_bits=bits, v_bits=bits, k_group=32, v_group=head_dim, dtype=jnp.bfloat16, layers=1,
                     batch=1, kv_heads=1, capacity=64, head_dim=head_dim)
  packed = pack_mma_store(store)
  k_ref, v_ref, _ = store.read_layer(0)
  plan, fields, registers = field_plan(bits), 16 // bits, head_dim // 4
  slots, positions = register_slots(bits, registers), word_positions(bits, head_dim)
  for shift, offset in plan:
    assert 2.0 ** (10 - offset) <= {1: 4, 8: 256}.get(bits, 16)
    assert magic_half(offset) & (((1 << bits) - 1) << offset) == 0

  def lanes(words, rho):  # the register's two fp16 lanes M + c, and M
    shift, offset = plan[slots[rho] % fields]
    word = int(words[slots[rho] // fields])
    word = (word >> shift if shift >= 0 else word << -shift) & 0xFFFFFFFF
    pair = (word & ((((1 << bits) - 1) << offset) * 0x00010001)) | (magic_half(offset) * 0x00010001)
    return _fp16_halves(pair), 2.0 ** (10 - offset)

  for kind, (rows, cols), words, ref, scale, zero in (
      ("keys", key_register_map(head_dim), packed.k_codes, k_ref, store.k_scale, store.k_zero),
      ("values", value_register_map(head_dim), packed.v_codes, v_ref, store.v_scale, store.v_zero)):
    tile_words, ref = np.asarray(words[0, 0, 0, 0]), np.asarray(ref[0, 0], np.float64)  # ref [64 tokens, D]
    bound = fold_bound(scale, zero, bits)
    for tau in range(128):
      warp, lane = divmod(tau, 32)
      for rho in range(registers):
        code_lanes, magic = lanes(tile_words[positions[tau]], rho)
        if kind == "keys":  # the group of the thread's tokens; its scale pair is word 2 j, j = rho // 2
          meta = np.asarray(packed.k_meta[0, 0, 0, rows[tau, rho, 0] // 32])
          k = 2 * (rho // 2)
        else:  # v_group = head_dim: one channel group; the pair of tokens a = rho % 4 // 2 of the warp's 16
          meta = np.asarray(packed.v_meta[0, 0, 0, 0])[16 * warp:16 * warp + 16]
          k = 2 * (rho % 4 // 2)
        s_pair = _fp16_halves(meta[quad_word_position(lane % 4, k)])
        z_pair = _fp16_halves(meta[quad_word_position(lane % 4, k + 1)])
        got = (code_lanes * s_pair + z_pair).astype(np.float16).astype(np.float64)
        tokens, channels = rows[tau, rho], cols[tau, rho]
        want = ref[tokens, channels]
        assert np.all(np.abs(got - want) <= bound + 2.0**-11 * np.abs(want)), (kind, tau, rho, got, want)
        assert np.all(code_lanes - magic < 2**bits)


def test_packing_refuses_what_the_kernel_does_not_take():
  with pytest.raises(ValueError, match="k_bits=3"):
    check_mma_packing(k_bits=3, v_bits=2, k_group=32, v_group=32, head_dim=128, tokens=512, meta_dtype=jnp.float16)
  store = make_store(2, k_bits=2, v_bits=2, k_group=32, v_group=32, dtype=jnp.float16, layers=1, capacity=96)
  with pytest.raises(ValueError, match="multiple of 64"):
    pack_mma_store(store)
  store = make_store(2, k_bits=2, v_bits=2, k_group=32, v_group=32, dtype=jnp.float32, layers=1)
  with pytest.raises(ValueError, match="16-bit scales"):
    pack_mma_store(store)


def _abstract_store(k_bits, v_bits, k_group, v_group, head_dim, dtype, layers=2, batch=2, kv_heads=2,
                    capacity=1024, holes=None):
  """``holes``: None, "stacked" ([L, B, Hkv, C], with a value channel scale) or "step" ([B, Hkv, C])."""
  s = jax.ShapeDtypeStruct
  lead = (layers, batch, kv_heads)
  tiles = capacity // 64
  valid = None if holes is None else s((*lead, capacity) if holes == "stacked" else lead[1:] + (capacity,), jnp.bool_)
  return MmaStore(s((*lead, tiles, 2 * head_dim * k_bits), jnp.uint32), s((*lead, capacity // k_group, head_dim),
                  jnp.uint32), s((*lead, tiles, 2 * head_dim * v_bits), jnp.uint32),
                  s((*lead, tiles, head_dim // v_group * 64), jnp.uint32), s((batch,), jnp.int32),
                  k_bits, v_bits, k_group, v_group, valid,
                  s((*lead, head_dim), jnp.float32) if holes == "stacked" else None)


@pytest.mark.parametrize("step_tiles,q_per_kv", [(1, 4), (4, 4), (4, 12), (None, 4)])
@pytest.mark.parametrize("k_bits,v_bits,k_group,v_group,head_dim,dtype", CONFIGS[:4])
def test_lowers_to_one_mosaic_gpu_kernel(k_bits, v_bits, k_group, v_group, head_dim, dtype, step_tiles, q_per_kv):
  """Each width, grouping, step (None: the default) and product width (N = 8 or 16 query rows) lowers to
  one kernel."""
  store = _abstract_store(k_bits, v_bits, k_group, v_group, head_dim, dtype)
  q = jax.ShapeDtypeStruct((2, 2, 1, q_per_kv, head_dim), dtype)
  fn = jax.jit(lambda q, layer, store: mgpu_decode_attention(q, layer, store, step_tiles=step_tiles,
                                                             return_lse=True))
  text = fn.trace(q, jax.ShapeDtypeStruct((), jnp.int32), store).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("capacity,k_group", [(320, 32), (384, 128), (1088, 64)])  # 5, 6 and 17 tiles
def test_any_tile_count_lowers(capacity, k_group):
  """A cache's capacity need not be a multiple of four tiles: the default step need not divide the tile count
  (also with the store's logits written out)."""
  store = _abstract_store(2, 2, k_group, 32, 128, jnp.bfloat16, capacity=capacity)
  q = jax.ShapeDtypeStruct((2, 2, 1, 4, 128), jnp.bfloat16)
  fn = jax.jit(lambda q, layer, store: mgpu_decode_partial(q, layer, store, logit_rows=(0,) * (k_group == 128)))
  text = fn.trace(q, jax.ShapeDtypeStruct((), jnp.int32), store).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("t_rows,q_per_kv,logit_rows,rows,want", [
    (2, 4, (1,), 8, (4, 4)), (1, 4, (0,), 8, (0, 4)), (4, 4, (2, 3), 16, (8, 8)), (2, 4, (0, 1), 8, (0, 8)),
    (3, 5, (2, 0), 16, (0, 16)), (3, 5, (1,), 16, (0, 16)), (1, 2, (0,), 8, (0, 8)), (2, 4, (), 8, None)])
def test_logit_columns_are_the_rows_heads_where_tma_can_write_them_alone(t_rows, q_per_kv, logit_rows, rows, want):
  """A row's heads alone where they are one run from an even column of whole 16-byte rows (4 fp32); else every
  column (rows out of order, an odd first column, 2 columns)."""
  assert logit_columns(t_rows, q_per_kv, logit_rows, rows) == want


def test_logit_rows_outside_the_query_rows_are_refused():
  with pytest.raises(ValueError, match="logit_rows"):
    logit_columns(2, 4, (2,), 8)


@pytest.mark.parametrize("t_rows,q_per_kv,logit_rows,width", [(2, 4, (1,), None), (4, 4, (2, 3), None),
                                                              (3, 5, (1,), None), (2, 4, (1,), 129)])
def test_the_logits_of_some_rows_lower(t_rows, q_per_kv, logit_rows, width):
  """The kernel that writes some rows' slot weights (a run of columns, or all of them; with a segment's, of
  ``width`` tokens) lowers to one Mosaic GPU call, and returns weights of every slot and token."""
  s = jax.ShapeDtypeStruct
  store = _abstract_store(1, 1, 32, 32, 128, jnp.bfloat16)
  segment = None if width is None else (s((2, 2, 2, width, 128), jnp.bfloat16), s((2, 2, 2, width, 128),
                                                                                  jnp.bfloat16),
                                        s((2, t_rows, width), jnp.bool_))
  q = s((2, 2, t_rows, q_per_kv, 128), jnp.bfloat16)
  fn = jax.jit(lambda q, layer, store, segment: mgpu_decode_partial(q, layer, store, segment=segment,
                                                                    logit_rows=logit_rows))
  traced = fn.trace(q, s((), jnp.int32), store, segment)
  assert traced.lower(lowering_platforms=("cuda",)).as_text().count("custom_call @mosaic_gpu") == 1
  weights = jax.eval_shape(fn, q, s((), jnp.int32), store, segment)[3:]
  want = [(2, 2, n, len(logit_rows), q_per_kv) for n in (1024, 1024 // 16) + (() if width is None else (width,) * 2)]
  assert [x.shape for pair in weights for x in pair] == want


@pytest.mark.parametrize("k_bits,store_dtype,segment_dtype,width,t_rows,q_per_kv,per_head,segment_depth,holes", [
    (2, jnp.float16, jnp.bfloat16, 129, 1, 4, False, 2, None),
    (4, jnp.bfloat16, jnp.bfloat16, 64, 3, 5, True, 2, "step"),
    (2, jnp.bfloat16, jnp.bfloat16, 129, 1, 4, False, 1, "stacked")])
def test_a_segment_lowers_into_the_same_kernel(k_bits, store_dtype, segment_dtype, width, t_rows, q_per_kv, per_head,
                                               segment_depth, holes):
  """A full-precision segment (KIVI's window: 129 tokens, in the model's dtype, not the store's) is read by the
  same kernel, not by a second one (also through a pipeline one slot deep, and with a store's holes, stacked or
  one step's, read in the same pipeline)."""
  store = _abstract_store(k_bits, k_bits, 32, 32, 128, store_dtype, holes=holes)
  s = jax.ShapeDtypeStruct
  segment = (s((2, 2, 2, width, 128), segment_dtype), s((2, 2, 2, width, 128), segment_dtype),
             s((2, 2, t_rows, width) if per_head else (2, t_rows, width), jnp.bool_))
  fn = jax.jit(lambda q, layer, store, segment: mgpu_decode_attention(q, layer, store, segment=segment,
                                                                     segment_depth=segment_depth))
  text = fn.trace(s((2, 2, t_rows, q_per_kv, 128), segment_dtype), s((), jnp.int32), store, segment).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1


def test_pools_lower_into_one_kernel_and_share_the_programs():
  """Two stores (4- and 2-bit, holes every head shares, a channel scale) and a segment lower to one Mosaic GPU
  call; the programs that run at once go to the stores by their tiles times a tile's time at their widths;
  slot weights and an explicit split count take one store."""
  s = jax.ShapeDtypeStruct
  pools = tuple(dataclasses.replace(_abstract_store(bits, bits, 32, 32, 128, jnp.float16, capacity=capacity),
                                    valid=s((2, 1, capacity), jnp.bool_),
                                    v_channel_scale=s((2, 2, 2, 128), jnp.float16))
                for bits, capacity in ((4, 19712), (2, 13120)))
  segment = (s((2, 2, 2, 100, 128), jnp.bfloat16),) * 2 + (s((2, 1, 100), jnp.bool_),)
  q = s((2, 2, 1, 4, 128), jnp.bfloat16)
  fn = jax.jit(lambda q, layer, stores, segment: mgpu_decode_attention(q, layer, stores, segment=segment))
  text = fn.trace(q, s((), jnp.int32), pools, segment).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @mosaic_gpu") == 1
  steps = (2, 4)
  splits = pool_splits(pools, steps, sm_count=132, segment=True, segment_depth=1)
  work = [pool.k_codes.shape[3] * 2 * TILE_COST[pool.k_bits] for pool in pools]
  assert sum(splits) <= 3 * 132 // 4 + 1 and splits[0] > splits[1] >= 1
  assert abs(splits[0] / sum(splits) - work[0] / sum(work)) <= 0.5 / sum(splits) + 1e-9
  with pytest.raises(ValueError, match="logit_rows takes one store"):
    jax.jit(lambda q, stores: mgpu_decode_partial(q, 0, stores, logit_rows=(0,))).trace(q, pools)
  with pytest.raises(ValueError, match="by default"):
    jax.jit(lambda q, stores: mgpu_decode_partial(q, 0, stores, splits=2)).trace(q, pools)


@pytest.mark.parametrize("k_bits,v_bits,k_group,v_group,head_dim,dtype", CONFIGS)
@pytest.mark.parametrize("capacity", [32768, 320])
@pytest.mark.parametrize("stages,segment", [(2, False), (4, False), (2, True)])
def test_default_step_is_the_largest_that_fits_two_programs_per_sm(k_bits, v_bits, k_group, v_group, head_dim,
                                                                   dtype, capacity, stages, segment):
  """The shared memory count is the bytes of the blocks the pipeline moves (sliced from a packed store's arrays),
  times the depth, plus q and the partials; a segment's pipeline (two slots, or one, of a tile of 16-bit keys and
  values and an int32 mask of 16 rows) runs after the store's, in the same memory, and adds its q and p.
  q takes its 16-bit rows and their fragments (16 rows each at most). The
  default step is the largest of 4, 2, 1 that divides the tile count and fits half an SM, by brute force."""
  store = make_store(12, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group, dtype=dtype, layers=1,
                     batch=1, kv_heads=1, capacity=1024, head_dim=head_dim)
  packed = pack_mma_store(store)
  tiles = capacity // 64
  packed = dataclasses.replace(packed, **{name: jax.ShapeDtypeStruct(
      (1, 1, 1, tiles * getattr(packed, name).shape[3] // packed.k_codes.shape[3], getattr(packed, name).shape[4]),
      jnp.uint32) for name in ("k_codes", "k_meta", "v_codes", "v_meta")})
  half = jnp.dtype(dtype).itemsize

  def program_bytes(step, segment_slots=2):
    block = lambda name, rows: rows * getattr(packed, name).shape[-1] * 4
    slot = (block("k_codes", step) + block("v_codes", step) + block("v_meta", step)
            + block("k_meta", max(1, 64 * step // k_group)))
    fixed = 16 * head_dim * 2 + 16 * head_dim * half + head_dim * 16 * 4 + 2 * 16 * 4  # q rows, fragments, o, l, m
    if segment:
      return (max(stages * slot, segment_slots * (2 * 64 * head_dim * 2 + 64 * 16 * 4)) + fixed
              + 16 * head_dim * 2 + 64 * 16 * 2)
    return stages * slot + fixed

  fits = [step for step in (4, 2, 1) if step <= tiles and program_bytes(step) <= 228 * 1024 // 2 - 1024]
  chosen = default_step_tiles(packed, stages, segment)
  assert chosen == (fits[0] if fits else 1)
  assert shared_memory_bytes(packed, chosen, stages, segment) == program_bytes(chosen)
  if segment:
    assert shared_memory_bytes(packed, chosen, stages, segment, segment_depth=1) == program_bytes(chosen, 1)


@pytest.mark.parametrize("step_tiles", [1, 2, 4])
def test_holes_fill_whole_tma_units(step_tiles):
  """A step's holes fill a whole number of TMA's 128-byte units whatever the step (a one-tile step's 64 bytes of
  int8 put every second pipeline slot off that boundary: a misaligned address on an H100), shared memory counts
  them at that size, and a split of several one-tile steps with holes lowers."""
  holed = _abstract_store(8, 8, 32, 32, 256, jnp.bfloat16, holes="stacked")
  plain = dataclasses.replace(holed, valid=None)
  hole_bytes = step_tiles * 64 * jnp.dtype(hole_dtype(step_tiles)).itemsize
  assert hole_bytes % 128 == 0
  assert shared_memory_bytes(holed, step_tiles, 3) - shared_memory_bytes(plain, step_tiles, 3) == 3 * hole_bytes
  if step_tiles == 1:
    s = jax.ShapeDtypeStruct
    fn = jax.jit(lambda q, layer, store: mgpu_decode_attention(q, layer, store, splits=2, step_tiles=1))
    text = fn.trace(s((2, 2, 1, 4, 256), jnp.bfloat16), s((), jnp.int32), holed).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("batch,capacity,k_bits,k_group,n_rows", [
    (1, 32768, 2, 32, 1), (8, 32768, 2, 32, 4), (8, 32768, 4, 32, 4), (8, 4736, 2, 128, 4), (33, 4608, 2, 32, 1),
    (256, 4608, 2, 32, 4), (256, 4608, 4, 32, 4), (3, 320, 2, 32, 4), (1, 65536, 2, 32, 8), (1, 65536, 4, 32, 16),
    (2, 32768, 2, 32, 16)])
def test_default_splits_fill_the_slots_with_whole_steps(batch, capacity, k_bits, k_group, n_rows):
  """Splits hold whole steps and key groups and cover the capacity with none empty; their programs fit the slots
  (132 SMs, ``programs_per_sm`` of the rows or fewer by shared memory), and one more split would not (by brute
  force over split counts)."""
  store = _abstract_store(k_bits, 2, k_group, 32, 128, jnp.bfloat16, layers=1, batch=batch, kv_heads=8,
                          capacity=capacity)
  tiles, step = capacity // 64, default_step_tiles(store)
  fit = min(programs_per_sm(n_rows), 228 * 1024 // (shared_memory_bytes(store, step, 2) + 1024))
  splits = default_splits(store, sm_count=132, n_rows=n_rows)
  per = split_tiles(store, splits, step)
  assert per % step == 0 and per * 64 % k_group == 0
  assert per * splits >= tiles > per * (splits - 1)
  covering = lambda asked: -(-tiles // split_tiles(store, asked, step))
  asked = [n for n in range(1, tiles + 1) if batch * 8 * n <= 132 * fit]  # programs that all run at once
  assert splits == (covering(max(asked)) if asked else 1)
  # A segment's pipeline is one slot deep where that lets more programs share an SM.
  per_sm = lambda depth: 228 * 1024 // (shared_memory_bytes(store, step, 2, True, depth) + 1024)
  assert default_segment_depth(store, step) == (1 if per_sm(1) > per_sm(2) else 2)


def test_more_query_rows_never_take_more_programs():
  """Fewer programs an SM for more query rows a KV head (the kernel's program count is sized by them), and never
  more splits for more rows at a fixed store; every row count up to ROWS gives at least one program an SM."""
  store = _abstract_store(2, 2, 32, 32, 128, jnp.bfloat16, layers=1, batch=1, kv_heads=2, capacity=1 << 20)
  per_sm = [programs_per_sm(n) for n in range(1, 17)]
  splits = [default_splits(store, sm_count=132, n_rows=n) for n in range(1, 17)]
  assert all(a >= b >= 1 for a, b in zip(per_sm, per_sm[1:]))
  assert all(a >= b for a, b in zip(splits, splits[1:])) and splits[0] > splits[-1]


def test_bad_arguments_raise():
  store = pack_mma_store(make_store(3, k_bits=2, v_bits=2, k_group=32, v_group=32, dtype=jnp.bfloat16, layers=1,
                                    batch=2))
  q = jnp.zeros((2, 2, 1, 4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="query rows"):
    mgpu_decode_attention(jnp.zeros((2, 2, 5, 4, 128), jnp.bfloat16), 0, store)
  with pytest.raises(ValueError, match="q is int32"):
    mgpu_decode_attention(q.astype(jnp.int32), 0, store)
  window = jnp.ones((2, 2, 129, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="a multiple of 8"):  # 2 * 2 * 129 rows
    mgpu_decode_attention(q, 0, store, segment=(window, window, jnp.ones((2, 1, 129), bool)))
  with pytest.raises(ValueError, match="one 16-bit type"):
    mgpu_decode_attention(q, 0, store, segment=(window[:, :, :128].astype(jnp.float32),) * 2 + (
        jnp.ones((2, 1, 128), bool),))
  with pytest.raises(ValueError, match="segment mask"):
    mgpu_decode_attention(q, 0, store, segment=(window[:, :, :128], window[:, :, :128], jnp.ones((2, 1, 129), bool)))
  with pytest.raises(ValueError, match="store holes"):  # 500 slots, the store has 512
    mgpu_decode_attention(q, 0, dataclasses.replace(store, valid=jnp.ones((2, 2, 500), bool)))
  with pytest.raises(ValueError, match="value channel scale"):  # D = 64, the store's is 128
    mgpu_decode_attention(q, 0, dataclasses.replace(store, v_channel_scale=jnp.ones((1, 2, 2, 64))))
  for splits, step_tiles, most in ((0, 1, 8), (9, 1, 8), (3, 4, 2)):  # 512 tokens: 8 tiles
    with pytest.raises(ValueError, match=f"splits={splits} must be from 1 to {most}"):
      mgpu_decode_attention(q, 0, store, splits=splits, step_tiles=step_tiles)
  with pytest.raises(ValueError, match="step_tiles=0"):
    mgpu_decode_attention(q, 0, store, step_tiles=0)
  with pytest.raises(ValueError, match="max_concurrent_steps=0"):
    mgpu_decode_attention(q, 0, store, max_concurrent_steps=0)
  with pytest.raises(ValueError, match="segment_depth=3 must be 1 or 2"):
    mgpu_decode_attention(q, 0, store, segment_depth=3)


def _has_hopper() -> bool:
  try:
    device = jax.devices("gpu")[0]
  except RuntimeError:
    return False
  return float(getattr(device, "compute_capability", "0")) >= 9.0 and available()


@pytest.mark.skipif(not _has_hopper(), reason="needs a Hopper GPU (compute capability 9.0) and Mosaic GPU")
class TestMgpuDecodeAttentionGpu:
  @pytest.mark.parametrize("step_tiles,stages", [(1, 2), (2, 3), (4, 3), (None, 2)])
  @pytest.mark.parametrize("k_bits,v_bits,k_group,v_group,head_dim,dtype", CONFIGS)
  def test_matches_reference(self, k_bits, v_bits, k_group, v_group, head_dim, dtype, step_tiles, stages):
    store = make_store(4, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group, dtype=dtype,
                       head_dim=head_dim, capacity=1024, lengths=[1024, 947, 100])
    q = jax.random.normal(jax.random.key(5), (3, 2, 1, 4, head_dim), dtype)
    packed = pack_mma_store(store)
    for layer in (0, 1):
      o, lse = mgpu_decode_attention(q, layer, packed, return_lse=True, step_tiles=step_tiles,
                                     max_concurrent_steps=stages)
      o_ref, lse_ref = decode_attention_reference(q, layer, (store,), (), return_lse=True)
      o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
      assert np.all(np.isfinite(o))
      assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE
      # The lse moves by at most the largest move of a logit.
      k_ref, _, _ = store.read_layer(layer)
      bound = logit_bound(q, k_ref, store.k_scale[layer], store.k_zero[layer], k_bits).max(-1)
      assert np.all(np.abs(np.asarray(lse, np.float64) - np.asarray(lse_ref, np.float64)) <= bound + 1e-5)

  @pytest.mark.parametrize("t_rows,q_per_kv", [(3, 5), (3, 3), (2, 4), (1, 1)])  # 15, 9, 8 and 1 rows: N 16 / 8
  def test_rows_of_several_query_positions_and_a_short_sequence(self, t_rows, q_per_kv):
    store = make_store(6, k_bits=2, v_bits=2, k_group=32, v_group=32, dtype=jnp.bfloat16, capacity=1024,
                       lengths=[1, 600, 1024])
    q = jax.random.normal(jax.random.key(7), (3, 2, t_rows, q_per_kv, 128), jnp.bfloat16)
    o = mgpu_decode_attention(q, 1, pack_mma_store(store))
    o_ref = decode_attention_reference(q, 1, (store,), ())
    o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
    assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE

  @pytest.mark.parametrize("capacity,k_group,step_tiles,splits", [
      (320, 32, None, None), (320, 32, 2, None), (384, 128, None, None), (384, 32, 4, 2), (384, 32, 2, 3),
      (448, 32, 4, 2), (640, 128, None, 3), (384, 32, 1, 4)])
  def test_a_step_that_does_not_divide_the_tiles(self, capacity, k_group, step_tiles, splits):
    """5, 6, 7 and 10 tiles in steps of 4, 2 or 1, in splits that need not divide them: a split holds whole steps
    (7 tiles in 2 splits of 4-tile steps: 4 and 3; 10 tiles in 3, key groups of 2 tiles: 4, 4 and 2; 6 tiles
    asked in 4 splits of 1-tile steps: 3 splits of 2), so a last step may reach past the capacity (TMA fills
    zeros) or the length: those tokens are masked."""
    store = make_store(10, k_bits=2, v_bits=2, k_group=k_group, v_group=32, dtype=jnp.float16, capacity=capacity,
                       lengths=[capacity, capacity - 61, 65])
    q = jax.random.normal(jax.random.key(11), (3, 2, 1, 4, 128), jnp.float16)
    o = np.asarray(mgpu_decode_attention(q, 1, pack_mma_store(store), step_tiles=step_tiles, splits=splits),
                   np.float64)
    o_ref = np.asarray(decode_attention_reference(q, 1, (store,), ()), np.float64)
    assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE

  @pytest.mark.parametrize("k_bits,store_dtype,segment_dtype,width,t_rows,q_per_kv,per_head,splits,stacked", [
      (2, jnp.float16, jnp.bfloat16, 129, 1, 4, False, None, True),  # KIVI's window: 129 tokens, the model's dtype
      (4, jnp.bfloat16, jnp.bfloat16, 129, 1, 4, True, 3, True),
      (2, jnp.float16, jnp.float16, 64, 3, 5, False, 2, False),      # 15 rows (N = 16), whole rows of 8: no shift
      (1, jnp.bfloat16, jnp.float16, 200, 2, 4, True, None, False)])
  @pytest.mark.parametrize("segment_depth", [2, 1])
  def test_a_segment_joins_the_store_in_one_softmax(self, k_bits, store_dtype, segment_dtype, width, t_rows,
                                                    q_per_kv, per_head, splits, stacked, segment_depth):
    """A segment's tokens join the last split's softmax: held to the reference over the store and the segment
    (stacked over layers, or one step's), with a store of length 0 (the segment alone), a row with no valid token
    anywhere (o = 0, lse = MASK_VALUE), and huge keys at the tokens no row may see (a leaked mask would swamp
    the softmax)."""
    store = make_store(20, k_bits=k_bits, v_bits=k_bits, k_group=32, v_group=32, dtype=store_dtype, batch=4,
                       capacity=1024, lengths=[1024, 947, 100, 0])
    kk, kv, km, kq = jax.random.split(jax.random.key(21), 4)
    k = jax.random.normal(kk, (2, 4, 2, width, 128), jnp.float32)
    v = jax.random.normal(kv, (2, 4, 2, width, 128), jnp.float32)
    mask = jax.random.bernoulli(km, 0.7, (4, 2, t_rows, width) if per_head else (4, t_rows, width))
    mask = mask.at[3, ..., 0, :].set(False)  # the empty store's first query row sees nothing
    seen = jnp.any(mask if per_head else mask[:, None], axis=2)  # [B, Hm, W]
    k = jnp.where(seen[None, ..., None], k, 300.0).astype(segment_dtype)
    v = v.astype(segment_dtype)
    q = jax.random.normal(kq, (4, 2, t_rows, q_per_kv, 128), segment_dtype)
    if not stacked:
      k, v = k[1], v[1]
    for layer in (0, 1):
      o, lse = mgpu_decode_attention(q, layer, pack_mma_store(store), segment=(k, v, mask), splits=splits,
                                     return_lse=True, segment_depth=segment_depth)
      o_ref, lse_ref = decode_attention_reference(q, layer, (store,), ((k, v, mask),), return_lse=True)
      assert np.all(np.asarray(o)[3, :, 0] == 0) and np.all(np.asarray(lse)[3, :, 0] == MASK_VALUE)
      o, o_ref, lse, lse_ref = (np.asarray(x, np.float64) for x in (o, o_ref, lse, lse_ref))
      assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE
      np.testing.assert_allclose(lse, lse_ref, atol=0.05)

  @pytest.mark.parametrize("with_segment", [False, True])
  def test_pools_in_one_launch(self, with_segment):
    """Two stores of other widths and lengths (ZipCache's pools: 4 and 2 bits, holes every head shares, one value
    channel scale), read in one launch, each program its store's share (and the last one a segment): held to the
    reference over both."""
    kh, kc, kq, kk, kv, km = jax.random.split(jax.random.key(41), 6)
    stores = [make_store(40 + bits, k_bits=bits, v_bits=bits, k_group=32, v_group=32, dtype=jnp.float16,
                         capacity=capacity, lengths=lengths)
              for bits, capacity, lengths in ((4, 1024, [1024, 700, 0]), (2, 640, [640, 0, 300]))]
    scale = jax.random.uniform(kc, (2, 3, 2, 128), jnp.float32, 0.25, 4.0)
    packed = []
    for i, store in enumerate(stores):
      valid = jax.random.bernoulli(jax.random.fold_in(kh, i), 0.9, (3, 1, store.capacity))
      stores[i] = dataclasses.replace(store, valid=jnp.broadcast_to(valid, (3, 2, store.capacity)),
                                      v_channel_scale=scale)
      packed.append(dataclasses.replace(pack_mma_store(stores[i]), valid=valid))
    q = jax.random.normal(kq, (3, 2, 1, 4, 128), jnp.bfloat16)
    segments = ()
    if with_segment:
      segment_kv = lambda key: jax.random.normal(key, (2, 3, 2, 100, 128), jnp.bfloat16)
      segments = ((segment_kv(kk), segment_kv(kv), jax.random.bernoulli(km, 0.7, (3, 1, 100))),)
    for layer in (0, 1):
      o, lse = mgpu_decode_attention(q, layer, tuple(packed), segment=segments[0] if segments else None,
                                     return_lse=True)
      o_ref, lse_ref = decode_attention_reference(q, layer, tuple(stores), segments, return_lse=True)
      o, o_ref = np.asarray(o, np.float64), np.asarray(o_ref, np.float64)
      assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE
      np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=0.05)

  @pytest.mark.parametrize("k_bits,dtype,step_tiles,holes,with_segment,segment_depth", [
      (2, jnp.float16, None, "stacked", False, None), (4, jnp.bfloat16, 1, "step", False, None),
      (2, jnp.bfloat16, 2, "stacked", True, None), (1, jnp.float16, None, "step", True, 1),
      (4, jnp.float16, None, "shared", False, None)])
  def test_holes_and_a_value_channel_scale(self, k_bits, dtype, step_tiles, holes, with_segment, segment_depth):
    """Holes (a fifth of the slots, all of sequence 1's tile 3, every slot of sequence 2) masked in the kernel, and
    a value channel scale on its output, stacked over layers or one step's (or stacked and the same for every
    head: a head axis of 1), with and without a segment: held to
    the reference over the library-layout store with the same holes and scale. Without the holes the answer is
    far off (so a hole that leaked would show), and sequence 2 has no key in the store (o = 0, lse = MASK_VALUE
    without a segment)."""
    store = make_store(30, k_bits=k_bits, v_bits=k_bits, k_group=32, v_group=32, dtype=dtype, capacity=1024,
                       lengths=[1024, 947, 100])
    kh, kc, kq, kk, kv, km = jax.random.split(jax.random.key(31), 6)
    valid = jax.random.bernoulli(kh, 0.8, (2, 3, 2, 1024)).at[:, 1, :, 192:256].set(False).at[:, 2].set(False)
    scale = jax.random.uniform(kc, (2, 3, 2, 128), jnp.float32, 0.25, 4.0)
    valid = {"stacked": valid, "step": valid[1], "shared": valid[:, :, :1]}[holes]
    store = dataclasses.replace(store, valid=jnp.broadcast_to(valid, valid.shape[:-2] + (2, 1024)),
                                v_channel_scale=scale)
    packed = dataclasses.replace(pack_mma_store(store), valid=valid)  # the reference's store takes every head's
    q = jax.random.normal(kq, (3, 2, 1, 4, 128), dtype)
    segments = ()
    if with_segment:  # 132 tokens: L * B * Hkv * W a multiple of 8, the kernel reads it in place
      segment_kv = lambda key: jax.random.normal(key, (2, 3, 2, 132, 128), dtype)
      segments = ((segment_kv(kk), segment_kv(kv), jax.random.bernoulli(km, 0.7, (3, 1, 132))),)
    for layer in (0, 1):
      o, lse = mgpu_decode_attention(q, layer, packed, segment=segments[0] if segments else None,
                                     return_lse=True, step_tiles=step_tiles, segment_depth=segment_depth)
      o_ref, lse_ref = decode_attention_reference(q, layer, (store,), segments, return_lse=True)
      no_holes = decode_attention_reference(q, layer, (dataclasses.replace(store, valid=None),), segments)
      o, o_ref, no_holes = (np.asarray(x, np.float64) for x in (o, o_ref, no_holes))
      if not with_segment:
        assert np.all(o[2] == 0) and np.all(np.asarray(lse)[2] == MASK_VALUE)
      assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE
      assert np.linalg.norm(no_holes - o_ref) / np.linalg.norm(o_ref) > 10 * O_TOLERANCE
      np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=0.05)

  @pytest.mark.parametrize("k_bits,head_dim,holes", [(4, 128, "step"), (4, 128, "stacked"), (8, 256, "stacked")])
  def test_holes_in_one_tile_steps(self, k_bits, head_dim, holes):
    """Holes in one-tile steps, over splits of 8 to 2 steps and one split of all 16, and the default (one-tile
    steps too at head_dim 256, 8 bits): held to the reference. Until holes took two bytes a slot in one-tile steps,
    a split of more than one step stopped with a misaligned address."""
    store = make_store(40, k_bits=k_bits, v_bits=k_bits, k_group=32, v_group=32, dtype=jnp.bfloat16, capacity=1024,
                       head_dim=head_dim, lengths=[1024, 700, 300])
    kh, kq = jax.random.split(jax.random.key(41))
    valid = jax.random.bernoulli(kh, 0.8, (2, 3, 2, 1024))
    store = dataclasses.replace(store, valid=valid)
    packed = dataclasses.replace(pack_mma_store(store), valid=valid if holes == "stacked" else valid[1])
    q = jax.random.normal(kq, (3, 2, 1, 4, head_dim), jnp.bfloat16)
    o_ref, lse_ref = decode_attention_reference(q, 1, (store,), (), return_lse=True)
    o_ref = np.asarray(o_ref, np.float64)
    cases = [(1, splits) for splits in (8, 4, 2, 1)] + [(None, None)]
    if head_dim == 256:
      assert default_step_tiles(packed) == 1
    for step_tiles, splits in cases:
      o, lse = mgpu_decode_attention(q, 1, packed, return_lse=True, step_tiles=step_tiles, splits=splits)
      assert np.linalg.norm(np.asarray(o, np.float64) - o_ref) / np.linalg.norm(o_ref) <= O_TOLERANCE
      np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=0.05)

  @pytest.mark.parametrize("k_bits,dtype,step_tiles,t_rows,q_per_kv,splits,logit_rows", [
      (1, jnp.bfloat16, None, 2, 4, None, (1,)), (2, jnp.float16, 1, 1, 4, 3, (0,)),
      (4, jnp.bfloat16, 2, 3, 5, None, (2, 0)), (2, jnp.bfloat16, None, 2, 4, 2, (0, 1)),
      (2, jnp.float16, 2, 4, 4, None, (2, 3))])
  def test_the_store_slot_weights_it_writes_out(self, k_bits, dtype, step_tiles, t_rows, q_per_kv, splits,
                                                logit_rows):
    """``logit_rows``: the slot weights the kernel writes out (what the token mass is made of), as each slot's
    probability (``slot_probabilities``, against the rows' log-sum-exp) at every slot that is a key, against
    exp(sm_scale q . k - lse) over the library-layout store's keys (in float64): within the rounding of each
    dequantized key (``logit_bound``) and of p to fp16 (half an ulp: 2**-11 relative, and 2**-25 of the max of
    its 16 slots where p is below fp16's normal range); the partials are unchanged by asking. The rows' columns
    alone (the second of two rows; the first of one; the last two of four, in 16 columns) or every row's (rows
    in another order; both of two)."""
    store = make_store(32, k_bits=k_bits, v_bits=k_bits, k_group=32, v_group=32, dtype=dtype, capacity=1024,
                       lengths=[1024, 947, 100])
    q = jax.random.normal(jax.random.key(33), (3, 2, t_rows, q_per_kv, 128), dtype)
    packed = pack_mma_store(store)
    o, m, l, weights = mgpu_decode_partial(q, 1, packed, logit_rows=logit_rows, step_tiles=step_tiles, splits=splits)
    o_plain, m_plain, l_plain = mgpu_decode_partial(q, 1, packed, step_tiles=step_tiles, splits=splits)
    for got, want in ((o, o_plain), (m, m_plain), (l, l_plain)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    k_ref, _, mask = store.read_layer(1)
    rows = np.asarray(q, np.float64)[:, :, list(logit_rows)]
    want = np.einsum("bhtgd,bhsd->bhtgs", rows, np.asarray(k_ref, np.float64)) * 128**-0.5
    bound = logit_bound(rows, k_ref, store.k_scale[1], store.k_zero[1], k_bits) + 1e-5
    keys = np.broadcast_to(np.asarray(mask)[:, :, None, None, :], want.shape)
    lse = (m + jnp.log(l))[:, :, list(logit_rows)]
    probability = np.asarray(slot_probabilities(weights, lse), np.float64)
    want = np.exp(want - np.asarray(lse, np.float64)[..., None])
    with np.errstate(over="ignore", invalid="ignore"):  # the maxima of runs no step wrote are anything
      maxima = np.moveaxis(np.asarray(weights[1], np.float64), 2, 4)  # [B, Hkv, R, g, C / 16]
      of_16 = np.repeat(np.exp(maxima - np.asarray(lse, np.float64)[..., None]), 16, -1)
      tolerance = want * np.expm1(bound) + probability * (2.0**-11 + 1e-6) + 2.0**-25 * of_16
    assert probability.shape == want.shape and weights[0].dtype == jnp.float16
    assert np.all(np.abs(probability - want)[keys] <= tolerance[keys])

  @pytest.mark.parametrize("width,per_head,stacked,t_rows,logit_rows", [
      (132, False, True, 2, (1,)),   # a window of 132 tokens a head: its rows start in the middle of a row of 8
      (64, True, False, 2, (1,)),    # SpeCache's fetched rows: a mask per head
      (72, False, True, 3, (2, 0))])  # every row's columns
  def test_the_segment_slot_weights_it_writes_out(self, width, per_head, stacked, t_rows, logit_rows):
    """With a segment and ``logit_rows``, its tokens' slot weights too: as each token's probability
    (``slot_probabilities``) at every token the mask shows a row, against exp(sm_scale q . k - lse) in float64
    with q rounded to the segment's type (as its key product takes it), within p's rounding to fp16; the store's
    weights and the partials as without the segment's."""
    store = make_store(34, k_bits=1, v_bits=1, k_group=32, v_group=32, dtype=jnp.bfloat16, capacity=1024,
                       lengths=[1024, 947, 100])
    kk, kv, km, kq = jax.random.split(jax.random.key(35), 4)
    k = jax.random.normal(kk, (2, 3, 2, width, 128), jnp.bfloat16)
    v = jax.random.normal(kv, (2, 3, 2, width, 128), jnp.bfloat16)
    mask = jax.random.bernoulli(km, 0.7, (3, 2, t_rows, width) if per_head else (3, t_rows, width))
    q = jax.random.normal(kq, (3, 2, t_rows, 4, 128), jnp.bfloat16)
    segment = (k, v, mask) if stacked else (k[1], v[1], mask)
    o, m, l, _, weights = mgpu_decode_partial(q, 1, pack_mma_store(store), segment=segment, logit_rows=logit_rows)
    o_plain, m_plain, l_plain = mgpu_decode_partial(q, 1, pack_mma_store(store), segment=segment)
    for got, want in ((o, o_plain), (m, m_plain), (l, l_plain)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    lse = (m + jnp.log(l))[:, :, list(logit_rows)]
    probability = np.asarray(slot_probabilities(weights, lse), np.float64)
    rows = np.asarray(q, np.float64)[:, :, list(logit_rows)]
    want = np.exp(np.einsum("bhtgd,bhsd->bhtgs", rows, np.asarray(k[1], np.float64)) * 128**-0.5
                  - np.asarray(lse, np.float64)[..., None])
    shown = np.broadcast_to(np.asarray(mask if per_head else mask[:, None])[:, :, list(logit_rows), None],
                            want.shape)
    assert probability.shape == want.shape and weights[0].dtype == jnp.float16
    np.testing.assert_allclose(probability[shown], want[shown], rtol=2.0**-11 + 1e-4, atol=1e-7)

  def test_splits_past_the_length_and_an_empty_sequence(self):
    """A split whose first token is at or past the length reads nothing; a sequence of length 0 gives o = 0 and
    lse = MASK_VALUE, as the reference does."""
    store = make_store(8, k_bits=2, v_bits=2, k_group=32, v_group=32, dtype=jnp.bfloat16, capacity=2048,
                       lengths=[0, 70, 2048])
    q = jax.random.normal(jax.random.key(9), (3, 2, 1, 4, 128), jnp.bfloat16)
    o, lse = mgpu_decode_attention(q, 0, pack_mma_store(store), return_lse=True, splits=8)  # 256 tokens a split
    o_ref, lse_ref = decode_attention_reference(q, 0, (store,), (), return_lse=True)
    o, o_ref, lse = np.asarray(o, np.float64), np.asarray(o_ref, np.float64), np.asarray(lse)
    assert np.all(o[0] == 0) and np.all(lse[0] == MASK_VALUE)
    for b in (1, 2):
      assert np.linalg.norm(o[b] - o_ref[b]) / np.linalg.norm(o_ref[b]) <= O_TOLERANCE
      np.testing.assert_allclose(lse[b], np.asarray(lse_ref)[b], atol=0.05)
