"""`ddtree-gen bench NAME`: our kernels next to their peers, side by side in one process on the GPU.

One module per benchmark, each with `run(args)` (args: `spec`, a list of spec names or None, and `out`,
a folder or None); each prints a table last, and --out DIR also writes it (and a plot where there is one):

  tree_build, draft_topk, tree_verify, kv_dtype (`bench kv-dtype`), arch, tree_accept, step, launch.

What they share lies below them, and the benchmarks never import each other: timing (CUDA-event and
CUDA-graph medians, the measured peak and copy rate, the table), peers (what an engine runs today:
FlashMLA, torch, a CPU heap builder) and specs (the shipped spec per head count, spec variants). Their
inputs come from ddtree_gen.inputs.

Two modules are no benchmark and no benchmark imports them: stand_in (a kernel set of stand-in binaries on a
stand-in device, with bench launch's call table: the CPU harness of the host path, scripts/profile_launch.py and
the tests) and compare (the comparison scripts' outputs to the host and worst-row differences). scripts/ reach
the benchmarks' call tables, inputs and timings through these modules' public names.
"""
