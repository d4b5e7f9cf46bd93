export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
timeout -s INT 170 python3 scripts/bwd_probe.py --causal no --shapes 1x16384x16x128 --variant split:fused_backward=False --variant L:$L --variant s01:$L,fused_wg_skew=0/1 --variant s12:$L,fused_wg_skew=1/2 --variant s11:$L,fused_wg_skew=1/1 --variant s02:$L,fused_wg_skew=0/2 --iters 7 --out $R > $R/probe_no.log 2>&1
echo "rc=$?" >> $R/probe_no.log; cut -c1-900 $R/probe_no.log | grep -E '^\{|rc=|Error' | tail -5
