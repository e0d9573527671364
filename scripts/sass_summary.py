"""SASS summary of generated kernels: matrix instructions and local-memory accesses.

NVRTC's own cubins are not read by cuobjdump / nvdisasm 13.5 ("does not contain device code"),
so this script takes the PTX from NVRTC (the build's options) and assembles it with ptxas, then
disassembles with nvdisasm. Both come from the CUDA toolkit or from the pip wheels
nvidia-cuda-nvcc (ptxas) and nvidia-cuda-nvdisasm; pass their folder with --bin or put them on PATH.
When (no GPU needed): after changing templates/tree_verify_mma.cu.j2 or tree_verify_wgmma.cu.j2, to
check the MMA instruction counts per tile and that there are no local-memory accesses (docs/perf/journal-tree-verify.md).

PYTHONPATH=. python scripts/sass_summary.py [--bin DIR] [SPEC] [KERNEL ...]
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ddtree_gen.build.compile import OPTIONS
from ddtree_gen.ops import all_kernels, by_name
from ddtree_gen.build.variant import variant
from ddtree_gen.build.render import render
from ddtree_gen.spec import find_spec


def tool(name, bin_dir):
    path = Path(bin_dir) / name if bin_dir else shutil.which(name)
    if not path or not Path(path).exists():
        sys.exit(f"sass_summary: {name} not found (--bin DIR, or PATH)")
    return str(path)


def ptx_of(source: str, name: str) -> str:
    from cupy.cuda import nvrtc
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [o for o in OPTIONS if o != "-Xptxas=-v"])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", help="folder with ptxas and nvdisasm")
    ap.add_argument("spec", nargs="?", default="deepseek-v3")
    ap.add_argument("kernels", nargs="*", default=["tree_verify_wgmma", "tree_verify_mma"])
    a = ap.parse_args()
    ptxas, nvdisasm = tool("ptxas", a.bin), tool("nvdisasm", a.bin)
    spec = find_spec(a.spec)
    names = a.kernels or [k.name for k in all_kernels()]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            ptx = Path(tmp) / f"{name}.ptx"
            ptx.write_text(ptx_of(render(variant(by_name(name), spec)), name))
            cubin = Path(tmp) / f"{name}.cubin"
            subprocess.run([ptxas, f"-arch={OPTIONS[0].split('=')[1]}", str(ptx), "-o", str(cubin)], check=True)
            sass = subprocess.run([nvdisasm, str(cubin)], check=True, capture_output=True, text=True).stdout
            mma = collections.Counter(re.findall(r"\b((?:HGMMA|HMMA)\.[A-Za-z0-9x.]+)", sass))
            local = len(re.findall(r"\b(?:LDL|STL)\b", sass))
            print(f"{spec.name} {name}: " + (", ".join(f"{n} x {op}" for op, n in sorted(mma.items())) or "no MMA")
                  + f"; local-memory instructions (LDL/STL): {local}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
