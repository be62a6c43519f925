"""The MMA-ready packing of a KIVI-layout store: codes and scales placed where the Hopper kernel's threads read them.

``mgpu_decode_attention`` feeds the tensor cores from registers: each warp w of the warpgroup takes tokens
16 w .. 16 w + 15 of a 64-token tile, whose key codes are the A operands of ``mma.sync`` m16n8k16 (tokens x
channels, a block of 16 channels each) and whose value codes, transposed, the A operands of the value product
(channels x tokens, a block of 16 channels each). In the A fragment (PTX "mma .m16n8k16 A", 16-bit), lane l holds
rows l // 4 and l // 4 + 8 and columns (c0, c0 + 1) and (c0 + 8, c0 + 9), c0 = 2 (l % 4): one 32-bit register
per (row half h, column half), two 16-bit lanes. Keys: register rho = 2 j + h holds tokens 16 w + l // 4 + 8 h
and channels c0 + 8 j, + 1 (j < D / 8) -- the same registers as the warpgroup's ``wgmma`` A layout, so
``WGMMA_LAYOUT`` arrays carry them; values: rho = 2 u + h with u = 2 i + a holds channels 16 i + l // 4 + 8 h and
tokens 16 w + c0 + 8 a, + 1 (i < D / 16). So rho = 2 u + h with u = j for keys, and the two registers of a u share
a scale and zero word. This module lays the codes out so that each thread's registers come from its own
consecutive words, a pair of lanes from one word:

    register rho sits at slot sigma = 2 W (u // W) + W h + u % W (W = min(F, D / 8), F = 16 // bits fields per
    16-bit half): word sigma // F, field sigma % F; the low half's field holds the pair's first code, the high
    half's field its second.

so both registers of a u sit in the same field of two words, and ``((word >> shift) & mask) | magic`` is both
lanes of a register at once, already in the order the product wants (docs/kernels.md). A thread's 2 * bits
words sit at ``(k // vec) * 128 * vec + vec * tau + k % vec`` (vec = min(4, 2 * bits)): the order in which a
``WG_STRIDED`` load of ``vec`` words per thread hands them out, so every load is 16 bytes wide and a warp's loads
are contiguous.

Codes become fp16 without a conversion (``field_plan``): the field, shifted to mantissa bit ``offset`` (6 to 9),
OR-ed into the fp16 constant M = 2^(10 - offset) (``magic_half``) reads as M + c exactly. The kernel then computes
(M + c) * s + z' with z' = z - M s in one fused multiply-add, so the packing stores z' in place of the zero-point:
one subtraction per two codes fewer. M <= 16 (M <= 4 for 1-bit codes, whose scale is half the range) keeps z''s
rounding within 2^-11 (|z| + 16 s), at most s / 128 past what rounding z itself costs: about what bf16's rounding
of a dequantized value costs (M <= 64 measured as fast on an H100 at B = 256, L = 4608, with four times the
bound). So the packing reads as the library layout's store up to that rounding, not bit for bit: where keys have
an outlier channel (a scale near 19) attention over it moves by up to 2%; the default model's perplexity through
the kernel does not move (docs/kernels.md). An 8-bit code fills the mantissa's upper 8 bits, so
its M is 256 and z' rounds within 2^-11 (|z| + 256 s): s / 8, or 2^-11 of the group's range of 255 s, which is
still below bf16's rounding of a dequantized value near that range (2^-9).
Scales and zero-points are therefore held in fp16 whatever the store's type (bf16 values in fp16's normal range,
6.1e-5 to 65504, convert exactly; smaller ones lose relative precision below an absolute 6e-8).

Scales and zero-points travel as uint32 words of two fp16 values, a pair's two lanes. A thread of quad
q = l % 4 reads K words of a block (k = 2 j + 0 for the scale pair, 2 j + 1 for the zero pair), the 8 lanes of a
warp that share q reading the same words; its word k sits at ``(k // 4) * 16 + 4 q + k % 4``, so each 16-byte
load of a warp touches four consecutive 16-byte pieces, one per quad, in different banks (quads K words apart
would put all four in the same banks: a 4-way conflict on every load, which bounded the first build):
  keys, per group of G tokens: K = D / 4 words over j < D / 8, the pair of channels (2 q + 8 j, 2 q + 8 j + 1);
  values, per 64-token tile and warp w (4 blocks of 16 D / Gv words): K = 4 D / Gv words, k = 4 g + 2 a (the
    scale pair, + 1 the z' pair) of tokens (16 w + 2 q + 8 a, + 1) in channel group g.

Nothing here reads a model or a method: ``pack_mma_store`` converts a ``QuantizedStore`` (the library's layout)
by unpacking its codes with the library's ``unpack`` and packing them again with ``pack``; ``read_mma_store``
dequantizes the packed form back, the plain-jnp check that the two layouts hold the same cache.
"""

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jkv_kernels.attention_reference import slot_mask
from jkv_kernels.quantization import dequantize, pack, unpack

TILE = 64          # tokens per tile: a warpgroup's 4 warps of 16
THREADS = 128      # one warpgroup
MMA_BITS = (1, 2, 4, 8)  # every width the library quantizes to
META_DTYPE = jnp.float16  # the scales' and zero-points' type in the packing, whatever the store's (docstring)
_MANTISSA = 10
# The lowest mantissa bit a field sits at, by width: magic numbers <= 4 for 1-bit codes, 256 for 8-bit ones (the
# field fills the mantissa's upper 8 bits), <= 16 otherwise (module docstring); each leaves room for two fields (one
# 4- or 8-bit field) per shift.
_LOWEST_OFFSET = {1: 8, 2: 6, 4: 6, 8: 2}


def words_per_thread(bits: int, head_dim: int) -> int:
  """A tile's 64 * D codes over 128 threads, 32 // bits to a word (keys and values alike)."""
  return head_dim * bits // 64


def load_vector(bits: int, head_dim: int) -> int:
  return min(4, words_per_thread(bits, head_dim))


def field_plan(bits: int) -> list[tuple[int, int]]:
  """(shift, offset) of each field f of a 16-bit half: ``word >> shift`` (``<<`` where negative) holds field f at
  bit ``offset`` of both halves, offset in [lowest, 10 - bits] (lowest: 8 for 1-bit codes, 2 for 8-bit ones, 6
  otherwise). One shift serves P fields (P = 2, 2, 1, 1 for 1-, 2-, 4-, 8-bit codes), field f at offset lowest +
  bits (f % P): so a field's offset depends on f % P only, and P divides 8, the fields apart that one value scale
  word's registers of neighbouring channel blocks lie (``register_slots``)."""
  lowest = _LOWEST_OFFSET[bits]
  per_shift = (_MANTISSA - lowest) // bits
  offsets = [lowest + bits * (f % per_shift) for f in range(16 // bits)]
  return [(bits * f - offset, offset) for f, offset in enumerate(offsets)]


def magic_half(offset: int) -> int:
  """The fp16 bits of M = 2^(10 - offset): its mantissa bit ``offset`` is worth exactly 1, so OR-ing a code c in
  at that bit (below ``offset`` the mantissa is zero) gives M + c."""
  return (15 + _MANTISSA - offset) << _MANTISSA


def register_slots(bits: int, registers: int) -> np.ndarray:
  """[registers] the slot sigma of each register rho (module docstring): word sigma // F, field sigma % F."""
  fields = 16 // bits
  u, h = np.divmod(np.arange(registers), 2)
  width = min(fields, registers // 2)
  return 2 * width * (u // width) + width * h + u % width


def pair_magic(bits: int, pairs: int) -> np.ndarray:
  """[pairs] the magic number M of column pair u: a key tile's channel pair j (u = j), a value tile's token pair j
  (u = j < 8). Register 2 u + h sits in field u % F of its word for h = 0 and at the same offset for h = 1, and a
  value register of block m (u = 8 m + j) at the offset of field j (``field_plan``)."""
  plan = field_plan(bits)
  return np.array([2.0 ** (_MANTISSA - plan[u % (16 // bits)][1]) for u in range(pairs)], np.float32)


def _folded_meta(scale, zero, magic):
  """(scale, z' = z - M s) in fp16, computed in fp32 (module docstring); ``magic`` broadcasts against them."""
  s = scale.astype(jnp.float32)
  return s.astype(META_DTYPE), (zero.astype(jnp.float32) - magic * s).astype(META_DTYPE)


def _thread_coordinates():
  tau = np.arange(THREADS)
  warp, lane = tau // 32, tau % 32
  return 16 * warp + lane // 4, 2 * (lane % 4)  # r0, c0


def key_register_map(head_dim: int):
  """[THREADS, 2 * D / 8, 2] (token, channel) of each register's two lanes in a key tile (rows are tokens)."""
  r0, c0 = _thread_coordinates()
  j, h = np.divmod(np.arange(head_dim // 8 * 2), 2)
  token = r0[:, None] + 8 * h[None, :]
  channel = c0[:, None] + 8 * j[None, :]
  return np.stack([np.broadcast_to(token, channel.shape)] * 2, -1), np.stack([channel, channel + 1], -1)


def value_register_map(head_dim: int):
  """[THREADS, D / 4, 2] (token, channel) of each register's two lanes in a value tile: warp w holds every channel
  of its 16 tokens 16 w .. 16 w + 15 (the A operand of ``mma.sync`` m16n8k16 per block of 16 channels, rows
  channels and columns the warp's tokens). Register rho = 2 u + h (u = 2 i + a): channels 16 i + l // 4 + 8 h,
  tokens 16 w + 2 (l % 4) + 8 a (+ 1)."""
  r0, c0 = _thread_coordinates()
  warp = np.arange(THREADS)[:, None] // 32
  u, h = np.divmod(np.arange(head_dim // 4), 2)
  i, a = np.divmod(u, 2)
  channel = 16 * i[None, :] + r0[:, None] % 16 + 8 * h[None, :]
  token = 16 * warp + c0[:, None] + 8 * a[None, :]
  return np.stack([token, token + 1], -1), np.stack([channel, channel], -1)


def word_positions(bits: int, head_dim: int) -> np.ndarray:
  """[THREADS, words_per_thread] position of each thread's k-th word in the tile's word array."""
  vec = load_vector(bits, head_dim)
  k = np.arange(words_per_thread(bits, head_dim))
  tau = np.arange(THREADS)
  return (k // vec)[None, :] * THREADS * vec + vec * tau[:, None] + (k % vec)[None, :]


def _pack_registers(codes, bits):
  """codes [..., THREADS, R, 2] (R registers, two lanes) -> tile words [..., THREADS * R * bits / 16] uint32."""
  fields = 16 // bits
  *lead, threads, registers, _ = codes.shape
  codes = codes[..., np.argsort(register_slots(bits, registers)), :]  # in slot order
  # A word holds F registers: their low lanes in bits [0, 16), their high lanes in [16, 32), which is the
  # library's packing of the 2F codes (low lanes first).
  by_word = codes.reshape(*lead, threads, registers // fields, fields, 2)
  lanes_in_order = jnp.concatenate([by_word[..., 0], by_word[..., 1]], axis=-1)
  words = pack(lanes_in_order, bits=bits, axis=-1)[..., 0]  # [..., THREADS, words_per_thread]
  order = np.argsort(word_positions(bits, 4 * registers).reshape(-1))  # R = D / 4 registers per thread
  return words.reshape(*lead, -1)[..., order]


def _unpack_registers(words, bits, registers):
  """Inverse of ``_pack_registers``: tile words [..., W] -> codes [..., THREADS, R, 2] int32."""
  fields = 16 // bits
  per_thread = words[..., word_positions(bits, 4 * registers)]  # [..., THREADS, words]
  codes = unpack(per_thread[..., None], bits=bits, axis=-1)  # [..., THREADS, words, 2F]
  codes = jnp.stack([codes[..., :fields], codes[..., fields:]], -1)  # [..., THREADS, words, F, 2]
  codes = codes.reshape(*codes.shape[:-4], THREADS, registers, 2)  # in slot order
  return codes[..., register_slots(bits, registers), :].astype(jnp.int32)


def quad_word_position(q, k):
  """Where word ``k`` of a thread of quad ``q`` sits in its block of 4 K words (module docstring)."""
  return (k // 4) * 16 + 4 * q + k % 4


def _interleave_quads(words):
  """[..., 4 (q), K] -> [..., 4 K]: each quad's K words at ``quad_word_position``."""
  *lead, quads, count = words.shape
  return jnp.swapaxes(words.reshape(*lead, quads, count // 4, 4), -3, -2).reshape(*lead, quads * count)


def _deinterleave_quads(block):
  """Inverse of ``_interleave_quads``: [..., 4 K] -> [..., 4 (q), K]."""
  *lead, size = block.shape
  return jnp.swapaxes(block.reshape(*lead, size // 16, 4, 4), -3, -2).reshape(*lead, 4, size // 4)


def _last_axes(x, order):
  """x with its last len(order) axes permuted by ``order``."""
  lead = x.ndim - len(order)
  return jnp.transpose(x, (*range(lead), *(lead + i for i in order)))


def _pair_words(a, b):
  """Two 16-bit arrays -> one uint32 array, a in the low half."""
  as_u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  return as_u32(a) | (as_u32(b) << 16)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_codes", "k_meta", "v_codes", "v_meta", "length", "valid", "v_channel_scale"],
    meta_fields=["k_bits", "v_bits", "k_group", "v_group"])
@dataclasses.dataclass(frozen=True)
class MmaStore:
  """A KIVI store in the MMA-ready packing (module docstring), every array stacked over layers.

  ``valid`` and ``v_channel_scale`` are ``QuantizedStore``'s: slot c of KV head h is a key iff c < length[b] and
  valid[..., b, h, c] (holes: OTT's placeholders, ZipCache's group tails), and every dequantized value channel d
  is multiplied by v_channel_scale[..., b, h, d] (ZipCache's channel-separable values)."""
  k_codes: jax.Array  # [L, B, Hkv, C / 64, 64 * D * k_bits / 32] uint32
  k_meta: jax.Array   # [L, B, Hkv, C / G, 4 * D / 4] uint32: (scale pair, z' pair) fp16 words, quads interleaved
  v_codes: jax.Array  # [L, B, Hkv, C / 64, 64 * D * v_bits / 32] uint32
  v_meta: jax.Array   # [L, B, Hkv, C / 64, D / Gv * 4 * 16] uint32: quads interleaved per channel group
  length: jax.Array   # [B] int32
  k_bits: int
  v_bits: int
  k_group: int
  v_group: int
  valid: Optional[jax.Array] = None  # [L, B, Hkv or 1, C] (stacked) or [B, Hkv or 1, C] bool; None: no holes
  v_channel_scale: Optional[jax.Array] = None  # [L, B, Hkv, D] float; None: 1

  @property
  def capacity(self) -> int:
    return self.k_codes.shape[3] * TILE

  def slot_mask(self, layer, start=0, size=None):
    """[B, Hkv, size] bool: slots [start, start + size) attended at ``layer`` (below ``length`` and not holes)."""
    size = self.capacity if size is None else size
    return slot_mask(self.length, self.valid, layer, start, size, self.k_codes.shape[2])


def check_mma_packing(*, k_bits: int, v_bits: int, k_group: int, v_group: int, head_dim: int, tokens: int,
                      meta_dtype) -> None:
  """One-line errors for what the MMA packing (and so the Hopper kernel) does not take."""
  for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
    if bits not in MMA_BITS:
      raise ValueError(f"the MMA packing takes {MMA_BITS}-bit codes, got {name}={bits}")
  if jnp.dtype(meta_dtype).itemsize != 2:
    raise ValueError(f"the MMA packing takes 16-bit scales and zero-points (fp16 or bf16), got "
                     f"{jnp.dtype(meta_dtype).name}")
  if tokens % TILE or head_dim % 64:
    raise ValueError(f"the MMA packing needs the capacity ({tokens}) a multiple of {TILE} and head_dim "
                     f"({head_dim}) a multiple of 64")
  if k_group < 16 or v_group < 16 or head_dim % v_group:
    raise ValueError(f"the MMA packing needs k_group and v_group >= 16 (got {k_group}, {v_group})")


def _channel_pairs(head_dim):
  """[4, D/8] the first channel (token) of each quad's pair 2 q + 8 j."""
  q_idx, j_idx = np.meshgrid(np.arange(4), np.arange(head_dim // 8), indexing="ij")
  return 2 * q_idx + 8 * j_idx


def _key_words(k, bits):
  """Integer key codes [..., n, D] (n a multiple of 64) -> tile words [..., n / 64, 64 D bits / 32] uint32."""
  *lead, tokens, head_dim = k.shape
  kt, kc = key_register_map(head_dim)
  return _pack_registers(k.reshape(*lead, tokens // TILE, TILE, head_dim)[..., kt, kc], bits)


def key_meta_words(scale, zero, *, bits: int):
  """Key scales and zero-points [..., D, groups] -> meta words [..., groups, D] uint32: per group, (scale pair,
  z' pair) words of the channel pairs (2 q + 8 j, + 1) in fp16, quads interleaved; z' = z - M s with the magic
  number of the channel pair's field."""
  *lead, head_dim, groups = scale.shape
  ch = _channel_pairs(head_dim)  # [4, D/8]
  magic = np.repeat(pair_magic(bits, head_dim // 8), 8)  # [D]: channel d is in pair d // 8
  ks, kz = _folded_meta(jnp.swapaxes(scale, -1, -2), jnp.swapaxes(zero, -1, -2), magic)  # [..., groups, D]
  meta = jnp.stack([_pair_words(ks[..., ch], ks[..., ch + 1]), _pair_words(kz[..., ch], kz[..., ch + 1])], -1)
  return _interleave_quads(meta.reshape(*lead, groups, 4, -1))


def pack_key_tiles(codes, scale, zero, *, bits: int):
  """Keys in the library's layout -> the MMA packing, for any leading axes and n tokens (a multiple of 64 and
  of the key group G).

  Args:
    codes: [..., D, n / Pk] uint32, packed along tokens; scale, zero: [..., D, n / G] (16-bit).
  Returns:
    (tile words [..., n / 64, 64 D bits / 32] uint32, meta [..., n / G, D] uint32).
  """
  return (_key_words(jnp.swapaxes(unpack(codes, bits=bits, axis=-1), -1, -2), bits),
          key_meta_words(scale, zero, bits=bits))


def _value_words(v, bits):
  """Integer value codes [..., n, D] (n a multiple of 64) -> tile words [..., n / 64, 64 D bits / 32] uint32."""
  *lead, tokens, head_dim = v.shape
  vt, vc = value_register_map(head_dim)
  return _pack_registers(v.reshape(*lead, tokens // TILE, TILE, head_dim)[..., vt, vc], bits)


def _value_meta_words(scale, zero, bits):
  """Value scales and zero-points [..., n, D / Gv] (n a multiple of 64) -> meta words [..., n / 64, 64 D / Gv]
  uint32: per tile and warp w, a block of 16 D / Gv words, quads interleaved; a thread of quad q reads words
  k = 4 g + 2 a (the scale pair) and k + 1 (the z' pair) of tokens 16 w + 2 q + 8 a (+ 1) in channel group g,
  fp16, z' = z - M s with the magic number of that token pair's field (``value_register_map``)."""
  *lead, tokens, channel_groups = scale.shape
  # token 16 w + 8 a + 2 q + e of a tile: [..., n, w, a, q, e, groups] -> [..., n, w, q, groups, a, e]
  per_tile = lambda x: _last_axes(x.reshape(*lead, tokens // TILE, 4, 2, 4, 2, channel_groups), (0, 1, 3, 5, 2, 4))
  magic = pair_magic(bits, 2)[:, None]  # [a, 1]: token pair a of a warp's 16 tokens
  vs, vz = _folded_meta(per_tile(scale), per_tile(zero), magic)  # [..., n, w, q, groups, a, e]
  meta = jnp.stack([_pair_words(vs[..., 0], vs[..., 1]), _pair_words(vz[..., 0], vz[..., 1])], -1)
  meta = meta.reshape(*meta.shape[:-4], 4, -1)  # [..., n, w, q, K]: k = 4 g + 2 a + (0 scale, 1 z')
  return _interleave_quads(meta).reshape(*lead, tokens // TILE, -1)


def pack_value_tiles(codes, scale, zero, *, bits: int):
  """Values in the library's layout -> the MMA packing, for any leading axes and n tokens (a multiple of 64).

  Args:
    codes: [..., n, D / Pv] uint32, packed along channels; scale, zero: [..., n, D / Gv] (16-bit).
  Returns:
    (tile words [..., n / 64, 64 D bits / 32] uint32, meta [..., n / 64, D / Gv * 64] uint32).
  """
  return _value_words(unpack(codes, bits=bits, axis=-1), bits), _value_meta_words(scale, zero, bits)


def merge_into_tiles(k_words, v_words, v_meta, keys, values, offset, *, k_bits: int, v_bits: int):
  """Packed tiles with M tokens from ``offset`` replaced by new ones in the library's layout, every other token
  kept: how a method that quantizes a block of tokens at a time (OTT's G, at any multiple of G within a tile)
  writes the MMA packing.

  Args:
    k_words, v_words: [B, H, n, W] uint32, the n tiles that hold the tokens; v_meta: [B, H, n, Wm] uint32.
    keys: (codes [B, H, D, M / Pk] uint32, scale, zero [B, H, D, M / G]); values: (codes [B, H, M, D / Pv],
      scale, zero [B, H, M, D / Gv]): the library's layout (``quantize_pack``).
    offset: [B] int32 where the first new token lies in the first tile; offset and M multiples of 16 (a pair of
      neighbouring tokens shares a value meta word), offset + M <= 64 n.
  Returns:
    (k_words, k_meta [B, H, M / G, D], v_words, v_meta): the merged tiles and the new key groups' meta words.
  """
  tokens = TILE * k_words.shape[2]
  k_codes, k_scale, k_zero = keys
  v_codes, v_scale, v_zero = values

  def place(x):  # [B, H, M, ...] -> [B, H, 64 n, ...]: x at tokens [offset, offset + M) of each sequence, 0 around
    zeros = jnp.zeros((*x.shape[1:2], tokens, *x.shape[3:]), x.dtype)
    at = lambda b_x, b_offset: jax.lax.dynamic_update_slice_in_dim(zeros, b_x, b_offset, axis=1)
    return jax.vmap(at)(x, offset)

  new = jnp.ones(v_codes.shape[:3] + (1,), bool)
  in_range = place(new)  # [B, H, 64 n, 1]
  ones = lambda bits: jnp.where(in_range, (1 << bits) - 1, 0).astype(jnp.uint32)  # every field of the new tokens
  head_dim = k_codes.shape[2]
  k_mask = _key_words(jnp.broadcast_to(ones(k_bits), in_range.shape[:3] + (head_dim,)), k_bits)
  v_mask = _value_words(jnp.broadcast_to(ones(v_bits), in_range.shape[:3] + (head_dim,)), v_bits)
  k_new = _key_words(place(jnp.swapaxes(unpack(k_codes, bits=k_bits, axis=-1), -1, -2)), k_bits)
  v_new = _value_words(place(unpack(v_codes, bits=v_bits, axis=-1)), v_bits)
  meta_new = _value_meta_words(place(v_scale), place(v_zero), v_bits)
  marked = place(jnp.ones(v_scale.shape, v_scale.dtype))
  meta_mask = _value_meta_words(marked, marked, v_bits) != 0  # the new tokens' words (a scale of 1 is not 0)
  return ((k_words & ~k_mask) | k_new, key_meta_words(k_scale, k_zero, bits=k_bits), (v_words & ~v_mask) | v_new,
          jnp.where(meta_mask, meta_new, v_meta))


def pack_mma_store(store) -> MmaStore:
  """A ``QuantizedStore`` (codes packed along tokens / channels) in the MMA-ready packing."""
  capacity, head_dim = store.v_codes.shape[3], store.k_codes.shape[3]
  check_mma_packing(k_bits=store.k_bits, v_bits=store.v_bits, k_group=store.k_group, v_group=store.v_group,
                    head_dim=head_dim, tokens=capacity, meta_dtype=store.k_scale.dtype)
  k_codes, k_meta = pack_key_tiles(store.k_codes, store.k_scale, store.k_zero, bits=store.k_bits)
  v_codes, v_meta = pack_value_tiles(store.v_codes, store.v_scale, store.v_zero, bits=store.v_bits)
  return MmaStore(k_codes, k_meta, v_codes, v_meta, store.length, store.k_bits, store.v_bits, store.k_group,
                  store.v_group, store.valid, store.v_channel_scale)


def _tile_order(tokens, channels) -> np.ndarray:
  """The gather that puts a tile's registers [THREADS, R, 2] (flattened) in (token, channel) order: the inverse of
  the register map, a permutation of the tile's 64 D entries (a gather, where writing each register at its
  (token, channel) would be a scatter, which XLA runs far slower)."""
  head_dim = tokens.size // TILE
  order = np.empty(tokens.size, np.int32)
  order[(tokens * head_dim + channels).reshape(-1)] = np.arange(tokens.size)
  return order


def _halves(words):
  """uint32 words -> (low, high) fp16 halves as float32."""
  as_float = lambda h: jax.lax.bitcast_convert_type(h.astype(jnp.uint16), META_DTYPE).astype(jnp.float32)
  return as_float(words & 0xFFFF), as_float(words >> 16)


def read_key_tiles(words, meta, *, bits: int, group: int):
  """Inverse of ``pack_key_tiles``: tile words [..., n, W] and the meta words of their key groups [..., groups,
  D] (one group for tiles inside a group longer than n tiles) -> keys [..., 64 n, D] float32: c s + (z' + M s),
  what the kernel's fused multiply-add computes before it rounds to fp16."""
  *lead, count, _ = words.shape
  head_dim, tokens = meta.shape[-1], count * TILE
  kt, kc = key_register_map(head_dim)
  registers = _unpack_registers(words, bits, kt.shape[1]).reshape(*lead, count, -1)
  k = registers[..., _tile_order(kt, kc)].reshape(*lead, tokens, head_dim)
  pairs = _deinterleave_quads(meta).reshape(*meta.shape[:-1], 4, head_dim // 8, 2)
  (s0, s1), (z0, z1) = _halves(pairs[..., 0]), _halves(pairs[..., 1])  # [..., groups, 4, D/8]
  # channel 2q + 8j (+1) -> index [.., j, q, pair]
  per_channel = lambda a, b: jnp.stack([a, b], -1).swapaxes(-3, -2).reshape(*lead, -1, head_dim)
  scale = per_channel(s0, s1)
  zero = per_channel(z0, z1) + np.repeat(pair_magic(bits, head_dim // 8), 8) * scale
  return dequantize(k, scale, zero, axis=-2, group_size=min(group, tokens), dtype=jnp.float32)


def read_value_tiles(words, meta, *, bits: int, group: int):
  """Inverse of ``pack_value_tiles``: tile words [..., n, W] and meta [..., n, 64 D / Gv] -> values
  [..., 64 n, D] float32, as ``read_key_tiles`` computes them."""
  *lead, count, _ = words.shape
  channel_groups = meta.shape[-1] // 64
  head_dim, tokens = channel_groups * group, count * TILE
  vt, vc = value_register_map(head_dim)
  registers = _unpack_registers(words, bits, vt.shape[1]).reshape(*lead, count, -1)
  v = registers[..., _tile_order(vt, vc)].reshape(*lead, tokens, head_dim)
  pairs = _deinterleave_quads(meta.reshape(*lead, count, 4, 16 * channel_groups))  # [..., n, w, q, K]
  pairs = pairs.reshape(*lead, count, 4, 4, channel_groups, 2, 2)  # [..., n, w, q, groups, a, scale | z']
  (s0, s1), (z0, z1) = _halves(pairs[..., 0]), _halves(pairs[..., 1])
  # [..., n, w, q, groups, a] for tokens e = 0, 1 -> token 16 w + 8 a + 2 q + e: [..., 64 n, groups]
  per_token = lambda a, b: _last_axes(jnp.stack([a, b], -1), (0, 1, 4, 2, 5, 3)).reshape(*lead, tokens, -1)
  scale = per_token(s0, s1)
  magic = np.tile(np.repeat(pair_magic(bits, 2), 8), 4 * count)[:, None]  # token t: pair a = t % 16 // 8
  zero = per_token(z0, z1) + magic * scale
  return dequantize(v, scale, zero, axis=-1, group_size=group, dtype=jnp.float32)


def read_mma_tiles(mma: MmaStore, layer, start, count: int):
  """Tiles [start, start + count) of layer ``layer`` dequantized from the MMA packing: keys, values (times the
  value channel scale) [B, Hkv, 64 count, D] float32. ``layer`` and ``start`` may be traced; the tiles lie in
  one key group or cover whole ones. The plain-jnp reading of the packing: the check that ``pack_mma_store``
  kept every code, scale and zero-point, and the XLA path's way to read an MMA store."""
  def take(x, first, n):  # one dynamic slice of the stacked array: [B, H, n, W] at ``layer``
    return jax.lax.dynamic_slice(x, (layer, 0, 0, first, 0), (1, *x.shape[1:3], n, x.shape[4]))[0]

  groups = max(1, count * TILE // mma.k_group)
  keys = read_key_tiles(take(mma.k_codes, start, count), take(mma.k_meta, start * TILE // mma.k_group, groups),
                        bits=mma.k_bits, group=mma.k_group)
  values = read_value_tiles(take(mma.v_codes, start, count), take(mma.v_meta, start, count), bits=mma.v_bits,
                            group=mma.v_group)
  if mma.v_channel_scale is not None:
    values = values * mma.v_channel_scale[layer].astype(jnp.float32)[:, :, None, :]
  return keys, values


def read_mma_store(mma: MmaStore, layer):
  """Layer ``layer`` dequantized from the MMA packing: keys, values [B, Hkv, C, D] float32."""
  return read_mma_tiles(mma, layer, 0, mma.k_codes.shape[3])
