export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $R/smi.txt 2>&1
timeout -s INT 200 python3 -m pytest -q -n 4 -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -k "(fused_backward_gradients and persistent) or default_noncausal" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
for part in a b; do
  if [ $part = a ]; then S=4x4096x16x128,8x4096x16x128,2x4096x16x128; else S=1x16384x16x128,2x16384x8x128x4; fi
  mkdir -p $R/ab_$part
  timeout -s INT 230 python3 scripts/config_ab.py --variant twin: --variant persist:fused_persistent=True --shapes $S --causal no --mode fwdbwd --iters 8 --out $R/ab_$part > $R/ab_$part.log 2>&1
  echo "ab rc=$?" >> $R/ab_$part.log
  python3 -c "
import json
for r in json.load(open('$R/ab_$part/config_ab.json')):
    print(r['shape'], r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()})
" 2>&1 | head -20
  tail -2 $R/ab_$part.log | cut -c1-300
done
