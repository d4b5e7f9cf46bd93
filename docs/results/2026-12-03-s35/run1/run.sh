export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=$OUT
cd .snap/new && export PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/env.txt
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 timeout -s INT 380 python3 -m pallas_flash.bench --memory --impl mosaic --max-seq 1048576 --json $R/memory_mosaic.json > $R/memory_mosaic.log 2>&1
echo "mosaic rc=$?" >> $R/memory_mosaic.log
cat $R/memory_mosaic.log | grep -v "^W\|^I" | tail -20
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 timeout -s INT 180 python3 -m pallas_flash.bench --memory --impl cudnn --start-seq 131072 --max-seq 1048576 --json $R/memory_cudnn.json > $R/memory_cudnn.log 2>&1
echo "cudnn rc=$?" >> $R/memory_cudnn.log
cat $R/memory_cudnn.log | grep -v "^W\|^I" | tail -12
