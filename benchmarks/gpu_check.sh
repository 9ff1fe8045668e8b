#!/usr/bin/env bash
# The one prepared GPU check (see benchmarks/gpu_check.py: one table of steps drives the GPU run and its CPU dry
# run, which the test suite executes).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [--rerun-failed] [OUT_DIR]
#
# OUT_DIR defaults to benchmarks/results/gpu, or $OUT/gpu_check when OUT is set; BUDGET_S (default 450) bounds
# the whole run; PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
