# GENERATED from solutions/collectives.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/02_collectives.ipynb.
# untouched-stub fingerprint: 806da3d0988559b2
"""Collectives built from point-to-point messages (notebook 02_collectives).

Each function behaves like its torch.distributed namesake, same arguments and
same result, but is written with nothing more than `dist.send` / `dist.recv`
and their non-blocking forms `dist.isend` / `dist.irecv` (which return a work
object: call `.wait()` on it before touching the tensor again).

Conventions, as in torch.distributed:
- every rank of `group` calls the function, in the same order as the others;
- `src` / `dst` are GLOBAL ranks; `info.group_rank(src)` turns one into a rank
  inside the group, which is what `group_dst=` / `group_src=` take;
- results are written in place and the functions return None;
- a rank that is not in `group` returns at once;
- reductions are sums (an average is a sum, then one division by the world size).

Before any message moves, `check_tensors` compares (numel, dtype, device) across
the ranks, so a mismatch raises a ValueError on every rank instead of hanging.
"""
import torch
import torch.distributed as dist

from labkit.comm.checks import check_tensors, group_info, require_contiguous

NOTEBOOK = "02_collectives"


def _list_error(tensors, like, size, what):
    """A message if `tensors` is not `size` contiguous tensors shaped like `like`, else None."""
    if tensors is None or len(tensors) != size:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        return f"{what} must hold one tensor per rank of the group ({size}), got {got}"
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.numel() != like.numel() or t.dtype != like.dtype:
            return (f"{what}[{i}] must have {like.numel()} elements of {like.dtype} like the "
                    f"tensor argument, got {tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t))}")
    return require_contiguous(*tensors)


def broadcast(tensor, src, group=None):
    """Copy `tensor` of global rank `src` into `tensor` on every rank of `group`, in place.

    Like `dist.broadcast(tensor, src, group)`. The root sends its tensor to each
    other rank; the others receive into theirs.
    """
    info = group_info(group)
    if info is None:
        return
    root = info.group_rank(src)
    check_tensors("broadcast", tensor, group, require_contiguous(tensor))
    raise NotImplementedError("exercise broadcast is not implemented yet: edit exercises/collectives.py, see notebooks/02_collectives.ipynb")


def reduce(tensor, dst, group=None):
    """Sum `tensor` over the ranks of `group` into `tensor` on global rank `dst`, in place.

    Like `dist.reduce(tensor, dst, op=SUM, group)`. Only `dst`'s tensor changes
    (torch leaves the others' unspecified; here they are untouched).
    """
    info = group_info(group)
    if info is None:
        return
    root = info.group_rank(dst)
    check_tensors("reduce", tensor, group, require_contiguous(tensor))
    raise NotImplementedError("exercise reduce is not implemented yet: edit exercises/collectives.py, see notebooks/02_collectives.ipynb")


def all_gather(tensor_list, tensor, group=None):
    """Fill `tensor_list[i]` with group rank i's `tensor`, on every rank.

    Like `dist.all_gather(tensor_list, tensor, group)`: `tensor_list` holds one
    tensor per rank of the group, each with as many elements as `tensor`.
    """
    info = group_info(group)
    if info is None:
        return
    problem = _list_error(tensor_list, tensor, info.size, "tensor_list") or require_contiguous(tensor)
    check_tensors("all_gather", tensor, group, problem)
    raise NotImplementedError("exercise all_gather is not implemented yet: edit exercises/collectives.py, see notebooks/02_collectives.ipynb")


def scatter(tensor, scatter_list=None, src=0, group=None):
    """Copy `scatter_list[i]` of global rank `src` into `tensor` on group rank i.

    Like `dist.scatter(tensor, scatter_list, src, group)`: only `src` passes a
    `scatter_list` (one tensor per rank, each with as many elements as
    `tensor`); the other ranks pass None or [].
    """
    info = group_info(group)
    if info is None:
        return
    root = info.group_rank(src)
    if info.rank == root:
        problem = _list_error(scatter_list, tensor, info.size, "scatter_list")
    else:
        problem = "only the src rank passes a scatter_list; pass None here" if scatter_list else None
    check_tensors("scatter", tensor, group, problem or require_contiguous(tensor))
    raise NotImplementedError("exercise scatter is not implemented yet: edit exercises/collectives.py, see notebooks/02_collectives.ipynb")


def reduce_scatter(output, input_list, group=None):
    """Set `output` on group rank i to the sum over all ranks of their `input_list[i]`.

    Like `dist.reduce_scatter(output, input_list, op=SUM, group)`: `input_list`
    holds one tensor per rank of the group, each with as many elements as `output`.
    """
    info = group_info(group)
    if info is None:
        return
    problem = _list_error(input_list, output, info.size, "input_list") or require_contiguous(output)
    check_tensors("reduce_scatter", output, group, problem)
    raise NotImplementedError("exercise reduce_scatter is not implemented yet: edit exercises/collectives.py, see notebooks/02_collectives.ipynb")
