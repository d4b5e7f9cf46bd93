set -x
cd .snap/new && export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLASH_COMMIT=$(cat COMMIT)
OUT=$OUT timeout -s INT 250 python3 scripts/config_ab.py --variant persistent128:fwd_persistent=True,block_kv=128,fwd_q_registers=True --variant grid128:block_kv=128,fwd_q_registers=True,fwd_split_tail=True --shapes 2x8192x16x128,3x5120x16x128 --mode fwd --causal no 2>&1 | grep '^{'
