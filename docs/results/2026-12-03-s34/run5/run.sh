export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 160 python3 -m pytest -v -n 4 tests/mosaic/test_mosaic_gpu.py tests/train/test_step.py -m gpu -k "large_shapes or test_step" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -E "PASSED|FAILED|ERROR" $R/tests.log | sed 's/.*:://' | head -20; tail -2 $R/tests.log
