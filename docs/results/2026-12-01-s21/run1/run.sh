set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee $R/gpu.txt
timeout -s INT 230 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py -k "windowed or segments_forward" 2>&1 | tail -8 | tee $R/tests.log
timeout -s INT 300 python3 scripts/features_bench.py --impl cudnn,mosaic,triton --quick --only "causal 32K,window 4K / 32K" --json $R/features.json 2>&1 | grep -v Warning | tail -14 | tee $R/features.log
