mkdir -p /tmp/pp /tmp/jkv_cache; ln -sfn $PWD/jkv /tmp/pp/jkv; ln -sfn $PWD/convert /tmp/pp/jkv_convert; ln -sfn $PWD/pallas_kernels /tmp/pp/jkv_kernels
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/pp:/tmp/site PATH=/usr/local/cuda/bin:$PATH XLA_PYTHON_CLIENT_PREALLOCATE=false JKV_CACHE=/tmp/jkv_cache
if [ -f .model/gguf.part00 ]; then cp .model/gguf.part00 /tmp/jkv_cache/; fi
if [ -f .model/gguf.part01 ] && [ -f /tmp/jkv_cache/gguf.part00 ]; then cat /tmp/jkv_cache/gguf.part00 .model/gguf.part01 > /tmp/jkv_cache/SmolLM2-135M-Instruct.Q4_1.gguf && rm /tmp/jkv_cache/gguf.part00; fi
ls -la /tmp/jkv_cache
