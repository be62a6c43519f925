source .gpu_setup.sh
timeout 500 python3 benchmarks/robustness_gpu.py --cases oom advice_batch advice_context over_cache under_cache --output $OUT/robust.json 2>&1 | tail -30
