export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $R/causal $R/full
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "head_major or batch_slowest" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
timeout -s INT 240 python3 scripts/config_ab.py --variant split:fused_backward=False --variant fused:$L --variant hm:$L,fused_dq_head_major=True --variant bs:$L,fused_batch_slowest=True --variant hmbs:$L,fused_dq_head_major=True,fused_batch_slowest=True --shapes 2x16384x8x128,2x16384x8x128x4,1x16384x8x128,1x16384x16x128 --causal yes --mode fwdbwd --iters 5 --out $R/causal > $R/ab_causal.log 2>&1
echo "ab rc=$?" >> $R/ab_causal.log
timeout -s INT 90 python3 scripts/config_ab.py --variant split:fused_backward=False --variant fused:$L --variant hm:$L,fused_dq_head_major=True --variant hmst:$L,fused_dq_head_major=True,fused_stagger_q=True --shapes 1x16384x16x128 --causal no --mode fwdbwd --iters 5 --out $R/full > $R/ab_full.log 2>&1
echo "ab rc=$?" >> $R/ab_full.log
python3 -c "
import json
for f in ['causal','full']:
  try:
    for r in json.load(open('$R/'+f+'/config_ab.json')):
      t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, {k: round(v,5) for k,v in r['err_vs_default'].items()})
  except Exception as e: print(f, e)
"
tail -2 $R/ab_causal.log $R/ab_full.log
