export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv > $R/env.txt
timeout -s INT 110 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128 --mode fwd --iters 15 --json $R/fwd4k.json > $R/fwd4k.log 2>&1
echo "rc=$?" >> $R/fwd4k.log
grep -v "^W\|^I" $R/fwd4k.log | tail -12
timeout -s INT 150 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b1_t32k_h16_d128 --mode fwdbwd --causal yes --iters 13 --json $R/bwd32k.json > $R/bwd32k.log 2>&1
echo "rc=$?" >> $R/bwd32k.log
grep -v "^W\|^I" $R/bwd32k.log | tail -12
