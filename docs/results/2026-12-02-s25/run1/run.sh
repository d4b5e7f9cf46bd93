export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -m fused -k "flat_stats or per_batch_entry" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
grep -q "^10 passed" $R/pytest.log || exit 0
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
timeout -s INT 120 python3 scripts/bwd_probe.py --shapes 2x16384x8x128x4,2x16384x8x128 --variant split:fused_backward=False --variant one:$L --variant flat:$L,fused_flat_stats=True --variant pbe:$L,fused_per_batch_entry=True --iters 7 --out $R > $R/probe.log 2>&1
echo "probe rc=$?" >> $R/probe.log
cut -c1-600 $R/probe.log | tail -3
mkdir -p $R/ab
timeout -s INT 90 python3 scripts/config_ab.py --variant flat:$L,fused_flat_stats=True --variant pbe:$L,fused_per_batch_entry=True --shapes 2x16384x8x128x4,2x16384x8x128 --causal yes --mode fwdbwd --iters 7 --out $R/ab > $R/ab.log 2>&1
echo "ab rc=$?" >> $R/ab.log
python3 -c "
import json
for r in json.load(open('$R/ab/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, r['ratio_vs_cudnn'], {k: round(v,5) for k,v in r['err_vs_default'].items()})
"
( time timeout -s INT 200 python3 -m train.compare throughput --attention ours cudnn --seq-len 16384 --batch-size 2 --steps 20 --rounds 2 --mosaic-config $L,fused_flat_stats=True --json $R/train.json ) 2>&1 | tail -9 | tee $R/train.log
