#!/usr/bin/env bash
# One-command set-up + run. Creates ./.venv on first use and installs the project into it.
#   ./dev.sh demo [demo options]   SPRINT end to end on the embedded default (CPU, minutes)
#   ./dev.sh test [--fast] [pytest options]  ruff, then the test suite (installs the test extras:
#                                  torch CPU, pytest, ...); --fast skips the slow tier
#   ./dev.sh sprint-jax ARGS...    any sprint-jax command inside the environment (serve included)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${SPRINT_JAX_VENV:-.venv}
PY=${PYTHON:-python3}

# Every command the README runs works in the environment: `serve` needs the serve extra (a small
# ASGI stack); the test extra holds it too. Each set of extras has its own stamp, so nothing is
# reinstalled until pyproject.toml or setup.py changes.
RUN_EXTRAS="[serve]"

ensure_env() {  # $1 = extras ("$RUN_EXTRAS" or "[test]")
  local stamp="$VENV/.installed$1"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
    # torch is pinned in the test extra (a CPU wheel); never let pip pick an unpinned torch
    "$VENV/bin/python" -m pip install -q -e ".$1"
    touch "$stamp"
  fi
}

# Where JAX runs is left to the package (sprint_jax/__init__.py): the CPU on a machine without an
# accelerator whatever plugins are installed (the test extras hold libtpu and the CUDA plugin), the
# accelerator where there is one; a JAX_PLATFORMS you set is kept. The tests set it for themselves.

cmd=${1:-help}
shift || true
case "$cmd" in
  demo)
    ensure_env "$RUN_EXTRAS"
    exec "$VENV/bin/sprint-jax" demo "$@"
    ;;
  test)
    ensure_env "[test]"
    # --fast: the tier for iteration (a few minutes; skips the tests marked slow: CLIs in
    # subprocesses, several processes, big compiles). CI runs everything.
    tier=()
    if [ "${1:-}" = "--fast" ]; then shift; tier=(-m "not slow"); fi
    "$VENV/bin/ruff" check --quiet sprint_jax kernels tests
    # exit code 5 (no tests collected) is a failure like any other non-zero code
    exec "$VENV/bin/pytest" tests -q -n 2 --dist loadfile --no-loadscope-reorder "${tier[@]}" "$@"
    ;;
  sprint-jax)
    ensure_env "$RUN_EXTRAS"
    exec "$VENV/bin/sprint-jax" "$@"
    ;;
  *)
    sed -n '2,6p' "$0"
    exit 2
    ;;
esac
