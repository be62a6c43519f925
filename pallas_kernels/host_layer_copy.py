"""One layer of a stacked, possibly host-resident array moved to the device (Pallas, Triton lowering).

    kv       [L, B, H, C, W]  any memory kind (``pinned_host`` where this kernel earns its place)
    layer    int32            the layer to copy (clipped to [0, L))
    lengths  [B] int32        rows of each sequence to read
    out      [B, H, C, W]     on the device: layer ``layer`` of kv; row blocks that start at or past a sequence's
                              length are zeros, never read

Why a kernel: on a GPU, XLA runs a slice of a ``pinned_host`` array as host compute, and numpy can only read one in
place (a view the array then cannot donate while it lives). A Pallas program reads the pinned pages directly over
the bus, as SpeCache's row gather does, so a layer reaches the device with one read of its held rows. Users:
SpeCache's exact prefill chunks (the held rows of the host copy) and ``jkv.saved_cache`` (a host copy saved layer
by layer, with no whole host-side copy).
"""

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from jkv_kernels.dequant_attention import triton_compiler_params


def _copy_layer_kernel(
    layer_ref,    # [1] int32: the layer to copy
    length_ref,   # [1] int32: rows held by this sequence
    kv_ref,       # [L, C, W]: every layer of this (b, h); one block of one layer's rows is read
    out_ref,      # [rows, W]
):
  rows = out_ref.shape[0]
  start = pl.program_id(2) * rows

  @pl.when(start < length_ref[0])
  def _():
    out_ref[...] = kv_ref[layer_ref[0], pl.ds(start, rows), :]

  @pl.when(start >= length_ref[0])
  def _():  # no read: the empty rows of a held buffer are zeros anyway
    out_ref[...] = jnp.zeros_like(out_ref)


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def copy_layer(kv, layer, lengths, block_rows: int = 64, interpret: bool = False):
  """Layer ``layer`` of kv [L, B, H, C, W] -> [B, H, C, W] on the device (layouts above). Blocks of ``block_rows``
  rows (halved until they divide C), grid (B, H, C / rows); a block that starts below a length is read whole."""
  L, B, H, C, W = kv.shape
  rows = block_rows
  while C % rows:
    rows //= 2
  return pl.pallas_call(
      _copy_layer_kernel,
      grid=(B, H, C // rows),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, j: (0,)),                                  # layer
          pl.BlockSpec((1,), lambda b, h, j: (b,)),                                  # lengths
          pl.BlockSpec((L, None, None, C, W), lambda b, h, j: (0, b, h, 0, 0)),      # kv
      ],
      out_specs=pl.BlockSpec((None, None, rows, W), lambda b, h, j: (b, h, j, 0)),
      out_shape=jax.ShapeDtypeStruct((B, H, C, W), kv.dtype),
      compiler_params=triton_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name=f"copy_layer_{rows=}_{W=}",
  )(jnp.clip(jnp.asarray(layer, jnp.int32), 0, L - 1).reshape(1), jnp.asarray(lengths, jnp.int32), kv)


def copy_layer_reference(kv, layer, lengths, block_rows: int = 64):
  """``copy_layer`` in plain jnp: the layer with every row block that starts at or past a length zeroed."""
  L, B, H, C, W = kv.shape
  rows = block_rows
  while C % rows:
    rows //= 2
  read = jnp.arange(C)[None, :] < -(-jnp.asarray(lengths)[:, None] // rows) * rows  # [B, C]
  return jnp.where(read[:, None, :, None], kv[jnp.clip(layer, 0, L - 1)], 0)
