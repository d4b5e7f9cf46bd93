export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/diag && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
timeout -s INT 100 python3 scripts/bwd_probe.py --causal no --shapes 1x16384x16x128 --variant split:fused_backward=False --variant L:$L --variant wgskew:$L,diag_fused=wgskew --iters 7 --out $R > $R/probe_a.log 2>&1
echo "rc=$?" >> $R/probe_a.log; cut -c1-700 $R/probe_a.log | grep -E '^\{|rc=|Error' | tail -3
timeout -s INT 100 python3 scripts/bwd_probe.py --causal no --shapes 1x16384x16x128 --variant split:fused_backward=False --variant L:$L --variant crange:$L,diag_fused=crange --iters 7 --out $R > $R/probe_b.log 2>&1
echo "rc=$?" >> $R/probe_b.log; cut -c1-700 $R/probe_b.log | grep -E '^\{|rc=|Error' | tail -3
