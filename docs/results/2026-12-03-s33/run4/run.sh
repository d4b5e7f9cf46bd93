export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 300 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b2_t16k_h8_k4_d128 --mode fwdbwd --causal no --iters 13 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -14 $R/bench.log
