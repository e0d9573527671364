#!/usr/bin/env bash
# The measurements waiting for a GPU, in the order they are worth a scarce device call: each step under its own
# timeout and the whole under DEADLINE seconds (a device command may run 10 minutes), a table of the steps last.
# When: the first device call of a session after work built behind a knob with no GPU lent (issues 45 and 46: the
# spread and producer loads, the one-wave chunk count, the combine by programmatic dependent launch).
# Usage: OUT=... [DEADLINE=560] [STEPS="prebuild loads ..."] bash scripts/device_queue.sh
#   FlashMLA's package on PYTHONPATH gives the compare scripts their peer column (docs/benchmarks.md).
# Steps (STEPS picks and orders them; the default: all, in this order):
#   prebuild   compile the builds the later steps load, 16 at a time (the steps then find them in the cache)
#   loads      tests/test_gpu_page_sizes.py -k page_loads: spread and producer against serial, bit for bit
#   pdl        the gpu tests of the combine by programmatic dependent launch (-k pdl), where they exist
#   compare    scripts/compare_loads.py: every loader at pages 64 / 16 / 1 of one cache (issue 46's table)
#   one_wave   scripts/compare_one_wave.py (issue 45: one wave of chunks for a request of few rows)
#   producer   scripts/compare_producer.py (issue 45: the producer at page 64 on drawn shapes, against FlashMLA)
#   pdl_time   scripts/compare_pdl.py, where it exists (issue 45: the combine's launch gap)
#   pages      ddtree-gen bench tree_verify --pages 1,16,64 --seed 43 (the default builds, drawn shapes)
#   ncu        scripts/ncu_tree_verify.py: the attention kernel and the combine of one call under ncu (issue 45's
#              "measure the limit first"), the default route and the producer loads
#   sanitize   scripts/sanitize_loads.py: memcheck and synccheck on the spread and producer builds
set -uo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;; esac
out="${OUT:-device-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DDTREE_GEN_CACHE="${DDTREE_GEN_CACHE:-/tmp/ddtree-gen-cache}"
deadline=$(( $(date +%s) + ${DEADLINE:-560} ))
steps="${STEPS:-prebuild loads pdl compare one_wave producer pdl_time pages ncu sanitize}"
declare -A limit=([prebuild]=150 [loads]=240 [pdl]=120 [compare]=240 [one_wave]=120 [producer]=240 [pdl_time]=120 [pages]=200
                  [ncu]=300 [sanitize]=400)
table=()

prebuild() {
  python3 - <<'EOF'
from ddtree_gen.bench.specs import page_variant
from ddtree_gen.build.artifacts import build_variants
from ddtree_gen.build.variant import variant
from ddtree_gen.ops import by_name
from ddtree_gen.ops.tree_verify.wgmma import seesaw_tma
from ddtree_gen.spec import find_spec
vs = []
for base in ("kimi-k2.6-tp8", "kimi-k2.6"):
    for page in (1, 16, 32, 64):
        spec = page_variant(find_spec(base), page)
        for tma in sorted({seesaw_tma(spec), False}):
            for grid in ("chunks", "parts"):
                for loads in ("serial", "spread", "producer"):
                    try:
                        v = variant(by_name("tree_verify_wgmma"), spec, tma=tma, grid=grid, page_loads=loads)
                        v.plan()
                    except Exception:   # a knob this build refuses (spread at page 64 TMA)
                        continue
                    vs.append(v)
built = build_variants(vs, jobs=16)
bad = [(v.name, r) for v, r in zip(vs, built) if isinstance(r, Exception)]
print(f"{len(vs) - len(bad)} of {len(vs)} builds compiled")
for name, err in bad:
    print(name, err)
raise SystemExit(1 if bad else 0)
EOF
}
step() {   # name: run it under the smaller of its limit and what is left of the deadline
  local name="$1" left=$(( deadline - $(date +%s) )) t0 rc
  local lim=$(( ${limit[$name]:-120} < left ? ${limit[$name]:-120} : left ))
  if [ "$lim" -le 10 ]; then table+=("$(printf '%-10s %-8s %6s' "$name" "no time" "-")"); return; fi
  t0=$(date +%s)
  echo "=== $name (limit ${lim}s)"
  case "$name" in
    prebuild) timeout "$lim" bash -c "$(declare -f prebuild); prebuild" ;;
    loads)    timeout "$lim" python3 -m pytest -q -ra -p no:cacheprovider tests/test_gpu_page_sizes.py -k page_loads ;;
    pdl)      if grep -lqs pdl tests/test_gpu_*.py; then
                timeout "$lim" python3 -m pytest -q -ra -p no:cacheprovider $(grep -ls pdl tests/test_gpu_*.py) -k pdl
              else echo "no pdl test"; fi ;;
    compare)  timeout "$lim" python3 scripts/compare_loads.py ;;
    one_wave) timeout "$lim" python3 scripts/compare_one_wave.py ;;
    producer) timeout "$lim" python3 scripts/compare_producer.py ;;
    pdl_time) if [ -f scripts/compare_pdl.py ]; then timeout "$lim" python3 scripts/compare_pdl.py
              else echo "no scripts/compare_pdl.py"; fi ;;
    pages)    timeout "$lim" python3 -m ddtree_gen bench tree_verify --pages 1,16,64 --seed 43 ;;
    ncu)      timeout "$lim" bash -c "python3 scripts/ncu_tree_verify.py --out '$out/ncu'; \
                python3 scripts/ncu_tree_verify.py --loads producer --out '$out/ncu-producer'" ;;
    sanitize) timeout "$lim" python3 scripts/sanitize_loads.py --out "$out/sanitize" ;;
    *)        echo "unknown step $name"; false ;;
  esac > "$out/$name.log" 2>&1
  rc=$?
  tail -n 25 "$out/$name.log"
  table+=("$(printf '%-10s %-8s %6s' "$name" "rc $rc" "$(( $(date +%s) - t0 ))s")")
}
for s in $steps; do step "$s"; done
echo; printf '%-10s %-8s %6s\n' step result time
printf '%s\n' "${table[@]}"
