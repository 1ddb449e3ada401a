"""Time of one collective from measured bus bandwidth and latency, per link level (notebook 15).

nccl-tests' convention (the lab's `labkit.comm.ops` bus factors): a collective of S bytes over n
ranks puts wire = S x bus factor on each rank's link (all-reduce 2(n-1)/n; all-gather, reduce-scatter,
all-to-all (n-1)/n; send/recv 1), and its bus bandwidth busbw = wire / time is what nccl-tests
reports, flat in n for a given link. So

    time = steps x alpha + wire / busbw(level, kind, S)

busbw: the cluster's measured figure (`Cluster.link`): the kind's own against the size S where
`busbw_by_kind` gives a curve (nccl-tests' sweeps: on 8 A100s the all-reduce from 1.3 GB/s at 32 KiB
to 235 GB/s at 16 GiB; on H100 nodes NVLink SHARP speeds up the all-reduce only, so the all-gather and
reduce-scatter have their own), else the level's large-message figure (`node_busbw_gbytes_per_s`),
else the link's datasheet rate: an upper bound. A node's curve, measured over the whole node, is read for
n ranks at S x gpus_per_node / n, where the node's ring moves the same chunk S / n per step (in a ring,
busbw depends on that chunk alone). alpha: the level's per-step latency, 0 where the size read lies
within a measured curve (its busbw is wire / measured time: the latency is in it). Across nodes a ring
collective of a group with k ranks in each node crosses on k NICs, up to the node's own busbw (`Cluster.link`'s
per_node: NVIDIA's '48GB/s from each CX7 NIC ... aggregated to achieve up to ~396GB/s with the RING protocol',
nccl-tests #319); an all-to-all or a send, one NIC's. Steps, by
NCCL's algorithm: ring all-gather / reduce-scatter / all-to-all n-1; all-reduce inside a node a ring,
2(n-1); all-reduce across nodes NCCL's tree (double binary tree, Sanders et al. 2009, NCCL >= 2.4),
2 log2(n) latency steps at the same bus bandwidth; send/recv 1. Without a curve, message size enters
through alpha: algbw = S / (steps alpha + wire / busbw) rises with S towards busbw / bus factor, the
shape of an nccl-tests curve.
"""
from __future__ import annotations

import math

from labkit.comm.ops import OPS

# each kind's row of the lab's op table: its bus factor is the one labkit.comm counts wire bytes with
_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
       "all_to_all": "all_to_all_single", "send": "send"}
BUS_FACTOR = {kind: (lambda n, op=op: float(OPS[op].bus_factor(n))) for kind, op in _OP.items()}


def steps(kind: str, n: int, level: str) -> int:
    """Latency steps of NCCL's algorithm for `kind` over n ranks at `level` ("node" or "network")."""
    if kind not in BUS_FACTOR:
        raise ValueError(f"kind={kind!r}: choose one of {sorted(BUS_FACTOR)}")
    if n <= 1:
        return 0
    if kind == "send":
        return 1
    if kind == "all_reduce":
        return 2 * math.ceil(math.log2(n)) if level == "network" else 2 * (n - 1)
    return n - 1


def collective_time(kind: str, nbytes: float, n: int, level: str, cluster, per_node: int = 1) -> tuple[float, float]:
    """(wire bytes per rank, seconds) of one collective of `nbytes` (nccl-tests' S) over n ranks at `level`;
    per_node: the group's ranks in each node, whose NICs a ring collective across nodes spreads over (Cluster.link)."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    wire = BUS_FACTOR[kind](n) * nbytes
    alpha, beta = cluster.link(level, kind, nbytes, n, per_node)
    return wire, steps(kind, n, level) * alpha + wire / beta
