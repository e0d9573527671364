"""tree_build: best-first DDTree draft-tree expansion. plan.py: build data; launch.py: launcher and declaration.
"""
