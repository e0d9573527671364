"""tree_verify, tree_verify_tail and merge_states: tree attention over the prefix and the tree.

Build data: simple.py (the CUDA-core kernels, merge_states, the cases), mma.py (mma.sync), wgmma.py (Hopper
warpgroup MMA: schedules and builds), split.py (split-KV policy, workspace, combine kernel). Launch: launch.py (the
public launchers and the route of every call), tensor_core.py (the tensor-core launch plan), which.py (what a call
runs: ks.tree_verify_schedule), mma_launch.py / wgmma_launch.py (the families' own launchers).
"""
