#!/usr/bin/env bash
# The GPU matrix on the device: build every variant, then every gpu-marked test.
# When: on a GPU machine after any change to templates/ or ddtree_gen/ (plans, launchers, runtime),
# before committing it; pytest args narrow it (e.g. tests/test_gpu_tree_verify.py -k wgmma).
# Usage: bash scripts/gpu_matrix.sh [pytest args...]; logs go to $OUT (or ./gpu-out).
# Build targets (docs/decisions.md, "Build targets"): by default each kernel runs as the build for the
# GPU (the sm_90a cubins on an H100 / H200). DDTREE_GEN_ARCH=sm_80 runs the matrix on the sm_80 PTX
# builds instead (what an A100, L40S or B200 runs; the tests of the wgmma kernels skip, saying why);
# PASSES="auto sm_80" runs both passes, one after the other (logs gpu-tests.log, gpu-tests-sm_80.log).
set -uo pipefail
out="${OUT:-gpu-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 DDTREE_GEN_CACHE="${DDTREE_GEN_CACHE:-/tmp/ddtree-gen-cache}"
python3 -c "import ml_dtypes" 2>/dev/null || echo "WARNING: ml_dtypes is not installed: the fp8 specs' GPU tests need it (pip install ml_dtypes)"
# one build process per spec, side by side (the binary cache's file locks make that safe): on the 16-core H200 machine
# the six shipped specs build in ~35 s this way, several minutes one variant after another
pids=()
for f in specs/*.toml; do
  name="$(basename "$f" .toml)"
  python3 -m ddtree_gen build "$name" > "$out/build-$name.log" 2>&1 & pids+=("$!")
done
build_rc=0
for pid in "${pids[@]}"; do wait "$pid" || build_rc=1; done
echo "build exit $build_rc"; tail -qn1 "$out"/build-*.log
rc=0
for arch in ${PASSES:-${DDTREE_GEN_ARCH:-auto}}; do
  tag=""; [ "$arch" = auto ] || tag="-$arch"
  echo "=== gpu tests, DDTREE_GEN_ARCH=$arch"
  DDTREE_GEN_ARCH="$arch" python3 -m pytest -m gpu -q -ra -p no:cacheprovider --junitxml="$out/gpu-junit$tag.xml" \
    "$@" 2>&1 | tee "$out/gpu-tests$tag.log" | tail -60 || rc=1
done
exit $rc
