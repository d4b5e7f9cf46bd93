set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $R/gpu.txt
( time timeout -s INT 240 python3 -m train.compare throughput --attention ours cudnn --seq-len 16384 --batch-size 2 --steps 20 --rounds 2 --json $R/train.json ) 2>&1 | tail -30 | tee $R/train.log
( time timeout -s INT 120 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes anchors,long,train --mode fwdbwd --causal yes --json $R/bench_causal.json ) 2>&1 | grep -A14 "^Summary\|real" | tee $R/bench_causal.log
mkdir -p $R/ab && ( time OUT=$R/ab timeout -s INT 150 python3 scripts/config_ab.py --variant deferred:fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24 --shapes 1x16384x16x128,1x32768x16x128,2x16384x8x128x4,4x4096x16x128 --causal yes,no --mode fwdbwd ) 2>&1 | tail -40 | tee $R/ab.log
