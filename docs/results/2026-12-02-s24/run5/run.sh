export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "per_batch_entry or deterministic_long_causal" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
grep -q "^6 passed" $R/pytest.log || exit 0
( time timeout -s INT 240 python3 -m train.compare throughput --attention ours cudnn --seq-len 16384 --batch-size 2 --steps 20 --rounds 2 --json $R/train.json ) 2>&1 | tail -14 | tee $R/train.log
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False,fused_per_batch_entry=True
timeout -s INT 120 python3 scripts/config_ab.py --variant split:fused_backward=False --variant pbe:$L --shapes 2x16384x8x128x4,4x16384x8x128x4 --causal yes --mode fwdbwd --iters 5 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, r['ratio_vs_cudnn'], {k: round(v,5) for k,v in r['err_vs_default'].items()})
"
