set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 170 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py -k "windowed or (test_forward_and_gradients and causal and d128)" 2>&1 | tail -6 | tee $R/tests.log
for impl in mosaic triton; do
timeout -s INT 110 python3 scripts/features_bench.py --impl $impl --quick --only "causal 32K,window 4K / 32K" --json $R/features_$impl.json 2>&1 | tail -6 | tee $R/features_$impl.log
done
