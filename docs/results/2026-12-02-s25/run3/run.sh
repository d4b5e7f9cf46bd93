export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
[ -n "$SKIPTEST" ] || timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider tests/mosaic/test_mosaic_gpu.py -k "flat_stats or stats_3d or defer_inline_no_auto_barriers or deterministic_long_causal" > $R/pytest.log 2>&1
echo "pytest rc=$?" >> $R/pytest.log
grep -v '^    @' $R/pytest.log | grep -E 'passed|failed|rc=|^E  ' | head -20 | cut -c1-300
[ -n "$SKIPTEST" ] || grep -q "^14 passed" $R/pytest.log || exit 0
L=fused_backward=True,fused_dq_shared=True,fused_defer_dq=True,fused_defer_inline=True,compute_registers=240,producer_registers=24,fused_auto_barriers=False
for c in yes no; do
mkdir -p $R/probe_$c
timeout -s INT 100 python3 scripts/bwd_probe.py --causal $c --shapes 2x16384x8x128x4,4x16384x8x128x4 --variant split:fused_backward=False --variant split3d:fused_backward=False,bwd_flat_stats=False --variant fused:$L --iters 7 --out $R/probe_$c > $R/probe_$c.log 2>&1
echo "probe rc=$?" >> $R/probe_$c.log
python3 -c "
import json
for r in json.load(open('$R/probe_$c/bwd_probe.json')): print(r['shape'], r['causal'], r['ms'], r['tflops'])
"
done
ab() { mkdir -p $R/$1; timeout -s INT $2 python3 scripts/config_ab.py --variant $3 --shapes $4 --causal $5 --mode fwdbwd --iters 5 --out $R/$1 > $R/$1.log 2>&1; echo "ab rc=$?" >> $R/$1.log
python3 -c "
import json
for r in json.load(open('$R/$1/config_ab.json')):
  t=r['tflops']; print(r['shape'], r['causal'], {k: round(v,1) for k,v in t.items()}, r['ratio_vs_cudnn'], {k: round(v,5) for k,v in r['err_vs_default'].items()})
"; }
ab abA 150 split:fused_backward=False 2x16384x8x128x4,2x16384x8x128,4x16384x8x128x4,8x16384x8x128x4,1x16384x16x128 yes
ab abB 110 fused:$L 4x4096x16x128,2x8192x16x128 yes,no
ab abC 70 fused:$L 2x16384x8x128x4,1x16384x16x128 no
# run as: SKIPTEST=1 bash run.sh (run2's tests had timed out)
