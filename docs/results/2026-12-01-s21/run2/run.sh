export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 420 python3 scripts/features_bench.py --impl cudnn,mosaic --quick --only "causal 32K,window 4K / 32K" --json $R/features.json > $R/features.log 2>&1
grep -v Warn $R/features.log | tail -12
