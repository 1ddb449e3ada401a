"""The layout of a composed run: how many ranks along each parallelism, checked before any process work.

    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2, ep=2, zero=1, microbatches=2)
    dims.check(config, batch=8, seq_len=32, world_size=16)   # ValueError naming the fix, or None
    mesh = dims.build_mesh()                                  # inside launched ranks

**How EP takes its ranks.** ``world_size = dp x pp x cp x tp``: expert parallelism BORROWS its ranks
from data parallelism, as torchtitan's ``ParallelDims`` and Megatron-Core do. Of the dp data-parallel
ranks (which read different rows of the batch), groups of ep hold different experts: each rank runs
every dense layer on its own rows, and the all-to-all brings it the tokens of the ep ranks of its group
for its experts. As its own axis (ep ranks reading the SAME rows) EP would repeat every dense layer ep
times and all five axes at size 2 would need 32 ranks; borrowed, they fit in 16. In the lab's Mesh
the grid keeps an ``ep`` axis, carved out of dp: ``Mesh(world, dp=dp // ep, pp=pp, ep=ep, cp=cp,
tp=tp)``, and the data-parallel ranks are the mesh's ``("dp", "ep")`` axes together.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from labkit.mesh import AXES, Mesh

ZERO_STAGES = (0, 1, 2, 3)
# How attention crosses the cp ranks (solutions/cp_methods.py): the ring, Llama 3's all-gather of K/V, Ulysses'
# all-to-alls, or Megatron's "a2a+p2p" hybrid: all-to-all inside groups of HYBRID_LOCAL cp ranks (a node in the
# lab's small runs; on a cluster, the node's share of cp), the ring across them.
CP_METHODS = ("ring", "allgather", "ulysses", "hybrid")
HYBRID_LOCAL = 2


@dataclass(frozen=True)
class ParallelDims:
    """dp (data-parallel ranks, ep's included), pp, cp, tp, ep (borrowed from dp), ZeRO stage, micro-batches,
    and how attention crosses the cp ranks (`CP_METHODS`)."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    cp_method: str = "ring"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def mesh_sizes(self) -> dict:
        """The Mesh's grid sizes, in `labkit.mesh.AXES` order: ep carved out of dp."""
        return dict(dp=self.dp // self.ep, pp=self.pp, ep=self.ep, cp=self.cp, tp=self.tp)

    def short(self) -> str:
        axes = " ".join(f"{a}{getattr(self, a)}" for a in ("dp", "pp", "cp", "tp", "ep") if getattr(self, a) > 1)
        extra = (f" zero{self.zero}" if self.zero else "") + (f" m{self.microbatches}" if self.microbatches > 1 else "")
        extra += f" {self.cp_method}" if self.cp_method != "ring" else ""
        return (axes or "single") + extra

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self, config, *, batch: int, seq_len: int, world_size: int | None = None) -> None:
        """ValueError with the fix for every layout this model, batch and world cannot run; else None.

        Pure arithmetic: call it before launching, and again in each rank (cheap)."""
        for name in ("dp", "pp", "cp", "tp", "ep", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: every axis size (and microbatches) must be an int >= 1")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero!r}: choose 0 (plain gradient sums), 1, 2 or 3")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"dp x pp x cp x tp = {self.dp} x {self.pp} x {self.cp} x {self.tp} = {self.world_size} ranks, "
                f"but {world_size} are running: choose sizes whose product is {world_size} "
                f"(ep borrows its ranks from dp and is not in the product)")
        c = config
        if self.tp > 1:
            for what, n in (("n_heads", c.n_heads), ("hidden_dim", c.hidden_dim), ("vocab_size", c.vocab_size)):
                if n % self.tp:
                    ok = [t for t in range(1, n + 1) if n % t == 0 and t <= 16]
                    raise ValueError(f"tp={self.tp} does not divide {what}={n}: every TP rank holds the same share "
                                     f"of the heads, the MLP's hidden units and the vocabulary; choose tp among {ok}")
        self.check_cp_method(c.n_heads // self.tp)
        if self.pp > c.n_layers:
            raise ValueError(f"pp={self.pp} is more stages than the model's n_layers={c.n_layers}: every stage needs "
                             f"a layer; use pp <= {c.n_layers}")
        if seq_len > c.context:
            raise ValueError(f"seq_len={seq_len} is longer than the model's context {c.context}")
        pieces = 2 * self.cp * self.tp if self.cp > 1 else self.tp
        if seq_len % pieces:
            why = (f"zigzag cuts it into 2 x cp = {2 * self.cp} chunks and sequence parallelism each rank's "
                   f"share into tp = {self.tp}" if self.cp > 1 else f"sequence parallelism cuts it into tp = {self.tp}")
            raise ValueError(f"seq_len={seq_len} does not split: {why} equal pieces; use a multiple of {pieces}, "
                             f"such as {max(pieces, seq_len // pieces * pieces)} or {(seq_len // pieces + 1) * pieces}")
        if batch % (self.dp * self.microbatches):
            raise ValueError(f"batch={batch} does not split into dp={self.dp} replicas x microbatches="
                             f"{self.microbatches}: use a batch that is a multiple of {self.dp * self.microbatches}")
        if self.ep > 1 and not c.n_experts:
            raise ValueError(f"ep={self.ep} on a dense model: expert parallelism splits the experts of MoE layers; "
                             "use --model tiny-moe (a config with n_experts > 0) or ep=1")
        if c.n_experts:
            if c.n_experts % self.ep:
                raise ValueError(f"ep={self.ep} does not divide n_experts={c.n_experts}: every EP rank holds the same "
                                 f"number of experts; choose ep among the divisors of {c.n_experts}")
            if self.dp % self.ep:
                raise ValueError(f"ep={self.ep} does not divide dp={self.dp}: EP borrows its ranks from the "
                                 f"data-parallel ones here, so groups of ep must tile the dp ranks")
            if self.cp * self.tp > 1 and c.capacity_factor * c.top_k < c.n_experts:
                raise ValueError(
                    f"a MoE with capacity_factor={c.capacity_factor} can drop tokens, and drops are decided per whole "
                    f"sequence in position order; with cp={self.cp}, tp={self.tp} no rank sees a whole sequence. "
                    f"Use a dropless MoE: capacity_factor >= n_experts / top_k = {c.n_experts / c.top_k:g} "
                    "(as Megatron-Core does with context or sequence parallelism)")

    def check_cp_method(self, heads_per_tp: int) -> None:
        """ValueError for an unknown cp_method, or heads that its all-to-all cannot split (Ulysses, hybrid)."""
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method={self.cp_method!r} is not a context-parallel method: choose one of "
                             f"{', '.join(CP_METHODS)}")
        if self.cp_method == "hybrid" and self.cp > 1 and (self.cp % HYBRID_LOCAL or self.cp == HYBRID_LOCAL):
            raise ValueError(f"cp_method='hybrid' with cp={self.cp}: the all-to-all runs inside groups of "
                             f"{HYBRID_LOCAL} cp ranks and the ring across them, so cp must be a multiple of "
                             f"{HYBRID_LOCAL} above it (4, 6, 8...); for cp={self.cp} use 'ulysses' or 'ring'")
        a2a = {"ulysses": self.cp, "hybrid": HYBRID_LOCAL}.get(self.cp_method, 1)
        if self.cp > 1 and heads_per_tp % a2a:
            raise ValueError(f"cp_method={self.cp_method!r}: its all-to-all gives each of {a2a} ranks heads/{a2a} "
                             f"whole heads, but each tp rank holds {heads_per_tp} (n_heads / tp): choose cp so that "
                             f"{heads_per_tp} heads split, or cp_method='ring' or 'allgather' (no heads constraint)")

    def build_mesh(self, world_size: int | None = None, *, rank: int | None = None) -> Mesh:
        """This rank's Mesh, with every group the composed step asks for created (collective)."""
        world_size = self.world_size if world_size is None else world_size
        if world_size != self.world_size:
            raise ValueError(f"dp x pp x cp x tp = {self.world_size} ranks, but {world_size} are running")
        sizes = self.mesh_sizes()
        combined = [s for s in dict.fromkeys(live_axes(axes, sizes) for axes in GROUP_SETS) if len(s) > 1]
        return Mesh(world_size, rank=rank, combined=combined, **sizes)


# The axis sets the composed step asks groups for: those a gradient is summed over (solutions/placement.py),
# the data-parallel ranks (rows), and a sequence's ranks (the MoE balance loss counts). The mesh creates them all.
GROUP_SETS = (("dp", "ep", "cp"), ("dp", "ep", "cp", "tp"), ("dp", "cp", "tp"), ("dp", "ep"), ("cp", "tp"))


def live_axes(axes, sizes: dict) -> tuple:
    """The axes of `axes` with more than one rank, in `AXES` order (a size-1 axis has nothing to sum)."""
    return tuple(a for a in AXES if a in axes and sizes[a] > 1)
