export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 170 python3 -m pytest -v -n 4 tests/mosaic/test_mosaic_gpu.py -m fused -k "static_wg or default or long_causal or split_loop_early" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
timeout -s INT 130 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b8_t4k_h16_d128 --mode fwdbwd --causal no --iters 13 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -7 $R/bench.log
mkdir -p $R/c $R/n
timeout -s INT 90 python3 scripts/config_ab.py --variant twin: --shapes 2x8192x16x128 --causal yes --mode fwdbwd --iters 10 --out $R/c > $R/ab_causal.log 2>&1
grep -o '"shape": "[^"]*"\|"tflops": {[^}]*}' $R/ab_causal.log
timeout -s INT 140 python3 scripts/config_ab.py --variant twin: --shapes 8x2048x16x128,16x4096x16x128 --causal no --mode fwdbwd --iters 10 --out $R/n > $R/ab_noncausal.log 2>&1
grep -o '"shape": "[^"]*"\|"tflops": {[^}]*}' $R/ab_noncausal.log
