set -x
mkdir -p /tmp/pp /tmp/jkv_cache; ln -sfn $PWD/jkv /tmp/pp/jkv; ln -sfn $PWD/convert /tmp/pp/jkv_convert; ln -sfn $PWD/pallas_kernels /tmp/pp/jkv_kernels
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp .model/gguf.part00 /tmp/jkv_cache/ &
export PYTHONPATH=/tmp/pp:/tmp/site PATH=/usr/local/cuda/bin:$PATH XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jax; print(jax.__version__, jax.devices())"
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_mgpu_decode_attention.py tests/test_memory_pool.py "tests/test_kivi.py::test_mma_packing_on_the_hopper_kernel_equals_the_xla_path" tests/test_interface.py -k "Gpu or hopper or mma or pool" 2>&1 | tail -30 > $OUT/tests.log; tail -30 $OUT/tests.log
timeout 200 python3 benchmarks/mgpu_decode.py --batches 8 --seq-lens 32768 --no-variants --out $OUT/mgpu.json 2>&1 | tail -40
wait
ls -la /tmp/jkv_cache
