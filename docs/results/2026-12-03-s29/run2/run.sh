export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 330 python3 -m pytest -q -rA -n 4 -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -k "test_forward_and_gradients or head_dim_256_mosaic_backward or default_noncausal or long_non_causal_default or (fused_backward_gradients and (defer_inline_split_loop or defer_inline_no_auto) and not early and not dq_first)" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -E '^(PASSED|FAILED|ERROR)|passed|failed|rc=' $R/pytest.log | cut -c1-200 | tail -40
for c in no yes; do
timeout -s INT 110 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b1_t16k_h16_d128,b2_t16k_h8_k4_d128,b1_t32k_h16_d128 --mode fwdbwd --causal $c --iters 13 --json $R/bench_$c.json > $R/bench_$c.log 2>&1
echo "bench rc=$?" >> $R/bench_$c.log
grep -E "mosaic|cudnn|rc=" $R/bench_$c.log | cut -c1-200
done
