"""Train a byte-level long-context transformer on pallas_flash.

  python -m train                          # preset cpu-demo: ~5 min on a laptop CPU
  python -m train --preset h200-long       # 124M params at 16K context on one H200
  python -m train --task retrieval --seq-len 16384 --preset h200-long
  python -m train --resume                 # continue exactly where the last run stopped
  python -m train --init-from runs/short --out-dir runs/long --seq-len 16384
                                           # a new run from another run's parameters
  ./scripts/retrieval_gpu.sh               # retrieval at 16K on one H200 (curriculum)

See docs/training.md; `python -m train.compare` benchmarks attention implementations.
"""

from train.config import parse_args
from train.main import run

if __name__ == "__main__":
  run(parse_args())
