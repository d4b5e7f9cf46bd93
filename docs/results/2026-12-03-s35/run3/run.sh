export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -v -n 4 -p no:cacheprovider -m "fused" -k "default or long_causal" tests/mosaic/test_mosaic_gpu.py > $R/tests_fused.log 2>&1
echo "fused rc=$?" >> $R/tests_fused.log
grep -c PASSED $R/tests_fused.log; grep -E "FAILED|ERROR" $R/tests_fused.log | head; tail -2 $R/tests_fused.log
timeout -s INT 390 python3 -m pytest -v -n 4 -p no:cacheprovider -m "gpu and not fused" tests/train/test_step.py tests/test_gpu_features.py tests/mosaic/test_mosaic_gpu.py > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
