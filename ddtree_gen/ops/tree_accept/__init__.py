"""tree_accept: walk the tree with the target's tokens and commit one layer's accepted KV. plan.py: build data;
launch.py: launcher and declaration.
"""
