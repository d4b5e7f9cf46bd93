export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $R/smi.txt 2>&1
for c in no yes; do
  timeout -s INT 200 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b1_t16k_h16_d128,b2_t16k_h8_k4_d128,b1_t32k_h16_d128 --mode fwdbwd --causal $c --iters 13 --json $R/bench_$c.json > $R/bench_$c.log 2>&1
  echo "bench $c rc=$?" >> $R/bench_$c.log
  tail -12 $R/bench_$c.log | cut -c1-200
done
