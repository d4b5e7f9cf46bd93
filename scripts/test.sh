#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests skip themselves without a GPU). Extra args go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
cd "$root"
# --durations: the slowest tests, so that a suite creeping towards CI's budget shows where.
# -n: one pytest-xdist worker per core (PALLAS_FLASH_TEST_WORKERS overrides; 0 runs in-process):
# the interpret-mode cases are single-threaded Python, so a 2-core CI machine runs two at once.
# --timeout: a kernel whose pipeline never drains hangs the interpreter as it hangs the GPU; the
# thread method ends that worker, which fails
# the test and lets xdist start another, instead of the suite running into CI's limit. No single
# test comes near 15 minutes (see --durations).
# -m "not slow": the interpreter cases of kernel forms no default runs and the longest CPU cases
# stay out of the routine run (CI's); a later -m replaces it (-m slow, or -m "" for everything).
exec .venv/bin/python -m pytest -q --durations=15 -n "${PALLAS_FLASH_TEST_WORKERS:-auto}" --dist loadgroup \
  --timeout "${PALLAS_FLASH_TEST_TIMEOUT:-900}" --timeout-method thread -m "not slow" "$@"
