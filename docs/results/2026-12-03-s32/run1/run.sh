export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 120 python3 -m pytest -q -n 4 tests/mosaic/test_mosaic_persistent.py -m gpu -k "chained" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -3 $R/tests.log
mkdir -p $R/ab $R/ab2 $R/ab3
timeout -s INT 170 python3 scripts/config_ab.py --variant twin: --variant chain:fwd_chain_tiles=True --shapes 4x4096x16x128,8x4096x16x128,2x4096x32x128 --causal no --mode fwd --iters 8 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
timeout -s INT 110 python3 scripts/config_ab.py --variant twin: --variant chain:fwd_chain_tiles=True --shapes 4x4096x16x128 --causal no --mode fwdbwd --iters 8 --out $R/ab2 > $R/ab2.log 2>&1
echo "ab2 rc=$?" >> $R/ab2.log
timeout -s INT 130 python3 scripts/config_ab.py --variant ov:fwd_intra_wg_overlap=True,fwd_q_registers=True,heads_fastest=False --variant chainov:fwd_intra_wg_overlap=True,fwd_q_registers=True,heads_fastest=False,fwd_chain_tiles=True --shapes 16x1024x16x128,8x2048x16x128 --causal no --mode fwd --iters 8 --out $R/ab3 > $R/ab3.log 2>&1
echo "ab3 rc=$?" >> $R/ab3.log
python3 -c "
import json
for f in ('$R/ab/config_ab.json', '$R/ab2/config_ab.json', '$R/ab3/config_ab.json'):
  try:
    for r in json.load(open(f)):
      print(r['shape'], r.get('mode'), r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()})
  except Exception as e: print(f, e)
" 2>&1 | head -20
tail -n 2 $R/ab.log $R/ab2.log $R/ab3.log | cut -c1-300
