export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 280 python3 scripts/config_ab.py --variant twin: --variant convert:fused_convert_dq=True --variant idle:fused_convert_dq=True,fused_convert_diag=True --shapes 4x4096x16x128,2x16384x8x128x4 --causal no --mode fwdbwd --iters 8 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
grep -o '"shape": "[^"]*"\|"tflops": {[^}]*}\|"err_vs_default": {[^}]*}' $R/ab.log
