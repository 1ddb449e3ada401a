"""The layout of a composed run: how many ranks along each parallelism, checked before any process work.

    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2, ep=2, zero=1, microbatches=2)
    dims.check(config, batch=8, seq_len=32, world_size=16)   # ValueError naming the fix, or None
    mesh = dims.build_mesh()                                  # inside launched ranks

**How EP takes its ranks: folded, not added.** ``world_size = dp x pp x cp x tp``: EP needs no ranks of
its own. In the MoE layer every rank of dp x cp x tp holds DIFFERENT tokens (other rows over dp, other
positions over cp, and under sequence parallelism other positions over tp too), so any ep of them can
exchange tokens by the all-to-all and hold different experts. ``ep_over`` names the axes it is folded
over: the ranks of those axes, flattened in grid order, are reshaped into (efsdp, ep), ep innermost;
efsdp ("FSDP of the experts") are the ranks that hold the SAME experts. This is how torchtitan builds it:
its ``ParallelDims`` requires ep to divide dp_shard x cp x tp and builds the expert mesh
[pp, dp_replicate, efsdp, ep] with efsdp = dp_shard x cp x tp / ep (torchtitan/distributed/parallel_dims.py,
``_validate`` and ``build_mesh``). Megatron-Core folds too: its MoE groups (expert-tp x ep x expert-dp) are
sub-groups of dp x cp x tp, and "the CP and EP group are folded together by default ... (CP=8, EP=8) ...
only requires 8 GPUs" (megatron/core/transformer/moe/README.md, "MoE Parallel Folding"; Liu et al. 2025,
arXiv 2504.14960). The lab offers:
    ep_over=("dp",)              ep borrows from the data ranks only (the lab's first form; the Mesh keeps
                                 an ``ep`` grid axis carved out of dp: ``Mesh(world, dp=dp // ep, pp, ep, cp, tp)``)
    ep_over=("dp", "cp")         ep over data and context ranks: with cp = ep, each ring is an EP group
    ep_over=("dp", "cp", "tp")   torchtitan's folding: with tp = ep, each TP group is an EP group
(without folding, ep ranks reading the SAME tokens would repeat every dense layer ep times, and all five
axes at size 2 would need 32 ranks). ``mesh.group("ep")`` is always the EP group, ``mesh.group("efsdp")``
the ranks with the same experts, ``mesh.group("batch")`` the data-parallel ranks (other rows).

**HSDP.** ``dp = dp_replicate x dp_shard``: ZeRO/FSDP (zero >= 1) shards each gradient group's state
over its ranks inside one replica (dp_shard, and cp, tp, efsdp where the group spans them) and
all-reduces the shards across the dp_replicate replicas (torchtitan's and FSDP2's HSDP on a 2-D mesh).
EP is folded over dp_shard only, never across replicas, as in torchtitan.
"""
from __future__ import annotations

import math
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
    """dp (data-parallel ranks), pp, cp, tp, ep (folded over `ep_over`), ZeRO stage, micro-batches,
    how attention crosses the cp ranks (`CP_METHODS`), and HSDP's dp = dp_replicate x dp_shard
    (dp_shard None: dp // dp_replicate)."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    cp_method: str = "ring"
    ep_over: tuple = ("dp",)
    dp_replicate: int = 1
    dp_shard: int | None = None
    ep_overlap: bool = False  # each MoE layer as two halves whose all-to-alls hide behind the other's experts

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def folded(self) -> tuple:
        """`ep_over` in the Mesh's order (dp, cp, tp)."""
        over = (self.ep_over,) if isinstance(self.ep_over, str) else tuple(self.ep_over)
        return tuple(a for a in ("dp", "cp", "tp") if a in over)

    def mesh_sizes(self) -> dict:
        """The Mesh's axis sizes, in `labkit.mesh.AXES` order: with ep over dp only, ep is a grid axis carved
        out of dp; folded over cp or tp too, ep is a slice of the folded axes (see `mesh_kwargs`)."""
        if self.folded == ("dp",):
            return dict(dp=self.dp // self.ep, pp=self.pp, ep=self.ep, cp=self.cp, tp=self.tp)
        return dict(dp=self.dp, pp=self.pp, ep=self.ep, cp=self.cp, tp=self.tp)

    def mesh_kwargs(self) -> dict:
        """Everything `labkit.mesh.Mesh` needs besides world_size and rank: the sizes, ep_over, dp_replicate."""
        extra = {} if self.folded == ("dp",) else {"ep_over": self.folded}
        return {**self.mesh_sizes(), **extra, **({"dp_replicate": self.dp_replicate} if self.dp_replicate > 1 else {})}

    def layout_mesh(self, rank: int = 0) -> Mesh:
        """The layout only (no process group, no groups): for tables, figures and closed forms."""
        return Mesh(self.world_size, rank=rank, groups=False, **self.mesh_kwargs())

    def short(self) -> str:
        axes = " ".join(f"{a}{getattr(self, a)}" for a in ("dp", "pp", "cp", "tp", "ep") if getattr(self, a) > 1)
        if self.dp_replicate > 1:
            axes = axes.replace(f"dp{self.dp}", f"dp{self.dp_replicate}x{self.dp // self.dp_replicate}")
        if self.ep > 1 and self.folded != ("dp",):
            axes += "/" + "".join(self.folded)
        extra = (f" zero{self.zero}" if self.zero else "") + (f" m{self.microbatches}" if self.microbatches > 1 else "")
        extra += f" {self.cp_method}" if self.cp_method != "ring" else ""
        extra += " overlap" if self.ep_overlap else ""
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
        for name in ("dp_replicate",) + (("dp_shard",) if self.dp_shard is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1 (--dp-replicate, --dp-shard)")
        shard = self.dp // self.dp_replicate if self.dp_shard is None else self.dp_shard
        if self.dp_replicate * shard != self.dp:
            raise ValueError(f"dp_replicate x dp_shard = {self.dp_replicate} x {shard} = {self.dp_replicate * shard}, "
                             f"but dp={self.dp}: HSDP splits the dp data-parallel ranks into replicas x shards; choose "
                             f"--dp-replicate R and --dp-shard S with R x S = {self.dp} (or leave --dp-shard out)")
        if self.ep_over != self.folded or not self.folded:
            raise ValueError(f"ep_over={self.ep_over!r}: name the axes EP is folded over, in the order dp, cp, tp, "
                             "such as ('dp',), ('dp', 'cp') or ('dp', 'cp', 'tp')")
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
        if self.ep_overlap and self.ep < 2:
            raise ValueError("ep_overlap hides expert parallelism's all-to-all, but ep=1 has none: use ep >= 2, "
                             "or leave ep_overlap out")
        if self.ep > 1 and not c.n_experts:
            raise ValueError(f"ep={self.ep} on a dense model: expert parallelism splits the experts of MoE layers; "
                             "use --model tiny-moe (a config with n_experts > 0) or ep=1")
        if c.n_experts:
            if c.n_experts % self.ep:
                raise ValueError(f"ep={self.ep} does not divide n_experts={c.n_experts}: every EP rank holds the same "
                                 f"number of experts; choose ep among the divisors of {c.n_experts}")
            sizes = {"dp": shard, "cp": self.cp, "tp": self.tp}
            over = {a: sizes[a] for a in self.folded}
            if math.prod(over.values()) % self.ep:
                names = " x ".join(f"{'dp_shard' if a == 'dp' else a}={n}" for a, n in over.items())
                more = [a for a in ("cp", "tp") if a not in self.folded and sizes[a] > 1]
                raise ValueError(f"ep={self.ep} does not divide the ranks it is folded over, {names} = "
                                 f"{math.prod(over.values())}: choose ep among the divisors of {math.prod(over.values())}"
                                 + (f", or fold it over more axes (ep_over={self.folded + tuple(more)}, --ep-over "
                                    f"{','.join(self.folded + tuple(more))})" if more else ""))
            Mesh(self.world_size, rank=0, groups=False, **self.mesh_kwargs())  # ep cutting across an axis: named
            rows = batch // (self.dp * self.microbatches)
            if self.ep_overlap and rows < 2:
                raise ValueError(f"ep_overlap cuts each rank's micro-batch into two halves of whole sequences, but "
                                 f"batch={batch} / (dp={self.dp} x microbatches={self.microbatches}) gives {rows} "
                                 f"sequence per rank: use a batch of at least {2 * self.dp * self.microbatches}")
            if self.cp * self.tp > 1 and c.capacity_factor * c.top_k < c.n_experts:
                raise ValueError(
                    f"a MoE with capacity_factor={c.capacity_factor} can drop tokens, and the lab's MoE "
                    "(labkit.model.moe) decides drops per whole sequence in position order, as one device does; with "
                    f"cp={self.cp}, tp={self.tp} no rank sees a whole sequence, so the run could not equal one device. "
                    f"Use a dropless MoE: capacity_factor >= n_experts / top_k = {c.n_experts / c.top_k:g} (this is the "
                    "lab's requirement, for its proofs: Megatron-Core drops by each rank's local routing map instead)")

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
        layout = self.layout_mesh()
        sets = [summed_axes(kind, layout) for kind in PARAM_CLASSES] + [("batch",), ("cp", "tp"), ("dp_replicate",)]
        sets += [hsdp_split(axes, layout)[0] for axes in sets[:len(PARAM_CLASSES)]]  # HSDP: a replica's shards
        combined = [s for s in dict.fromkeys(live_axes(axes, layout) for axes in sets) if s]  # the Mesh dedupes
        return Mesh(world_size, rank=rank, combined=combined, **self.mesh_kwargs())


PARAM_CLASSES = ("tp_shard", "sp_replica", "expert")


def summed_axes(kind: str, mesh: Mesh) -> tuple:
    """labkit's own rule (the placement exercise's answer, never the learner's): the names of the ranks that
    hold a replica of a parameter of class `kind` (labkit.compose.model.param_class), so sum its gradient.

        tp_shard     batch, cp        complete over tp: the matmul saw the sequence SP gathered
        sp_replica   batch, cp, tp    under SP each tp rank applied it to its own positions
        expert       dp_replicate, efsdp, and cp, tp where ep is not folded over them: the ranks with the
                     same experts (the all-to-all already brought the tokens of the ep group)
    """
    if kind == "tp_shard":
        return ("batch", "cp")
    if kind == "sp_replica":
        return ("batch", "cp", "tp")
    if kind == "expert":
        return ("dp_replicate", "efsdp") + tuple(a for a in ("cp", "tp") if a not in mesh.ep_over)
    raise ValueError(f"{kind!r}: the parameter classes are {PARAM_CLASSES}")


def hsdp_split(axes, mesh: Mesh) -> tuple:
    """(shard axes, replica axes) of a gradient group under HSDP: the group's ranks inside one replica, and
    its dp_replicate ranks (() when the group does not span the replicas or dp_replicate = 1)."""
    replicas = mesh.atoms("dp_replicate")
    atoms = mesh.atoms(axes) if axes else ()
    if not set(replicas) <= set(atoms) or mesh.size("dp_replicate") == 1:
        return live_axes(axes, mesh), ()
    return live_axes(tuple(a for a in atoms if a not in replicas), mesh), ("dp_replicate",)


def live_axes(axes, mesh) -> tuple:
    """The ranks `axes` name, as the fewest names of the mesh (its axes first, ep last, then batch,
    dp_replicate, dp_shard, efsdp, then the atoms no name covers; in the mesh's order) that span them, size-1 ones left out
    (nothing to sum there): two spellings of one group give one key. `mesh` may be a dict of the AXES' sizes."""
    if isinstance(mesh, dict):
        return tuple(a for a in AXES if a in axes and mesh[a] > 1)
    want = [a for a in mesh.atoms(axes) if mesh.size(a) > 1] if axes else []
    out, have = [], set()
    prefer = ("dp", "pp", "cp", "tp", "ep") + tuple(mesh.names[len(AXES):])  # a folded ep lies inside dp, cp or tp
    for name in prefer + tuple(want):
        atoms = {a for a in mesh.atoms(name) if mesh.size(a) > 1}
        if atoms and atoms <= set(want) and not atoms <= have:
            out.append(name)
            have |= atoms
    order = list(mesh.names) + want
    return tuple(sorted(out, key=order.index))
