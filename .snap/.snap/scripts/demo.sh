#!/usr/bin/env bash
# Runs the training demo (preset cpu-demo by default). Extra args go to `python -m train`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m train "$@"
