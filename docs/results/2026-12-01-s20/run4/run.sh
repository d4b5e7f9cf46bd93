set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
for round in 1 2; do for c in new old; do
( cd .snap/$c && export PALLAS_FLASH_COMMIT=$(cat COMMIT) && timeout -s INT 100 python3 scripts/features_bench.py --impl mosaic --only "causal 8K,softcap 8K" --iters 5 --json $R/${c}_$round.json 2>&1 | tail -4 | tee $R/${c}_$round.log )
done; done
