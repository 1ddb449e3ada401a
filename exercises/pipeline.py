# GENERATED from solutions/pipeline.py by `python -m labkit.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/06_microbatches.ipynb.
# untouched-stub fingerprint: 28f33e9fc47344f9
"""Micro-batch pipeline schedules and the executor that runs them (notebook 06_microbatches).

A schedule is data: one list of actions per rank, ``"{stage}F{mb}"`` / ``"{stage}B{mb}"``.
`gpipe_schedule` and `one_f_one_b_schedule` build the two classic ones (the variants,
`interleaved_schedule` and `zero_bubble_schedule`, live in `labkit.schedules`).
`labkit.schedules.lower` turns any of them into what each rank runs, its compute actions
with the messages made explicit (``1RECV_F0 1F0 1SEND_F0 ... 1RECV_B0 1B0 1SEND_B0``);
the checks, the simulation, the drawing and `run_schedule` below all read that one list.

`run_schedule` walks this rank's lowered list: F and B call `forward_step` /
`backward_step` from notebook 05 (`pipeline_naive.py`), and every message goes through
`communicate`, the exercise: post ONE send or receive. With blocking ``dist.send`` 1F1B
deadlocks in it (two neighbours both sending: gloo's send waits for the receiver); with
``isend`` / ``irecv`` it cannot.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit import schedules
from labkit.timeline import NullTimeline

from labkit.grading import impl

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


def communicate(op: schedules.Action, tensor, peer: int, *, group=None, blocking: bool = False):
    """Post ONE lowered message of this rank; return its ``Work`` handle, or None once it is done.

    op: a lowered `labkit.schedules.Action` (``op.kind``, ``op.stage``, ``op.mb``):
        ``SEND_F`` / ``SEND_B`` send ``tensor`` (the activation, the input gradient) to ``peer``;
        ``RECV_F`` / ``RECV_B`` receive into ``tensor``, an empty buffer of the right shape.
    peer: the GLOBAL rank of the other side (pass ``group=group`` too).
    Tag the message with ``op.tag``: sender and receiver compute the same number from
        (kind, sender's stage, micro-batch), so that two messages between the same ranks
        can never be swapped.
    blocking: True -> ``dist.send`` / ``dist.recv``, which return when done (return None).
        False -> ``dist.isend`` / ``dist.irecv``, which return at once; return their Work:
        `run_schedule` waits for a receive before it uses the buffer, and for the sends at
        the end of the step. (gloo's blocking send waits until the receiver posts its
        receive: in 1F1B two neighbours that send to each other at once wait forever.)
    """
    raise NotImplementedError("exercise communicate is not implemented yet: edit exercises/pipeline.py, see notebooks/06_microbatches.ipynb")


class NonBlockingMissing(NotImplementedError):
    """`communicate(..., blocking=False)` returned no ``Work``: refused at once instead of a hang.

    A NotImplementedError, so that a notebook cell that needs the non-blocking version says so
    in one line (`labkit.needs_exercise`) and the deadlock section, which needs only the
    blocking version, can be reached without minutes of hangs on the way.
    """

    def __init__(self, op):
        super().__init__(
            f"exercise communicate: the non-blocking version is not written yet: communicate({op}, "
            "blocking=False) returned None instead of the Work of dist.isend / dist.irecv (a missing "
            "`return`?). Cells that need it skip; the deadlock section runs your blocking version.")


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


def run_schedule(stage_module, schedule, inputs=None, targets=None, *, stage: int, act_shape,
                 prev_rank: int | None = None, next_rank: int | None = None, group=None, timeline=None,
                 loss_scale: float | None = None, blocking_send: bool = False, check: bool = True,
                 stats: dict | None = None, dtype=None):
    """Run this rank's part of ``schedule`` (the FULL per-rank list) for one training step.

    stage_module: this rank's stage (`labkit.model.make_stage` or `SyntheticStage`), or a
        dict {stage: module} when the rank holds several stages (interleaved schedules).
    schedule: action lists indexed by pipeline rank, or their `labkit.schedules.lower`;
        this rank runs ``lower(schedule)[stage]``.
    stage: this rank's position in the pipeline (its stage when it holds one).
    inputs: token ids [B, T] on the rank of stage 0; targets [B, T] on the rank of the last
        stage (every rank can read the data); None elsewhere.
    act_shape: (B / m, T, d_model), see `activation_shape`; the same on every rank.
    prev_rank / next_rank: GLOBAL ranks of the previous / next pipeline position (default
        position -/+ 1 modulo the number of positions), with ``group`` their process group
        (a DP x PP hybrid passes its row's). Stage s+1 lives on the next position.
    timeline: a `labkit.timeline.Timeline` to record F/B/W/send/recv/wait spans into.
    loss_scale: multiplies each micro-batch loss; default 1/m, so that the accumulated
        ``.grad`` equal the full-batch mean-loss gradient.
    blocking_send: `communicate` with ``blocking=True`` (to show the deadlock); default isend/irecv.
    check: simulate the whole lowered schedule first (default), so that a malformed or
        deadlocking schedule raises `labkit.schedules.ScheduleError` on every rank
        before any message is sent.
    dtype: of the activations and gradients received; default: the stage's parameters' dtype
        (float64 stages, as in the lab's proofs, exchange float64).
    stats: a dict to fill with ``peak_inflight`` (micro-batch activations held at once,
        counted per stage) and ``peak_activation_bytes`` (tensors saved for backward then).

    Zero-bubble ``W`` actions: a micro-batch with a W gets its input gradient in B (sent at
    once) and its weight gradients in W. (W runs autograd again on the kept graph: on a real
    model it costs a whole backward; synthetic stages model the split.)
    Returns the batch's mean loss (0-d, the sum of the scaled micro-batch losses) on the last
    stage, None elsewhere. Gradients accumulate into ``.grad``.
    """
    lowered = schedules.lower(schedule)  # parsed and lowered once: this list is what runs
    if check:
        schedules.simulate(lowered, blocking_send=blocking_send)
    run = _setup(stage_module, lowered, inputs, targets, stage, act_shape, loss_scale)
    if run is None:
        return None
    dtype = dtype or run.dtype
    prev_rank = (stage - 1) % len(lowered) if prev_rank is None else prev_rank
    next_rank = (stage + 1) % len(lowered) if next_rank is None else next_rank
    tl = timeline if timeline is not None else NullTimeline()
    steps = impl("pipeline_naive")  # notebook 05's forward_step / backward_step (yours, under exercises)
    box, saved, sends, loss = {}, {}, [], None  # box: tensors received / to send, by message
    split = lowered.split  # (stage, mb) whose B computes only the input gradient; a W follows
    for op in lowered[stage]:
        s, mb = op.stage, op.mb
        if op.kind in schedules.SENDS or op.kind in schedules.RECVS:
            sending = op.kind in schedules.SENDS
            buf = box.pop(op.message) if sending else torch.empty(act_shape, dtype=dtype, device=run.device)
            peer = next_rank if op.kind in ("SEND_F", "RECV_B") else prev_rank
            with tl.span("send" if sending else "recv", s, mb):
                work = communicate(op, buf, peer, group=group, blocking=blocking_send)
                if work is None and not blocking_send:  # else: an unwaited irecv, or a blocking 1F1B hang
                    raise NonBlockingMissing(op)
                if work is not None and not sending:
                    work.wait()  # the compute that follows reads the buffer
            if sending and work is not None:
                sends.append((work, buf))  # keep the tensor alive until its send completes
            elif not sending:
                box[op.message] = buf
        elif op.kind == "F":
            x = run.x[mb] if s == 0 else box.pop(("act", s - 1, mb))
            with tl.span("F", s, mb), run.memory.count(s, mb):
                saved[s, mb] = steps.forward_step(run.modules[s], x, run.y[mb] if s == run.last else None, run.scale)
            if s != run.last:
                box["act", s, mb] = saved[s, mb][1].detach()
        elif op.kind == "B":
            grad_out = None if s == run.last else box.pop(("grad", s + 1, mb))
            inp, out = saved[s, mb]
            with tl.span("B", s, mb):
                if (s, mb) in split:  # only the input gradient; W computes the weights' later
                    saved[s, mb] = (inp, out, grad_out)
                    grad_in = None if inp is None else torch.autograd.grad(out, inp, grad_out, retain_graph=True)[0]
                else:
                    grad_in = steps.backward_step(*saved.pop((s, mb)), grad_out)
                    run.memory.free(s, mb)
            if s != 0:
                box["grad", s, mb] = grad_in
            if s == run.last:
                loss = out.detach() if loss is None else loss + out.detach()
        else:  # W: the weight gradient of a split backward (no message)
            inp, out, grad_out = saved.pop((s, mb))
            with tl.span("W", s, mb):
                torch.autograd.backward(out, grad_out, inputs=run.params[s])
            run.memory.free(s, mb)
    if sends:
        with tl.span("wait", stage):
            for work, _ in sends:
                work.wait()
    if stats is not None:
        stats.update(peak_inflight=run.memory.peak_count, peak_activation_bytes=run.memory.peak_bytes)
    return loss


def _setup(stage_module, lowered, inputs, targets, stage, act_shape, loss_scale):
    """Check the arguments against the lowered schedule; the modules, micro-batches and counters of this rank."""
    if not 0 <= stage < len(lowered):
        raise ValueError(f"stage={stage} but the schedule has {len(lowered)} ranks")
    own = sorted({op.stage for op in lowered[stage]})
    if isinstance(stage_module, dict):
        if any(s not in stage_module for s in own):
            raise ValueError(f"rank {stage} runs stages {own}: stage_module has no module for "
                             f"{[s for s in own if s not in stage_module]}")
        modules = stage_module
    elif len(own) > 1:
        raise ValueError(f"rank {stage} runs stages {own}: pass stage_module as a dict {{stage: module}}")
    else:
        modules = {s: stage_module for s in own}
    if not own:
        return None
    m, last = 1 + max(op.mb for op in lowered[stage]), lowered.n_stages - 1
    for name, t, needed in (("inputs", inputs, 0 in own), ("targets", targets, last in own)):
        if needed and (t is None or t.shape[0] != act_shape[0] * m):
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"stage {stage}: {name} must be a batch of {act_shape[0] * m} rows "
                             f"(act_shape[0]={act_shape[0]} x {m} micro-batches), got {got}")
    params = {s: [p for p in mod.parameters() if p.requires_grad] for s, mod in modules.items()}
    return SimpleNamespace(
        modules=modules, last=last, scale=1.0 / m if loss_scale is None else loss_scale, params=params,
        x=inputs.chunk(m) if 0 in own else None, y=targets.chunk(m) if last in own else None,
        device=next(next(iter(modules.values())).parameters()).device,  # buffers live where the stage does
        dtype=next(next(iter(modules.values())).parameters()).dtype,
        memory=_Memory({p.data_ptr() for mod in modules.values() for p in mod.parameters()}))


class _Memory:
    """Counts the micro-batches whose activations are held, and the bytes autograd saved for them."""

    def __init__(self, param_ptrs):
        self.param_ptrs, self.held = param_ptrs, {}
        self.peak_count = self.peak_bytes = 0

    @contextmanager
    def count(self, s, mb):
        seen = {}  # bytes of the tensors autograd saves for this micro-batch's backward, parameters excluded

        def pack(t):
            if t.data_ptr() not in self.param_ptrs:
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.held[s, mb] = sum(seen.values())
        self.peak_count = max(self.peak_count, len(self.held))
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))

    def free(self, s, mb):
        self.held.pop((s, mb))


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
    The backward has two paths: t_b - t_w towards the input and t_w towards the weight
    (t_w = t_b / 2 by default), so a zero-bubble B (input gradient) sleeps t_b - t_w and
    its W sleeps t_w; a full backward sleeps t_b. On the first stage a zero-bubble B has
    an input gradient to compute only if the inputs are floating point (act_shape-sized
    rows, e.g. zeros): give it those to time a zero-bubble schedule, token ids otherwise.
    """

    def __init__(self, stage: int, n_stages: int, act_shape, t_f: float = 0.01, t_b: float | None = None,
                 t_w: float | None = None):
        super().__init__()
        self.stage, self.n_stages, self.act_shape = stage, n_stages, tuple(act_shape)
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.t_f, self.t_b = t_f, 2 * t_f if t_b is None else t_b
        self.t_w = self.t_b / 2 if t_w is None else t_w
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x, targets=None):
        if self.is_first and not x.is_floating_point():  # token ids: stand in for the embedding's output
            x = torch.ones(self.act_shape, device=self.weight.device, requires_grad=True)
        y = _Delay.apply(x, self.t_f, self.t_b - self.t_w) * _Delay.apply(self.weight, 0.0, self.t_w)
        return y.mean() if self.is_last and targets is not None else y
