export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,power.limit,clocks.sm --format=csv > $R/smi.txt 2>&1
timeout -s INT 170 python3 -m pytest -q -n 4 -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -k "test_forward_and_gradients or head_dim_256_mosaic_backward or default_noncausal or long_non_causal_default or (fused_backward_gradients and (defer_inline_split_loop or defer_inline_no_auto) and not early and not dq_first)" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
mkdir -p $R/ab
timeout -s INT 330 python3 scripts/config_ab.py --variant twin: --variant stagger:fused_stagger_q=True --variant bslow:fused_batch_slowest=True --variant hmajor:fused_dq_head_major=True --shapes 4x4096x16x128,8x4096x16x128 --causal no --mode fwdbwd --iters 8 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/ab/config_ab.json')):
    print(r['shape'], r['tflops'], r['ratio_vs_cudnn'], {k: round(v, 4) for k, v in r['err_vs_default'].items()})
" 2>&1 | head -20
tail -2 $R/ab.log | cut -c1-300
