export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > $R/gpu.txt
timeout -s INT 270 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py -k "windowed or (fused_backward_gradients and overlap)" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -25 $R/tests.log
timeout -s INT 250 python3 scripts/config_ab.py --variant mbwd:window_backward=mosaic --window 4095 --shapes 1x32768x16x128 --causal yes --mode fwdbwd --iters 5 --out $R > $R/window_ab.log 2>&1
echo "ab rc=$?" >> $R/window_ab.log
grep -v Warn $R/window_ab.log | tail -6
