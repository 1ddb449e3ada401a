"""Every parameter of a composed run gathered back to the full model's shape: what the proofs compare.

`full_state(stage, mesh=mesh)` is collective over the mesh's tp groups. It returns, on the ONE rank
that reports each parameter, {name: full tensor}; the union over every rank's return value is the
whole model's state dict, with the full model's names. The placement used here is labkit's own
(`labkit.compose.model.param_class`), never the learner's table, so a wrong table cannot hide itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.compose.model import param_class, shard_dim
from labkit.mesh import Mesh


def full_state(stage, *, mesh: Mesh) -> dict:
    """{name: the full parameter} for the parameters this rank reports (see the module docstring)."""
    return gather_full(((name, p.detach()) for name, p in stage.named_parameters()), mesh=mesh)


def gather_full(named, *, mesh: Mesh) -> dict:
    """`full_state` for any tensors shaped as the stage's parameters ((name, tensor) in the stage's
    parameter order: the weights, or their gradients): tp shards all-gathered, one report each."""
    from labkit.compose.dims import summed_axes
    first = {kind: mesh.index(summed_axes(kind, mesh)) == 0 for kind in ("tp_shard", "sp_replica", "expert")}
    out = {}
    for name, t in named:
        kind = param_class(name)
        if kind == "tp_shard" and mesh.size("tp") > 1:
            parts = [torch.empty_like(t) for _ in range(mesh.size("tp"))]
            dist.all_gather(parts, t.contiguous(), group=mesh.group("tp"))
            t = torch.cat(parts, dim=shard_dim(name))
        # the first of the ranks holding this replica reports it (a tp shard: the first tp rank, after the gather);
        # experts: one report per ep rank
        if first[kind] and (kind != "tp_shard" or mesh.coord("tp") == 0):
            out[name] = t.clone()
    return out


def merge(states) -> dict:
    """One state dict from every rank's `full_state`; ValueError if a name is reported twice."""
    merged = {}
    for state in states:
        for name, t in state.items():
            if name in merged:
                raise ValueError(f"{name} reported by two ranks")
            merged[name] = t
    return merged
