set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 220 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py -k "soft or (test_forward_and_gradients and (d128 or d64))" 2>&1 | tail -15 | tee $R/tests.log
for impl in mosaic triton; do
timeout -s INT 120 python3 scripts/features_bench.py --impl $impl --only "causal 8K,softcap 8K" --json $R/features_$impl.json 2>&1 | tail -6 | tee $R/features_$impl.log
done
