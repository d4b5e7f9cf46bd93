#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests skip themselves without a GPU). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
# --durations: the slowest tests, so that a suite creeping towards CI's budget shows where.
# -n: one pytest-xdist worker per core (PALLAS_FLASH_TEST_WORKERS overrides; 0 runs in-process):
# the interpret-mode cases are single-threaded Python, so a 2-core CI machine runs two at once.
exec .venv/bin/python -m pytest -q --durations=15 -n "${PALLAS_FLASH_TEST_WORKERS:-auto}" "$@"
