#!/usr/bin/env bash
# The GPU matrix on the device: build every variant, then every gpu-marked test.
# When: on a GPU machine after any change to templates/ or ddtree_gen/ (plans, launchers, runtime),
# before committing it; pytest args narrow it (e.g. tests/test_gpu_tree_verify.py -k wgmma).
# Usage: bash scripts/gpu_matrix.sh [pytest args...]; logs go to $OUT (or ./gpu-out).
set -uo pipefail
out="${OUT:-gpu-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 DDTREE_GEN_CACHE="${DDTREE_GEN_CACHE:-/tmp/ddtree-gen-cache}"
python3 -m ddtree_gen build > "$out/build.log" 2>&1; echo "build exit $?"; tail -3 "$out/build.log"
python3 -m pytest -m gpu -q -ra -p no:cacheprovider --junitxml="$out/gpu-junit.xml" "$@" 2>&1 | tee "$out/gpu-tests.log" | tail -60
