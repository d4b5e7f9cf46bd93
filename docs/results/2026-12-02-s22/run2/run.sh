export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
F=fused_backward=True,fused_dq_shared=True,compute_registers=240,producer_registers=24
timeout -s INT 560 python3 scripts/config_ab.py --variant fa3:$F,fused_overlap=True --variant shared:$F --variant deferred:$F,fused_defer_dq=True,fused_defer_inline=True --shapes 1x16384x16x128,1x32768x16x128 --causal yes,no --mode fwdbwd --iters 5 --out $R > $R/fused_ab.log 2>&1
echo "ab rc=$?" >> $R/fused_ab.log
grep -v Warn $R/fused_ab.log | tail -8 | cut -c1-900
