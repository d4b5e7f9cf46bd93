export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
timeout -s INT 170 python3 scripts/bwd_probe.py --causal no --shapes 1x16384x16x128,4x4096x16x128 --variant split:fused_backward=False --variant L:$L --variant stag:$L,fused_stagger_q=True --variant hf:$L,bwd_heads_fastest=True --iters 7 --out $R > $R/probe_no.log 2>&1
echo "rc=$?" >> $R/probe_no.log; cut -c1-700 $R/probe_no.log | grep -E '^\{|rc=|Error' | tail -5
timeout -s INT 150 python3 scripts/bwd_probe.py --causal no --shapes 1x16384x16x128 --variant L:$L --variant noreduce:$L,diag_fused=noreduce --variant store:$L,diag_fused=store --variant stagnored:$L,fused_stagger_q=True,diag_fused=noreduce --iters 7 --out $R > $R/probe_diag_no.log 2>&1
echo "rc=$?" >> $R/probe_diag_no.log; cut -c1-700 $R/probe_diag_no.log | grep -E '^\{|rc=|Error' | tail -5
timeout -s INT 120 python3 scripts/bwd_probe.py --causal yes --shapes 1x16384x16x128 --variant split:fused_backward=False --variant L:$L --variant noreduce:$L,diag_fused=noreduce --variant store:$L,diag_fused=store --iters 7 --out $R > $R/probe_diag_yes.log 2>&1
echo "rc=$?" >> $R/probe_diag_yes.log; cut -c1-700 $R/probe_diag_yes.log | grep -E '^\{|rc=|Error' | tail -5
