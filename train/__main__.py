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


def main() -> int:
  """Runs the command line; returns the exit status (130 after Ctrl-C, as shells report it)."""
  try:
    from train.config import parse_args  # here, so that a Ctrl-C while jax loads is caught too
    from train.main import run

    return 130 if run(parse_args())["interrupted"] else 0
  except KeyboardInterrupt:  # before the training loop, or a second Ctrl-C
    print("\naborted by Ctrl-C; `--resume` continues from the last checkpoint saved, if any.",
          file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
