# GENERATED from solutions/pipeline.py by `python -m labkit.grading.stubgen`: this file is yours to edit.
# Fill in every `raise NotImplementedError(...)`; see notebooks/06_microbatches.ipynb.
# untouched-stub fingerprint: 920f12c154a3d2c3
"""Micro-batch pipeline schedules and the executor that runs them (notebook 06_microbatches).

A schedule is data: one list of actions per rank, ``"{stage}F{mb}"`` / ``"{stage}B{mb}"``.
`gpipe_schedule` and `one_f_one_b_schedule` build the two classic ones (the variants,
`interleaved_schedule` and `zero_bubble_schedule`, live in `labkit.parallel.schedules`).
`labkit.parallel.schedules.lower` turns any of them into what each rank runs, its compute actions
with the messages made explicit (``1RECV_F0 1F0 1SEND_F0 ... 1RECV_B0 1B0 1SEND_B0``);
the checks, the simulation, the drawing and `run_schedule` below all read that one list.

`run_schedule` walks this rank's lowered list: F and B call `forward_step` /
`backward_step` from notebook 05 (`pipeline_naive.py`), and every message goes through
`communicate`, the exercise: post ONE send or receive. With blocking ``dist.send`` 1F1B
deadlocks in it (two neighbours both sending: gloo's send waits for the receiver); with
``isend`` / ``irecv`` it cannot.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from labkit.parallel import schedules
from labkit.mesh import Mesh
from labkit.parallel.stages import ActivationMemory, SyntheticStage, activation_shape  # noqa: F401 (re-exported)
from labkit.measure.timeline import NullTimeline

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

    op: a lowered `labkit.parallel.schedules.Action` (``op.kind``, ``op.stage``, ``op.mb``):
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
def run_schedule(stage_module, schedule, inputs=None, targets=None, *, mesh: Mesh, act_shape,
                 timeline=None, loss_scale: float | None = None, blocking_send: bool = False,
                 check: bool = True, stats: dict | None = None, dtype=None):
    """Run this rank's part of ``schedule`` (the FULL per-rank list) for one training step.

    stage_module: this rank's stage (`labkit.model.make_stage` or `SyntheticStage`), or a
        dict {stage: module} when the rank holds several stages (interleaved schedules).
    schedule: action lists indexed by pipeline rank, or their `labkit.parallel.schedules.lower`;
        this rank runs ``lower(schedule)[stage]``.
    mesh: the `labkit.mesh.Mesh` this rank is in; the pipeline is its ``"pp"`` axis. This rank's
        position is ``mesh.coord("pp")`` (its stage when it holds one), the neighbours are
        ``mesh.prev_rank("pp", wrap=True)`` / ``mesh.next_rank("pp", wrap=True)`` (GLOBAL ranks:
        not position -/+ 1 when pp is not the mesh's innermost axis; wrapping, because an
        interleaved schedule's last stage feeds the first rank's next chunk), on ``mesh.group("pp")``.
        ``Mesh(world_size, pp=world_size)`` for a pipeline over every rank.
    inputs: token ids [B, T] on the rank of stage 0; targets [B, T] on the rank of the last
        stage (every rank can read the data); None elsewhere.
    act_shape: (B / m, T, d_model), see `activation_shape`; the same on every rank.
    timeline: a `labkit.measure.timeline.Timeline` to record F/B/W/send/recv/wait spans into.
    loss_scale: multiplies each micro-batch loss; default 1/m, so that the accumulated
        ``.grad`` equal the full-batch mean-loss gradient.
    blocking_send: `communicate` with ``blocking=True`` (to show the deadlock); default isend/irecv.
    check: simulate the whole lowered schedule first (default), so that a malformed or
        deadlocking schedule raises `labkit.parallel.schedules.ScheduleError` on every rank
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
    if mesh.size("pp") != len(lowered):
        raise ValueError(f"the schedule has {len(lowered)} pipeline ranks but the mesh's pp axis has "
                         f"{mesh.size('pp')} ({mesh}): build the schedule for mesh.size('pp') ranks")
    if check:
        schedules.simulate(lowered, blocking_send=blocking_send)
    stage = mesh.coord("pp")  # this rank's position in the pipeline
    run = _setup(stage_module, lowered, inputs, targets, stage, act_shape, loss_scale)
    if run is None:
        return None
    dtype = dtype or run.dtype
    # the neighbours are the mesh's, global ranks; Stage s+1 lives on the next position
    prev_rank, next_rank = mesh.prev_rank("pp", wrap=True), mesh.next_rank("pp", wrap=True)
    group = mesh.group("pp")
    tl = timeline if timeline is not None else NullTimeline()
    steps = impl("pipeline_naive")  # notebook 05's forward_step / backward_step (yours, under exercises)
    box, saved, sends, loss = {}, {}, [], None  # box: tensors received / to send, by message
    split = lowered.split  # (stage, mb) whose B computes only the input gradient; a W follows
    for op in lowered[stage]:
        s, mb = op.stage, op.mb
        if op.kind in schedules.SENDS or op.kind in schedules.RECVS:
            sending = op.kind in schedules.SENDS
            buf = box.pop(op.message) if sending else torch.empty(act_shape, dtype=dtype, device=run.device)
            peer = next_rank if lowered.to_next_position(op) else prev_rank  # a V sends back up
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
                if (s, mb) in split:  # only the input gradient; W computes the weights' later (notebook 06)
                    saved[s, mb] = (inp, out, grad_out)
                    grad_in = impl("zero_bubble").backward_input(inp, out, grad_out)
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
                impl("zero_bubble").backward_weight(out, grad_out, run.params[s])
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
        memory=ActivationMemory({p.data_ptr() for mod in modules.values() for p in mod.parameters()}))
