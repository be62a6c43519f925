"""Per-sequence reads and writes of stacked cache arrays [L, B, ...] at one layer."""

import math

import jax
import jax.numpy as jnp

from jkv_kernels.mma_layout import TILE, merge_into_tiles


def write_at(buf, layer, x, start, axis):
  """Write x [B, ...] into buf [L, B, ...] at ``layer``, at per-sequence offsets start [B] along ``axis``.

  ``axis`` indexes x (batch first); every other axis is written from 0. Measured both ways: on a GPU one
  scatter (a vmapped ``dynamic_update_slice``) is fastest, where B separate updates per write made a KIVI-2
  decode step 3x slower (Llama-3-8B shape, B=8); on CPU XLA copies the whole buffer for that scatter, and one
  in-place ``dynamic_update_slice`` per sequence made dense decoding 7x faster. One sequence is one update
  everywhere: a scatter of one sequence's prompt chunk (16k rows) made XLA on an H200 transpose the whole stacked
  dense cache for it (23 GiB at 378k tokens).
  """
  if jax.default_backend() != "cpu" and x.shape[0] > 1:
    def one(b_buf, b_x, b_start):  # b_buf [L, ...], b_x [...]
      idx = [0] * b_x.ndim
      idx[axis - 1] = b_start
      return jax.lax.dynamic_update_slice(b_buf, b_x[None].astype(b_buf.dtype), [layer] + idx)
    return jax.vmap(one, in_axes=(1, 0, 0), out_axes=1)(buf, x, start)
  for b in range(x.shape[0]):
    idx = [layer, b] + [0] * (x.ndim - 1)
    idx[axis + 1] = start[b]
    buf = jax.lax.dynamic_update_slice(buf, x[b][None, None].astype(buf.dtype), idx)
  return buf


def write_span(buf, layer, x, start, axis):
  """``write_at`` of a span that may reach outside buf: the entries of x whose index along ``axis`` (start [B] + i)
  lies outside buf's are dropped, not moved inside over what buf holds (a device of ``seq`` keeps the rows of its
  range: ``jkv.context_parallel``). One scatter."""
  B, size = x.shape[0], buf.shape[axis + 1]
  index = start[:, None] + jnp.arange(x.shape[axis])[None]  # [B, M]
  index = jnp.where((index >= 0) & (index < size), index, size)  # a negative one would wrap around
  # The advanced indices (sequence, index) stand apart from the sliced axes, so they lead the updates: [B, M, ...].
  at = (layer, jnp.arange(B)[:, None]) + (slice(None),) * (axis - 1) + (index,)
  return buf.at[at].set(jnp.moveaxis(x, axis, 1).astype(buf.dtype), mode="drop")


def write_positions(buf, layer, x, start, unit: int, axis: int, due=None, first_slot=None):
  """``write_at_where`` of store rows from position start [B] (a multiple of ``unit``, the positions one index of
  ``axis`` spans); with ``first_slot``, into a store of the positions from it on (a device's range of ``seq``:
  ``jkv.context_parallel``), rows outside it and sequences not ``due`` dropped."""
  if first_slot is None:
    return write_at_where(buf, layer, x, start // unit, axis, due)
  offset = (start - first_slot) // unit
  if due is not None:
    offset = jnp.where(due, offset, buf.shape[axis + 1])
  return write_span(buf, layer, x, offset, axis)


def write_at_where(buf, layer, x, start, axis, where=None):
  """``write_at`` for the sequences where ``where`` [B] (all of them when None); the others keep what they had."""
  if where is not None:
    old = read_at(buf, layer, start, x.shape[axis], axis=axis)
    x = jnp.where(where.reshape((-1,) + (1,) * (x.ndim - 1)), x, old)
  return write_at(buf, layer, x, start, axis=axis)


def read_at(buf, layer, start, size, axis):
  """Per-sequence slices of ``size`` from buf [L, B, ...] at ``layer``, from start [B] along ``axis`` (as in
  ``write_at``); returns [B, ...].

  The layer is sliced first and the sequences mapped over its leading axis: mapped over axis 1 of the stacked
  buffer, XLA (on the CPU, seen in the compiled decode step) copied the whole buffer, every layer, into a
  batch-major layout for each read."""
  def one(b_buf, b_start):  # b_buf [...] of one sequence at the layer
    idx = [0] * b_buf.ndim
    sizes = list(b_buf.shape)
    idx[axis - 1] = b_start
    sizes[axis - 1] = size
    return jax.lax.dynamic_slice(b_buf, idx, sizes)
  return jax.vmap(one)(jax.lax.dynamic_index_in_dim(buf, layer, axis=0, keepdims=False), start)


def write_layer(buf, layer, x):
  """Write a whole layer x [B, ...] (from index 0 on every axis) into buf [L, B, ...] in place."""
  return jax.lax.dynamic_update_slice(buf, x[None].astype(buf.dtype), (layer,) + (0,) * x.ndim)


def write_mma_tokens(tiles, layer, keys, values, start, *, k_bits: int, v_bits: int, k_group: int, due=None,
                     first_slot=None):
  """Quantized tokens into a store in the MMA packing at one layer: M tokens per sequence from start [B] (a
  multiple of ``k_group``, which with M is a multiple of 16), merged into the tiles that hold them
  (``mma_layout.merge_into_tiles``); with ``due`` [B], only those sequences change; with ``first_slot`` (a
  multiple of 64), into a store of the positions from it on (``write_positions``), tiles outside it dropped.

  Args:
    tiles: (k_tiles, k_meta, v_tiles, v_meta) stacked [L, B, H, ...] (``MmaStore``'s arrays).
    keys, values: the M tokens in the library's layout (``quantize_pack``): keys (codes [B, H, D, M / Pk], scale,
      zero [B, H, D, M / k_group]), values (codes [B, H, M, D / Pv], scale, zero [B, H, M, D / Gv]).
  Returns:
    the four arrays written. The tokens lie in ``span`` tiles read and written whole, from the tile of start
    (or earlier, where that would run past the store: start + M never does; with ``first_slot`` the tiles past
    the store are dropped instead), whatever start's place in its tile.
  """
  k_tiles, k_meta, v_tiles, v_meta = tiles
  tokens, n_tiles = values[0].shape[2], k_tiles.shape[3]
  span = -(-(tokens + TILE - math.gcd(k_group, TILE)) // TILE)
  if first_slot is None:
    span = min(n_tiles, span)
    first = jnp.minimum(start // TILE, n_tiles - span)
    read = lambda buf: read_at(buf, layer, first, span, axis=2)
    first_tile = TILE * first  # the position of the first tile read
  else:  # a tile outside the range is read clamped (whatever it merges is dropped)
    first = (start - first_slot) // TILE
    index = jnp.clip(first[:, None] + jnp.arange(span), 0, n_tiles - 1)[:, None, :, None]  # [B, 1, span, 1]
    read = lambda buf: jnp.take_along_axis(buf[layer], index, axis=2)
    first_tile = first_slot + TILE * first
  k_words, k_new_meta, v_words, v_new_meta = merge_into_tiles(
      read(k_tiles), read(v_tiles), read(v_meta), keys, values, start - first_tile, k_bits=k_bits, v_bits=v_bits)
  put = lambda buf, new, at, unit: write_positions(buf, layer, new, at, unit, 2, due, first_slot)
  return (put(k_tiles, k_words, first_tile, TILE), put(k_meta, k_new_meta, start, k_group),
          put(v_tiles, v_words, first_tile, TILE), put(v_meta, v_new_meta, first_tile, TILE))
