# GENERATED from solutions/hierarchical.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/03_allreduce.ipynb.
# untouched-stub fingerprint: 9fe185b3064b168d
"""A two-level (hierarchical) all-reduce, the shape real clusters use (notebook 03_allreduce, stretch).

A cluster has fast links inside a node (NVLink, shared memory) and a slower network between
nodes (InfiniBand, Ethernet). With ranks numbered node by node (node = rank // node_size,
local = rank % node_size), the two-level all-reduce of a tensor of S bytes is:

  1. intra-node reduce-scatter: local rank i of every node ends with the node's sum of chunk i
     (the tensor cut into node_size chunks);
  2. inter-node all-reduce of that chunk, among the ranks with the same local index, one per
     node (node_size independent all-reduces of S / node_size bytes, in parallel);
  3. intra-node all-gather: every rank gets every completed chunk.

Only step 2 crosses the network, and with n_nodes ranks instead of world_size: 2(n_nodes - 1)
network steps instead of the flat ring's 2(world_size - 1). `cost_model` gives both times.
Horovod's hierarchical all-reduce and NCCL's intra-node rings around an inter-node ring or
tree follow the same idea.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.mesh import Mesh
from labkit.renames import renamed_in

NOTEBOOK = "03_allreduce"


def node_mesh(node_size: int) -> Mesh:
    """This rank's `labkit.mesh.Mesh` over a cluster of nodes of `node_size` consecutive ranks.

    The mesh's cluster vocabulary: ``Mesh(world, node=world // node_size, local=node_size)``,
    the grid arange(world).view(n_nodes, node_size), node outer, local inner. Then
    ``mesh.group("local")`` holds this rank's node, ``mesh.group("node")`` the ranks with its
    local index on every node, ``mesh.coord("local")`` is its index inside the node and
    ``mesh.size("local")`` the node size. Collective: every rank of the world calls it, with the
    same node_size. Raises ValueError on every rank when node_size does not divide the world size
    (nodes would be unequal).
    """
    world = dist.get_world_size()
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be an int >= 1, got {node_size!r}")
    if world % node_size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"node_size={node_size} does not divide the world size {world}: the nodes would "
                         f"be unequal; use one of {divisors}")
    return Mesh(world, node=world // node_size, local=node_size)


def hierarchical_allreduce(tensor: torch.Tensor, *, mesh: Mesh, inter_allreduce=None) -> torch.Tensor:
    """Sum `tensor` over every rank of the world, in place, in two levels; return `tensor`.

    mesh: from ``node_mesh(node_size)``, a Mesh with the axes ``node`` and ``local``; ask it for
    ``mesh.size("local")`` (node_size), ``mesh.coord("local")`` (this rank's index in its node),
    ``mesh.group("local")`` (its node's ranks) and ``mesh.group("node")`` (the same local index
    on every node). Steps (docstring of the module):
      1. flatten (a contiguous copy), pad with zeros to a multiple of node_size, and
         dist.reduce_scatter the node_size chunks over ``mesh.group("local")``: this rank keeps
         the node's sum of chunk ``mesh.coord("local")``;
      2. all-reduce that chunk over ``mesh.group("node")`` with inter_allreduce(chunk, group=...)
         (default dist.all_reduce; pass your ring from notebook 03 to use it between nodes);
      3. dist.all_gather the chunks over ``mesh.group("local")``, drop the padding, copy back into
         `tensor` (which may be non-contiguous).
    Equal to dist.all_reduce(tensor) up to the order of the additions (exact for integers).
    """
    inter_allreduce = inter_allreduce or dist.all_reduce
    raise NotImplementedError("exercise hierarchical_allreduce is not implemented yet: edit exercises/hierarchical.py, see notebooks/03_allreduce.ipynb")


def cost_model(nbytes: float, n_nodes: int, node_size: int, intra_bw: float, inter_bw: float,
               intra_latency: float = 0.0, inter_latency: float = 0.0, nics_per_node: int = 1) -> dict:
    """Seconds of a flat ring and of the two-level all-reduce (alpha-beta model, a ring at each level).

    intra_bw: bytes/s of one rank's link inside a node; inter_bw: bytes/s of one node's network
    links together, spread over `nics_per_node` NICs (a GPU node often has one per GPU);
    latencies in seconds per message. S = nbytes, N = n_nodes x node_size, M = n_nodes, L = node_size.
    Flat ring over all N ranks, numbered node by node: 2(N-1) steps of S/N bytes, each paced by
    the slowest link of the ring, a network hop, which goes through ONE NIC of the node:
        2(N-1) x (inter_latency + S / (N x inter_bw / nics_per_node))
    Two-level: reduce-scatter and all-gather inside the node (2(L-1) steps of S/L bytes on the
    fast links), and L rings of S/L bytes between the nodes, in parallel, sharing all the
    node's NICs (2(M-1) steps; per step the node's links carry L x S/(M L) = S/M bytes):
        2(L-1) x (intra_latency + S / (L intra_bw)) + 2(M-1) x (inter_latency + S / (M inter_bw))
    With one NIC the bandwidth terms are about equal (2S / inter_bw each): the gain is the
    2(M-1) network latencies instead of 2(N-1). With a NIC per rank, the two-level version
    also drives every NIC at once: about L times less time on the network.
    Returns {"flat": s, "hierarchical": s, "flat_network_steps": .., "hierarchical_network_steps": ..}.
    """
    if n_nodes < 1 or node_size < 1 or nics_per_node < 1:
        raise ValueError(f"need n_nodes, node_size, nics_per_node >= 1, got {n_nodes}, {node_size}, {nics_per_node}")
    n, m, L = n_nodes * node_size, n_nodes, node_size
    if m == 1:  # one node: the flat ring never leaves it, and the two levels are the same ring
        flat = 2 * (n - 1) * (intra_latency + nbytes / (n * intra_bw))
        return {"flat": flat, "hierarchical": flat, "flat_network_steps": 0, "hierarchical_network_steps": 0}
    flat = 2 * (n - 1) * (inter_latency + nbytes / (n * inter_bw / nics_per_node))
    hier = 2 * (L - 1) * (intra_latency + nbytes / (L * intra_bw)) + \
        2 * (m - 1) * (inter_latency + nbytes / (m * inter_bw))
    return {"flat": flat, "hierarchical": hier,
            "flat_network_steps": 2 * (n - 1), "hierarchical_network_steps": 2 * (m - 1)}


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
