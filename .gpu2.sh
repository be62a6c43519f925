mkdir -p /tmp/pp /tmp/jkv_cache; ln -sfn $PWD/jkv /tmp/pp/jkv; ln -sfn $PWD/convert /tmp/pp/jkv_convert; ln -sfn $PWD/pallas_kernels /tmp/pp/jkv_kernels
ls /tmp/jkv_cache; cat /tmp/jkv_cache/gguf.part00 .model/gguf.part01 > /tmp/jkv_cache/SmolLM2-135M-Instruct.Q4_1.gguf && rm /tmp/jkv_cache/gguf.part00
export PYTHONPATH=/tmp/pp:/tmp/site PATH=/usr/local/cuda/bin:$PATH XLA_PYTHON_CLIENT_PREALLOCATE=false JKV_CACHE=/tmp/jkv_cache
ls -la /tmp/jkv_cache
timeout 500 python3 benchmarks/robustness_gpu.py --cases oom advice_batch advice_context over_cache under_cache --output $OUT/robust.json 2>&1 | tail -40
