# GENERATED from solutions/zero_bubble.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/06_microbatches.ipynb.
# untouched-stub fingerprint: 3532f26058496ab7
"""Zero-bubble pipeline parallelism: ZB-H1 and its split backward (notebook 06_microbatches).

A backward does two jobs: the gradient of the stage's INPUT (B), which the previous
stage waits for, and the gradient of the stage's WEIGHTS (W), which nobody waits for
until the optimizer step. Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024,
https://arxiv.org/abs/2401.10241) split them and move the W's into what would have
been bubbles. ZB-H1 keeps 1F1B's peak activation memory (the first stage holds p
micro-batches) and cuts each rank's idle time from 1F1B's (p-1)(F+B+W) to (p-1)(F+B-W).

The exercises:
- `zb_h1_schedule`: the schedule as data, in the lab's notation with W actions;
- `backward_input` / `backward_weight`: the split backward on a real stage, which
  `run_schedule` (``pipeline.py``) calls for every micro-batch that has a W action.

The split here asks autograd twice on one graph, as ``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight`` do: first the input gradient only,
keeping the graph, then the weights' gradient. (torch also saves, during B, the
gradients arriving at the weights' operations, so that W does not walk the graph again;
here W walks back from ``out`` once more: the same gradients, more arithmetic. On the
lab's synthetic stages the two halves cost exactly t_B - t_W and t_W.)
"""
from __future__ import annotations

import torch

NOTEBOOK = "06_microbatches"


def zb_h1_schedule(n_stages: int, n_microbatches: int) -> list[list[str]]:
    """ZB-H1: 1F1B whose backwards are split into B (input gradient) and W (weights).

    Rank s runs stage s. Like 1F1B it warms up with ``w = min(p - s - 1, m)`` forwards,
    then runs the m backwards in order, each B preceded by the next forward while any
    is left. Then the W's: rank s runs W of its oldest pending micro-batch right after
    each B from its (s+1)-th B on (the first s B's go without a W, which fills the
    bubbles of the ramp-down), and the s W's still pending at the end.
    With p = 4, m = 4 rank 1 runs
    ``["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1W0", "1B2", "1W1", "1B3", "1W2", "1W3"]``.
    This is torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (its "ZB1P").
    """
    raise NotImplementedError("exercise zb_h1_schedule is not implemented yet: edit exercises/zero_bubble.py, see notebooks/06_microbatches.ipynb")


def backward_input(inp, out, grad_out=None):
    """B: the gradient of this stage's input only; returns it (None when ``inp`` is None).

    inp, out: what ``forward_step`` returned for this micro-batch (``inp`` is None on the
        first stage, whose input is token ids).
    grad_out: the gradient of the loss with respect to ``out`` (None on the last stage,
        where ``out`` is the scaled scalar loss).
    Must NOT touch any parameter's ``.grad`` (that is W's job), and must keep the graph:
    `backward_weight` walks it again later. Use ``torch.autograd.grad``.
    """
    raise NotImplementedError("exercise backward_input is not implemented yet: edit exercises/zero_bubble.py, see notebooks/06_microbatches.ipynb")


def backward_weight(out, grad_out, params) -> None:
    """W: accumulate the gradient of ``out`` with respect to ``params`` into their ``.grad``.

    out, grad_out: as for `backward_input` (called earlier on the same micro-batch).
    params: the stage's parameters that require grad.
    Afterwards every parameter's ``.grad`` is exactly what ``backward_step`` (one full
    ``backward``) would have accumulated: add to an existing ``.grad`` (several
    micro-batches), create it when it is None, and leave a parameter that ``out`` does
    not depend on untouched. The graph may be freed afterwards.
    """
    raise NotImplementedError("exercise backward_weight is not implemented yet: edit exercises/zero_bubble.py, see notebooks/06_microbatches.ipynb")
