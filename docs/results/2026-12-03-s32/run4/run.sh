export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $R/ab
timeout -s INT 150 python3 scripts/config_ab.py --variant twin: --variant plain:fwd_intra_wg_overlap=False,fwd_q_registers=False,heads_fastest=True --shapes 4x1000x16x128,8x1500x16x128x4,16x1024x16x128 --causal no --mode fwd --iters 10 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/ab/config_ab.json')):
  L=r['loop_s']; n=len(L['default'])
  wins={v: sum(a<b for a,b in zip(L[v],L['default'])) for v in L}
  print(r['shape'], r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()}, 'rounds faster than default', wins, n)
"
timeout -s INT 260 python3 -m pytest -v -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_persistent.py -m "gpu and not fused" -k "persistent or soft_capped or q_registers or long_non_causal" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
grep -c PASSED $R/tests.log; grep -E "FAILED|ERROR" $R/tests.log | head; tail -2 $R/tests.log
