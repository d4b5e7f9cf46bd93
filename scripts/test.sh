#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests skip themselves without a GPU). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -q "$@"
