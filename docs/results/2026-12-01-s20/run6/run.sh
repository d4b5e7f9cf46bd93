set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -q -m gpu -n 5 tests/mosaic/test_mosaic_gpu.py -k "windowed" 2>&1 | tail -3 | tee $R/tests.log
