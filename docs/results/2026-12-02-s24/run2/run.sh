export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
timeout -s INT 300 python3 scripts/bwd_probe.py --shapes 1x16384x8x128,2x16384x8x128,1x16384x16x128,2x16384x8x128x4 --variant split:fused_backward=False --variant fused:$L --variant fusedbs:$L,fused_batch_slowest=True --halves --out $R > $R/probe.log 2>&1
echo "probe rc=$?" >> $R/probe.log
cut -c1-600 $R/probe.log | tail -8
