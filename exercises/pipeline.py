# GENERATED from solutions/pipeline.py by `python -m labkit.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/06_microbatches.ipynb.
# untouched-stub fingerprint: 9b15d0f2f41f12c9
"""Micro-batch pipeline schedules and the executor that runs them (notebook 06_microbatches).

A schedule is data: one list of actions per rank, ``"{stage}F{mb}"`` / ``"{stage}B{mb}"``
(see `labkit.schedules`, which parses, checks and simulates them without processes).
`gpipe_schedule` and `one_f_one_b_schedule` build the two classic ones; `run_schedule`
runs ANY valid list on real ranks, one stage per rank, with point-to-point messages:

    F on stage s: receive the activation from stage s-1 (unless s = 0), forward, send
                  the output to stage s+1 (unless s is last; the last stage computes the loss)
    B on stage s: receive d loss / d output from stage s+1 (unless s is last), backward,
                  send d loss / d input to stage s-1 (unless s = 0)

Sends are ``isend`` (waited for at the end of the step) and every message carries a tag
made of (kind, stage, micro-batch), so no pair of neighbours can block each other (see
the deadlock section of notebook 06: plain gloo ``send`` waits for the receiver).
The forward and backward of one micro-batch are `forward_step` / `backward_step` from
notebook 05 (`pipeline_naive.py`).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import schedules
from labkit.timeline import NullTimeline

from .pipeline_naive import backward_step, forward_step

NOTEBOOK = "06_microbatches"


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[str]]:
    """GPipe: every rank runs all its forwards, then all its backwards.

    Returns one action list per rank (rank s runs stage s): rank s gets
    ``[sF0, sF1, ..., sF(m-1), sB0, sB1, ..., sB(m-1)]``.
    Every rank holds the activations of all m micro-batches at its peak.
    """
    raise NotImplementedError("exercise gpipe_schedule is not implemented yet: edit exercises/pipeline.py, see notebooks/06_microbatches.ipynb")


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[str]]:
    """1F1B (PipeDream-Flush / DAPPLE): warm up, then alternate one F and one B, then drain.

    Rank s first runs ``w = min(p - s - 1, m)`` forwards (warm-up), then m - w pairs
    "forward of the next micro-batch, backward of the oldest one", then the w remaining
    backwards. Same bubble as GPipe, but rank s holds at most p - s activations.
    With 4 stages and 4 micro-batches rank 1 runs
    ``["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"]``.
    """
    raise NotImplementedError("exercise one_f_one_b_schedule is not implemented yet: edit exercises/pipeline.py, see notebooks/06_microbatches.ipynb")


# ----------------------------------------------------------------------------- executor
def activation_shape(config, batch_size: int, seq_len: int, n_microbatches: int) -> tuple[int, int, int]:
    """(micro-batch, seq_len, d_model): what flows between stages, known to every rank.

    Receivers must allocate their buffer before the message arrives, so every rank derives
    the shape from the model config and the batch size (no shape message is sent).
    Raises ValueError when the batch does not split into n_microbatches equal parts.
    """
    if n_microbatches < 1 or batch_size % n_microbatches:
        raise ValueError(f"batch size {batch_size} does not split into {n_microbatches} equal micro-batches: "
                         f"choose n_microbatches among the divisors of {batch_size}")
    return (batch_size // n_microbatches, seq_len, config.d_model)


def _tag(kind: str, stage: int, mb: int) -> int:
    # the sender's stage and the micro-batch make every message between two ranks unique
    return (stage << 20) | (mb << 1) | (kind == "grad")


def run_schedule(stage_module, schedule, inputs=None, targets=None, *, stage: int, act_shape,
                 prev_rank: int | None = None, next_rank: int | None = None, group=None, timeline=None,
                 loss_scale: float | None = None, blocking_send: bool = False, check: bool = True,
                 stats: dict | None = None, dtype=torch.float32):
    """Run this rank's part of ``schedule`` (the FULL per-rank list) for one training step.

    stage_module: this rank's stage (`labkit.model.make_stage` or `SyntheticStage`).
    schedule: list of action lists indexed by pipeline rank; this rank runs ``schedule[stage]``.
    inputs: token ids [B, T] on stage 0; targets [B, T] on the last stage (every rank can
        read the data, so the last stage reads its targets directly); None elsewhere.
    act_shape: (B / m, T, d_model), see `activation_shape`; the same on every rank.
    prev_rank / next_rank: GLOBAL ranks of the neighbouring stages (default stage -/+ 1),
        so that a DP x PP hybrid can pass its row's ranks with ``group`` its pipeline group.
    timeline: a `labkit.timeline.Timeline` to record F/B/send/recv/wait spans into.
    loss_scale: multiplies each micro-batch loss; default 1/m, so that the accumulated
        ``.grad`` equal the full-batch mean-loss gradient.
    blocking_send: use blocking ``dist.send`` (to show the deadlock hazard); default isend.
    check: validate the whole schedule first (default), so that a malformed or
        deadlocking schedule raises `labkit.schedules.ScheduleError` on every rank
        before any message is sent.
    stats: a dict to fill with ``peak_inflight`` (micro-batches whose activations are
        held at once) and ``peak_activation_bytes`` (tensors saved for backward then).

    Returns the batch's mean loss (a 0-d tensor, the sum of the scaled micro-batch
    losses) on the last stage, None elsewhere. Gradients accumulate into ``.grad``.
    Receive buffers are allocated on the device of the stage's parameters.
    """
    n_stages = len(schedule)
    if check:
        schedules.validate(schedule, blocking_send=blocking_send)
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage={stage} but the schedule has {n_stages} ranks")
    actions = [schedules.parse_action(a) for a in schedule[stage]]
    if any(a.stage != stage for a in actions):
        raise ValueError(f"rank of stage {stage} got actions of other stages: {schedule[stage]}")
    m = 1 + max(a.mb for a in actions)
    first, last = stage == 0, stage == n_stages - 1
    for name, t, needed in (("inputs", inputs, first), ("targets", targets, last)):
        if needed and (t is None or t.shape[0] != act_shape[0] * m):
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"stage {stage}: {name} must be a batch of {act_shape[0] * m} rows "
                             f"(act_shape[0]={act_shape[0]} x {m} micro-batches), got {got}")
    x_mbs = inputs.chunk(m) if first else None
    y_mbs = targets.chunk(m) if last else None
    prev_rank = stage - 1 if prev_rank is None else prev_rank
    next_rank = stage + 1 if next_rank is None else next_rank
    scale = 1.0 / m if loss_scale is None else loss_scale
    tl = timeline if timeline is not None else NullTimeline()
    params = {p.data_ptr() for p in stage_module.parameters()}
    device = next(stage_module.parameters()).device  # buffers live where the stage does (GPU under nccl)

    saved, saved_bytes, sends, loss = {}, {}, [], None
    peak_count = peak_bytes = 0

    def send(tensor, dst, key, mb):
        with tl.span("send", stage, mb):
            if blocking_send:
                dist.send(tensor, dst, group=group, tag=_tag(key, stage, mb))
            else:  # keep the tensor alive until the send completes
                sends.append((dist.isend(tensor, dst, group=group, tag=_tag(key, stage, mb)), tensor))

    def recv(src, key, src_stage, mb):
        buf = torch.empty(act_shape, dtype=dtype, device=device)
        with tl.span("recv", stage, mb):
            dist.recv(buf, src, group=group, tag=_tag(key, src_stage, mb))
        return buf

    for a in actions:
        mb = a.mb
        if a.kind == "F":
            x = x_mbs[mb] if first else recv(prev_rank, "act", stage - 1, mb)
            seen = {}  # bytes of the tensors autograd saves for this micro-batch's backward

            def pack(t):
                if t.data_ptr() not in params:
                    seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
                return t

            with tl.span("F", stage, mb), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                saved[mb] = forward_step(stage_module, x, y_mbs[mb] if last else None, scale)
            saved_bytes[mb] = sum(seen.values())
            peak_count = max(peak_count, len(saved))
            peak_bytes = max(peak_bytes, sum(saved_bytes.values()))
            if not last:
                send(saved[mb][1].detach(), next_rank, "act", mb)
        else:
            inp, out = saved.pop(mb)
            saved_bytes.pop(mb)
            grad_out = None if last else recv(next_rank, "grad", stage + 1, mb)
            with tl.span("B", stage, mb):
                grad_in = backward_step(inp, out, grad_out)
            if not first:
                send(grad_in, prev_rank, "grad", mb)
            if last:
                loss = out.detach() if loss is None else loss + out.detach()
    if sends:
        with tl.span("wait", stage):
            for work, _ in sends:
                work.wait()
    if stats is not None:
        stats.update(peak_inflight=peak_count, peak_activation_bytes=peak_bytes)
    return loss


# ----------------------------------------------------------------------- synthetic mode
class _Delay(torch.autograd.Function):
    """Identity that sleeps t_f in forward and t_b in backward."""

    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.save_for_backward(x)  # counted like a real stage's saved activation
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_b)
        return grad, None, None


class SyntheticStage(nn.Module):
    """A stand-in stage whose compute is a fixed delay: F sleeps t_f, B sleeps t_b (default 2 t_f).

    Same interface as `labkit.model.Stage`: the first stage takes token ids [b, T], later
    stages activations of ``act_shape`` = (b, T, D); the last stage returns a scalar loss
    when given targets. Sleeping instead of computing makes schedule shapes crisp on a
    few shared CPU cores: the ranks do not compete for cores while they "compute".
    """

    def __init__(self, stage: int, n_stages: int, act_shape, t_f: float = 0.01, t_b: float | None = None):
        super().__init__()
        self.stage, self.n_stages, self.act_shape = stage, n_stages, tuple(act_shape)
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.t_f, self.t_b = t_f, 2 * t_f if t_b is None else t_b
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x, targets=None):
        if self.is_first:
            x = torch.ones(self.act_shape, device=self.weight.device)
        y = _Delay.apply(x * self.weight, self.t_f, self.t_b)
        return y.mean() if self.is_last and targets is not None else y
