export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -v -n 2 tests/mosaic/test_mosaic_gpu.py -m fused -k "long_causal or defer_inline_static_wg" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
timeout -s INT 200 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b1_t16k_h16_d128,b1_t32k_h16_d128,b2_t16k_h8_k4_d128 --mode fwdbwd --causal yes --iters 13 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -9 $R/bench.log
mkdir -p $R/c $R/n; timeout -s INT 100 python3 scripts/config_ab.py --variant fused:fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False,fused_static_wg=True,fused_early_probs=True --shapes 4x4096x16x128,2x8192x16x128 --causal yes --mode fwdbwd --iters 8 --out $R/c > $R/ab_causal.log 2>&1
grep -o '"shape": "[^"]*"\|"tflops": {[^}]*}' $R/ab_causal.log
timeout -s INT 100 python3 scripts/config_ab.py --variant fused:fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False,fused_static_wg=True,fused_early_probs=True,fused_split_loop=True --shapes 8x2048x16x128,16x4096x16x128 --causal no --mode fwdbwd --iters 8 --out $R/n > $R/ab_noncausal.log 2>&1
grep -o '"shape": "[^"]*"\|"tflops": {[^}]*}' $R/ab_noncausal.log
