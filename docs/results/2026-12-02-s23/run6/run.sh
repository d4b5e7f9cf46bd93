export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 200 python3 scripts/config_ab.py --variant split:fused_backward=False --shapes 2x16384x8x128,1x16384x16x128x8,1x65536x16x128 --causal yes --mode fwdbwd --iters 5 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
tail -1 $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, r['err_vs_default'])
"
