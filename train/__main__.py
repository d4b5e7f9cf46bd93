"""Train a byte-level long-context transformer on pallas_flash.

  python -m train                          # preset cpu-demo: ~5 min on a laptop CPU
  python -m train --preset h200-long       # 124M params at 16K context on one H200
  python -m train --task retrieval --seq-len 16384 --preset h200-long
  python -m train --resume                 # continue exactly where the last run stopped
  python -m train --overwrite              # a new run in place of the one in --out-dir
  python -m train --init-from runs/short --out-dir runs/long --seq-len 16384
                                           # a new run from another run's parameters
  ./scripts/retrieval_gpu.sh               # retrieval at 16K on one H200 (curriculum)

Ctrl-C stops after the current step and saves a checkpoint (exit status 130); a second
Ctrl-C aborts without saving. See docs/training.md; `python -m train.compare` benchmarks
attention implementations.
"""

import sys

from train.config import parse_args
from train.main import run

if __name__ == "__main__":
  try:
    interrupted = run(parse_args())["interrupted"]
  except KeyboardInterrupt:  # before training started, or a second Ctrl-C
    print("\naborted by Ctrl-C; `--resume` continues from the last checkpoint saved.",
          file=sys.stderr)
    interrupted = True
  sys.exit(130 if interrupted else 0)  # 128 + SIGINT, as a shell reports a Ctrl-C'd command
