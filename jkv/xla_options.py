"""XLA compiler options for every jitted model computation (prefill, decode, perplexity scoring).

The first two concern the weights of a layer read out of the stacked parameters inside the layer scan (a decode step
streams every weight once, so any copy of a weight matrix costs as much as the dot that reads it), the third the
batch. Measured on an H100 at the Llama-3-8B shape, B=8, 8k context unless said (benchmarks/profile_decode_step.py,
results in benchmarks/results/profile_decode_step_*):

- Triton gemm fusions cannot take a dynamic slice of the stacked weights as an operand, so XLA copied each layer's
  seven weight matrices before its dots (``memcpy128``, 9.5 ms of a 19.3 ms dense step); cuBLAS reads the slice in
  place. Off: 11.0 ms.
- The dot merger joins dots that share an input by concatenating their weights (q/k/v, gate/up): a 50-100 MB copy
  per layer per step (1 ms). Off: 10.1 ms against a floor of 9.1 ms (weights + cache at the copy rate).
- cuBLAS's padding pass pads a 16-bit dot's dimensions to multiples of 8, so a batch of 307 sequences became 312
  rows before every projection: five pad fusions a layer, 1.03 ms of a 26.8 ms KIVI-2 step (cuBLAS takes any row
  count: unpadded, its products took 0.36 ms longer, and the activation and a transpose the pads had absorbed
  0.57 ms). Off: 26.38 ms against 26.79 in the profiler at B=307, 4608 tokens; in ``generate`` 26.36 against
  26.53 ms (KIVI-2, 307 sequences) and 21.60 against 21.91 (dense, 66; the records of commit 0f424c6).

Options unknown to a backend are ignored by it, and the pass the third names runs on CUDA GPUs only: a CPU compile
sees them and does nothing.
"""

MODEL_COMPILER_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_disable_hlo_passes": "cublas-pad-for-gemms",
}
