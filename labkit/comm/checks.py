"""Plumbing shared by the collectives written from point-to-point (notebooks 02 and 03).

Two jobs, so that the exercises can stay about the algorithm:

- `group_info(group)`: this rank's position in a process group and the group's
  global ranks (torch's `src`/`dst` arguments are GLOBAL ranks, point-to-point
  with `group_dst=`/`group_src=` takes ranks inside the group);
- `check_tensors(name, tensor, group)`: refuse, on EVERY rank and with a message
  that says what to fix, the inputs that would otherwise hang a collective:
  a tensor on a device the backend cannot move, or tensors whose number of
  elements or dtype differ across ranks. A point-to-point collective given
  mismatched sizes would wait forever for bytes that never come; one tiny
  `all_gather` of (numel, dtype, device ok) first turns that hang into an error.

Both are collective-safe: every rank of the group calls them in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# A stable code per dtype, so ranks can compare dtypes as integers.
DTYPE_CODES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.complex64, torch.complex128]


@dataclass(frozen=True)
class GroupInfo:
    rank: int                # this process's rank inside the group
    size: int                # number of ranks in the group
    global_ranks: list      # global_ranks[i] is the global rank of group rank i

    def group_rank(self, global_rank: int) -> int:
        """The group rank of a GLOBAL rank (how torch's `src=`/`dst=` are given)."""
        if global_rank not in self.global_ranks:
            raise ValueError(f"rank {global_rank} is not in this group (its global ranks are "
                             f"{self.global_ranks}): src/dst are GLOBAL ranks, as in torch.distributed")
        return self.global_ranks.index(global_rank)


def group_info(group=None) -> GroupInfo | None:
    """This rank's place in `group` (None: the default group), or None if it is not a member."""
    if not dist.is_initialized():
        raise RuntimeError("no process group: run this inside labkit.launch(fn, world_size), "
                           "or call torch.distributed.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        return None
    return GroupInfo(rank, dist.get_world_size(group), dist.get_process_group_ranks(group or dist.group.WORLD))


def _allowed_devices(group) -> set | None:
    """Device types the group's backend can move, None if unknown (then no check)."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # e.g. "cpu:gloo,cuda:nccl"
        return {pair.split(":")[0] for pair in backend.split(",")}
    return {"gloo": {"cpu"}, "nccl": {"cuda"}}.get(backend)


def metadata_device(group) -> torch.device:
    """Where a small tensor of metadata (sizes, dtype codes) must live to travel over `group`'s backend."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_tensors(name: str, tensor: torch.Tensor, group=None, local_error: str | None = None) -> None:
    """Raise ValueError on every rank unless all ranks pass tensors the backend can move
    with the same number of elements and dtype. Collective: every rank must call it.

    `local_error`: a problem only this rank can see (e.g. a wrong list on the root);
    it is shared so that every rank raises instead of the others waiting forever.
    """
    if not isinstance(tensor, torch.Tensor):
        local_error = local_error or f"expected a torch.Tensor, got {type(tensor).__name__}"
        tensor = torch.empty(0)
    allowed = _allowed_devices(group)
    device_ok = allowed is None or tensor.device.type in allowed
    code = DTYPE_CODES.index(tensor.dtype) if tensor.dtype in DTYPE_CODES else -1
    mine = torch.tensor([tensor.numel(), code, int(device_ok), int(local_error is None)],
                        dtype=torch.int64, device=metadata_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(int(v) for v in row.cpu()) for row in everyone]
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    backend = dist.get_backend(group)
    if local_error is not None:
        raise ValueError(f"{name}: {local_error}")
    bad_args = [ranks[i] for i, row in enumerate(rows) if not row[3]]
    if bad_args:
        raise ValueError(f"{name}: rank(s) {bad_args} were given bad arguments (see their error); "
                         f"stopping here on every rank instead of waiting for them")
    bad_device = [ranks[i] for i, row in enumerate(rows) if not row[2]]
    if bad_device:
        raise ValueError(
            f"{name}: rank(s) {bad_device} passed a tensor on a device the '{backend}' backend cannot "
            f"use (this rank's is on {tensor.device}); gloo moves CPU tensors, nccl CUDA tensors: "
            f"move the tensor (.cpu() / .cuda()) or pick the matching backend")
    if len({row[:2] for row in rows}) > 1:
        def describe(row):
            dtype = DTYPE_CODES[row[1]] if row[1] >= 0 else "an unusual dtype"
            return f"{row[0]} elements of {dtype}"
        listing = ", ".join(f"rank {r}: {describe(row)}" for r, row in zip(ranks, rows))
        raise ValueError(f"{name}: the tensors differ across ranks ({listing}); every rank must "
                         f"pass a tensor of the same size and dtype, or the collective would hang")


def require_contiguous(*tensors) -> str | None:
    """A message for `check_tensors(local_error=...)` if a tensor is not contiguous, else None."""
    if any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in tensors):
        return ("tensors must be contiguous, as for torch.distributed's own collectives: "
                f"pass t.contiguous() and copy the result back")
    return None
