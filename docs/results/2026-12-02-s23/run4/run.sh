export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "no_auto_barriers" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
grep -q "10 passed" $R/pytest.log || exit 0
F=fused_backward=True,fused_dq_shared=True,compute_registers=240,producer_registers=24
D=$F,fused_defer_dq=True,fused_defer_inline=True
timeout -s INT 330 python3 scripts/config_ab.py --variant shared:$F --variant shared_nb:$F,fused_auto_barriers=False --variant deferred:$D --variant deferred_nb:$D,fused_auto_barriers=False --shapes 1x16384x16x128,1x32768x16x128,4x4096x16x128 --causal no,yes --mode fwdbwd --iters 5 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
tail -1 $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()})
"
