export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 330 python3 -m pytest -q -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_persistent.py tests/mosaic/test_mosaic_split_tail.py -m gpu -k "intra_wg_overlap or lse_matches or persistent or split_tail" > $R/tests.log 2>&1
echo "tests rc=$?" >> $R/tests.log
tail -4 $R/tests.log
