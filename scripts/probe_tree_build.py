"""Where tree_build's time goes: graph-replayed time per step against the budget (pops).

The slope is the cost of one pop, the intercept the fixed cost (launch, staging, epilogue).
`ddtree-gen bench tree_build` times the full budget only; this sweep splits the time. Then: the pop
loop's cycles and nanoseconds read inside the kernel (clock64, %globaltimer; the rendered source with
a printf added), and the latencies of the warp
operations on a pop's chain (redux, ballot, shfl, lds, fadd), each as a chain of dependent ones.
When: on a GPU after changing the pop loop of templates/tree_build.cu.j2, to compare with the
probe numbers in docs/perf/journal-kernels.md ("tree_build").
Run: PYTHONPATH=. python scripts/probe_tree_build.py
"""
import argparse

from ddtree_gen import needs

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
needs.script_requires(__file__, gpu=True)

import numpy as np  # noqa: E402
import cupy  # noqa: E402
import ddtree_gen  # noqa: E402
from ddtree_gen.spec import find_spec  # noqa: E402
from ddtree_gen.bench.timing import graph_time_ms  # noqa: E402
from ddtree_gen.inputs import tree_build_inputs  # noqa: E402

spec = find_spec("kimi-k2.6-tp8")
ks = ddtree_gen.load(spec, kernels=["tree_build"])
dev = [cupy.asarray(x) for x in tree_build_inputs(spec, 64, np.random.default_rng(0))]
rows = []
for budget in (0, 1, 8, 16, 32, 64):
    out = ks.tree_build(*dev, budget)
    rows.append((budget, graph_time_ms(lambda: ks.tree_build(*dev, budget, out=out)) * 1e3))
empty = cupy.ElementwiseKernel("", "int32 x", "x = 0", "probe_empty")
z = cupy.zeros(1, cupy.int32)
base = graph_time_ms(lambda: empty(z)) * 1e3
slope, icept = np.polyfit([b for b, _ in rows], [t for _, t in rows], 1)
print("budget  us/step")
for b, t in rows:
    print(f"{b:6d}  {t:7.2f}")
print(f"empty kernel in the same graph: {base:.2f} us; fit: {icept:.2f} us + {slope * 1e3:.0f} ns per pop")

# Cycles of the pop loop, read inside the kernel: the rendered source with clock64() / %globaltimer around
# the loop and a printf of block 0's counts, compiled by CuPy with the build's options (a probe, not a build).
from ddtree_gen.build.compile import OPTIONS
from ddtree_gen.ops import by_name
from ddtree_gen.build.variant import variant
from ddtree_gen.build.render import render

kdef = by_name("tree_build")
src = render(variant(kdef, spec))
LOOP = "while (nodes <= budget && w >= 0) {"
probe = ("long long ddt_c0 = clock64(); unsigned long long ddt_t0; "
         "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ddt_t0));\n        " + LOOP)
done = ("if (lane == 0) s.nodes = nodes;\n"
        "        { unsigned long long t1; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t1));\n"
        "          if (lane == 0 && blockIdx.x == 0) printf(\"pops %d: %lld cycles, %llu ns\\n\", nodes - 1,"
        " clock64() - ddt_c0, t1 - ddt_t0); }")
assert src.count(LOOP) == 1 and src.count("if (lane == 0) s.nodes = nodes;") == 1
src = src.replace(LOOP, probe).replace("if (lane == 0) s.nodes = nodes;", done)
n = spec.max_tree_size
outs = [cupy.empty((64,), cupy.int32)] + [cupy.empty((64, n), t) for t in
                                          (cupy.int32, cupy.int32, cupy.int32, cupy.int32, cupy.float32)]
outs.append(cupy.empty((64, n, spec.mask_words), cupy.uint32))
outs += [cupy.empty((64, n), cupy.int32), cupy.empty((64, n), cupy.int32)]
d, k = dev[0].shape[1], dev[0].shape[2]
consts = ks.constants("tree_build")
smem = int(consts["DYNAMIC_SMEM"])
print("as built (block 0):")
fn = cupy.RawModule(code=src, options=tuple(o for o in OPTIONS if not o.startswith("--gpu-architecture")),
                    backend="nvrtc").get_function(kdef.entry)
fn.max_dynamic_shared_size_bytes = smem
for _ in range(3):   # the first launch warms up
    fn((1,), (int(consts["THREADS"]),), (*dev, np.int32(d), np.int32(k), np.int32(64), *outs), shared_mem=smem)
    cupy.cuda.Device().synchronize()

# Latencies (cycles) of the warp operations on a pop's chain, each measured as a chain of 256 dependent ones
LAT_SRC = r"""
extern "C" __global__ void lat(unsigned* out, unsigned seed) {
    const unsigned lane = threadIdx.x;
    __shared__ unsigned sh[64];
    sh[lane] = lane * 2654435761u; sh[lane + 32] = lane;
    __syncwarp();
    unsigned x = seed + lane, y;
    long long t0, t1;
#define CHAIN(name, op) t0 = clock64(); _Pragma("unroll 1") for (int i = 0; i < 256; ++i) { op; } \
    t1 = clock64(); if (lane == 0) printf("%-28s %6.1f cycles\n", name, (double)(t1 - t0) / 256.0);
    CHAIN("redux.max", x = __reduce_max_sync(0xffffffffu, x) + lane)
    CHAIN("redux.min", x = __reduce_min_sync(0xffffffffu, x) ^ lane)
    CHAIN("ballot + ffs", x = __ffs(__ballot_sync(0xffffffffu, (x & 1u) != 0u)) + lane)
    CHAIN("shfl.idx", x = __shfl_sync(0xffffffffu, x, x & 31u) + 1u)
    CHAIN("lds (dependent address)", x = sh[x & 63u])
    CHAIN("fadd", x = __float_as_uint(__uint_as_float(x) + 1.0f))
    y = x;
    out[lane] = y;
}
"""
lat = cupy.RawModule(code=LAT_SRC, options=("--std=c++17",), backend="nvrtc").get_function("lat")
o = cupy.zeros(32, cupy.uint32)
for _ in range(2):
    lat((1,), (32,), (o, np.uint32(7)))
    cupy.cuda.Device().synchronize()
