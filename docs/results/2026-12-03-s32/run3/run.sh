export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 300 python3 -m pytest -q -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_persistent.py -m "gpu and not fused" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -4 $R/tests.log
timeout -s INT 200 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b16_t1k_h16_d128,b4_t1000_h16_d128 --mode fwd,fwdbwd --causal no --iters 10 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -12 $R/bench.log
