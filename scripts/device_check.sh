#!/usr/bin/env bash
# The first-accelerator check of issue 34: `jaxrl bench device` on this machine's first GPU or TPU, in under
# 8 minutes, writing device_check.json and device_check.md (docs/benchmarks.md, "Device check").
#
#   bash scripts/device_check.sh                 # results in ./device_check/
#   bash scripts/device_check.sh OUT_DIR [--remat dots]
#   bash scripts/device_check.sh OUT_DIR --dry-run   # CPU, tiny shapes, seconds (what CI runs)
#
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3). A run stopped at the
# time limit (DEVICE_CHECK_TIMEOUT seconds, default 470) keeps every section finished before it: the files
# are rewritten after each section.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-device_check}"
shift || true
python="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout "${DEVICE_CHECK_TIMEOUT:-470}" "$python" -m jaxrl.cli bench device --out "$out" "$@"
