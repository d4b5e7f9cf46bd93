export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $R/smi.txt 2>&1
timeout -s INT 200 python3 -m pytest -q -n 4 -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "split_tail or default_noncausal" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -4 $R/tests.log
mkdir -p $R/ab
timeout -s INT 340 python3 scripts/config_ab.py --variant twin: --variant split:bwd_split_tail=fused --shapes 4x4096x16x128,1x16384x16x128,1x32768x16x128 --causal no --mode fwdbwd --iters 8 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/ab/config_ab.json')):
    print(r['shape'], r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()})
" 2>&1 | head -20
tail -2 $R/ab.log | cut -c1-300
