set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 300 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes ragged,d256 --mode fwd,fwdbwd --json $R/new_bench.json 2>&1 | tee $R/new_bench.log | grep -v Warning
mkdir -p $R/new_3001 && OUT=$R/new_3001 timeout -s INT 120 python3 scripts/config_ab.py --variant twin: --shapes 2x3001x8x128x4,2x3008x8x128x4 --mode fwd --causal no,yes 2>&1 | tail -12
cd ../old && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
timeout -s INT 100 python3 -m pallas_flash.bench --impl mosaic,cudnn --shapes ragged --mode fwd --causal no --json $R/old_bench.json 2>&1 | tee $R/old_bench.log | grep -v Warning
mkdir -p $R/old_d256 && OUT=$R/old_d256 timeout -s INT 120 python3 scripts/config_ab.py --variant twin: --shapes 4x4000x8x256 --mode fwdbwd --causal no,yes 2>&1 | tail -8
