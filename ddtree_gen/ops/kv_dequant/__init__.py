"""kv_dequant: an fp8 spec's pre-pass, e4m3 pages -> a bf16 paged workspace. plan.py: build data; launch.py:
launcher.
"""
