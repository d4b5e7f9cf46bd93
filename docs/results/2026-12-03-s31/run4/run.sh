export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $R/ab
timeout -s INT 280 python3 scripts/config_ab.py --variant twin: --variant grid128:fwd_persistent=False --variant grid128tail:fwd_persistent=False,fwd_split_tail=True --variant grid192:fwd_persistent=False,block_kv=192,fwd_q_registers=False --shapes 4x4096x16x128,8x4096x16x128 --causal no --mode fwd --iters 8 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/ab/config_ab.json')):
    print(r['shape'], r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()})
" 2>&1 | head -20
tail -2 $R/ab.log | cut -c1-300
