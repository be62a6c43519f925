"""Attention for the model and the methods: the implementation choice, masks, prompt attention, decode attention.

The implementation is chosen once, by ``choose_impl``, from the platform and the user's flag, and handed to
every method through the cache (``StepContext.impl``); nothing else looks at the device to decide.
"""


import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jkv_kernels import dequant_attention, mgpu_decode_attention
from jkv_kernels.dequant_attention import QuantizedStore  # re-exported for the methods
from jkv_kernels.mma_layout import TILE, MmaStore, read_mma_tiles
from jkv_kernels.attention_reference import MASK_VALUE, gqa_attention_reference
from jkv_kernels.quantization import dequantize, unpack
from jkv.token_mass import TokenMass

IMPL_CHOICES = ("auto", "pallas", "interpret", "xla")


def _gpu_capability() -> float:
  """The first device's CUDA compute capability (0 for a CPU or a device that reports none)."""
  device = jax.devices()[0]
  return float(getattr(device, "compute_capability", "0") or 0) if device.platform == "gpu" else 0.0


def pallas_gpu_available() -> bool:
  """A CUDA GPU of compute capability >= 8.0: the Pallas Triton kernels need it (a T4 is 7.5)."""
  return _gpu_capability() >= 8.0


def hopper_kernel_available() -> bool:
  """A Hopper GPU (compute capability 9.x: wgmma) and a jax with Mosaic GPU: where the tensor-core kernel over
  MMA-packed stores (``mgpu_decode_attention``) runs. Elsewhere an ``MmaStore`` is read by the XLA path."""
  return 9.0 <= _gpu_capability() < 10.0 and mgpu_decode_attention.available()


def hopper_kernel_takes(query_rows: int) -> bool:
  """The Hopper kernel runs here and takes ``query_rows`` (T * g) query rows per KV head (at most 16)."""
  return hopper_kernel_available() and query_rows <= mgpu_decode_attention.ROWS


def mma_left_open(method, impl: str, query_rows: int, check: Callable[[], None]):
  """``method`` (a dataclass with an ``mma`` field: keep its store in the MMA packing) with ``mma`` decided where
  it is left open (None): on exactly where the Hopper kernel would read the store (impl "pallas" on a Hopper
  GPU that takes ``query_rows`` query rows per KV head) and ``check()``, the method's one-line errors for what the
  packing does not take, raises nothing."""
  if method.mma is not None:
    return method
  fits = impl == "pallas" and hopper_kernel_takes(query_rows)
  if fits:
    try:
      check()
    except ValueError:
      fits = False
  return dataclasses.replace(method, mma=fits)


def choose_impl(requested: str = "auto") -> str:
  """The attention implementation for this process: ``"pallas"`` on a GPU that runs the Pallas kernels,
  ``"xla"`` elsewhere; ``requested`` other than "auto" forces one (``"interpret"`` runs the kernels in Pallas
  interpret mode, for tests). Asking for ``"pallas"`` where it cannot run is a one-line error."""
  if requested not in IMPL_CHOICES:
    raise ValueError(f"unknown attention implementation {requested!r}; choose one of {', '.join(IMPL_CHOICES)}")
  if requested == "auto":
    return "pallas" if pallas_gpu_available() else "xla"
  if requested == "pallas" and not pallas_gpu_available():
    raise ValueError("the Pallas kernels need a CUDA GPU of compute capability >= 8.0; use --attention-impl xla "
                     "(or interpret, for testing on a CPU)")
  return requested


# ------------------------------------------------------------------------------------------------- masks

def prompt_mask(positions):
  """[B, T, T] causal mask among prompt tokens; padding (position < 0) is never a key."""
  valid = positions >= 0
  causal = jnp.tril(jnp.ones((positions.shape[1],) * 2, bool))
  return causal[None] & valid[:, None, :]


def causal_mask(q_positions, num_keys):
  """[B, T, S] bool: key slot s is visible to query row t iff s <= q_positions[b, t]."""
  return jnp.arange(num_keys)[None, None, :] <= q_positions[:, :, None]


# ------------------------------------------------------------------------------------------------- prefill

def prompt_attention(q, k, v, positions, *, flash: bool):
  """Causal attention of a right-padded prompt (exact for every method: the cache stores what it keeps after).

  Args:
    q: [B, H, T, g, D]; k, v: [B, H, T, D]; positions: [B, T] int32, -1 for padding.
    flash: use cuDNN's flash attention (GPU, 16-bit dtypes); otherwise the fp32 jnp reference.

  Returns:
    [B, H, T, g, D] in q.dtype (rows of padding tokens are unspecified).

  Under a device mesh (``jkv.sharding.use_mesh``) it runs per shard of sequences and KV heads: cuDNN's kernel,
  like every kernel, on local shapes. With ``flash``, over a ``seq`` axis whose size divides T, each device
  computes its range's rows (``jkv.context_parallel.prompt_attention_by_ranges``); without, every device all of
  them, which keeps the reference's rounding (one device's, to the bit, where tests compare the two).
  """
  from jkv import sharding  # here: jkv.sharding imports the cache module, which the methods importing this need
  mesh = sharding.current_mesh()
  if mesh is not None and sharding.splits(mesh, q.shape[0], q.shape[1]):
    n = sharding.axis_size(mesh, sharding.SEQ_AXIS)
    if flash and n > 1 and q.shape[2] % n == 0:
      from jkv.context_parallel import prompt_attention_by_ranges  # it imports this module
      return prompt_attention_by_ranges(q, k, v, positions, mesh, impl="pallas")
    heads = sharding.P("data", "model")
    run = sharding.shard_map(functools.partial(_prompt_attention, flash=flash), mesh=mesh,
                             in_specs=(heads, heads, heads, sharding.P("data")), out_specs=heads)
    return run(q, k, v, positions)
  return _prompt_attention(q, k, v, positions, flash=flash)


def _prompt_attention(q, k, v, positions, *, flash: bool):
  if not (flash and q.dtype in (jnp.bfloat16, jnp.float16)):
    return gqa_attention_reference(q, k, v, prompt_mask(positions))
  B, H, T, g, D = q.shape
  # No lengths: a prompt's padding follows its tokens, so a real row's causal keys are all real, and cuDNN's padding
  # mask costs (benchmarks/attention_core.py). XLA's version materializes [B, heads, T, T] logits: 32 GiB at 8k
  # tokens, B=8. The keys and values go in the cache's [batch, heads, tokens, dim] layout: handed over tokens first
  # (``jax.nn.dot_product_attention``'s only layout), they made XLA lay the whole stacked cache out tokens first
  # inside the layer loop, a transposed copy of it in and out of every prefill call (26 GiB of dense's keys at 430k
  # tokens), to spare one layer's transpose of the prompt's rows.
  o, _ = cudnn_attention(q.transpose(0, 1, 3, 2, 4).reshape(B, H * g, T, D), k, v, causal=True)
  return o.reshape(B, H, g, T, D).transpose(0, 1, 3, 2, 4)


def cudnn_attention(q, k, v, *, causal: bool, kv_lengths=None):
  """cuDNN's flash attention in the [batch, heads, tokens, dim] layout with its log-sum-exp in fp32.

  q [B, N, T, D], k and v [B, K, S, D] (N a multiple of K; 16-bit); kv_lengths [B] int32 or None (every key
  row): keys past a sequence's length are not keys (cuDNN's padding mask, which skips them but costs on the rest:
  ``held_attention``). Returns o [B, N, T, D] in q.dtype and the natural log-sum-exp of each row's scaled logits
  [B, N, T] float32. ``jax.nn.dot_product_attention`` rounds that log-sum-exp to the output dtype (bf16 is 0.125
  apart near 20: a merge weight off by up to 6%) and takes only the [batch, tokens, heads, dim] layout (a transpose
  of every held row), so this calls the function it wraps."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # the wrapped function; no public form keeps fp32
  if kv_lengths is None:
    mask, lengths = (cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK), (None, None)
  else:
    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    lengths = (jnp.full(q.shape[:1], q.shape[2], jnp.int32), kv_lengths)
  o, lse = cudnn.dot_product_attention(q, k, v, None, None, *lengths, scale=q.shape[-1] ** -0.5,
                                       mask_type=mask, qkv_layout="BNTH", return_residual=True)
  return o, lse.astype(jnp.float32).reshape(q.shape[:3])


# ------------------------------------------------------------------------------------------------- decode

def block_size(length: int, largest: int = 512) -> int:
  """The largest power of two <= ``largest`` that divides ``length``."""
  return min(largest, length & -length)


def blockwise_partials(q, load, valid, num_keys, n_blocks: int, block: int, *, sm_scale=None):
  """Online-softmax partials of q over keys read ``block`` at a time (plain XLA, nothing larger materialized).

  Args:
    q: [B, H, T, g, D].
    load: start -> (k, v), each [B, H, block, D] float32: keys [start, start + block).
    valid: start -> [B, H or 1, T, block] bool: which of those keys each row may attend.
    num_keys: optional traced bound: blocks at and past it are never visited.
    n_blocks: blocks in the segment.

  Returns:
    (o [B, H, T, g, D] f32 unnormalized, m [B, H, T, g] running max, l [B, H, T, g] running sum).
  """
  B, H, T, g, D = q.shape
  sm_scale = D**-0.5 if sm_scale is None else sm_scale
  qf = q.astype(jnp.float32) * sm_scale

  def body(i, carry):
    o, m, l = carry
    kb, vb = load(i * block)
    ok = valid(i * block)[:, :, :, None, :]  # [B, H|1, T, 1, n]
    s = jnp.einsum("bhtgd,bhsd->bhtgs", qf, kb, precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(ok, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
    # Slots no row may see can hold anything, NaN included: 0 * NaN would leak through the dot.
    vb = jnp.where(jnp.any(ok, axis=(2, 3))[..., None], vb, 0.0)
    o = o * alpha[..., None] + jnp.einsum("bhtgs,bhsd->bhtgd", p, vb, precision=jax.lax.Precision.HIGHEST)
    return o, m_new, l * alpha + jnp.sum(p, axis=-1)

  init = (jnp.zeros((B, H, T, g, D), jnp.float32), jnp.full((B, H, T, g), MASK_VALUE, jnp.float32),
          jnp.zeros((B, H, T, g), jnp.float32))
  if num_keys is not None:
    n_blocks = jnp.minimum(-(-num_keys // block), n_blocks)
  return jax.lax.fori_loop(0, n_blocks, body, init)


@dataclasses.dataclass(frozen=True)
class _Source:
  """One source of keys for the XLA path, read ``block`` tokens at a time.

  load: start -> (k, v), each [B, H, block, D] float32; valid: start -> [B, H or 1, T, block] bool;
  bound: optional traced bound on the keys that can be valid (blocks past it are never visited).
  """
  load: Callable
  valid: Callable
  length: int
  block: int
  bound: Optional[jax.Array] = None

  @property
  def n_blocks(self) -> int:
    return self.length // self.block


def _segment_source(layer, k, v, mask, bound) -> _Source:
  """One full-precision segment: k, v [L, B, H, S, D] read at ``layer``, or [B, H, S, D]; mask [B, T, S] or
  [B, H, T, S]."""
  S = k.shape[-2]
  block = block_size(S)
  mask = mask if mask.ndim == 4 else mask[:, None]
  if k.ndim == 4:
    k, v, layer = k[None], v[None], 0

  def load(start):
    return (_layer_block(k, layer, 2, start, block).astype(jnp.float32),
            _layer_block(v, layer, 2, start, block).astype(jnp.float32))

  valid = lambda start: jax.lax.dynamic_slice_in_dim(mask, start, block, axis=3)
  return _Source(load, valid, S, block, bound)


def _layer_block(x, layer, axis: int, start, size: int):
  """x [L, B, H, r, c] -> [B, H, ...] at ``layer`` with ``axis`` (of the result) cut to [start, start + size),
  in one dynamic_slice of the stacked array (no layer-sized intermediate)."""
  index = [layer, 0, 0, 0, 0]
  sizes = list(x.shape)
  sizes[0] = 1
  index[axis + 1] = start
  sizes[axis + 1] = size
  return jax.lax.dynamic_slice(x, index, sizes)[0]


def _store_source(layer, store: QuantizedStore) -> _Source:
  """A quantized store, dequantized a block at a time from the stacked arrays (blocks cover whole key groups)."""
  C = store.capacity
  Gk, pk = store.k_group, 32 // store.k_bits
  block = Gk * max(1, block_size(C // Gk, largest=max(1, 512 // Gk)))

  def load(start):
    groups = lambda x: _layer_block(x, layer, 3, start // Gk, block // Gk)
    kc = unpack(_layer_block(store.k_codes, layer, 3, start // pk, block // pk), bits=store.k_bits, axis=3)
    k = dequantize(kc, groups(store.k_scale), groups(store.k_zero), axis=3, group_size=Gk, dtype=jnp.float32)
    rows = lambda x: _layer_block(x, layer, 2, start, block)
    vc = unpack(rows(store.v_codes), bits=store.v_bits, axis=3)
    v = dequantize(vc, rows(store.v_scale), rows(store.v_zero), axis=3, group_size=store.v_group,
                   dtype=jnp.float32)
    if store.v_channel_scale is not None:
      v = v * store.v_channel_scale[layer].astype(jnp.float32)[:, :, None, :]
    return jnp.swapaxes(k, 2, 3), v

  valid = lambda start: store.slot_mask(layer, start, block)[:, :, None, :]
  return _Source(load, valid, C, block, jnp.max(store.length))


def _mma_store_source(layer, store: MmaStore) -> _Source:
  """An MMA-packed store, dequantized a block of whole tiles (and whole key groups) at a time; slots at and past
  ``store.length`` and holes are not keys."""
  unit = max(TILE, store.k_group)
  block = unit * block_size(store.capacity // unit, largest=max(1, 512 // unit))
  load = lambda start: read_mma_tiles(store, layer, start // TILE, block // TILE)
  valid = lambda start: store.slot_mask(layer, start, block)[:, :, None, :]
  return _Source(load, valid, store.capacity, block, jnp.max(store.length))


def read_store(store, layer, dtype):
  """Every slot of a store (``QuantizedStore`` or ``MmaStore``) at ``layer``, dequantized: keys, values
  [B, H, C, D] in ``dtype``; slots past its length and holes included (the caller masks them)."""
  if isinstance(store, MmaStore):
    k, v = read_mma_tiles(store, layer, 0, store.capacity // TILE)
    return k.astype(dtype), v.astype(dtype)
  k, v, _ = store.read_layer(layer, dtype)
  return k, v


def normalized_partial(o, lse):
  """(o, lse) of one pass -> an (o, m, l) partial for ``merge_partials`` (l = 0 for a row with no key)."""
  return o.astype(jnp.float32), lse, jnp.where(lse == MASK_VALUE, 0.0, 1.0)


def _partials(q, source: _Source):
  return blockwise_partials(q, source.load, source.valid, source.bound, source.n_blocks, source.block)


def _token_mass(q, source: _Source, lse, rows, *, matmul: bool = True):
  """[B, H, R, S]: the probability each key of ``source`` receives from query rows ``rows``, summed over the g
  query heads of its KV head. A second pass over the source (the fused kernel gets it from its one pass).
  ``matmul=False``: the logits as products summed elementwise, which XLA fuses with the rest into one small
  kernel (a segment of a few rows on the GPU, where a matrix product of that size is a launch of several µs)."""
  B, H, T, g, D = q.shape
  qf = q[:, :, rows].astype(jnp.float32) * D**-0.5  # [B, H, R, g, D]
  lse_rows = lse[:, :, rows]  # [B, H, R, g]

  def body(i, mass):
    start = i * source.block
    kb, _ = source.load(start)
    ok = source.valid(start)
    ok = jnp.broadcast_to(ok, (B, H, T, source.block))[:, :, rows][:, :, :, None, :]
    if matmul:
      s = jnp.einsum("bhtgd,bhsd->bhtgs", qf, kb, precision=jax.lax.Precision.HIGHEST)
    else:
      s = jnp.sum(qf[:, :, :, :, None, :] * kb[:, :, None, None], axis=-1)
    p = jnp.where(ok, jnp.exp(s - lse_rows[..., None]), 0.0)
    return jax.lax.dynamic_update_slice_in_dim(mass, jnp.sum(p, axis=3), start, axis=3)

  mass = jnp.zeros((B, H, len(rows), source.length), jnp.float32)
  return jax.lax.fori_loop(0, source.n_blocks, body, mass)


def merge_partials(partials):
  """Exact softmax merge of (o, m, l) partials -> (o [B, H, T, g, D] f32 normalized, lse [B, H, T, g]).

  A row with no valid key anywhere gets o = 0 and lse = MASK_VALUE."""
  m_all = partials[0][1]
  for _, m, _ in partials[1:]:
    m_all = jnp.maximum(m_all, m)
  o_all = jnp.zeros_like(partials[0][0])
  l_all = jnp.zeros_like(m_all)
  for o, m, l in partials:
    alpha = jnp.exp(m - m_all)
    o_all = o_all + alpha[..., None] * o
    l_all = l_all + alpha * l
  empty = l_all == 0
  o = o_all / jnp.where(empty, 1.0, l_all)[..., None]
  return o, jnp.where(empty, MASK_VALUE, m_all + jnp.log(jnp.where(empty, 1.0, l_all)))


def _joined_segments(layer, segments):
  """Segments the Hopper kernel can read, joined into one of this layer's [B, H, S1 + S2 + ..., D] (per-head masks)
  where there are several of one type (OTT's buffer and pools; SpeCache's window, fetched rows and own rows): one
  copy of their few rows, so that the kernel reads them all in its softmax instead of a second kernel reading the
  rest (OTT at its defaults, B = 8, L = 32768, H100: benchmarks/README.md). The others follow, in their order.

  Returns (segments, parts): parts[j] lists the (original index, first slot, slots) of the segments in segments[j]
  (one whole segment where nothing was joined), so that a mass over segments[j] is cut back into theirs."""
  size = lambda i: segments[i][0].shape[-2]
  unjoined = segments, tuple(((i, 0, size(i)),) for i in range(len(segments)))
  readable = [i for i, seg in enumerate(segments) if mgpu_decode_attention.reads_segment(seg[0], seg[1])]
  if len(readable) < 2 or len({segments[i][0].dtype for i in readable}) > 1:
    return unjoined
  at_layer = lambda x: x[layer] if x.ndim == 5 else x
  batch, heads = at_layer(segments[readable[0]][0]).shape[:2]
  per_head = lambda mask: jnp.broadcast_to(mask if mask.ndim == 4 else mask[:, None],
                                           (batch, heads) + mask.shape[-2:])
  joined = tuple(jnp.concatenate([f(segments[j][i]) for j in readable], axis=-2 if i < 2 else -1)
                 for i, f in enumerate((at_layer, at_layer, per_head)))
  if not mgpu_decode_attention.reads_segment(joined[0], joined[1]):
    return unjoined
  starts = [sum(size(j) for j in readable[:n]) for n in range(len(readable))]
  others = [i for i in range(len(segments)) if i not in readable]
  parts = (tuple((j, start, size(j)) for j, start in zip(readable, starts)),)
  return (joined,) + tuple(segments[i] for i in others), parts + tuple(((i, 0, size(i)),) for i in others)


def _summed_mass(layer, stores, masses):
  """``TokenMass`` of stores whose mass [B, H, R, C] is summed over the query heads already."""
  return tuple(TokenMass.summed(mass, store.slot_mask(layer)) for store, mass in zip(stores, masses))


def _kernel_segment_mass(mask, rows, probabilities):
  """[B, H, R, S]: a segment's token mass from the probabilities [B, H, R, g, S] of its slot weights, which are
  unspecified where its mask [B, T, S] or [B, H, T, S] hides a token from a row."""
  shown = (mask[:, None] if mask.ndim == 3 else mask)[:, :, rows][:, :, :, None, :]
  return jnp.sum(jnp.where(shown, probabilities, 0.0), axis=3)


def _hopper_decode_attention(q, layer, mma_stores, stores, segments, return_lse, rows, store_mass):
  """``decode_attention`` on a Hopper GPU: the tensor-core kernel over the MMA-packed stores (all in one launch, or
  one a launch where their slot weights are asked), with the longest segment it reads in place (KIVI's window;
  OTT's buffer and pools, SpeCache's window, fetched rows and own rows, joined: ``_joined_segments``); the rest
  through the Triton kernel, one softmax merged exactly. Token mass: the stores' and the kernel's segment's from
  the slot weights the kernel writes out (of the mass rows alone, where the kernel can:
  ``mgpu_decode_attention.logit_columns``; a joined segment's cut back into its segments'), the other segments'
  from a second pass over them in XLA (they are a few rows), each against the merged lse. Joining SpeCache's
  three segments took a layer of its B = 1, 128k step from 56 kernels to 48 compiled for an H100
  (``benchmarks/deviceless_step.py``): the Triton kernel, its merge and the second pass gone."""
  all_segments = segments
  segments, parts = _joined_segments(layer, segments)
  readable = [i for i, (k, v, _) in enumerate(segments) if mgpu_decode_attention.reads_segment(k, v)]
  fused = max(readable, key=lambda i: segments[i][0].shape[-2], default=None)  # the most tokens in the kernel
  segment = segments[fused] if fused is not None else None
  if rows and store_mass:  # the slot weights come from one store per launch
    partials = [mgpu_decode_attention.mgpu_decode_partial(q, layer, store, segment=segment if i == 0 else None,
                                                          logit_rows=rows) for i, store in enumerate(mma_stores)]
  else:  # every store in one launch (ZipCache's pools)
    partials = [mgpu_decode_attention.mgpu_decode_partial(q, layer, mma_stores, segment=segment)]
  weights = [part[3] for part in partials] if rows and store_mass else []
  segment_weights = partials[0][4] if rows and store_mass and segment is not None else None
  partials = [part[:3] for part in partials]
  rest = tuple(segment for i, segment in enumerate(segments) if i != fused)
  if stores or rest:
    partials.append(normalized_partial(*dequant_attention.decode_attention(q, layer, stores, rest,
                                                                            return_lse=True)))
  o, lse = merge_partials(partials)
  out = (o.astype(q.dtype),) + ((lse,) if return_lse else ())
  if rows:
    lse_rows = lse[:, :, rows]  # [B, H, R, g]
    of_stores = tuple(TokenMass(p, jnp.exp(m - lse_rows[:, :, None]), store.slot_mask(layer))
                      for store, (p, m) in zip(mma_stores, weights))
    kernel_mass = None if segment_weights is None else _kernel_segment_mass(
        segment[2], rows, mgpu_decode_attention.slot_probabilities(segment_weights, lse_rows))
    of_segments = [None] * len(all_segments)
    for j, members in enumerate(parts):
      for i, start, size in members:
        k, v, mask = all_segments[i]
        of_segments[i] = (kernel_mass[..., start:start + size] if j == fused and kernel_mass is not None
                          else _token_mass(q, _segment_source(layer, k, v, mask, None), lse, rows, matmul=False))
    of_segments = tuple(of_segments)
    out += ((of_stores, of_segments),)
  return out if len(out) > 1 else out[0]


def decode_attention(q, layer, *, stores=(), segments=(), impl: str, num_keys=None, return_lse: bool = False,
                     token_mass_rows: tuple = (), store_mass: bool = True):
  """Attention of q [B, H, T, g, D] over quantized stores and full-precision segments, one softmax.

  Args:
    q: [B, H, T, g, D].
    layer: int32 scalar: the layer read from stacked arrays (every cache array has a leading layer axis).
    stores: ``QuantizedStore``s (KIVI layout, stacked, each with its own widths, groupings, holes and value
      channel scale; ``jkv_kernels.dequant_attention``) and ``MmaStore``s (the MMA-ready packing of
      ``jkv_kernels.mma_layout``, holes and channel scale too: read by the Hopper tensor-core kernel with impl
      "pallas" on a Hopper GPU, with the longest segment it reads in place (``mgpu_decode_attention.reads_segment``;
      several such segments joined into one where no token mass is asked) in the same softmax; by the XLA path
      everywhere else). Token mass takes one kind of store at a time.
    segments: ((k, v, mask), ...): k, v [L, B, H, S, D] stacked (read at ``layer``) or [B, H, S, D] per step;
      mask [B, T, S] or [B, H, T, S] bool.
    impl: "pallas" or "interpret" (the fused kernel, which reads the stacked arrays in place) or "xla"
      (a block-by-block online softmax in XLA: nothing larger than a block is materialized).
    num_keys: optional traced bound on the keys of the first segment that can be valid (the XLA loop stops
      there; the kernel finds its bounds from the masks).
    return_lse: also return the log-sum-exp [B, H, T, g] f32 of every row (MASK_VALUE for a row with no key).
    token_mass_rows: static query rows t: also return the probability each key receives from row t, summed over
      the g query heads of its KV head (ZipCache's probes, SpeCache's speculative top-k).
    store_mass: with ``token_mass_rows``, the stores' mass too; False: the segments' alone (ZipCache's probes
      score the window), and neither kernel writes the stores' logits out.

  Returns:
    o [B, H, T, g, D] in q.dtype (0 for a row with no valid key), then lse with ``return_lse``, then with
    ``token_mass_rows`` mass = ((per store a ``jkv.token_mass.TokenMass``: [B, H, R, C] by its ``dense()``), (per
    segment [B, H, R, S])), R = len(token_mass_rows), the first () without ``store_mass``.
  """
  stores, segments, rows = tuple(stores), tuple(segments), tuple(token_mass_rows)
  mma_stores = tuple(store for store in stores if isinstance(store, MmaStore))
  stores = tuple(store for store in stores if not isinstance(store, MmaStore))
  if mma_stores and stores and rows:
    raise ValueError("token mass is read from MMA-packed stores or from library-layout ones, not both at once")
  if mma_stores and impl == "pallas" and hopper_kernel_takes(q.shape[2] * q.shape[3]):
    return _hopper_decode_attention(q, layer, mma_stores, stores, segments, return_lse, rows, store_mass)
  if impl != "xla" and not mma_stores:
    out = dequant_attention.decode_attention(q, layer, stores, segments, return_lse=return_lse,
                                             token_mass_rows=rows, store_mass=store_mass,
                                             interpret=impl == "interpret")
    if not rows:
      return out
    of_stores, of_segments = out[-1]
    return out[:-1] + ((_summed_mass(layer, stores, of_stores), of_segments),)
  store_sources = [_mma_store_source(layer, store) for store in mma_stores]
  store_sources += [_store_source(layer, store) for store in stores]
  segment_sources = [_segment_source(layer, k, v, mask, num_keys if i == 0 else None)
                     for i, (k, v, mask) in enumerate(segments)]
  o, lse = merge_partials([_partials(q, source) for source in store_sources + segment_sources])
  out = (o.astype(q.dtype),) + ((lse,) if return_lse else ())
  if rows:
    of_stores = tuple(_token_mass(q, s, lse, rows) for s in store_sources) if store_mass else ()
    out += ((_summed_mass(layer, mma_stores + stores, of_stores),
             tuple(_token_mass(q, s, lse, rows) for s in segment_sources)),)
  return out if len(out) > 1 else out[0]
