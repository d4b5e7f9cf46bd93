export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "narrow or b2_t1024_s1024_h4:4_d128_bfloat16-dq_shared" > $R/pytest_narrow.log 2>&1
echo "pytest rc=$?" >> $R/pytest_narrow.log
grep -v '^    @' $R/pytest_narrow.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
grep -q "6 passed" $R/pytest_narrow.log || exit 0
F=fused_backward=True,fused_dq_shared=True,compute_registers=240,producer_registers=24
timeout -s INT 380 python3 scripts/config_ab.py --variant shared:$F --variant narrow:$F,block_q_fused=80 --variant deferred:$F,fused_defer_dq=True,fused_defer_inline=True --shapes 1x16384x16x128,1x32768x16x128,4x4096x16x128 --causal no,yes --mode fwdbwd --iters 5 --out $R > $R/narrow_ab.log 2>&1
echo "ab rc=$?" >> $R/narrow_ab.log
grep -v Warn $R/narrow_ab.log | tail -40 | cut -c1-600
