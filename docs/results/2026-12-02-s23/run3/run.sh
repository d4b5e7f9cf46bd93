# The snapshot of 3bffc0f with diag.patch applied (backward_fused.narrow_q / tile_swizzle read
# PF_DIAG_NARROW_ALL / PF_DIAG_SWIZZLE), so that 64-row q tiles take the narrow form's data flow.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)-diag
F=fused_backward=True,fused_dq_shared=True,compute_registers=240,producer_registers=24
mkdir -p $R/t32 $R/t128 $R/overlap
PF_DIAG_NARROW_ALL=1 timeout -s INT 150 python3 scripts/config_ab.py --variant t32:$F --shapes 1x16384x16x128 --causal no,yes --mode fwdbwd --iters 5 --out $R/t32 > $R/t32/log.txt 2>&1
echo "rc=$?" >> $R/t32/log.txt
PF_DIAG_NARROW_ALL=1 PF_DIAG_SWIZZLE=128 timeout -s INT 150 python3 scripts/config_ab.py --variant t128:$F --shapes 1x16384x16x128 --causal no,yes --mode fwdbwd --iters 5 --out $R/t128 > $R/t128/log.txt 2>&1
echo "rc=$?" >> $R/t128/log.txt
timeout -s INT 120 python3 scripts/mosaic_profile.py --backward --shape 1,16384,16,128 --out $R/overlap fused_backward=True fused_dq_shared=True fused_overlap=True compute_registers=240 producer_registers=24 > $R/overlap/log.txt 2>&1
echo "rc=$?" >> $R/overlap/log.txt
for d in t32 t128; do tail -1 $R/$d/log.txt; python3 -c "
import json,sys
for r in json.load(open('$R/$d/config_ab.json')): print('$d', r['shape'], r['causal'], {k: round(v,1) for k,v in r['tflops'].items()}, r.get('err_vs_default'))
"; done
grep -v Warn $R/overlap/log.txt | tail -30
du -sh $R/*
