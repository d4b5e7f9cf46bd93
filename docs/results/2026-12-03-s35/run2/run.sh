export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 560 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes anchors,long,train,short --iters 7 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
grep -v "^W\|^I" $R/bench.log | tail -60
