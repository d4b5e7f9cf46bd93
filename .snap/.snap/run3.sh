cd .snap && export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $OUT/fwd $OUT/fwdbwd
timeout -s INT 200 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_split_tail.py -k "large_shapes or split_tail_forward_on_gpu or intra_wg or q_registers" > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
timeout -s INT 60 python3 scripts/config_ab.py --variant twin: --shapes 1x4992x16x128,1x5000x16x128 --causal no,yes --mode fwd --iters 6 --out $OUT/fwd 2>&1 | grep -v Warning | python3 -c "import sys,json
for l in sys.stdin:
  try: r=json.loads(l); print(r['shape'],r['causal'],r['mode'],r['tflops'],r['err_vs_default'])
  except Exception: print(l.rstrip()[:300])"
timeout -s INT 120 python3 scripts/config_ab.py --variant twin: --shapes 1x4992x16x128,1x5000x16x128 --causal no,yes --mode fwdbwd --iters 6 --out $OUT/fwdbwd 2>&1 | grep -v Warning | python3 -c "import sys,json
for l in sys.stdin:
  try: r=json.loads(l); print(r['shape'],r['causal'],r['mode'],r['tflops'],r['err_vs_default'])
  except Exception: print(l.rstrip()[:300])"
