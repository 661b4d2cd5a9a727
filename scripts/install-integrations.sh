#!/bin/sh
# Virtual environments of their own for the RL harnesses the integration tests run against a node
# (docs/integrations.md), from PyPI, outside the project's environment: verifiers pulls 52
# packages of its own (openai, anthropic, prime-sandboxes...), harbor needs Python >= 3.12.
#   install-integrations.sh [DIR]   DIR: build/integrations by default
# Each environment is made once (a stamp names its requirement); one that cannot be made (no
# Python >= 3.12 for harbor, no index) is said and skipped: its tests skip saying why.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/integrations}
UV=$ROOT/.venv/bin/uv
mkdir -p "$OUT"

# make_env NAME PYTHON REQUIREMENT
make_env() {
  name=$1 python=$2 requirement=$3
  stamp="$OUT/$name/.installed"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$requirement" ]; then
    return 0
  fi
  echo "integrations: $name ($requirement) with $python"
  rm -rf "${OUT:?}/$name"
  "$python" -m venv "$OUT/$name" || return 1
  if [ -x "$UV" ]; then
    "$UV" pip install --python "$OUT/$name/bin/python" --system-certs -q "$requirement" ||
      "$OUT/$name/bin/pip" install -q "$requirement" || return 1
  else
    "$OUT/$name/bin/pip" install -q "$requirement" || return 1
  fi
  echo "$requirement" > "$stamp"
}

# The first Python >= 3.12 found: on PATH, then pyenv's (Debian bookworm has none).
newer_python() {
  for p in python3.13 python3.12 /root/.pyenv/versions/3.13*/bin/python3 \
      /root/.pyenv/versions/3.12*/bin/python3; do
    if command -v "$p" >/dev/null 2>&1 &&
        "$p" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$p"
      return 0
    fi
  done
  return 1
}

status=0
make_env verifiers python3 'verifiers[e2b]==0.4.0' || {
  echo "integrations: verifiers not installed" >&2; status=1; }
if newer=$(newer_python); then
  make_env harbor "$newer" 'harbor[e2b]==0.26.0' || {
    echo "integrations: harbor not installed" >&2; status=1; }
else
  echo "integrations: harbor skipped: no Python >= 3.12 on this host" >&2
fi
exit $status
