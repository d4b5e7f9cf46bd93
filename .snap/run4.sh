cd .snap && export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $OUT/fwd $OUT/fwdbwd
timeout -s INT 330 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_split_tail.py tests/mosaic/test_mosaic_persistent.py -k "forward_and_gradients or large_shapes or segments or lse or q_registers or split_tail or persistent or deterministic" > $OUT/tests.log 2>&1; tail -4 $OUT/tests.log
S=1x4992x16x128,1x5000x16x128,4x1000x16x128,2x3001x8x128x4
timeout -s INT 75 python3 scripts/config_ab.py --variant twin: --shapes $S --causal no,yes --mode fwd --iters 6 --out $OUT/fwd 2>&1 | grep -v Warning | python3 -c "import sys,json
for l in sys.stdin:
  try: r=json.loads(l); print(r['shape'],r['causal'],r['mode'],r['tflops'],r['err_vs_default'])
  except Exception: print(l.rstrip()[:300])"
timeout -s INT 140 python3 scripts/config_ab.py --variant twin: --shapes $S --causal no,yes --mode fwdbwd --iters 6 --out $OUT/fwdbwd 2>&1 | grep -v Warning | python3 -c "import sys,json
for l in sys.stdin:
  try: r=json.loads(l); print(r['shape'],r['causal'],r['mode'],r['tflops'],r['err_vs_default'])
  except Exception: print(l.rstrip()[:300])"
