export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -v -n 2 tests/mosaic/test_mosaic_gpu.py -m fused -k "default_noncausal" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
timeout -s INT 230 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b1_t16k_h16_d128,b1_t32k_h16_d128,b2_t16k_h8_k4_d128 --mode fwdbwd --causal no --iters 13 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -22 $R/bench.log
timeout -s INT 200 python3 scripts/config_ab.py --variant static:fused_static_wg=True --variant static_early:fused_static_wg=True,fused_early_probs=True --shapes 1x16384x16x128,2x16384x8x128x4 --causal yes --mode fwdbwd --iters 8 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
grep -o '"shape": "[^"]*"\|"tflops": {[^}]*}' $R/ab.log
