export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > $R/gpu.txt
timeout -s INT 540 python3 scripts/features_bench.py --impl cudnn,mosaic --only "causal 32K,window 4K / 32K,causal 128K,window 4K / 128K" --json $R/features.json > $R/features.log 2>&1
echo "rc=$?" >> $R/features.log
grep -v Warn $R/features.log | tail -20
