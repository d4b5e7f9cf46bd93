export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b8_t4k_h16_d128 --mode fwdbwd --causal no --iters 21 --json $R/bench_no.json > $R/bench_no.log 2>&1
echo "bench rc=$?" >> $R/bench_no.log
grep -E "mosaic|cudnn|rc=" $R/bench_no.log | cut -c1-200
