"""HSDP by hand: shard inside a node, replicate across nodes (notebook 10_scaling_out).

ZeRO/FSDP (notebook 09) shards the model states over EVERY data-parallel rank: each step's
reduce-scatter and all-gather then run over a group that spans the whole cluster, so every
ring step is paced by the network between nodes. HSDP ("hybrid sharded data parallel") cuts
the W = R x S data-parallel ranks into R replicas of S shards: shard inside a node (fast
links), replicate across nodes (slow links). It is torchtitan's ``dp_replicate x dp_shard``,
FSDP2's ``fully_shard`` on a 2-D ``DeviceMesh`` (replicate, shard), and Megatron-Core's
distributed optimizer with ``num_distributed_optimizer_instances`` = R. One step, on every rank:

    1. backward on this rank's rows: the full gradient g (P elements, zero-padded to S x s)
    2. reduce-scatter g inside the SHARD group (S ranks, one node): shard i of the node's mean
    3. all-reduce that shard across the REPLICA group (R ranks, one per node, same shard i):
       shard i of the mean over all W ranks -- only 1/S of the gradient crosses the network
    4. the optimizer on shard i only (its state is 1/S of the model's)
    5. all-gather the updated shards inside the SHARD group: every rank has every parameter

Steps 2, 3 and 5 are the hierarchical all-reduce of notebook 03 split open: the optimizer runs
on the 1/S shard between its network all-reduce and its node all-gather, and what is gathered
is the parameters, not the gradients. R = 1 is ZeRO-1/2 over the node (notebook 09); S = 1 is
plain DP (notebook 04).

**Why an exercise, not a graded given.** The learner has written each collective already
(reduce-scatter and all-gather in notebook 02, the all-reduce in 03, the shard arithmetic in
09); nothing here is new code. The lesson is WHERE each one runs: which group, which bytes,
and in which order, and a wrong group still trains (it just averages over the wrong ranks or
moves S times the bytes over the network), so a graded check per step is what teaches it.

**The mesh.** One `labkit.mesh.Mesh` in its cluster vocabulary: ``Mesh(W, node=R, local=S)``
(`hsdp_mesh`), ranks node by node. ``mesh.group("local")`` (S consecutive ranks, one node)
is the shard group, ``mesh.group("node")`` (the same local index on every node) the replica
group. The functions take the two groups by keyword, so that a composed run whose
data-parallel ranks are split in some other way can call them with its own groups.

**Bytes per step** (wire bytes, what crosses one rank's link: labkit.comm's bus factors; P =
the trainable parameters' bytes after zero-padding to a multiple of S, s = P / S per rank):

    level                          HSDP (this module)          FSDP2's HSDP (ZeRO-3 in a node)
    shard group, inside a node     (S-1)/S x P  reduce-scatter  (S-1)/S x P  reduce-scatter
                                 + (S-1)/S x P  all-gather    + (S-1)/S x (P + P_blocks) all-gathers
    replica group, across nodes    2 (R-1)/R x P/S  all-reduce  2 (R-1)/R x P/S  all-reduce

(FSDP2 frees each block's parameters after its forward and gathers them again in backward: the
root, kept from forward to backward, is gathered once. Notebook 09's ZeRO3 over the shard group,
plus one all-reduce of its shards' gradients across the replicas, is that HSDP: tests/test_hsdp_checks.py
shows it moves FSDP2's bytes exactly.) Against the W ranks together:

    DDP over W              2 (W-1)/W x P     all of it in a group that spans the nodes
    ZeRO-1/2 or FSDP over W 2 (W-1)/W x P (ZeRO-3: + (W-1)/W x P_blocks), all spanning the nodes

HSDP's two levels add up to the same total, 2 (S-1)/S P + 2 (R-1)/(R S) P = 2 (W-1)/W P, but
only 2 (R-1)/R x P/S of it crosses the network: (R-1)/(W-1) of what a flat collective puts in
a group spanning the nodes (about 1/S), and in 2(R-1) ring steps instead of 2(W-1). The price:
optimizer state is divided by S, not W.
`wire_bytes_per_level` gives these forms; tests/grading/test_hsdp.py counts them with
`labkit.comm.traffic.count_traffic` and checks them EQUAL.
"""
from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

from labkit.mesh import Mesh
from labkit.parallel.flat import flatten, grads_or_zeros, write_back
from labkit.parallel.optim import WrapperOptimizer
from labkit.parallel.sharding import all_gather_flat, local_shard, reduce_scatter_mean, shard_size

NOTEBOOK = "10_scaling_out"


def check_hsdp(world_size: int, replicate: int, shard: int) -> None:
    """ValueError naming the fix when ``replicate x shard`` is not the data-parallel size; else None.

    Pure arithmetic: call it before launching (and `hsdp_mesh` calls it again in each rank).
    """
    for name, value in (("world_size", world_size), ("replicate", replicate), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1")
    if replicate * shard != world_size:
        fits = [f"{world_size // s} x {s}" for s in range(1, world_size + 1) if world_size % s == 0]
        raise ValueError(f"replicate x shard = {replicate} x {shard} = {replicate * shard} ranks, but the "
                         f"data-parallel size is {world_size}: every rank is one shard of one replica, so "
                         f"choose replicate x shard among {', '.join(fits)} (shard = ranks per node, "
                         f"replicate = nodes)")


def hsdp_mesh(replicate: int, shard: int) -> Mesh:
    """This rank's Mesh of `replicate` nodes of `shard` ranks: ``Mesh(W, node=replicate, local=shard)``.

    ``group("local")`` is the shard group, ``group("node")`` the replica group. Collective (every
    rank creates every group). Raises ValueError (`check_hsdp`) before any group is created.
    """
    check_hsdp(dist.get_world_size(), replicate, shard)
    return Mesh(dist.get_world_size(), node=replicate, local=shard)


def hsdp_sync(flat_grad: torch.Tensor, *, shard_group: dist.ProcessGroup,
              replica_group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's shard of the MEAN of `flat_grad` over every rank of both groups: a new tensor.

    flat_grad: 1-D, the same length on every rank, a multiple of the shard group's size S.
    Returns s = len / S elements: piece ``dist.get_rank(shard_group)`` of the mean over the
    R x S ranks. Two collectives, in this order:
      1. ``reduce_scatter_mean(flat_grad, group=shard_group)`` (labkit.parallel.sharding): this
         rank's piece of the mean over its shard group (its node);
      2. ``dist.all_reduce`` of that piece over ``replica_group`` (the same piece on every node),
         then divide by the replica group's size R.
    Only the 1/S piece crosses the replica group (the network): never all-reduce the whole
    gradient there.
    """
    ### BEGIN SOLUTION
    mine = reduce_scatter_mean(flat_grad, group=shard_group)  # inside the node: the node's mean, my piece
    dist.all_reduce(mine, group=replica_group)  # across the nodes: 1/S of the bytes
    return mine.div_(dist.get_world_size(replica_group))
    ### END SOLUTION


class HSDPOptimizer(WrapperOptimizer):
    """HSDP's step: HSDPOptimizer(params, optimizer_class=torch.optim.AdamW, *, shard_group, replica_group, **defaults).

    A torch.optim.Optimizer (labkit.parallel.optim.WrapperOptimizer: lr schedulers drive it) over
    `params` (one parameter group; every rank passes the same parameters with the same values).
    Its trainable parameters (requires_grad) are ONE flat vector, zero-padded to S x s elements,
    s = ceil(numel / S), S = the shard group's size; this rank owns piece ``dist.get_rank(shard_group)``
    as the nn.Parameter `shard`, and `optimizer` = optimizer_class([shard], **defaults) (element-wise
    optimizers only, as ZeRO-1). Usage, after loss.backward() on this rank's rows: opt.step();
    opt.zero_grad(). step() calls
      - sync_gradients() (unless you did): the gradients (None counts as zeros) flattened and padded,
        `hsdp_sync` -> this rank's shard of the mean over all R x S ranks, into ``shard.grad``;
      - update_parameters(): the inner optimizer's step on the shard, then ``all_gather_flat`` of the
        updated shards over the SHARD group only, written back into the parameters (``write_back``).
    Every rank ends each step with the parameters of single-process training on the global batch.
    Raises ValueError for several parameter groups, no trainable parameter, or mixed dtypes/devices.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, *, shard_group: dist.ProcessGroup,
                 replica_group: dist.ProcessGroup, **defaults):
        self.shard_group, self.replica_group = shard_group, replica_group
        self.shard_rank, self.n_shards = dist.get_rank(shard_group), dist.get_world_size(shard_group)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError(f"HSDPOptimizer takes one parameter group, got {len(self.param_groups)}: "
                             "pass model.parameters()")
        self.params = [p for p in self.param_groups[0]["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("HSDPOptimizer got no parameter that requires grad: pass model.parameters()")
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("HSDPOptimizer needs the parameters on one device with one dtype: "
                             "cast the model first (model.double())")
        size = shard_size(sum(p.numel() for p in self.params), self.n_shards)
        flat = flatten([p.detach() for p in self.params], size * self.n_shards)
        self.shard = nn.Parameter(local_shard(flat, self.shard_rank, self.n_shards).clone())
        self.optimizer = optimizer_class([self.shard], **defaults)
        self.state = self.optimizer.state  # the (sharded) state lives in the inner optimizer

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """``self.shard.grad`` = `hsdp_sync` of the flat, padded gradients (``grads_or_zeros``,
        ``flatten(tensors, total)`` with total = ``self.shard.numel() * self.n_shards``)."""
        ### BEGIN SOLUTION
        flat = flatten(grads_or_zeros(self.params), self.shard.numel() * self.n_shards)
        self.shard.grad = hsdp_sync(flat, shard_group=self.shard_group, replica_group=self.replica_group)
        ### END SOLUTION
        self.mark_synced()

    @torch.no_grad()
    def update_parameters(self) -> None:
        """``self.optimizer.step()``, then the updated shards gathered over the shard group into the parameters."""
        ### BEGIN SOLUTION
        self.optimizer.step()  # on 1/S of the parameters
        write_back(all_gather_flat(self.shard.detach(), group=self.shard_group), self.params)  # inside the node
        ### END SOLUTION


def wire_bytes_per_level(param_bytes: int, *, replicate: int, shard: int, gathered_bytes: int | None = None) -> dict:
    """Closed forms (module docstring): wire bytes per rank per step, exact Fractions, by level.

    param_bytes: P, the flat trainable parameters' bytes after padding to a multiple of `shard`.
    gathered_bytes: the bytes all-gathered per step (default P, as `HSDPOptimizer`; FSDP2's
    ZeRO-3 in a node gathers P + P_blocks). Returns {"shard": inside a node, "replica": across nodes}.
    """
    S, R = Fraction(shard), Fraction(replicate)
    gathered = param_bytes if gathered_bytes is None else gathered_bytes
    return {"shard": (S - 1) / S * param_bytes + (S - 1) / S * gathered,
            "replica": 2 * (R - 1) / R * Fraction(param_bytes) / S}
