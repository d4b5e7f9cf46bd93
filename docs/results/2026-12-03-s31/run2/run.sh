export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $R/smi.txt 2>&1
timeout -s INT 120 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "split_tail" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -3 $R/tests.log
timeout -s INT 300 python3 scripts/tail_waves.py --seq-len 16384 --heads 32,33 --modes fwdbwd --iters 7 --out $R > $R/tail.log 2>&1
echo "tail rc=$?" >> $R/tail.log
tail -12 $R/tail.log
