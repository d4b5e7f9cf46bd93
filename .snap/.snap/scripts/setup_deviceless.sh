#!/usr/bin/env bash
# Installs what compiling the Mosaic kernels for an H200 *without a GPU* needs into .cuda-aot/
# (git-ignored): jax's CUDA PJRT plugin and kernel extension (same version as jax), ptxas
# (nvidia-cuda-nvcc) and nvdisasm (for SASS). Used by `scripts/mosaic_ptxas.py --deviceless`,
# which compiles against a described H200 (scripts/h200_target_config.txtpb) and prints ptxas'
# spills and serialisation warnings per kernel: the register side of kernel work on a CPU machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
jax_version="$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
.venv/bin/python -m pip install -q --no-deps --upgrade --target .cuda-aot \
  "jax-cuda13-pjrt==$jax_version" "jax-cuda13-plugin==$jax_version" \
  "nvidia-cuda-nvcc>=13.0,<13.1" "nvidia-cuda-nvdisasm>=13.0"
echo "deviceless toolchain in .cuda-aot (ptxas: $(ls .cuda-aot/nvidia/cu13/bin/ptxas))"
