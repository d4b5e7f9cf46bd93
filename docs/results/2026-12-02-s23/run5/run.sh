export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -k "deterministic_long_causal or (large_shapes and causal)" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
timeout -s INT 150 python3 scripts/config_ab.py --variant split:fused_backward=False --shapes 2x16384x8x128x4,1x16384x16x128,1x32768x16x128 --causal yes --mode fwdbwd --iters 5 --out $R > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
tail -1 $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, r['err_vs_default'])
"
timeout -s INT 200 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b1_t16k_h16_d128,b2_t16k_h8_k4_d128,b1_t32k_h16_d128 --mode fwdbwd --causal yes > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
grep -v Warn $R/bench.log | tail -14
