"""Where every parameter lives and where its gradient is summed; what data each rank reads (notebook 14_everything).

Notebook 14 composes every parallelism on one `labkit.mesh.Mesh` with the axes (dp, pp, ep, cp, tp)
(`labkit.compose.dims`): ep needs no ranks of its own, it is FOLDED over ranks that hold different tokens:
over the data ranks only (``mesh.ep_over == ("dp",)``), or over dp x cp, or dp x cp x tp. Names the mesh
answers for besides its axes: ``batch`` (the data-parallel ranks, which read other rows), ``dp_replicate``
(HSDP's replicas; size 1 without HSDP) and ``efsdp`` (among the ranks ep is folded over, those that hold
the SAME experts). Each rank backpropagates its SHARE of the one global loss (its tokens' terms divided
by the global token count), so the rule for every parameter is one sentence:

    its gradient is SUMMED over exactly the ranks that hold a replica of it,
    and those are the ranks that saw other tokens through the same weights.

The parameter classes (`param_class`), in the model `labkit.compose.parallelize` builds:
  "tp_shard"    wq wk wv wo, the dense MLP's w1 w2 w3, the vocab-parallel embedding and head: each tp
                rank holds a slice (rows or columns), computed on the WHOLE sequence that SP gathers,
                so its gradient is complete over tp. Replicated over the data ranks and cp.
  "sp_replica"  the RMSNorm weights and the MoE router: a full copy on every tp rank, but under
                sequence parallelism each tp rank applies it to its own s/tp positions only.
  "expert"      a MoE expert's w1 w2 w3: held by one ep rank of each EP group (sharded over ep), and
                that rank already received, by the all-to-all, the tokens of its whole EP group. The same
                expert is on every rank of efsdp, on every HSDP replica, and along cp and tp where ep is
                not folded over them.
No parameter is on two pipeline stages: nothing is ever summed across pp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.compose.model import param_class, shard_dim  # noqa: F401 (the classes; notebook 14 reads them here)
from labkit.grading import impl
from labkit.mesh import Mesh
from labkit.parallel.sharding import shard_rows

NOTEBOOK = "14_everything"

@dataclass(frozen=True)
class Placement:
    sharded_over: tuple  # the mesh axes whose ranks hold DIFFERENT pieces of it ("tp" or "ep"), or ()
    summed_over: tuple   # the mesh axes whose ranks hold the SAME values: its gradient is summed over them


def placement(name: str, *, mesh: Mesh) -> Placement:
    """The placement of parameter `name` (a name of `model.named_parameters()`, as in the full model).

    sharded_over: ("tp",) for a "tp_shard", ("ep",) for an "expert", () for an "sp_replica".
    summed_over: the mesh names (axes, or "batch", "dp_replicate", "efsdp") whose ranks hold a replica
        of it: names of size 1 included (the mesh then has nothing to sum there). Never "pp". The data
        ranks are "batch" (with ep a grid axis, the mesh's ("dp", "ep") together; folded over cp or tp,
        "ep" lies inside cp or tp, so do not use it for the data ranks). For an expert the answer
        depends on the folding: ask ``mesh.ep_over`` (the axes ep is folded over, such as ("dp", "cp")).
        Use `param_class(name)`.
    """
    ### BEGIN SOLUTION
    kind = param_class(name)
    if kind == "tp_shard":  # complete over tp (the gathered sequence); other rows over batch; other positions over cp
        return Placement(("tp",), ("batch", "cp"))
    if kind == "sp_replica":  # also other positions on each tp rank (sequence parallelism)
        return Placement((), ("batch", "cp", "tp"))
    # expert: the all-to-all already summed over its EP group; the same expert on efsdp, on every replica,
    # and along cp, tp where ep is not folded over them
    return Placement(("ep",), ("dp_replicate", "efsdp") + tuple(a for a in ("cp", "tp") if a not in mesh.ep_over))
    ### END SOLUTION


def local_batch(tokens: torch.Tensor, targets: torch.Tensor, *, mesh: Mesh):
    """(x, y): what this rank reads of the GLOBAL batch tokens, targets [B, s] (the same on every rank).

    rows: this data-parallel replica's rows, ``shard_rows(t, index, count)`` with
        ``index, count = mesh.index("batch"), mesh.size("batch")`` (the data ranks, ep's and HSDP's included);
    positions: this cp rank's zigzag pieces of the sequence, ``impl("context_parallel").zigzag_split(
        s, mesh.size("cp"), mesh.coord("cp"))`` cut out with ``impl("context_parallel").take(t, pieces,
        dim=1)`` (with cp = 1: the whole sequence, ``[(0, s)]``); the same on every tp rank (sequence
        parallelism splits the positions inside the model, after the embedding);
    stages: x only on the first pipeline stage (``mesh.is_first("pp")``), y only on the last, None elsewhere.
    Returns (x [B/batch, s/cp] or None, y [B/batch, s/cp] or None).
    """
    ### BEGIN SOLUTION
    cp, s = impl("context_parallel"), tokens.shape[1]
    pieces = cp.zigzag_split(s, mesh.size("cp"), mesh.coord("cp")) if mesh.size("cp") > 1 else [(0, s)]
    index, count = mesh.index("batch"), mesh.size("batch")
    mine = lambda t: cp.take(shard_rows(t, index, count), pieces, dim=1)  # noqa: E731
    return (mine(tokens) if mesh.is_first("pp") else None,
            mine(targets) if mesh.is_last("pp") else None)
    ### END SOLUTION
