export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 200 python3 -m pytest -v -n 4 tests/mosaic/test_mosaic_gpu.py -m fused -k "static_wg or defer_inline_split_loop_early_probs-" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
timeout -s INT 400 python3 scripts/config_ab.py --variant static:fused_static_wg=True --variant static_early:fused_static_wg=True,fused_early_probs=True --shapes 4x4096x16x128,1x16384x16x128,2x16384x8x128x4 --causal no --mode fwdbwd --iters 10 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
tail -25 $R/ab.log
