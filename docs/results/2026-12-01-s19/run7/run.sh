set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py -k "(forward_and_gradients or intra_wg or q_registers) and causal and d128" 2>&1 | tail -3 | tee $R/tests.log
timeout -s INT 100 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes anchors,long,train --mode fwd --causal yes --json $R/new_bench.json 2>&1 | grep -A12 "^Summary" | tee $R/new_bench.log
cd ../old && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 100 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes anchors,long,train --mode fwd --causal yes --json $R/old_bench.json 2>&1 | grep -A12 "^Summary" | tee $R/old_bench.log
