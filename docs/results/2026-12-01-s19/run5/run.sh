cd .snap/new && export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 400 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes anchors,long,train --mode fwdbwd --json $OUT/bench_fwdbwd.json 2>&1 | grep -A40 "^Summary" | tee $OUT/bench_fwdbwd.log
