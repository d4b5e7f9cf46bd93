set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py -k "soft" 2>&1 | tail -4 | tee $R/tests.log
timeout -s INT 120 python3 scripts/features_bench.py --impl mosaic --only "causal 8K,softcap 8K" --json $R/features_mosaic.json 2>&1 | tail -6 | tee $R/features_mosaic.log
