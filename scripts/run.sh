#!/usr/bin/env bash
# One entry point for the README's two commands: it creates .venv and installs jaxrl on first use.
#   bash scripts/run.sh quickstart   # the main job on the embedded default (tiny model, CPU)
#   bash scripts/run.sh test         # the test suite (what .ci/run calls)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # Tested versions (requirements/constraints.txt pins every extra, so extras added here stay pinned).
  .venv/bin/python -m pip install -q -c requirements/constraints.txt -e ".[test,plan]"
fi
cmd=${1:-}
shift || true
case "$cmd" in
  quickstart) exec .venv/bin/jaxrl quickstart "$@" ;;
  # The server tests run in fresh worker processes: late in a long worker's life, XLA has segfaulted in them
  # (compiling or loading a cached program on the serving thread; docs/reliability.md); alone they pass.
  test) if [ "$#" -gt 0 ]; then exec .venv/bin/python -m pytest -q -n 2 --durations=25 "$@"; fi
        .venv/bin/python -m pytest -q -n 2 --durations=25 --ignore=tests/serve tests &&
          exec .venv/bin/python -m pytest -q -n 2 --durations=10 tests/serve ;;
  *) echo "usage: bash scripts/run.sh quickstart|test [args...]" >&2; exit 2 ;;
esac
