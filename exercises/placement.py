# GENERATED from solutions/placement.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/14_everything.ipynb.
# untouched-stub fingerprint: 5f9208beed827102
"""Where every parameter lives and where its gradient is summed; what data each rank reads (notebook 14_everything).

Notebook 14 composes every parallelism on one `labkit.mesh.Mesh` with the axes (dp, pp, ep, cp, tp)
(`labkit.compose`: ep borrows its ranks from dp, so the data-parallel ranks are the mesh's dp and ep
axes together). Each rank backpropagates its SHARE of the one global loss (its tokens' terms divided
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
                that rank already received, by the all-to-all, the tokens of its whole EP group.
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
    summed_over: every axis among ("dp", "ep", "cp", "tp") along which the ranks hold a replica
        of it, in `labkit.mesh.AXES` order (dp, ep, cp, tp): axes of size 1 included (the mesh
        then has nothing to sum there). Never "pp". Use `param_class(name)`; `mesh` is given so
        that you could ask it (``mesh.sizes``), but the answer depends on the class alone.
    """
    raise NotImplementedError("exercise placement is not implemented yet: edit exercises/placement.py, see notebooks/14_everything.ipynb")


def local_batch(tokens: torch.Tensor, targets: torch.Tensor, *, mesh: Mesh):
    """(x, y): what this rank reads of the GLOBAL batch tokens, targets [B, s] (the same on every rank).

    rows: this data-parallel replica's rows, ``shard_rows(t, index, count)`` with
        ``index, count = mesh.index(("dp", "ep")), mesh.size(("dp", "ep"))`` (ep borrows from dp);
    positions: this cp rank's zigzag pieces of the sequence, ``impl("context_parallel").zigzag_split(
        s, mesh.size("cp"), mesh.coord("cp"))`` cut out with ``impl("context_parallel").take(t, pieces,
        dim=1)`` (with cp = 1: the whole sequence, ``[(0, s)]``); the same on every tp rank (sequence
        parallelism splits the positions inside the model, after the embedding);
    stages: x only on the first pipeline stage (``mesh.is_first("pp")``), y only on the last, None elsewhere.
    Returns (x [B/(dp), s/cp] or None, y [B/(dp), s/cp] or None).
    """
    raise NotImplementedError("exercise local_batch is not implemented yet: edit exercises/placement.py, see notebooks/14_everything.ipynb")
