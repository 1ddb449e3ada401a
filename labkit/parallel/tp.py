"""Tensor-parallel helpers that are not exercises (used by notebooks 08 and 11)."""
from __future__ import annotations

import torch.distributed as dist


def tp_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when no process group is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_divisible(size: int, world: int, what: str) -> int:
    """size // world, or a ValueError that says which dimension does not split."""
    if size % world:
        raise ValueError(f"{what}={size} does not divide by the tensor-parallel size {world}: "
                         f"choose a TP size that divides {size}, or pad {what} to a multiple of {world}")
    return size // world
