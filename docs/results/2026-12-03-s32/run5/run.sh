export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 300 python3 -m pytest -v -n 4 tests/mosaic/test_mosaic_gpu.py -m "gpu and not fused" -k "not (persistent or soft_capped or q_registers or long_non_causal)" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
