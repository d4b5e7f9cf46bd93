export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
nvidia-smi -q -d CLOCK,POWER | head -60 > $R/smi.txt
timeout -s INT 100 python3 ../clock_probe.py 1x16384x16x128 no split:fused_backward=False L:$L cudnn L2:$L split2:fused_backward=False > $R/clk_no.log 2>&1; echo rc=$? >> $R/clk_no.log
timeout -s INT 80 python3 ../clock_probe.py 1x16384x16x128 yes split:fused_backward=False L:$L cudnn L2:$L > $R/clk_yes.log 2>&1; echo rc=$? >> $R/clk_yes.log
cat $R/clk_no.log $R/clk_yes.log | grep -E '^\{|rc=|Error' | cut -c1-400
