#!/usr/bin/env bash
# The GPU matrix on the device: build every variant, then every gpu-marked test.
# When: on a GPU machine after any change to templates/ or ddtree_gen/ (plans, launchers, runtime),
# before committing it; pytest args narrow it (e.g. tests/test_gpu_tree_verify.py -k wgmma: they select the tests
# at collection; the processes run the selected ids).
# Usage: [JOBS=4] bash scripts/gpu_matrix.sh [pytest args...]; logs go to $OUT (or ./gpu-out): one log and junit
# file per test process (JOBS of them, side by side; JOBS=1: one process).
# Build targets (docs/decisions.md, "Build targets"): by default each kernel runs as the build for the
# GPU (the sm_90a cubins on an H100 / H200). DDTREE_GEN_ARCH=sm_80 runs the matrix on the sm_80 PTX
# builds instead (what an A100, L40S or B200 runs; the tests of the wgmma kernels skip, saying why);
# PASSES="auto sm_80" runs both passes, one after the other (logs gpu-tests-J.log, gpu-tests-sm_80-J.log).
# BUILD=0 skips the build (the tests then build what the cache lacks: a rerun on a machine that built already).
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac   # before anything is built or written
jobs="${JOBS:-4}"
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then echo "gpu_matrix.sh: JOBS=$jobs, expected a positive integer" >&2; exit 2; fi
out="${OUT:-gpu-out}"; mkdir -p "$out"
# the caller's PYTHONPATH is kept after the checkout (FlashMLA's package there: the pairing tests run, else skip)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DDTREE_GEN_CACHE="${DDTREE_GEN_CACHE:-/tmp/ddtree-gen-cache}"
python3 -c "import ml_dtypes" 2>/dev/null || echo "WARNING: ml_dtypes is not installed: the fp8 specs' GPU tests need it (pip install ml_dtypes)"
# one build process per spec, side by side (the binary cache's file locks make that safe): on the 16-core H200 machine
# the six shipped specs build in ~35 s this way, several minutes one variant after another
rc=0
if [ "${BUILD:-1}" != 0 ]; then
  pids=()
  for f in specs/*.toml; do
    name="$(basename "$f" .toml)"
    python3 -m ddtree_gen build "$name" > "$out/build-$name.log" 2>&1 & pids+=("$!")
  done
  build_rc=0
  for pid in "${pids[@]}"; do wait "$pid" || build_rc=1; done
  echo "build exit $build_rc"; tail -qn1 "$out"/build-*.log
  [ "$build_rc" = 0 ] || rc=1   # a variant that fails to build fails the matrix (its tests still run)
fi
for arch in ${PASSES:-${DDTREE_GEN_ARCH:-auto}}; do
  tag=""; [ "$arch" = auto ] || tag="-$arch"
  echo "=== gpu tests, DDTREE_GEN_ARCH=$arch, $jobs processes"
  # the collected test ids dealt round-robin to $jobs pytest processes side by side on the one GPU (a test's kernel
  # builds are CPU work, and the whole matrix in one process outgrew one 10-minute device call); each process writes
  # its own log and junit file, and the summary lines of all of them are printed last
  ids="$(mktemp -d)/ids.txt"   # (outside $out: the device returns a limited number of files)
  DDTREE_GEN_ARCH="$arch" python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider "$@" > "$ids.collect" 2>&1
  collect_rc=$?
  grep '::' "$ids.collect" > "$ids"
  if [ "$collect_rc" != 0 ] || [ ! -s "$ids" ]; then   # a module that fails to import is an error, not fewer tests
    echo "collecting the gpu tests failed (pytest exit $collect_rc):"; tail -n 40 "$ids.collect"; rc=1; continue
  fi
  echo "$(wc -l < "$ids") tests collected"
  rm -f "$out"/gpu-tests$tag-[0-9]*.log "$out"/gpu-junit$tag-[0-9]*.xml   # (an earlier run's, with another JOBS)
  pids=()
  for j in $(seq 0 $((jobs - 1))); do
    awk -v n="$jobs" -v j="$j" 'NR % n == j' "$ids" > "$ids.$j"
    # (-s: one pytest command line for all ids; xargs' default 128 KB buffer split JOBS=1's ~180 KB of ids in two runs)
    DDTREE_GEN_ARCH="$arch" xargs -r -s $(( $(getconf ARG_MAX) / 2 )) -a "$ids.$j" -d '\n' python3 -m pytest -q -ra -p no:cacheprovider \
      --durations=15 --junitxml="$out/gpu-junit$tag-$j.xml" > "$out/gpu-tests$tag-$j.log" 2>&1 & pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for j in $(seq 0 $((jobs - 1))); do
    echo "--- process $j (gpu-tests$tag-$j.log)"
    [ -s "$ids.$j" ] || { echo "(no tests: fewer tests than processes)"; continue; }
    grep -E "^(FAILED|ERROR)" "$out/gpu-tests$tag-$j.log"
    tail -n1 "$out/gpu-tests$tag-$j.log"
  done
  echo "--- skips of all processes, by reason"
  cat "$out"/gpu-tests$tag-[0-9]*.log | sed -n 's/^SKIPPED \[\([0-9]*\)\] [^ ]*: /\1 /p' \
    | awk '{n = $1; $1 = ""; c[$0] += n} END {for (r in c) printf "%6d %s\n", c[r], r}' | sort -rn
done
exit $rc
