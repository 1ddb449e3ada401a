"""Flat buffers: many tensors as one 1-D tensor, and back (the lab's one version of each).

A collective per tensor costs one latency each; the parallelisms therefore move ONE flat
buffer: flatten (zero-padded where the buffer is cut into N equal shards), communicate,
write the result back into the tensors. Buckets are the same idea cut into pieces of about
``bucket_size_mb`` so that communication can start while backward is still running.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def trainable(model: nn.Module) -> list:
    """The parameters that get a gradient; model.parameters() lists a tied Parameter once."""
    return [p for p in model.parameters() if p.requires_grad]


def flatten(tensors, total: int | None = None) -> torch.Tensor:
    """The tensors flattened into one new 1-D tensor, zero-padded to `total` elements (default: none)."""
    flat = [t.reshape(-1) for t in tensors]
    if not flat:
        raise ValueError("nothing to flatten: pass at least one tensor")
    numel = sum(t.numel() for t in flat)
    total = numel if total is None else total
    if total < numel:
        raise ValueError(f"total={total} is smaller than the {numel} elements of the tensors")
    pad = [flat[0].new_zeros(total - numel)] if total > numel else []
    return torch.cat(flat + pad)


def write_back(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of `flat` into `tensors`, in place (the inverse of `flatten`; padding ignored)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def grads_or_zeros(params) -> list:
    """Each parameter's .grad, or zeros where it is None (a parameter this rank's data did not use)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def allreduce_mean_(tensors, *, group: dist.ProcessGroup | None = None) -> None:
    """Replace every tensor by its mean over the ranks of `group`, in place, with ONE flat all-reduce.

    Collective. Returns None, as the in-place dist ops do.
    """
    tensors = list(tensors)
    if not tensors:
        return
    flat = flatten(tensors)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    write_back(flat, tensors)


def bucket_parameters(params, bucket_size_mb: float) -> list[list]:
    """`params` in REVERSE order cut into buckets of about `bucket_size_mb` MB each.

    Reverse order because backward produces the last layers' gradients first; a parameter
    larger than the limit gets a bucket of its own. buckets[0] holds the LAST parameters.
    Raises ValueError when bucket_size_mb is not positive.
    """
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}: "
                         "use e.g. 25 (MB of gradient per collective)")
    limit = bucket_size_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
