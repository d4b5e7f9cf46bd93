export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $R/ab $R/ab2
MED=med:fwd_intra_wg_overlap=True,fwd_q_registers=True,heads_fastest=False
timeout -s INT 260 python3 scripts/config_ab.py --variant twin: --variant $MED --shapes 16x1024x16x128,8x2048x16x128,4x2048x16x128,8x2048x16x128x4,32x1024x8x128,4x1536x16x128,2x2048x32x128 --causal no --mode fwd --iters 10 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
timeout -s INT 150 python3 scripts/config_ab.py --variant twin: --variant $MED --shapes 16x1024x16x128,8x2048x16x128 --causal no --mode fwdbwd --iters 8 --out $R/ab2 > $R/ab2.log 2>&1
echo "ab2 rc=$?" >> $R/ab2.log
python3 -c "
import json
for f in ('$R/ab/config_ab.json', '$R/ab2/config_ab.json'):
  try:
    for r in json.load(open(f)):
      print(r['shape'], r.get('mode'), r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()}, r.get('rounds_faster'))
  except Exception as e: print(f, e)
" 2>&1 | head -20
tail -n 1 $R/ab.log $R/ab2.log | cut -c1-300
