#!/usr/bin/env bash
# One-command set-up + run. Creates ./.venv on first use and installs the project into it.
#   ./dev.sh demo [demo options]   SPRINT end to end on the embedded default (CPU, minutes)
#   ./dev.sh test [pytest options] the test suite (installs the test extras: torch CPU, pytest, ...)
#   ./dev.sh sprint-jax ARGS...    any sprint-jax command inside the environment
set -euo pipefail
cd "$(dirname "$0")"
VENV=${SPRINT_JAX_VENV:-.venv}
PY=${PYTHON:-python3}

ensure_env() {  # $1 = extras ("" or "[test]")
  local stamp="$VENV/.installed$1"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # torch is pinned in the test extra (a CPU wheel); never let pip pick an unpinned torch
    "$VENV/bin/python" -m pip install -q -e ".$1"
    touch "$stamp"
  fi
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo)
    ensure_env ""
    exec "$VENV/bin/sprint-jax" demo "$@"
    ;;
  test)
    ensure_env "[test]"
    # exit code 5 (no tests collected) is a failure like any other non-zero code
    exec "$VENV/bin/pytest" tests -q -n 2 --dist loadfile "$@"
    ;;
  sprint-jax)
    ensure_env ""
    exec "$VENV/bin/sprint-jax" "$@"
    ;;
  *)
    sed -n '2,6p' "$0"
    exit 2
    ;;
esac
