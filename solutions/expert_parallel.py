"""Expert parallelism (EP), and EP x DP (notebook 12_experts).

The E experts of each MoE layer are split over the `ep` ranks of an EP group: rank r
holds experts r*E/ep ... (r+1)*E/ep - 1; everything else (attention, norms, router,
embeddings) is replicated. Every rank routes ITS OWN tokens, then one MoE layer is:

    dispatch   sort the kept picks by expert (labkit.model.moe.sort_by_expert); exchange the
               counts (how many rows each rank sends to each of my experts); all-to-all
               the rows, so each rank receives the tokens of its own experts
    compute    run each local expert on all the rows it received, from every rank
    combine    all-to-all the outputs back (the same sizes, reversed), put every row back
               at its token (unpermute) and weight it by its gate

The all-to-all is differentiable: its backward is the all-to-all with the sizes swapped
(the gradient of a row goes back where the row came from). Routing, capacity and drops
are labkit.model.moe's, per sequence, so EP drops exactly the tokens one device drops, and the
forward pass and every gradient equal the single-device MoE (solutions/all_to_all.py
moves the rows).

EP x DP: on a Mesh(world, dp=D, ep=P, combined=[("dp", "ep")]) every rank trains on its
own rows of the batch. A rank's expert gradient already holds the contributions of all the
tokens of its EP group (the all-to-all brought them); the ranks that hold the SAME
experts are its "dp" group, so expert gradients are all-reduced over "dp". Every other
parameter is replicated on all ranks: all-reduced over ("dp", "ep"), i.e. every rank.
Both are then divided by the world size, because each rank's loss is the mean over its
own rows (1/world of the batch). `gradient_groups` says which group each parameter uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit.model import moe as moe_lib
from labkit.grading import impl
from labkit.measure.timeline import Timeline, or_null
from labkit.mesh import Mesh
from labkit.renames import renamed_in

NOTEBOOK = "12_experts"

# ---------------------------------------------------------------------------------------
# The differentiable all-to-all (labkit.comm.traffic.count_traffic counts its messages)


def _exchange(x, out_splits, in_splits, group):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    impl("all_to_all").all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x, out_splits: list, in_splits: list, *, group: dist.ProcessGroup | None = None):
    """Rows in_splits[j] of x to group rank j; returns the received rows. Differentiable."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


# ---------------------------------------------------------------------------------------
# The three steps


@dataclass
class Plan:
    """What dispatch did, for combine to undo. ep ranks, L = E / ep experts per rank."""
    tokens: torch.Tensor       # [M] token (row of x.reshape(-1, D)) of each sorted kept pick
    picks: torch.Tensor        # [M] index of each sorted pick in routing.gate.reshape(-1)
    send_splits: list          # rows sent to each group rank
    recv_splits: list          # rows received from each group rank
    recv_counts: torch.Tensor  # [ep, L] rows received from rank s for local expert e


def dispatch(x: torch.Tensor, routing, *, group: dist.ProcessGroup | None = None):
    """Send every kept pick's token row to the rank that holds its expert.

    x [B, T, D] (or [N, D]): this rank's tokens; routing: their labkit.model.moe.Routing.
    Returns (received [R, D], plan). The received rows come grouped by source rank
    (group rank 0 first) and, inside, by local expert; plan.recv_counts [ep, L] says how
    many: rows of rank s for local expert e. Expert e lives on group rank e // L.
    Collective over `group` (the EP group). Hint: exchange the counts with
    `impl("all_to_all").all_to_all_single` (one row of L counts per rank), then move the
    rows with this module's `all_to_all` (differentiable; its sizes are Python lists).
    """
    ep = dist.get_world_size(group)
    tokens, picks, counts = moe_lib.sort_by_expert(routing)
    rows = x.reshape(-1, x.shape[-1])[tokens]
    ### BEGIN SOLUTION
    send_counts = counts.view(ep, -1)  # [destination rank, its local expert]
    recv_counts = torch.empty_like(send_counts)
    # the counts first (one row per rank, equal splits), so every rank knows what it receives
    impl("all_to_all").all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all(rows, recv_splits, send_splits, group=group)
    ### END SOLUTION
    return received, Plan(tokens, picks, send_splits, recv_splits, recv_counts)


def compute_experts(experts, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
    """Run local expert e (experts[e]) on every row received for it; outputs in the SAME order as `received`.

    received: rows grouped by source rank, then local expert (recv_counts [ep, L] rows each).
    Each expert runs once, on its rows from all ranks, source rank 0 first (so with the
    batch split in rank order it sees its tokens in the single-device order).
    Hint: gather the rows expert by expert, `labkit.model.moe.run_experts(experts, rows, counts)`
    runs experts[e] on counts[e] consecutive rows, then put the outputs back in place.
    """
    ### BEGIN SOLUTION
    ep, L = recv_counts.shape
    starts = torch.cumsum(recv_counts.flatten(), 0) - recv_counts.flatten()  # block (s, e) starts here
    starts, counts = starts.view(ep, L).tolist(), recv_counts.tolist()
    order = [torch.arange(starts[s][e], starts[s][e] + counts[s][e], device=received.device)
             for e in range(L) for s in range(ep)]
    order = torch.cat(order)  # expert-major row order
    per_expert = recv_counts.sum(0).tolist()
    outputs = moe_lib.run_experts(experts, received[order], per_expert)
    return outputs[torch.argsort(order)]  # back to the received order
    ### END SOLUTION


def combine(rows: torch.Tensor, plan: Plan, routing, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send the expert outputs back, put each at its token, weighted by its gate.

    rows: compute_experts's output (the received order). Returns y [N, D], N = this
    rank's tokens: y[n] = sum of gate x expert output over n's kept picks (0 if none).
    Collective over `group`. Hint: `all_to_all` (differentiable) with dispatch's sizes
    swapped, then `labkit.model.moe.unpermute(rows, plan.tokens, gates, N)`.
    """
    ### BEGIN SOLUTION
    back = all_to_all(rows, plan.send_splits, plan.recv_splits, group=group)  # sizes reversed
    gates = routing.gate.reshape(-1)[plan.picks]
    return moe_lib.unpermute(back, plan.tokens, gates, routing.gate.shape[0] * routing.gate.shape[1])
    ### END SOLUTION


# ---------------------------------------------------------------------------------------
# The EP layer and the EP x DP model


class EPMoE(nn.Module):
    """A labkit.model.moe.MoE whose experts are split over `group`: this rank keeps experts
    ep_rank*L ... (ep_rank+1)*L - 1 (in `.experts`, keyed by their global index, so parameter
    names match the single-device model's) and the router. Same forward contract as MoE."""

    def __init__(self, moe: moe_lib.MoE, *, group: dist.ProcessGroup | None, ep_rank: int, ep_size: int,
                 timeline: Timeline | None = None, layer: int | None = None):
        super().__init__()
        if moe.n_experts % ep_size:
            raise ValueError(f"EPMoE: n_experts={moe.n_experts} does not divide by the EP group's size {ep_size}: "
                             f"every EP rank holds the same number of experts; choose an ep among the divisors "
                             f"of {moe.n_experts}, or another n_experts")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"EPMoE: ep_rank={ep_rank} is not in range(ep_size={ep_size}): pass mesh.index('ep')")
        if dist.is_initialized() and dist.get_world_size(group) != ep_size:
            raise ValueError(f"EPMoE: ep_size={ep_size} but the group holds {dist.get_world_size(group)} ranks: "
                             "pass mesh.group('ep') and mesh.sizes['ep']")
        local = moe.n_experts // ep_size
        self.n_experts, self.top_k, self.capacity_factor = moe.n_experts, moe.top_k, moe.capacity_factor
        self.group, self.layer = group, layer
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(ep_rank * local, (ep_rank + 1) * local)})
        self.timeline = or_null(timeline)
        self.aux_loss, self.routing = None, None

    def forward(self, x):
        tl = self.timeline
        routing = moe_lib.route(x, self.router.weight, self.top_k, self.capacity_factor)
        self.aux_loss, self.routing = routing.aux_loss, routing
        with tl.span("dispatch", stage=self.layer):
            received, plan = dispatch(x, routing, group=self.group)
        with tl.span("F", stage=self.layer):
            rows = compute_experts(list(self.experts.values()), received, plan.recv_counts)
        with tl.span("combine", stage=self.layer):
            y = combine(rows, plan, routing, group=self.group)
        return y.view_as(x)


def check_mesh(mesh: Mesh, n_experts: int) -> None:
    """ValueError, with the fix, unless `mesh` is a labkit Mesh of this world with only dp and ep axes
    and n_experts divisible by ep. (Its ("dp", "ep") group is then the whole world: `Mesh.group` gives
    the default group for it, so no `combined=` is needed.)"""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"expected a labkit.mesh.Mesh, got {type(mesh).__name__}: "
                         "use Mesh(world_size, dp=.., ep=.., combined=[('dp', 'ep')])")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.world_size != world:
        raise ValueError(f"the mesh holds {mesh.world_size} ranks but {world} are running: build it with the world size")
    others = {a: s for a, s in mesh.sizes.items() if a not in ("dp", "ep") and s > 1}
    if others:
        raise ValueError(f"EP x DP uses the dp and ep axes only, the mesh also has {others}: set them to 1")
    if n_experts % mesh.sizes["ep"]:
        raise ValueError(f"n_experts={n_experts} does not divide by ep={mesh.sizes['ep']}: every EP rank must hold "
                         f"the same number of experts; choose ep among the divisors of {n_experts}")


def shard_experts(model: nn.Module, *, mesh: Mesh, timeline: Timeline | None = None) -> nn.Module:
    """Replace every MoE layer of `model` (in place) by an EPMoE over mesh's "ep" group; returns model."""
    check_mesh(mesh, model.config.n_experts)
    for i, block in enumerate(model.layers):
        if isinstance(block.feed_forward, moe_lib.MoE):
            block.feed_forward = EPMoE(block.feed_forward, group=mesh.group("ep"), ep_rank=mesh.index("ep"),
                                       ep_size=mesh.sizes["ep"], timeline=timeline, layer=i)
    return model


def is_expert_parameter(name: str) -> bool:
    return ".experts." in name


def gradient_groups(model: nn.Module) -> dict:
    """{parameter name: the mesh axes its gradient is all-reduced over}: ("dp",) for experts
    (the ranks holding the same experts), ("dp", "ep") for everything else (every rank)."""
    return {name: ("dp",) if is_expert_parameter(name) else ("dp", "ep") for name, _ in model.named_parameters()}


def sync_gradients(model: nn.Module, *, mesh: Mesh) -> None:
    """Average the gradients of an EP x DP model, each over its group (`gradient_groups`).

    Sum over the group, divide by mesh.world_size (each rank's loss is the mean over 1/world
    of the batch). Collective over the whole mesh; a parameter without gradient counts as 0.
    What you need: ``gradient_groups(model)`` ({name: axes}), ``model.get_parameter(name)``,
    ``mesh.group(axes)`` (this rank's process group along those axes; ("dp", "ep") exists
    because the mesh was built with combined=[("dp", "ep")]), ``dist.all_reduce(t, group=...)``.
    Every rank must issue the same all-reduces in the same order, frozen parameters included.
    """
    ### BEGIN SOLUTION
    for name, axes in gradient_groups(model).items():
        p = model.get_parameter(name)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=mesh.group(axes))
        p.grad.div_(mesh.world_size)
    ### END SOLUTION


def build_ep_model(config, *, mesh: Mesh, seed: int = 0, dtype: torch.dtype | None = None,
                   timeline: Timeline | None = None) -> nn.Module:
    """The model `labkit.model.build_model(config, seed)` (same weights on every rank) with its experts sharded."""
    from labkit.model import build_model

    model = build_model(config, seed=seed)
    if dtype is not None:
        model = model.to(dtype)
    return shard_experts(model, mesh=mesh, timeline=timeline)


__getattr__ = renamed_in(__name__)  # old names fail naming their replacement, for one release
