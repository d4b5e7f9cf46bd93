set -x
cd .snap/new && export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PALLAS_FLASH_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
timeout -s INT 520 python3 -m pytest -q -m gpu -n 4 tests/mosaic/test_mosaic_gpu.py tests/mosaic/test_mosaic_persistent.py tests/mosaic/test_mosaic_split_tail.py -k "forward_and_gradients or intra_wg or q_registers or large_shapes or head_dim_256 or persistent or split_tail_forward or (fused_backward_gradients and (dq_shared or defer_inline))" 2>&1 | tail -25 | tee $OUT/tests.log
