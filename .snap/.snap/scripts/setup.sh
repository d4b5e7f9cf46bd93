#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs pallas_flash (editable) with its test and
# training extras. Idempotent: reinstalls only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

is_py312() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local c v
  for c in "${PALLAS_FLASH_PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_py312 "$c" && { echo "$c"; return; }
  done
  # pyenv keeps interpreters that are not on PATH by default.
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -rV); do
      PYENV_VERSION="$v" is_py312 pyenv exec python && { echo "PYENV_VERSION=$v pyenv exec python"; return; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_py312 .venv/bin/python; then
  if ! py="$(find_python)"; then
    echo "error: pallas_flash needs Python >= 3.12 (jax 0.11.2 does), and none was found." >&2
    echo "       Install one (e.g. 'pyenv install 3.12') or set PALLAS_FLASH_PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "setup: creating .venv with $py" >&2
  rm -rf .venv
  eval "$py -m venv .venv"
fi

stamp=.venv/.pallas_flash_installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing dependencies into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
