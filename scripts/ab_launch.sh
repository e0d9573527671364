#!/usr/bin/env bash
# `ddtree-gen bench launch` of an older commit and of this tree, alternately, in one process each, on one GPU.
#
# When: a launch-path change's H200 rows moved by more than the bench's run-to-run noise (docs/perf/journal-host.md round 4: rows
# 8-11 us worse with torch.add unchanged), to tell a real change from the host's noise in one device call.
# What: exports COMMIT (default cd3eca8) with `git archive COMMIT ddtree_gen generated specs templates
# pyproject.toml` into build/ab-launch/COMMIT (build/ is ignored), then runs `python3 -m ddtree_gen bench launch`
# from that tree and from this one alternately (old, new, old, new, ...), ROUNDS rounds each (default 3); each
# tree with PYTHONPATH and DDTREE_GEN_ROOT set to itself and a DDTREE_GEN_CACHE of its own (the first round of a
# tree compiles its kernels into it). Prints, per row of the bench, the median eager us of the plain launcher
# (torch inputs) and of the torch op of each tree side by side, and each round's torch.add for the host's pace.
# Logs: $OUT/ab-launch/ where OUT is set (the device's output folder), else build/ab-launch/logs/.
# Run: bash scripts/ab_launch.sh [COMMIT] [--rounds N] [--spec SPEC]      (needs git, a CUDA GPU, torch, CuPy)
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }

commit=cd3eca8 rounds=3 spec=kimi-k2.6-tp8
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
        --spec) spec=${2:?--spec needs a spec name}; shift 2 ;;
        -*) echo "ab_launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) commit=$1; shift ;;
    esac
done
case "$rounds" in ''|*[!0-9]*|0) echo "ab_launch.sh: --rounds $rounds: expected a number >= 1" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
git rev-parse --git-dir >/dev/null 2>&1 || { echo "ab_launch.sh: $root is not a git checkout (needs .git)" >&2; exit 2; }
full=$(git rev-parse --verify --quiet "$commit^{commit}") || { echo "ab_launch.sh: no commit $commit here" >&2; exit 2; }
short=$(git rev-parse --short "$full")
old="$root/build/ab-launch/$short"
logs="${OUT:+$OUT/ab-launch}"
logs="${logs:-$root/build/ab-launch/logs}"
mkdir -p "$logs"
if [ ! -f "$old/.exported" ]; then
    rm -rf "$old" && mkdir -p "$old"
    git archive "$full" ddtree_gen generated specs templates pyproject.toml | tar -x -C "$old"
    touch "$old/.exported"
fi
here=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- ddtree_gen generated specs templates || echo "+changes")

bench() {   # bench TREE LOG: one `bench launch` run from TREE, its own cache and root, the package checked to be TREE's
    local tree=$1 log=$2
    local env=(env PYTHONPATH="$tree" DDTREE_GEN_ROOT="$tree" DDTREE_GEN_CACHE="$root/build/ab-launch/cache-$(basename "$tree")")
    local where
    where=$(cd "$tree" && "${env[@]}" python3 -c 'import ddtree_gen, os; print(os.path.dirname(ddtree_gen.__file__))')
    if [ "$where" != "$tree/ddtree_gen" ]; then
        echo "ab_launch.sh: from $tree, python3 imports ddtree_gen from $where" >&2; exit 1
    fi
    (cd "$tree" && "${env[@]}" python3 -m ddtree_gen bench launch --spec "$spec") >"$log" 2>&1 || {
        echo "ab_launch.sh: bench launch failed in $tree (log $log):" >&2; tail -20 "$log" >&2; exit 1; }
}

echo "bench launch, spec $spec: $short (old, build/ab-launch/$short) vs $here (this tree), $rounds rounds each, alternating"
for r in $(seq 1 "$rounds"); do
    bench "$old" "$logs/old-$r.txt"
    bench "$root" "$logs/new-$r.txt"
    echo "  round $r of $rounds done"
done

python3 - "$logs" "$rounds" "$short" "$here" <<'EOF'
import statistics
import sys

logs, rounds, old, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def rows(path):
    """{(call, inputs): eager us} of one `bench launch` table (columns: call 34, inputs 9, then the numbers)."""
    out = {}
    for line in open(path):
        parts = line[44:].split()
        if len(line) < 45 or len(parts) != 5 or line.startswith("call "):
            continue
        try:
            out[(line[:34].strip(), line[35:44].strip())] = float(parts[0])
        except ValueError:
            continue
    return out


runs = {side: [rows(f"{logs}/{side}-{r}.txt") for r in range(1, rounds + 1)] for side in ("old", "new")}
names = list(dict.fromkeys(name for side in runs.values() for run in side for name, _ in run))


def median(side, name, kind):
    got = [run[(name, kind)] for run in runs[side] if (name, kind) in run]
    return f"{statistics.median(got):7.1f}" if got else f"{'-':>7}"


print(f"median eager us per call over {rounds} rounds (plain = the launcher on torch inputs; op = the torch op)")
print(f"{'call':<34} {'plain ' + old:>14} {'plain ' + new:>14} {'op ' + old:>14} {'op ' + new:>14}")
for name in names:
    print(f"{name:<34} {median('old', name, 'torch'):>14} {median('new', name, 'torch'):>14} "
          f"{median('old', name, 'torch op'):>14} {median('new', name, 'torch op'):>14}")
for side in ("old", "new"):
    adds = [f"{run.get(('torch.add, 16 floats', 'torch'), float('nan')):.1f}" for run in runs[side]]
    print(f"torch.add per round, {side}: {' '.join(adds)}")
EOF
echo "logs: $logs"
