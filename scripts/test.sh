#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests skip themselves without a GPU). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
# --durations: the slowest tests, so that a suite creeping towards CI's budget shows where.
exec .venv/bin/python -m pytest -q --durations=15 "$@"
