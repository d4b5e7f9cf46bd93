export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 150 python3 -m pytest -q -n 2 -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "default_noncausal" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
timeout -s INT 120 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes batch8 --mode fwdbwd --causal both --iters 7 --json $R/bench.json > $R/bench.log 2>&1
echo "bench rc=$?" >> $R/bench.log
tail -9 $R/bench.log | cut -c1-200
