export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 130 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "defer_inline_skew" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
F=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False,fused_wg_skew=True
mkdir -p $R/ab
timeout -s INT 330 python3 scripts/config_ab.py --variant skew:$F --shapes 1x16384x16x128,2x16384x8x128x4,4x4096x16x128,1x32768x16x128,2x8192x16x128 --causal no --mode fwdbwd --iters 5 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/ab/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, r['ratio_vs_cudnn'], {k: round(v,5) for k,v in r['err_vs_default'].items()})
"
tail -3 $R/ab.log | cut -c1-300
