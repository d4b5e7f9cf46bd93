export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $R/smi.txt 2>&1
timeout -s INT 160 python3 -m pytest -q -n 4 -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "default_noncausal or dq_first" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
mkdir -p $R/ab $R/abc
timeout -s INT 230 python3 scripts/config_ab.py --variant dqfirst:fused_dq_first=True --variant dqfe:fused_dq_first=True,fused_early_probs=True --shapes 4x4096x16x128,1x16384x16x128,2x16384x8x128x4 --causal no --mode fwdbwd --iters 6 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
timeout -s INT 100 python3 scripts/config_ab.py --variant dqfirst:fused_dq_first=True --shapes 1x16384x16x128,2x16384x8x128x4 --causal yes --mode fwdbwd --iters 6 --out $R/abc > $R/abc.log 2>&1
echo "abc rc=$?" >> $R/abc.log
for d in ab abc; do python3 -c "
import json
for r in json.load(open('$R/$d/config_ab.json')):
    print(r['shape'], r['causal'], r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()})
"; tail -1 $R/$d.log; done
timeout -s INT 60 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b2_t16k_h8_k4_d128 --mode fwdbwd --causal no --iters 9 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -5 $R/bench.log | cut -c1-200
