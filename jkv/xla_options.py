"""XLA compiler options for every jitted model computation (prefill, decode, perplexity scoring).

Both concern the weights of a layer read out of the stacked parameters inside the layer scan. A decode step streams
every weight once, so any copy of a weight matrix costs as much as the dot that reads it. Measured on an H100 at the
Llama-3-8B shape, B=8, 8k context (benchmarks/profile_decode_step.py, results in
benchmarks/results/profile_decode_step_*):

- Triton gemm fusions cannot take a dynamic slice of the stacked weights as an operand, so XLA copied each layer's
  seven weight matrices before its dots (``memcpy128``, 9.5 ms of a 19.3 ms dense step); cuBLAS reads the slice in
  place. Off: 11.0 ms.
- The dot merger joins dots that share an input by concatenating their weights (q/k/v, gate/up): a 50-100 MB copy
  per layer per step (1 ms). Off: 10.1 ms against a floor of 9.1 ms (weights + cache at the copy rate).

Options unknown to a backend are ignored by it (these are GPU options; CPU compiles see them and do nothing).
"""

MODEL_COMPILER_OPTIONS = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
}
