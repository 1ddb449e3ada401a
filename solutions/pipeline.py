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
    ### BEGIN SOLUTION
    return [[f"{s}F{i}" for i in range(n_microbatches)] + [f"{s}B{i}" for i in range(n_microbatches)]
            for s in range(n_stages)]
    ### END SOLUTION


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[str]]:
    """1F1B (PipeDream-Flush / DAPPLE): warm up, then alternate one F and one B, then drain.

    Rank s first runs ``w = min(p - s - 1, m)`` forwards (warm-up), then m - w pairs
    "forward of the next micro-batch, backward of the oldest one", then the w remaining
    backwards. Same bubble as GPipe, but rank s holds at most p - s activations.
    With 4 stages and 4 micro-batches rank 1 runs
    ``["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"]``.
    """
    ### BEGIN SOLUTION
    out = []
    for s in range(n_stages):
        w = min(n_stages - s - 1, n_microbatches)
        actions = [f"{s}F{i}" for i in range(w)]
        for i in range(n_microbatches - w):
            actions += [f"{s}F{w + i}", f"{s}B{i}"]
        actions += [f"{s}B{i}" for i in range(n_microbatches - w, n_microbatches)]
        out.append(actions)
    return out
    ### END SOLUTION


def interleaved_schedule(n_ranks: int, n_chunks: int, n_microbatches: int) -> list[list[str]]:
    """Interleaved 1F1B (Megatron-LM's virtual stages), given as a worked example (not an exercise).

    The model is cut into ``n_ranks * n_chunks`` stages and rank r holds stages
    r, r + p, r + 2p, ...: each micro-batch goes round the ranks ``n_chunks`` times. Every
    rank walks its (chunk, micro-batch) pairs in groups of p micro-batches, chunk after
    chunk, forwards in chunk order and backwards in reverse chunk order, with
    ``2 (p - r - 1) + (v - 1) p`` warm-up forwards. With stages 1/v as long, the bubble
    shrinks to (p-1)/(v m + p - 1), at the price of more messages and more activations
    in flight. Needs n_microbatches to be a multiple of n_ranks.
    """
    p, v, m = n_ranks, n_chunks, n_microbatches
    if p < 1 or v < 1 or m < 1 or m % p:
        raise ValueError(f"interleaved 1F1B needs n_microbatches ({m}) to be a positive multiple of "
                         f"n_ranks ({p}), and n_chunks >= 1 (got {v})")
    out = []
    for r in range(p):
        def action(k, kind):
            chunk = (k % (p * v)) // p
            chunk = chunk if kind == "F" else v - 1 - chunk
            return f"{chunk * p + r}{kind}{(k // (p * v)) * p + k % p}"

        total, w = m * v, min(2 * (p - r - 1) + (v - 1) * p, m * v)
        actions = [action(k, "F") for k in range(w)]
        for k in range(total - w):
            actions += [action(k + w, "F"), action(k, "B")]
        out.append(actions + [action(k, "B") for k in range(total - w, total)])
    return out


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

    stage_module: this rank's stage (`labkit.model.make_stage` or `SyntheticStage`), or a
        dict {stage: module} when the rank holds several stages (interleaved schedules).
    schedule: list of action lists indexed by pipeline rank; this rank runs ``schedule[stage]``.
    stage: this rank's position in the pipeline (its stage when it holds one).
    inputs: token ids [B, T] on the rank of stage 0; targets [B, T] on the rank of the last
        stage (every rank can read the data, so the last stage reads its targets
        directly); None elsewhere.
    act_shape: (B / m, T, d_model), see `activation_shape`; the same on every rank.
    prev_rank / next_rank: GLOBAL ranks of the previous / next pipeline position (default
        position -/+ 1 modulo the number of positions), so that a DP x PP hybrid can pass
        its row's ranks with ``group`` its pipeline group. With several stages per rank,
        stage s+1 lives on the next position, the last position's next being position 0.
    timeline: a `labkit.timeline.Timeline` to record F/B/send/recv/wait spans into.
    loss_scale: multiplies each micro-batch loss; default 1/m, so that the accumulated
        ``.grad`` equal the full-batch mean-loss gradient.
    blocking_send: use blocking ``dist.send`` (to show the deadlock hazard); default isend.
    check: validate the whole schedule first (default), so that a malformed or
        deadlocking schedule raises `labkit.schedules.ScheduleError` on every rank
        before any message is sent.
    stats: a dict to fill with ``peak_inflight`` (micro-batch activations held at once,
        counted per stage) and ``peak_activation_bytes`` (tensors saved for backward then).

    Zero-bubble schedules add ``W`` actions: a micro-batch with a W gets its input
    gradient in B (sent at once) and its weight gradients in W, later. (Here W runs
    autograd again on the kept graph, so on a real model it costs a whole backward; a
    real implementation splits each layer's backward. Synthetic stages model the split.)

    Returns the batch's mean loss (a 0-d tensor, the sum of the scaled micro-batch
    losses) on the last stage, None elsewhere. Gradients accumulate into ``.grad``.
    Receive buffers are allocated on the device of the stage's parameters.
    """
    n_ranks = len(schedule)
    if check:
        schedules.validate(schedule, blocking_send=blocking_send)
    if not 0 <= stage < n_ranks:
        raise ValueError(f"stage={stage} but the schedule has {n_ranks} ranks")
    actions = [schedules.parse_action(a) for a in schedule[stage]]
    owner = schedules.stage_ranks(schedule)  # stage -> pipeline position
    n_stages = max(owner) + 1
    for s in range(n_stages - 1):  # messages only go to the previous / next position
        if s in owner and s + 1 in owner and owner[s + 1] != (owner[s] + 1) % n_ranks:
            raise ValueError(f"stage {s + 1} must run on the position after stage {s}'s "
                             f"({(owner[s] + 1) % n_ranks}), not on {owner[s + 1]}")
    own = sorted({a.stage for a in actions})
    if isinstance(stage_module, dict):
        modules = stage_module
        if any(s not in modules for s in own):
            raise ValueError(f"rank {stage} runs stages {own}: stage_module has no module for "
                             f"{[s for s in own if s not in modules]}")
    elif len(own) > 1:
        raise ValueError(f"rank {stage} runs stages {own}: pass stage_module as a dict {{stage: module}}")
    else:
        modules = {s: stage_module for s in own}
    if not actions:
        return None
    m = 1 + max(a.mb for a in actions)
    first, last = 0 in own, n_stages - 1 in own
    for name, t, needed in (("inputs", inputs, first), ("targets", targets, last)):
        if needed and (t is None or t.shape[0] != act_shape[0] * m):
            got = None if t is None else tuple(t.shape)
            raise ValueError(f"stage {stage}: {name} must be a batch of {act_shape[0] * m} rows "
                             f"(act_shape[0]={act_shape[0]} x {m} micro-batches), got {got}")
    x_mbs = inputs.chunk(m) if first else None
    y_mbs = targets.chunk(m) if last else None
    prev_rank = (stage - 1) % n_ranks if prev_rank is None else prev_rank
    next_rank = (stage + 1) % n_ranks if next_rank is None else next_rank
    scale = 1.0 / m if loss_scale is None else loss_scale
    tl = timeline if timeline is not None else NullTimeline()
    params = {p.data_ptr() for mod in modules.values() for p in mod.parameters()}
    device = next(next(iter(modules.values())).parameters()).device  # buffers live where the stage does

    split = schedules.split_backwards(schedule)  # (stage, mb) whose weight gradient waits for a W
    saved, saved_bytes, sends, loss = {}, {}, [], None
    peak_count = peak_bytes = 0

    def send(tensor, dst, key, s, mb):
        with tl.span("send", s, mb):
            if blocking_send:
                dist.send(tensor, dst, group=group, tag=_tag(key, s, mb))
            else:  # keep the tensor alive until the send completes
                sends.append((dist.isend(tensor, dst, group=group, tag=_tag(key, s, mb)), tensor))

    def recv(src, key, src_stage, s, mb):
        buf = torch.empty(act_shape, dtype=dtype, device=device)
        with tl.span("recv", s, mb):
            dist.recv(buf, src, group=group, tag=_tag(key, src_stage, mb))
        return buf

    for a in actions:
        s, mb = a.stage, a.mb
        if a.kind == "F":
            x = x_mbs[mb] if s == 0 else recv(prev_rank, "act", s - 1, s, mb)
            seen = {}  # bytes of the tensors autograd saves for this micro-batch's backward

            def pack(t):
                if t.data_ptr() not in params:
                    seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
                return t

            is_last = s == n_stages - 1
            with tl.span("F", s, mb), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                saved[s, mb] = forward_step(modules[s], x, y_mbs[mb] if is_last else None, scale)
            saved_bytes[s, mb] = sum(seen.values())
            peak_count = max(peak_count, len(saved))
            peak_bytes = max(peak_bytes, sum(saved_bytes.values()))
            if not is_last:
                send(saved[s, mb][1].detach(), next_rank, "act", s, mb)
        elif a.kind == "W":  # zero-bubble: the weight gradient, long after B (no messages)
            inp, out, grad_out = saved.pop((s, mb))
            saved_bytes.pop((s, mb))
            with tl.span("W", s, mb):
                torch.autograd.backward(out, grad_out, inputs=[p for p in modules[s].parameters() if p.requires_grad])
        else:
            is_last = s == n_stages - 1
            grad_out = None if is_last else recv(next_rank, "grad", s + 1, s, mb)
            if (s, mb) in split:  # B: only the input gradient; keep the graph for W
                inp, out = saved[s, mb]
                saved[s, mb] = (inp, out, grad_out)
                with tl.span("B", s, mb):
                    grad_in = None if inp is None else torch.autograd.grad(out, inp, grad_out, retain_graph=True)[0]
            else:
                inp, out = saved.pop((s, mb))
                saved_bytes.pop((s, mb))
                with tl.span("B", s, mb):
                    grad_in = backward_step(inp, out, grad_out)
            if s > 0:
                send(grad_in, prev_rank, "grad", s, mb)
            if is_last:
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
