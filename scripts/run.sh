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
  # Four pytest calls, so no worker process lives through the whole suite (tests/conftest.py also drops
  # compiled programs before a worker nears Linux's memory-map limit: docs/reliability.md). The third call
  # takes every directory the others do not name, so a new test directory is never left out.
  test) if [ "$#" -gt 0 ]; then exec .venv/bin/python -m pytest -q -n 2 --durations=25 "$@"; fi
        first="tests/bench tests/data tests/envs tests/eval tests/kernels tests/latent tests/losses tests/models
               tests/multihost tests/plan"
        .venv/bin/python -m pytest -q -n 2 --durations=15 $first &&
          .venv/bin/python -m pytest -q -n 2 --durations=15 tests/rl tests/sampling &&
          .venv/bin/python -m pytest -q -n 2 --durations=15 --ignore=tests/serve --ignore=tests/rl --ignore=tests/sampling \
            $(printf -- '--ignore=%s ' $first) tests &&
          exec .venv/bin/python -m pytest -q -n 2 --durations=10 tests/serve ;;
  *) echo "usage: bash scripts/run.sh quickstart|test [args...]" >&2; exit 2 ;;
esac
