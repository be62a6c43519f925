source .gpu_setup.sh
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_mgpu_decode_attention.py "tests/test_memory_pool.py::test_compiled_prefill_and_decode_hold_no_copy_of_the_cache" "tests/test_kivi.py::test_mma_packing_on_the_hopper_kernel_equals_the_xla_path" -k "Gpu or hopper or pool or default_step or compiled" > $OUT/tests.log 2>&1; grep -E "^E |passed|failed|FAILED|Error" $OUT/tests.log | head -60
cp benchmarks/results/generate_decode_nvidia_h100_80gb_hbm3.json $OUT/gen.json
timeout 300 python3 benchmarks/generate_decode.py --part b8 --methods dense kivi2 kivi2_mma kivi4_mma --out $OUT/gen.json 2>&1 | tail -25
