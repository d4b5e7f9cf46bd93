set -x
# (stdout of each config_ab call was piped through a one-line filter printing shape, causal, tflops and err_vs_default per row; config_ab.json holds the full rows)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
mkdir -p $R/nc && OUT=$R/nc timeout -s INT 280 python3 scripts/config_ab.py --variant kv192:block_kv=192,fwd_q_registers=False --variant kv128smemq:fwd_q_registers=False --shapes 1x16384x16x128,1x32768x16x128,2x16384x8x128x4,4x4096x16x128 --mode fwd --causal no
mkdir -p $R/c && OUT=$R/c timeout -s INT 200 python3 scripts/config_ab.py --variant kv192:block_kv=192,fwd_q_registers=False --shapes 1x16384x16x128,2x16384x8x128x4 --mode fwd --causal yes
