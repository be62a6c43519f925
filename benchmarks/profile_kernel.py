"""Run the fused decode kernel a few times on one shape, for a profiler to look at (e.g. Nsight Compute).

    ncu --kernel-name regex:decode_attention_rows --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/profile_kernel.py --batch 8 --seq-len 32768 --bits 2
    python benchmarks/profile_kernel.py --layout zipcache_pools   # a layout of kernel_decode.py's LAYOUTS
    ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --set full \
        python benchmarks/profile_kernel.py --mgpu                 # the Mosaic GPU kernel (mgpu_decode.py's inputs)
    python benchmarks/profile_kernel.py --mgpu --window --batch 256 --seq-len 4608   # with KIVI's window

It uses the inputs and defaults of kernel_decode.py, so what the profiler sees is what that table timed: a
QuantizedStore of L - 128 tokens plus a 128-token residual segment, stacked over one layer, read at layer 0 (or,
with ``--layout``, that method's stores and segments). The kernel's name carries each store's widths,
groupings, holes and channel scale (``_holes``, ``_cscale``) and the tunables; for the defaults it is

    decode_attention_rows16_store_2x2bit_G32_bk64_ks16_seg128_bs64_ss2_num_warps=4_num_stages=1
"""

import argparse

import jax

from jkv_kernels.mgpu_decode_attention import STAGES, mgpu_decode_attention
from kernel_decode import LAYOUTS, Shape, fused, kivi_inputs, layout_config, layout_inputs
from mgpu_decode import timing_inputs as mgpu_inputs, window_inputs


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=32768)
  parser.add_argument("--bits", type=int, default=2)
  parser.add_argument("--layout", choices=sorted(LAYOUTS), help="a method's layout instead of the KIVI store")
  parser.add_argument("--mgpu", action="store_true",
                      help="the Mosaic GPU kernel on one packed store of L tokens (mgpu_decode.py's timing inputs)")
  parser.add_argument("--window", action="store_true",
                      help="with --mgpu: KIVI's whole call, the store and a window of 129 exact tokens in one kernel")
  parser.add_argument("--step-tiles", type=int, help="with --mgpu: tiles of 64 tokens per step (default: the kernel's)")
  parser.add_argument("--stages", type=int, default=STAGES, help="with --mgpu: pipeline depth (default: the kernel's)")
  parser.add_argument("--splits", type=int,
                      help="with --mgpu: programs per (sequence, KV head) (default: the kernel's)")
  parser.add_argument("--calls", type=int, default=4)
  args = parser.parse_args()
  shape = Shape(args.batch, args.seq_len)
  if args.mgpu:
    inputs = (window_inputs if args.window else mgpu_inputs)(shape, args.bits, seed=0)
    fn = jax.jit(lambda q, s, *window: mgpu_decode_attention(
        q, 0, s, segment=window[0] if window else None, step_tiles=args.step_tiles,
        max_concurrent_steps=args.stages, splits=args.splits))
  elif args.layout:
    inputs, fn = layout_inputs(shape, args.layout, seed=0), fused(layout_config({}, args.layout), interpret=False)
  else:
    inputs, fn = kivi_inputs(shape, args.bits, seed=0), fused({}, interpret=False)  # the widths come with the store
  for _ in range(args.calls):
    jax.block_until_ready(fn(*inputs))


if __name__ == "__main__":
  main()
