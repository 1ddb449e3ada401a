"""A layout: how a training step is spread over the GPUs, and its checks (notebook 15).

The axes are labkit.mesh's, in its order (dp outermost, tp innermost): a group along an axis
holds ranks `stride` apart, stride = the product of the axes inside it. A group lies in one
node when stride x size <= gpus_per_node, so tp (innermost) is the first to stay on NVLink.
`zero` is the data-parallel flavour over dp x cp (torchtitan's FSDP shards over both):
"dp" (plain averaging), "zero1", "zero2", "zero3" (FSDP). `recompute` is "none",
"selective" (torchtitan's op-level policy) or "full" (every block's input only).
`micro_batch` is sequences per micro-batch; each data-parallel rank's share of the global
batch is cut into micro-batches (gradient accumulation, or the pipeline's micro-batches).
`schedule`: "1f1b" or "interleaved" (`virtual_stages` stages per pipeline rank).
EP borrows its ranks from dp x cp (as torchtitan's ParallelDims): ep must divide dp x cp.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from labkit.mesh import AXES

ZERO_STAGES = ("dp", "zero1", "zero2", "zero3")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved")


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
    recompute: str = "selective"
    micro_batch: int = 1
    sequence_parallel: bool = True
    schedule: str = "1f1b"
    virtual_stages: int = 1

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
        """"node" if every group along `axis` lies inside one node, else "network"."""
        if axis == "ep":  # borrowed from dp x cp: cp's ranks first (stride tp), then dp's (stride pp cp tp)
            span = self.ep * self.tp if self.ep <= self.cp else self.ep * self.pp * self.tp
        else:
            span = getattr(self, axis) * self.stride(axis)
        return "node" if span <= gpus_per_node else "network"

    def layers_per_rank(self, n_layers: int) -> int:
        """Blocks on the busiest pipeline rank: stages get ceil(L / stages) blocks (torchtitan
        splits 126 layers into 8 stages unevenly; the fullest stage sets the pace)."""
        stages = self.pp * (self.virtual_stages if self.schedule == "interleaved" else 1)
        return -(-n_layers // stages) * (stages // self.pp)

    def short(self) -> str:
        axes = " ".join(f"{a}{getattr(self, a)}" for a in ("dp", "pp", "cp", "tp", "ep") if getattr(self, a) > 1)
        extra = f" {self.schedule}x{self.virtual_stages}" if self.pp > 1 and self.schedule == "interleaved" else ""
        return f"{axes or 'single'} {self.zero} {self.recompute} mb{self.micro_batch}{extra}"

    def as_dict(self) -> dict:
        return asdict(self)


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise LayoutError(message)


def check_layout(model, layout: Layout, n_gpus: int, gpus_per_node: int, global_batch: int, seq_len: int) -> int:
    """Raise LayoutError naming the first thing that does not split; return the micro-batch count.

    Checks, in order: positive ints and known options; the axes' product is n_gpus (whole
    nodes); tp divides the heads, the KV heads and the MLP width (tp across nodes is a cost,
    not an error: the search may pick it); pp divides the layers (x virtual stages) at most once each; cp
    splits the sequence into 2 cp zigzag chunks; ep divides the experts and dp x cp, and is
    1 for a dense model; the global batch splits over dp and into micro-batches.
    """
    for axis in ("dp", "pp", "cp", "tp", "ep", "micro_batch", "virtual_stages"):
        value = getattr(layout, axis)
        _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
              f"{axis}={value!r}: must be an int >= 1")
    _need(layout.zero in ZERO_STAGES, f"zero={layout.zero!r}: choose one of {ZERO_STAGES}")
    _need(layout.recompute in RECOMPUTE, f"recompute={layout.recompute!r}: choose one of {RECOMPUTE}")
    _need(layout.schedule in SCHEDULES, f"schedule={layout.schedule!r}: choose one of {SCHEDULES}")
    _need(layout.world_size == n_gpus,
          f"dp x pp x cp x tp = {layout.dp} x {layout.pp} x {layout.cp} x {layout.tp} = {layout.world_size} "
          f"GPUs, but the cluster has {n_gpus}: choose sizes whose product is {n_gpus}")
    _need(n_gpus % gpus_per_node == 0 or n_gpus < gpus_per_node,
          f"{n_gpus} GPUs is not a whole number of nodes of {gpus_per_node}: use a multiple of {gpus_per_node}")
    m = model
    _need(m.n_heads % layout.tp == 0 and m.n_kv_heads % layout.tp == 0,
          f"tp={layout.tp} does not divide {m.name}'s {m.n_heads} heads and {m.n_kv_heads} KV heads: "
          f"use a tp that divides {math.gcd(m.n_heads, m.n_kv_heads)}")
    _need(m.hidden_dim % layout.tp == 0, f"tp={layout.tp} does not divide the MLP width {m.hidden_dim}")
    stages = layout.pp * (layout.virtual_stages if layout.schedule == "interleaved" else 1)
    _need(layout.schedule == "1f1b" or layout.pp > 1, "schedule='interleaved' needs pp > 1")
    _need(stages <= m.n_layers,
          f"pp={layout.pp} x {stages // layout.pp} virtual stage(s) = {stages} stages for {m.name}'s "
          f"{m.n_layers} layers: every stage needs a layer, use at most {m.n_layers} stages")
    _need(seq_len % (2 * layout.cp) == 0 if layout.cp > 1 else True,
          f"cp={layout.cp}: the sequence of {seq_len} tokens must split into 2 x cp = {2 * layout.cp} "
          "zigzag chunks")
    if m.n_experts == 0:
        _need(layout.ep == 1, f"ep={layout.ep} on the dense model {m.name}: ep needs experts (use ep=1)")
    else:
        _need(m.n_experts % layout.ep == 0, f"ep={layout.ep} does not divide the {m.n_experts} experts")
        _need((layout.dp * layout.cp) % layout.ep == 0,
              f"ep={layout.ep} borrows its ranks from dp x cp = {layout.dp * layout.cp}: it must divide it")
    _need(global_batch % layout.dp == 0,
          f"the global batch of {global_batch} sequences does not split over dp={layout.dp}")
    local = global_batch // layout.dp
    _need(local % layout.micro_batch == 0,
          f"each dp rank's {local} sequences do not split into micro-batches of {layout.micro_batch}")
    n_micro = local // layout.micro_batch
    _need(layout.pp == 1 or n_micro >= layout.pp,
          f"pp={layout.pp} needs at least {layout.pp} micro-batches per step, the layout has {n_micro}: "
          "use smaller micro-batches or fewer stages")
    return n_micro
