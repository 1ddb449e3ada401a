"""Time of one collective from measured bus bandwidth and latency, per link level (notebook 15): the lab's one
model of a collective's time, which the cost model's traffic (labkit.scale.traffic) prices every call with.

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
busbw depends on that chunk alone). Across nodes a ring collective of a group with k ranks in each node crosses
on k NICs, up to the node's own busbw (`Cluster.link`'s per_node: NVIDIA's '48GB/s from each CX7 NIC ...
aggregated to achieve up to ~396GB/s with the RING protocol', nccl-tests #319); an all-to-all or a send, one NIC's.

Steps: NCCL's rings, every kind: all-gather / reduce-scatter / all-to-all n-1, all-reduce 2(n-1), send 1.
alpha: 0 where the size read lies within a measured curve (its busbw is wire / measured time: the latency is
in it); inside a node NVLink's latency per step; a ring across nodes takes NCCL's own latency model
(`Cluster.ring_step_latency`, src/graph/tuning.cc: a base per collective, NVLink's latency for the steps inside a
node, the network's only at each crossing), given here as its mean per step; an all-to-all or a send across
nodes, the network's latency per step. (NCCL may pick its tree for a small all-reduce across nodes; the lab
prices the ring, which its tuner picks for the large gradient all-reduces the cost model meets.) Without a
curve, message size enters through alpha: algbw = S / (steps alpha + wire / busbw) rises with S towards
busbw / bus factor, the shape of an nccl-tests curve.
"""
from __future__ import annotations

from labkit.comm.ops import OPS
from labkit.scale.cluster import RING_KINDS

# each kind's row of the lab's op table: its bus factor is the one labkit.comm counts wire bytes with
_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
       "all_to_all": "all_to_all_single", "send": "send"}
BUS_FACTOR = {kind: (lambda n, op=op: float(OPS[op].bus_factor(n))) for kind, op in _OP.items()}


def steps(kind: str, n: int) -> int:
    """Latency steps of NCCL's ring for `kind` over n ranks (a send: 1; one rank: 0)."""
    if kind not in BUS_FACTOR:
        raise ValueError(f"kind={kind!r}: choose one of {sorted(BUS_FACTOR)}")
    if n <= 1:
        return 0
    if kind == "send":
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def ring_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> tuple[float, float]:
    """(wire bytes per rank, seconds) of one collective of a full tensor of `nbytes` over n ranks, at a link of
    (alpha seconds per step, beta bytes/s of bus bandwidth)."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    wire = BUS_FACTOR[kind](n) * nbytes
    return wire, steps(kind, n) * alpha + wire / beta


def ring_link(cluster, level: str, kind: str, nbytes: float, n: int, per_node: int = 1) -> tuple[float, float]:
    """(alpha, beta) of one collective (`Cluster.link`), where a ring collective across nodes that no measured curve
    covers takes NCCL's latency model for its steps (`Cluster.ring_step_latency`: a base per collective, NVLink's
    latency for the steps inside a node, the network's for each crossing), not the network's latency for every
    step."""
    alpha, beta = cluster.link(level, kind, nbytes, n, per_node)
    if level == "network" and kind in RING_KINDS and alpha > 0 and n > 1:
        alpha = cluster.ring_step_latency(kind, n, min(per_node, cluster.gpus_per_node))
    return alpha, beta


def collective_time(kind: str, nbytes: float, n: int, level: str, cluster, per_node: int = 1) -> tuple[float, float]:
    """(wire bytes per rank, seconds) of one collective of `nbytes` (nccl-tests' S) over n ranks at `level`;
    per_node: the group's ranks in each node, whose NICs a ring collective across nodes spreads over (Cluster.link)."""
    return ring_time(kind, nbytes, n, *ring_link(cluster, level, kind, nbytes, n, per_node))
