"""kv_commit: commit the accepted KV of every layer in one launch. plan.py: build data; launch.py: launcher.
"""
