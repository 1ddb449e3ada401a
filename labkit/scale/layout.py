"""A layout: how a training step is spread over the GPUs, and its checks (notebook 15).

The axes are labkit.mesh's, in its order (dp outermost, tp innermost): a group along an axis
holds ranks `stride` apart, stride = the product of the axes inside it. A group lies in one
node when stride x size <= gpus_per_node, so tp (innermost) is the first to stay on NVLink.
`zero` is the data-parallel flavour over dp x cp (torchtitan's FSDP shards over both):
"dp" (plain averaging), "zero1", "zero2", "zero3" (FSDP). `recompute` is one of
labkit.scale.specs.RECOMPUTE: "none", "selective-op" (torchtitan's op-level policy; "selective",
its old name here and torchtitan's, is read as it), "selective-attn" (Megatron's: the attention
core only) or "full" (every block's input only).
`micro_batch` is sequences per micro-batch; each data-parallel rank's share of the global
batch is cut into micro-batches (gradient accumulation, or the pipeline's micro-batches).
`schedule`: "1f1b", "interleaved" (`virtual_stages` stages per pipeline rank) or "zb" (the lab's zero-bubble-style
schedule, labkit.parallel.schedule_variants: B and W split, 1F1B's memory; the flat model prices it as 1F1B,
the kernel model through the schedule simulator).
Stages, in order (stage k on pipeline rank k mod pp, as interleaving loops): `stage_layers(L)`
gives each stage's blocks. `first_stage_embedding_only` / `last_stage_loss_only` make the first
stage hold the embedding alone and the last the final norm, head and loss alone (Llama 3's split:
Dubey et al. 2024, sec. 3.3.2, one layer fewer on the first and last stages); the L blocks are spread
evenly over the other stages, the earlier ones taking one more when they do not divide.
EP borrows its ranks, as torchtitan's ParallelDims folds them (torchtitan/distributed/parallel_dims.py,
its two expert meshes, `expert_tensor_parallel_degree` etp = tp or 1):
    ep divides dp_shard x cp   (etp = tp) ep over the data and context ranks, cp's first (stride tp), then
                               dp_shard's (stride pp cp tp); each expert tensor-parallel over tp (1/(tp ep)
                               of the experts per GPU); its replicas, efsdp = dp_shard x cp / ep ranks
    otherwise, ep divides      (etp = 1, `ep_over_tp`) torchtitan's mesh [pp, dp_replicate, efsdp, ep]:
    dp_shard x cp x tp         (dp_shard, cp, tp) flattened in grid order, ep the innermost ep ranks (tp's
                               first), efsdp = dp_shard x cp x tp / ep the rest; whole experts (1/ep of them
                               per GPU), each tp rank dispatching its own sequence-parallel tokens (so SP is
                               required), the expert gradients reduced over efsdp
(dp_shard = dp without HSDP; replicas are never folded.) A layout picks etp = tp wherever it can.

Three choices of how an axis runs (issue 35), each defaulting to the lab's first form:
`dp_replicate` (HSDP, torchtitan's dp_replicate x dp_shard): dp = dp_replicate x dp_shard, the
replicas outermost (a replica group holds ranks world / dp_replicate apart: across nodes), the
model states sharded over dp_shard x cp only (the shard group) and all-reduced across the
replicas; 1 is full sharding over dp x cp. Under HSDP, EP borrows from dp_shard x cp (x tp) inside a
replica, as torchtitan's efsdp x ep.
`cp_method`: how attention crosses the cp ranks (labkit.scale.cp_traffic.CP_METHODS): "ring"
(K/V passed around), "allgather" (Llama 3's all-gather of K/V), "ulysses" (all-to-alls swap
sequence for heads: the query heads per tp rank must divide by cp), "hybrid" (Ulysses over the
cp ranks inside a node, `cp_local`, a ring across nodes: the heads per tp rank must divide by it).
`ep_overlap`: EP's two-micro-batch overlap (solutions/moe_overlap.py, notebook 12): each
micro-batch runs as two halves whose all-to-alls hide behind the other half's experts.
`zero3_unit`: what ZeRO-3 gathers at once: "block" (FSDP2, torchtitan: a transformer block),
"module" (DeepSpeed's ZeRO-3 of 2021: each weight-holding submodule, labkit.scale.footprint; its step as its code
runs it, labkit.scale.deepspeed_zero3; no pipeline, replicas or experts) or "flat" (FSDP1, FullyShardedDataParallel
wrapping each block: its flat parameter is gathered in place, so no copy-out after the all-gather, but its
gradient is still cast to the reduce dtype before each reduce-scatter, labkit.scale.kernels.fsdp_copies; no pipeline
or experts; with zero="zero2" it names FSDP1's SHARD_GRAD_OP: the model's ZeRO-2 with FSDP1's fp32 reduce-scatters
and their casts, and is carried to the ZeRO-3 layouts of a framework's space, labkit.scale.space).
`grad_reduce`: when plain DP and ZeRO-1/2 reduce the gradients: "overlap" (buckets during the backward that
completes them: torch DDP, FSDP2, Megatron-Core's DDP since 2023) or "after" (one all-reduce after the step's
last backward, nothing hidden: Megatron-LM's `--DDP-impl local`, its default until 2023, whose train_step
calls allreduce_gradients() once forward_backward_func returns). ZeRO-3 prefetches either way.
`kv_rotation`: how the ring's K/V reach every cp rank (cp_method="ring" only; labkit.scale.cp_traffic.KV_ROTATIONS):
"p2p" (the lab's ring: one hop per step, each hidden behind a step's attention) or "allgather" (torch's
context_parallel by default, torchtitan's `context_parallel_rotate_method`: one all-gather launched at the first
step and waited for at the second, hidden only behind that step; dK/dV still hop).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from labkit.mesh import AXES

from labkit.scale.specs import RECOMPUTE
from labkit.scale.cp_traffic import CP_METHODS, KV_ROTATIONS  # noqa: F401 (re-exported: what a Layout may name)

ZERO_STAGES = ("dp", "zero1", "zero2", "zero3")
SCHEDULES = ("1f1b", "interleaved", "zb")
ZERO3_UNITS = ("block", "module", "flat")
GRAD_REDUCES = ("overlap", "after")


class LayoutError(ValueError):
    """A layout that cannot run this model on this cluster (the message says why and what to change)."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero: str = "zero3"
    recompute: str = "selective-op"
    micro_batch: int = 1
    sequence_parallel: bool = True
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dp_replicate: int = 1
    cp_method: str = "ring"
    ep_overlap: bool = False
    first_stage_embedding_only: bool = False
    last_stage_loss_only: bool = False
    zero3_unit: str = "block"
    grad_reduce: str = "overlap"
    kv_rotation: str = "p2p"

    def __post_init__(self):
        if self.recompute == "selective":  # torchtitan's name for its op policy (and the lab's, before)
            object.__setattr__(self, "recompute", "selective-op")

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: pp x virtual stages per rank (interleaved), else pp."""
        return self.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)

    def stage_layers(self, n_layers: int) -> list[int]:
        """Blocks per stage, in stage order (stage k on pipeline rank k mod pp). The embedding-only and
        loss-only stages hold 0; the others share the n_layers evenly, the earlier ones one more.
        LayoutError when a stage that is neither would hold no block."""
        stages = self.n_stages
        ends = int(self.first_stage_embedding_only) + int(self.last_stage_loss_only)
        holders = stages - ends
        if not (holders >= 1 and n_layers >= holders):
            raise LayoutError(
                f"{stages} stages (pp={self.pp} x {stages // self.pp} per rank"
                + (f", {ends} of them embedding- or loss-only" if ends else "")
                + f") for {n_layers} layers: {holders - n_layers if holders >= 1 else stages} stage(s) would hold no block "
                "and are not an embedding or loss stage; use at most "
                f"{n_layers + ends} stages, or fewer virtual stages per rank")
        q, r = divmod(n_layers, holders)
        blocks = [q + 1] * r + [q] * (holders - r)
        return ([0] if self.first_stage_embedding_only else []) + blocks + ([0] if self.last_stage_loss_only else [])

    def rank_layers(self, n_layers: int) -> list[int]:
        """Blocks per pipeline rank: the sum of its stages' (rank i holds stages i, i + pp, ...)."""
        per_stage = self.stage_layers(n_layers)
        return [sum(per_stage[i::self.pp]) for i in range(self.pp)]

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks inside one replica (HSDP's shard group is dp_shard x cp)."""
        return self.dp // self.dp_replicate

    @property
    def ep_over_tp(self) -> bool:
        """ep folded over tp too (torchtitan's etp = 1): ep > 1 does not divide dp_shard x cp, so it takes tp's ranks."""
        return self.ep > 1 and (self.dp_shard * self.cp) % self.ep != 0

    @property
    def expert_tp(self) -> int:
        """The tp ranks each expert is split over: tp (etp = tp), or 1 when ep is folded over tp (whole experts)."""
        return 1 if self.ep_over_tp else self.tp

    @property
    def efsdp(self) -> int:
        """The ranks of one replica that hold the same experts: dp_shard x cp / ep, or dp_shard x cp x tp / ep
        when ep is folded over tp (torchtitan's efsdp); each ZeRO-shards the experts and reduces their gradients."""
        return self.dp_shard * self.cp * (self.tp // self.expert_tp) // self.ep

    def cp_local(self, gpus_per_node: int) -> int:
        """The cp ranks of one cp group inside one node (tp ranks apart): gcd(cp, gpus_per_node / tp),
        1 when a tp group fills a node or does not divide one."""
        return math.gcd(self.cp, gpus_per_node // self.tp) if gpus_per_node % self.tp == 0 else 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def sizes(self) -> dict:
        """Axis sizes in labkit.mesh's order (ep borrowed: its own size 1 in the grid)."""
        return {axis: getattr(self, axis) if axis != "ep" else 1 for axis in AXES}

    def stride(self, axis: str) -> int:
        sizes = self.sizes()
        return math.prod(sizes[a] for a in AXES[AXES.index(axis) + 1:])

    def level(self, axis: str, gpus_per_node: int) -> str:
        """"node" if every group along `axis` lies inside one node, else "network". A group spans an aligned
        block of `span` ranks; the blocks tile the nodes only when span divides gpus_per_node (tp 3 on 8-GPU
        nodes: ranks 6, 7, 8 straddle two, and that group sets the pace)."""
        if axis == "ep" and self.ep_over_tp:  # the innermost ep of (dp_shard, cp, tp) flattened: contiguous
            # while inside cp x tp, then dp_shard's ranks, pp cp tp apart
            span = self.ep if self.ep <= self.cp * self.tp else self.ep * self.pp
        elif axis == "ep":  # borrowed from dp x cp: cp's ranks first (stride tp), then dp's (stride pp cp tp);
            # under HSDP dp's inner part is dp_shard (stride pp cp tp too), so the same span
            span = self.ep * self.tp if self.ep <= self.cp else self.ep * self.pp * self.tp
        else:
            span = getattr(self, axis) * self.stride(axis)
        tiles = gpus_per_node % span == 0 or self.world_size <= gpus_per_node  # (whole nodes: else one straddles)
        return "node" if span <= gpus_per_node and tiles else "network"

    def group_parts(self, axis: str) -> list[tuple[int, int]]:
        """The ranks of one group along `axis` as (count, stride) runs, innermost first: "dpcp" is the
        data-parallel group FSDP and DDP reduce over (dp x cp: cp's ranks tp apart, then dp's pp cp tp apart);
        "ep" follows `level`'s borrowing; any other axis is one run of its size at its stride."""
        inner = self.pp * self.cp * self.tp  # dp's stride
        if axis == "dpcp":
            return [(self.cp, self.tp), (self.dp, inner)]
        if axis == "ep" and self.ep_over_tp:  # (dp_shard, cp, tp) flattened: contiguous, then dp's ranks
            block = self.cp * self.tp
            return [(self.ep, 1)] if self.ep <= block else [(block, 1), (self.ep // block, inner)]
        if axis == "ep":  # cp's ranks first (stride tp), then dp's
            return [(self.ep, self.tp)] if self.ep <= self.cp else [(self.cp, self.tp), (self.ep // self.cp, inner)]
        return [(getattr(self, axis), self.stride(axis))]

    def ranks_per_node(self, axis: str, gpus_per_node: int) -> int:
        """How many ranks of one group along `axis` (`group_parts`) share a node: the NICs a ring collective of
        that group spreads over when it spans nodes (labkit.scale.cluster.Cluster.link's per_node)."""
        offsets = [0]
        for count, stride in self.group_parts(axis):
            offsets = [o + i * stride for i in range(count) for o in offsets]
        return max(1, sum(o < gpus_per_node for o in offsets))

    def layers_per_rank(self, n_layers: int) -> int:
        """Blocks on the busiest pipeline rank (`rank_layers`' largest: torchtitan splits 126 layers
        into 8 stages unevenly; the fullest rank sets the pace)."""
        return max(self.rank_layers(n_layers))

    def short(self) -> str:
        axes = " ".join(f"{a}{getattr(self, a)}" for a in ("dp", "pp", "cp", "tp", "ep") if getattr(self, a) > 1)
        extra = f" {self.schedule}x{self.virtual_stages}" if self.pp > 1 and self.schedule == "interleaved" else ""
        if self.first_stage_embedding_only or self.last_stage_loss_only:
            extra += " ends-alone"
        if self.dp_replicate > 1:
            extra += f" hsdp{self.dp_replicate}x{self.dp_shard}"
        if self.cp > 1 and self.cp_method != "ring":
            extra += f" cp-{self.cp_method}"
        elif self.cp > 1 and self.kv_rotation != "p2p":
            extra += f" kv-{self.kv_rotation}"
        if self.ep_over_tp:
            extra += " ep-over-tp"
        if self.ep > 1 and self.ep_overlap:
            extra += " ep-overlap"
        if self.zero3_unit == "module":
            extra += " per-module"
        elif self.zero3_unit == "flat":
            extra += " fsdp1"
        if self.tp > 1 and not self.sequence_parallel:
            extra += " no-sp"
        if self.grad_reduce == "after":
            extra += " reduce-after"
        return f"{axes or 'single'} {self.zero} {self.recompute} mb{self.micro_batch}{extra}"

    def as_dict(self) -> dict:
        return asdict(self)


def check_layout(model, layout: Layout, n_gpus: int, gpus_per_node: int, global_batch: int, seq_len: int) -> int:
    """Raise LayoutError naming the first thing that does not split; return the micro-batch count.

    Checks, in order: positive ints and known options (cp_method among CP_METHODS); dp_replicate
    divides dp, and is 1 under zero="dp"; the axes' product is n_gpus (whole
    nodes); tp divides the heads, the KV heads and the MLP width (tp across nodes is a cost,
    not an error: the search may pick it); pp divides the layers (x virtual stages) at most once each; cp
    splits the sequence into 2 cp zigzag chunks; Ulysses: cp divides the heads per tp rank; the
    hybrid: its cp ranks per node (`cp_local`) divide them, and are neither 1 nor cp (then it is
    the ring, or Ulysses); ep divides the experts and dp x cp x tp (dp_shard x cp x tp under HSDP; folded
    over tp only with sequence parallelism), and is 1 for a dense model; ep_overlap needs ep > 1; the global batch splits over dp and into micro-batches
    (at least pp of them; a multiple of pp when interleaved).
    """
    for axis in ("dp", "pp", "cp", "tp", "ep", "micro_batch", "virtual_stages", "dp_replicate"):
        value = getattr(layout, axis)
        if type(value) is not int or value < 1:  # noqa: E721 (bool, an int subclass, is refused too)
            raise LayoutError(f"{axis}={value!r}: must be an int >= 1")
    if layout.zero not in ZERO_STAGES:
        raise LayoutError(f"zero={layout.zero!r}: choose one of {ZERO_STAGES}")
    if layout.zero3_unit not in ZERO3_UNITS or (layout.zero3_unit == "module" and layout.zero != "zero3") or \
            (layout.zero3_unit == "flat" and layout.zero not in ("zero2", "zero3")):
        raise LayoutError(f"zero3_unit={layout.zero3_unit!r} with zero={layout.zero!r}: it says what ZeRO-3 gathers at once, "
                          f"one of {ZERO3_UNITS}; 'module' needs zero='zero3', 'flat' (FSDP1) zero='zero2' "
                          "(SHARD_GRAD_OP) or 'zero3' (FULL_SHARD)")
    if layout.zero3_unit == "flat" and (layout.pp > 1 or layout.ep > 1):
        raise LayoutError(f"zero3_unit='flat' (FSDP1) with pp={layout.pp}, ep={layout.ep}: the model runs FSDP1 without "
                          "a pipeline or experts; use pp = ep = 1, or zero3_unit='block' (FSDP2)")
    if layout.zero3_unit == "module" and (layout.pp > 1 or layout.dp_replicate > 1 or layout.ep > 1):
        raise LayoutError(f"zero3_unit='module' (DeepSpeed's ZeRO-3 of 2021, labkit.scale.deepspeed_zero3) with pp="
                          f"{layout.pp}, dp_replicate={layout.dp_replicate}, ep={layout.ep}: it ran without a pipeline, "
                          "replicas or experts; use pp = dp_replicate = ep = 1, or zero3_unit='block' (FSDP2)")
    if layout.grad_reduce not in GRAD_REDUCES:
        raise LayoutError(f"grad_reduce={layout.grad_reduce!r}: when the gradients are reduced, one of {GRAD_REDUCES}")
    if layout.kv_rotation not in KV_ROTATIONS:
        raise LayoutError(f"kv_rotation={layout.kv_rotation!r}: how the ring's K/V move, one of {KV_ROTATIONS}")
    if layout.recompute not in RECOMPUTE:
        raise LayoutError(f"recompute={layout.recompute!r} is not a policy the model knows: choose one of {RECOMPUTE} "
                          "('selective' is read as 'selective-op', torchtitan's op policy)")
    if layout.recompute == "selective-op" and model.mlp != "swiglu":
        raise LayoutError(f"recompute='selective-op' is torchtitan's op policy for its SwiGLU blocks; {model.name} has a "
                          f"{model.mlp} MLP: use 'selective-attn' (Megatron's), 'full' or 'none'")
    for end in ("first_stage_embedding_only", "last_stage_loss_only"):
        if not isinstance(getattr(layout, end), bool):
            raise LayoutError(f"{end}={getattr(layout, end)!r}: must be True or False")
        if getattr(layout, end) and layout.pp == 1:
            raise LayoutError(f"{end}=True with pp=1: a stage of its own for the {'embedding' if 'first' in end else 'loss'} "
                              "needs a pipeline; use pp > 1 or leave it False")
    if layout.schedule not in SCHEDULES:
        raise LayoutError(f"schedule={layout.schedule!r}: choose one of {SCHEDULES}")
    if layout.cp_method not in CP_METHODS:
        raise LayoutError(f"cp_method={layout.cp_method!r}: choose one of {CP_METHODS}")
    if not isinstance(layout.ep_overlap, bool):
        raise LayoutError(f"ep_overlap={layout.ep_overlap!r}: must be True or False")
    if not (layout.dp % layout.dp_replicate == 0):
        raise LayoutError(f"dp_replicate={layout.dp_replicate} does not divide dp={layout.dp}: HSDP splits dp into "
                          f"dp_replicate x dp_shard, use one of {[d for d in range(1, layout.dp + 1) if layout.dp % d == 0]}")
    if not (layout.dp_replicate == 1 or layout.zero != "dp"):
        raise LayoutError(f"dp_replicate={layout.dp_replicate} with zero='dp': plain data parallelism already replicates every "
                          "state, there is no shard group; use zero='zero1', 'zero2' or 'zero3' (HSDP), or dp_replicate=1")
    if not (layout.world_size == n_gpus):
        raise LayoutError(f"dp x pp x cp x tp = {layout.dp} x {layout.pp} x {layout.cp} x {layout.tp} = {layout.world_size} "
                          f"GPUs, but the cluster has {n_gpus}: choose sizes whose product is {n_gpus}")
    if not (n_gpus % gpus_per_node == 0 or n_gpus < gpus_per_node):
        raise LayoutError(f"{n_gpus} GPUs is not a whole number of nodes of {gpus_per_node}: use a multiple of {gpus_per_node}")
    m = model
    if not (m.n_heads % layout.tp == 0 and m.n_kv_heads % layout.tp == 0):
        raise LayoutError(f"tp={layout.tp} does not divide {m.name}'s {m.n_heads} heads and {m.n_kv_heads} KV heads: "
                          f"use a tp that divides {math.gcd(m.n_heads, m.n_kv_heads)}")
    if not (m.hidden_dim % layout.tp == 0):
        raise LayoutError(f"tp={layout.tp} does not divide the MLP width {m.hidden_dim}")
    stages = layout.pp * (layout.virtual_stages if layout.schedule == "interleaved" else 1)
    if not (layout.schedule == "1f1b" or layout.pp > 1):
        raise LayoutError(f"schedule={layout.schedule!r} needs pp > 1 (use schedule='1f1b' without a pipeline)")
    layout.stage_layers(m.n_layers)  # LayoutError for a stage that would hold nothing
    if not (seq_len % (2 * layout.cp) == 0 if layout.cp > 1 else True):
        raise LayoutError(f"cp={layout.cp}: the sequence of {seq_len} tokens must split into 2 x cp = {2 * layout.cp} "
                          "zigzag chunks")
    heads = m.n_heads // layout.tp
    if layout.cp > 1 and layout.cp_method == "ulysses":
        if not (heads % layout.cp == 0):
            raise LayoutError(f"cp_method='ulysses' with cp={layout.cp}: {m.name}'s {heads} heads per tp rank (tp={layout.tp}) do "
                              f"not split over {layout.cp} cp ranks (the all-to-all gives each rank heads / cp whole heads): use a "
                              f"cp that divides {heads}, or cp_method='ring', 'allgather' or 'hybrid'")
    if layout.cp > 1 and layout.cp_method == "hybrid":
        local = layout.cp_local(gpus_per_node)
        if not (1 < local < layout.cp):
            raise LayoutError(f"cp_method='hybrid' with cp={layout.cp}: {local} of each cp group's ranks share a node "
                              f"(tp={layout.tp}, {gpus_per_node} GPUs per node), so the hybrid would be "
                              f"{'the ring' if local == 1 else 'Ulysses'} alone: use cp_method='{'ring' if local == 1 else 'ulysses'}'")
        if not (heads % local == 0):
            raise LayoutError(f"cp_method='hybrid' with {local} cp ranks per node: {m.name}'s {heads} heads per tp rank "
                              f"(tp={layout.tp}) do not split over them: use cp_method='ring' or 'allgather', or another tp")
    if m.n_experts == 0:
        if layout.ep != 1:
            raise LayoutError(f"ep={layout.ep} on the dense model {m.name}: ep needs experts (use ep=1)")
    else:
        if not (m.n_experts % layout.ep == 0):
            raise LayoutError(f"ep={layout.ep} does not divide the {m.n_experts} experts")
        folded = layout.dp_shard * layout.cp * layout.tp
        if not (folded % layout.ep == 0):
            works = [e for e in range(1, folded + 1) if folded % e == 0 and m.n_experts % e == 0]
            where = (f"dp x cp x tp = {layout.dp} x {layout.cp} x {layout.tp} = {folded}" if layout.dp_replicate == 1 else
                     f"dp_shard x cp x tp = {layout.dp_shard} x {layout.cp} x {layout.tp} = {folded} (inside a replica, "
                     f"dp_replicate={layout.dp_replicate})")
            raise LayoutError(f"ep={layout.ep} borrows its ranks from {where}: it must divide {folded}; the ep that "
                              f"work here (dividing it and the {m.n_experts} experts): {works}")
        if layout.ep_over_tp and not layout.sequence_parallel:
            raise LayoutError(f"ep={layout.ep} is folded over tp (it does not divide dp_shard x cp = "
                              f"{layout.dp_shard * layout.cp}), so each tp rank must hold its own tokens: use "
                              "sequence_parallel=True, or an ep that divides dp_shard x cp")
    if layout.ep_overlap and layout.ep == 1:
        raise LayoutError("ep_overlap=True with ep=1: there is no all-to-all to hide; use ep > 1 or ep_overlap=False")
    if not (global_batch % layout.dp == 0):
        raise LayoutError(f"the global batch of {global_batch} sequences does not split over dp={layout.dp}")
    local = global_batch // layout.dp
    if not (local % layout.micro_batch == 0):
        raise LayoutError(f"each dp rank's {local} sequences do not split into micro-batches of {layout.micro_batch}")
    n_micro = local // layout.micro_batch
    if not (layout.pp == 1 or n_micro >= layout.pp):
        raise LayoutError(f"pp={layout.pp} needs at least {layout.pp} micro-batches per step, the layout has {n_micro}: "
                          "use smaller micro-batches or fewer stages")
    if not (layout.schedule != "interleaved" or n_micro % layout.pp == 0):
        raise LayoutError(f"schedule='interleaved' runs micro-batches in groups of pp={layout.pp}: {n_micro} micro-batches "
                          "are not a multiple of it; use a micro-batch count that is, or schedule='1f1b'")
    return n_micro
