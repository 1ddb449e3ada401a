# GENERATED from solutions/hybrid.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/07_hybrid.ipynb.
# untouched-stub fingerprint: d7b89e16dfa984d1
"""DP x PP hybrid: several pipelines trained as data-parallel replicas (notebook 07_hybrid).

The ranks form one grid ``torch.arange(world_size).view(dp, pp)``:

    pp coord: 0  1  2
    dp 0:   [ 0, 1, 2 ]   <- one pipeline (a row): stage s lives on column s
    dp 1:   [ 3, 4, 5 ]   <- another pipeline, same stages, other data

Every process group is a slice of that grid: a row is a pipeline (neighbours send
activations forward and gradients backward), a column holds the replicas of one stage
(they all-reduce that stage's gradients). One training step runs the micro-batches of
each replica's share of the batch through its pipeline with 1F1B, then all-reduces the
gradients of every stage among its replicas ONCE, after the flush, and steps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.grading import impl
from labkit.mesh import Mesh, shard_rows
from labkit.measure.timeline import NullTimeline

NOTEBOOK = "07_hybrid"


def make_mesh(world_size: int, dp: int, pp: int, rank: int | None = None) -> Mesh:
    """This rank's `labkit.mesh.Mesh` of the grid ``torch.arange(world_size).view(dp, pp)``, its groups made by hand.

    Start from the layout, ``mesh = Mesh(world_size, dp=dp, pp=pp, rank=rank, groups=False)``:
    it checks the sizes (ValueError, before any group is created, when dp or pp is not
    positive, when ``world_size != dp * pp``, when ``rank`` is not in ``range(world_size)``,
    or when they disagree with the initialised process group) and answers the layout
    questions: ``mesh.coord("dp")`` (which pipeline replica, the grid row),
    ``mesh.coord("pp")`` (which stage, the column), ``mesh.prev_rank("pp")`` /
    ``mesh.next_rank("pp")`` (global ranks of the neighbouring stages, None at the ends),
    ``mesh.is_first("pp")`` / ``mesh.is_last("pp")``, ``mesh.ranks("pp")`` (its pipeline).

    Your part: the process groups. If torch.distributed is initialised, every rank must
    create ALL groups in the same order, since ``dist.new_group`` is collective: every row
    of the grid (a pipeline), then every column (the replicas of one stage). Hand the two
    this rank belongs to to the mesh: ``mesh.add_group("pp", its_row_group)`` and
    ``mesh.add_group("dp", its_column_group)`` (add_group checks that a group holds the right
    ranks). Without a process group (``rank`` given), return the layout alone.
    Returns the mesh; then ``mesh.group("pp")`` / ``mesh.group("dp")`` are the groups.
    """
    raise NotImplementedError("exercise make_mesh is not implemented yet: edit exercises/hybrid.py, see notebooks/07_hybrid.ipynb")


def replica_rows(x, *, mesh: Mesh):
    """This replica's rows of a global batch tensor: rows i*b:(i+1)*b, i = mesh.coord("dp"), b = B // dp.

    The lab's one sharding rule (`labkit.mesh.shard_rows`, the same as notebook 04's
    ``shard_for_rank``), with the replica's index and count taken from the mesh.
    """
    return shard_rows(x, mesh.coord("dp"), mesh.size("dp"))


def hybrid_step(stage_module, x, y, n_microbatches: int, optimizer=None, *, mesh: Mesh,
                timeline=None, sync_grads: bool = True):
    """One DP x PP training step on this rank; returns the global batch's mean loss on
    the last stage (every replica's last stage returns the same value), None elsewhere.

    mesh: this rank's (dp, pp) `labkit.mesh.Mesh` (your `make_mesh`): ``mesh.coord("dp")``,
        ``mesh.size("dp")``, ``mesh.is_first("pp")``, ``mesh.is_last("pp")``, ``mesh.group("dp")``.
    stage_module: this rank's stage, ``labkit.model.make_stage(model, mesh.coord("pp"), mesh.size("pp"))``
        (or a ``SyntheticStage`` of notebook 06, whose ``act_shape`` is the micro-batch's).
    x, y: the GLOBAL batch [B, T] (the same on every rank). Replica ``mesh.coord("dp")`` trains
        on its rows (``replica_rows(x, mesh=mesh)``), split into ``n_microbatches`` micro-batches.
    The step:
      1. zero this stage's gradients;
      2. run the replica's rows through its pipeline with 1F1B: notebook 06's executor,
         ``impl("pipeline").run_schedule(..., mesh=mesh, act_shape=...)``, which sends along
         the mesh's pp axis; the accumulated ``.grad`` is that of the replica's mean loss;
      3. ONCE, after the pipeline's flush: average the stage's gradients over the
         replicas of this stage, ``impl("data_parallel").sync_gradients`` on
         ``mesh.group("dp")`` (recorded as an "allreduce" span); skipped when
         ``sync_grads=False`` (a caller that synchronised the gradients itself);
      4. ``optimizer.step()`` when an optimizer is given.
    Together: the gradient of the mean loss over the global batch, as one process computes it.
    Raises ValueError when B does not split into dp x n_microbatches equal parts.
    """
    raise NotImplementedError("exercise hybrid_step is not implemented yet: edit exercises/hybrid.py, see notebooks/07_hybrid.ipynb")


# ------------------------------------------------------------------ the slow way, for contrast
class PerMicrobatchAllReduce(torch.nn.Module):
    """Wraps a stage so that its gradients are averaged over ``group`` after EVERY micro-batch.

    What not to do: it moves the same gradient volume once per micro-batch (m times per
    step) and makes every backward wait for the slowest replica. Still correct: each
    micro-batch's contribution (the change of ``.grad`` in its backward) is averaged on
    its own, with the same `sync_gradients` as `hybrid_step`. Use it as
    ``hybrid_step(PerMicrobatchAllReduce(stage, mesh.group("dp")), ..., mesh=mesh, sync_grads=False)``.
    The all-reduce runs at the end of each micro-batch's backward pass, queued from a
    hook on the stage's output, as torch's DDP does it.
    """

    def __init__(self, stage_module, group, timeline=None):
        super().__init__()
        self.inner, self.group, self.timeline = stage_module, group, timeline
        self.act_shape = getattr(stage_module, "act_shape", None)
        if hasattr(stage_module, "config"):
            self.config = stage_module.config
        self._before = None  # .grad as it was before the current backward

    def forward(self, x, targets=None):
        out = self.inner(x, targets) if targets is not None else self.inner(x)
        if out.requires_grad:
            out.register_hook(self._on_backward_start)
        return out

    def _on_backward_start(self, grad):
        self._before = [None if p.grad is None else p.grad.clone() for p in self.inner.parameters()]
        torch.autograd.Variable._execution_engine.queue_callback(self._sync)
        return grad

    def _sync(self):
        params = list(self.inner.parameters())
        for p, before in zip(params, self._before):  # this micro-batch's contribution only
            if p.grad is not None and before is not None:
                p.grad.sub_(before)
        tl = self.timeline if self.timeline is not None else NullTimeline()
        with tl.span("allreduce", getattr(self.inner, "stage", None)):
            impl("data_parallel").sync_gradients(self.inner, group=self.group)
        for p, before in zip(params, self._before):
            if before is not None:
                if p.grad is None:
                    p.grad = before
                else:
                    p.grad.add_(before)


# ------------------------------------------------------------------ communication, from formulas
def stage_param_counts(config, pp: int) -> list[int]:
    """Parameters of each of the pp stages of a model with this config (embedding on stage 0, head last)."""
    from labkit.model import build_model, make_stages

    model = build_model(config, seed=0)
    return [sum(p.numel() for p in stage.parameters()) for stage in make_stages(model, pp)]


def communication_per_step(config, dp: int, pp: int, batch_size: int, seq_len: int,
                           n_microbatches: int = 1, bytes_per_element: int = 4,
                           allreduce_per_microbatch: bool = False) -> dict:
    """Bytes SENT in one training step of a (dp, pp) mesh, from the formulas (no process).

    Gradient all-reduce (ring, among the dp replicas of each stage s with P_s parameters):
        each rank sends 2 (dp - 1) / dp * P_s elements; all ranks together 2 (dp - 1) P.
        Once per step, or m times with ``allreduce_per_microbatch`` (the mistake).
    Pipeline (each of the pp - 1 boundaries of each replica, whatever m is):
        the activations forward and their gradients backward, (B / dp) x T x d_model
        elements each way; all ranks together 2 (pp - 1) B T d_model.
    Returns {"allreduce_bytes", "p2p_bytes", "total_bytes": summed over all ranks;
    "max_rank_bytes": the busiest rank's; "messages": point-to-point messages per step}.
    """
    counts = stage_param_counts(config, pp)
    times = n_microbatches if allreduce_per_microbatch else 1
    ar = [times * 2 * (dp - 1) / dp * c * bytes_per_element for c in counts]  # per rank of stage s
    act = batch_size // dp * seq_len * config.d_model * bytes_per_element  # one way, one boundary
    p2p = [act * ((s < pp - 1) + (s > 0)) for s in range(pp)]  # sends forward and/or backward
    return {
        "allreduce_bytes": dp * sum(ar),
        "p2p_bytes": dp * sum(p2p),
        "total_bytes": dp * (sum(ar) + sum(p2p)),
        "max_rank_bytes": max(a + p for a, p in zip(ar, p2p)),
        "messages": dp * (pp - 1) * 2 * n_microbatches,
    }
