"""Run the fused decode kernel a few times on one shape, for a profiler to look at (e.g. Nsight Compute).

    ncu --kernel-name regex:decode_attention_rows --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/profile_kernel.py --batch 8 --seq-len 32768 --bits 2

It uses the inputs and defaults of kernel_decode.py, so what the profiler sees is what that table timed: a
QuantizedStore of L - 128 tokens plus a 128-token residual segment, stacked over one layer, read at layer 0.
The kernel's name (``decode_attention_rows16_store_2x2bit_G32_bk64_ks16_seg128_...`` for the defaults) carries
the store's widths and tunables.
"""

import argparse

import jax

from kernel_decode import Shape, fused, kivi_inputs


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=32768)
  parser.add_argument("--bits", type=int, default=2)
  parser.add_argument("--calls", type=int, default=4)
  args = parser.parse_args()
  inputs = kivi_inputs(Shape(args.batch, args.seq_len), args.bits, seed=0)
  fn = fused({}, interpret=False)  # the widths come with the store
  for _ in range(args.calls):
    jax.block_until_ready(fn(*inputs))


if __name__ == "__main__":
  main()
