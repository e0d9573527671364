"""draft_topk: the drafter's logits -> tree_build's top-k table. plan.py: build data; launch.py: launcher.
"""
