"""The lab's one sharding rule: N equal, contiguous pieces, piece r to rank r.

- a batch: rows ``[r*b, (r+1)*b)``, ``b = B // N`` (`shard_rows`; B must divide by N);
- a flat parameter vector: elements ``[r*s, (r+1)*s)``, ``s = ceil(numel / N)``, after zero-padding
  to ``s*N`` (`shard_size`, `local_shard`): what ZeRO-1/2/3 store, reduce-scatter and all-gather.
Every function that communicates is collective over `group` (None: the default group) and calls
``dist.<op>`` when it runs, so that the lab's interception sees it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def shard_rows(batch, index: int, count: int):
    """Rows ``[index*b, (index+1)*b)`` of a global batch, ``b = B // count``.

    ``batch`` is a tensor or a tuple/list (or namedtuple) of tensors sharing their first
    dimension; the result has the same structure. Shards are disjoint and cover the batch.
    Raises ValueError when B does not split into ``count`` equal parts or ``index`` is out of range.
    """
    tensors = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    if not tensors:
        raise ValueError("the batch holds no tensors: pass a tensor or a tuple such as (x, y)")
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is not in [0, {count})")
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1:
        raise ValueError(f"the tensors of a batch must share their first dimension, got {sorted(rows)}")
    (size,) = rows
    if size % count:
        raise ValueError(f"global batch of {size} rows does not split into {count} equal shards: "
                         f"use a global batch size that is a multiple of {count}")
    b = size // count
    shards = [t[index * b:(index + 1) * b] for t in tensors]
    if not isinstance(batch, (tuple, list)):
        return shards[0]
    return type(batch)(*shards) if hasattr(batch, "_fields") else type(batch)(shards)


def shard_size(numel: int, world_size: int) -> int:
    """Elements per rank once `numel` is padded to a multiple of world_size: ceil(numel / N)."""
    return math.ceil(numel / world_size)


def local_shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s piece (a view) of a 1-D `flat` whose length divides by world_size."""
    if flat.dim() != 1 or flat.numel() % world_size:
        raise ValueError(f"flat must be 1-D with a length that divides by the world size {world_size}, "
                         f"got shape {tuple(flat.shape)}: pad it first (labkit.parallel.flat.flatten(.., total=))")
    size = flat.numel() // world_size
    return flat[rank * size:(rank + 1) * size]


def reduce_scatter_mean(flat: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                        via_allreduce: bool = False) -> torch.Tensor:
    """This rank's shard of the average of `flat` over the ranks: a new tensor of len(flat) // N.

    flat: 1-D, length a multiple of the world size, identical in length on every rank.
    `via_allreduce=True` is the fallback for a backend without reduce-scatter: all-reduce
    everything, keep the shard. Same result, but every rank receives the whole sum (2x traffic).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_shard(flat, rank, world)  # checks the shape
    if via_allreduce:
        total = flat.clone()
        dist.all_reduce(total, group=group)
        out = local_shard(total, rank, world).clone()
    else:
        out = torch.empty(flat.numel() // world, dtype=flat.dtype, device=flat.device)
        # SUM then divide (not ReduceOp.AVG): AVG is missing on some backends and versions
        dist.reduce_scatter_single(out, flat.contiguous(), group=group)
    return out.div_(world)


def all_gather_flat(shard: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D `shard` (same length everywhere) concatenated in rank order: a new tensor."""
    world = dist.get_world_size(group)
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes THIS rank holds in an optimizer's state (Adam: exp_avg, exp_avg_sq, step).

    A DTensor (FSDP2's sharded state) counts its local shard only.
    """
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return sum(local(t).numel() * t.element_size()
               for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))
