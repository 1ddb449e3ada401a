# GENERATED from solutions/pipeline_naive.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/05_pipeline_parallel.ipynb.
# untouched-stub fingerprint: 6434f64e4e3c7ab0
"""Naive pipeline parallelism: one batch, one stage per rank (notebook 05_pipeline_parallel).

The model is cut into consecutive stages (`labkit.model.make_stage`); rank s holds stage s.
A training step sends the activations forward, stage after stage, then the gradients
backward:

    rank 0:  F ──act──▶                                   ◀──grad── B
    rank 1:            F ──act──▶             ◀──grad── B
    rank 2:                       F (loss) B

Autograd never crosses a process boundary. Each stage runs its own small graph: it
starts from a *leaf* copy of the activation it received (``requires_grad=True``), so
that after its backward that leaf's ``.grad`` is exactly what the previous stage needs
as the gradient of its output. The last stage reads its targets from the data itself
(every rank can load the batch) instead of receiving them through the pipe.

`forward_step`, `backward_step` and `naive_step` (the messages between them) are the
exercises; the micro-batch executor of notebook 06 (`solutions/pipeline.py`) reuses the
first two for every F and B it runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.mesh import Mesh
from labkit.measure.timeline import NullTimeline

NOTEBOOK = "05_pipeline_parallel"


def forward_step(stage_module, x, targets=None, loss_scale: float = 1.0):
    """One stage's forward of one (micro-)batch; returns ``(inp, out)``.

    x: token ids [b, T] on the first stage; on later stages the activation [b, T, D]
        received from the previous stage (a plain tensor with no autograd history).
    targets: token ids [b, T] on the last stage (it returns the loss), else None.
    loss_scale: multiplies the last stage's loss (1/m with m micro-batches, so that the
        summed gradients are those of the whole batch's mean loss).

    inp: the tensor the stage's graph starts from: for a floating-point x (later stages)
        a leaf that requires grad (x detached), so that `backward_step` can return its
        gradient; None when x holds token ids (an integer tensor, the first stage: token
        ids have no gradient).
    out: the activation to send to the next stage [b, T, D], or on the last stage the
        scaled scalar loss.

    The stage module (`labkit.model.make_stage`) is called ``stage_module(x)`` -> the
    activation, or on the last stage ``stage_module(x, targets)`` -> the mean loss over the
    (micro-)batch's tokens.
    """
    raise NotImplementedError("exercise forward_step is not implemented yet: edit exercises/pipeline_naive.py, see notebooks/05_pipeline_parallel.ipynb")


def backward_step(inp, out, grad_out=None):
    """Backpropagate one (micro-)batch through this stage; returns the gradient of ``inp``.

    inp, out: what `forward_step` returned for this (micro-)batch.
    grad_out: the gradient of the loss with respect to ``out``, received from the next
        stage; None on the last stage, where ``out`` is the (scaled) loss itself.

    The parameters' ``.grad`` accumulate (several micro-batches add up). Returns
    ``inp.grad``, to send to the previous stage, or None on the first stage.
    """
    raise NotImplementedError("exercise backward_step is not implemented yet: edit exercises/pipeline_naive.py, see notebooks/05_pipeline_parallel.ipynb")


def naive_step(stage_module, x, targets, *, mesh: Mesh, act_shape, timeline=None, dtype=None):
    """One pipelined forward and backward of a whole batch; returns the loss on the last stage.

    x: the batch's token ids [B, T] on stage 0 (ignored elsewhere); targets [B, T] on the
    last stage (ignored elsewhere). act_shape: (B, T, d_model), the shape of what flows
    between stages, known to every rank from the config so receivers can allocate it.
    mesh: the `labkit.mesh.Mesh`; the pipeline is its ``"pp"`` axis and this rank's stage is
    ``mesh.coord("pp")``. Ask it for the neighbours: ``mesh.prev_rank("pp")`` and
    ``mesh.next_rank("pp")`` are the GLOBAL ranks of the previous / next stage (None at the
    ends), to use with ``group=mesh.group("pp")``. They are stage -/+ 1 only when pp is the
    mesh's innermost axis: in ``Mesh(4, pp=2, tp=2)`` stage 1 of rank 0's pipeline is rank 2.
    Parameter gradients accumulate into ``.grad``.

    Four parts, with blocking ``dist.send`` / ``dist.recv`` (one message at a time here):
      1. unless first: receive the activation from the previous stage into a new buffer
         (``torch.empty(act_shape, dtype=dtype, device=device)``); `forward_step` makes it
         the leaf that requires grad;
      2. `forward_step` (the last stage passes its targets), then, unless last, send the
         output (detached: data, no graph) to the next stage;
      3. unless last: receive d loss / d output from the next stage (same shape);
      4. `backward_step`, then, unless first, send d loss / d input to the previous stage.
    Record each part on ``tl`` (``with tl.span("recv", stage, 0): ...``, and "F", "send",
    "B") so that notebook 05 can draw your run. Returns the loss (detached) on the last
    stage, None elsewhere.
    """
    tl = timeline if timeline is not None else NullTimeline()
    param = next(stage_module.parameters())  # receive buffers follow the stage: its device, its dtype (dtype=None)
    device, dtype = param.device, dtype or param.dtype
    stage, first, last = mesh.coord("pp"), mesh.is_first("pp"), mesh.is_last("pp")
    raise NotImplementedError("exercise naive_step is not implemented yet: edit exercises/pipeline_naive.py, see notebooks/05_pipeline_parallel.ipynb")
