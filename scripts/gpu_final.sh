#!/usr/bin/env bash
# One device call: the GPU matrix, the benchmarks, the tree_build probe and the example loop.
set -uo pipefail
out="${OUT:-gpu-out}"; mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 DDTREE_GEN_CACHE="${DDTREE_GEN_CACHE:-/tmp/ddtree-gen-cache}"
timeout 300 bash scripts/gpu_matrix.sh --timeout=150 > "$out/matrix.txt" 2>&1
timeout 200 python3 -m ddtree_gen bench tree_build tree_verify --out "$out" > "$out/bench.txt" 2>&1
timeout 60 python3 scripts/probe_tree_build.py > "$out/probe.txt" 2>&1
timeout 120 python3 examples/speculative_decode.py --spec kimi-k2.6-tp8 --batch 8 --graph > "$out/example.txt" 2>&1
tail -4 "$out/matrix.txt"; grep -E "^(FAILED|ERROR)" "$out/matrix.txt" | head -20
tail -34 "$out/bench.txt"; cat "$out/probe.txt"; tail -25 "$out/example.txt"
