set -x
cd .snap/new && export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 280 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_split_tail.py -k "long_non_causal or q_registers or large_shapes or split_tail_forward" 2>&1 | tail -8 | tee $OUT/tests.log
timeout -s INT 250 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes anchors,long,train --mode fwd --json $OUT/bench_fwd.json 2>&1 | grep -A40 "^Summary" | tee $OUT/bench_fwd.log
