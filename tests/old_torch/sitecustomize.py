"""On the path (PYTHONPATH), makes this torch look like torch 2.11: no *_single collectives.

Used by tests/test_gpu_node.py to prove the lab runs where they are missing (labkit.comm.compat).
"""
import torch.distributed as _dist

for _name in ("all_gather_single", "reduce_scatter_single"):
    if hasattr(_dist, _name):
        delattr(_dist, _name)
