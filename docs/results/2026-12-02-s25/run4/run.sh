export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
( time timeout -s INT 150 python3 -m train.compare throughput --attention ours cudnn --seq-len 16384 --batch-size 2 --steps 20 --rounds 2 --json $R/train.json ) 2>&1 | tail -9 | tee $R/train.log
timeout -s INT 200 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes b4_t4k_h16_d128,b1_t16k_h16_d128,b2_t16k_h8_k4_d128,b1_t32k_h16_d128 --mode fwdbwd --causal yes --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
grep -E "^\||rc=" $R/bench.log | tail -22 | cut -c1-200
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -k "stats_3d or deterministic_long_causal or defer_inline_no_auto_barriers" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
tail -3 $R/pytest.log
