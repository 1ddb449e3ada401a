"""Pipeline schedules simulated in unit time, without any process: spans per rank, makespan, bubble,
peak in-flight activations, and the deadlock check (`simulate`, `validate`); the bubble's closed forms.
Every simulation reads `labkit.parallel.schedule_actions.lower`'s list, as the executor does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.parallel.schedule_actions import (COMPUTE, RECVS, SENDS, Action, DeadlockError, ScheduleError,
                                              check_schedule, lower)


@dataclass
class SimResult:
    """Unit-time simulation of a schedule: spans per rank, makespan, bubble, memory.

    With ``simulate(..., strict=False)``: ``error`` is the first ScheduleError (None if the
    schedule is right) and ``stuck`` maps every rank that could not finish to (the time it
    got stuck, the lowered `Action` it waits in).
    """
    spans: list[list[tuple[float, float, Action]]]  # per rank: (start, end, compute action)
    makespan: float
    busy: list[float]
    peak_inflight: list[int]  # per rank: most activations held at once (F done, B/W not yet)
    n_stages: int
    n_microbatches: int
    t_f: float = 1.0
    t_b: float = 2.0
    error: ScheduleError | None = None
    stuck: dict[int, tuple[float, Action]] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle fraction: 1 - sum(busy) / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def simulate(schedule, t_f: float = 1.0, t_b: float = 2.0, *, t_w: float | None = None, blocking_send: bool = False,
             n_stages: int | None = None, n_microbatches: int | None = None, strict: bool = True,
             t_msg: float = 0.0, t_recv: float = 0.0) -> SimResult:
    """Run the lowered schedule on a unit-time model: F takes t_f, B takes t_b, messages are free.

    ``t_msg``: with non-blocking sends, a message reaches its receiver t_msg after it is
    sent (alpha + bytes / beta, see `labkit.measure.overlap`), so that the model shows
    which messages the schedule hides and which lie on its critical path. ``t_recv``: every
    receive also costs its receiver t_recv, counted from the later of its own arrival and the
    message's, hidden or not (gloo's receive: the data moves only once the receiver has posted
    it, and the executor posts each receive just before the compute that reads it).

    ``schedule``: action lists or a `Lowered`. A backward split by a ``W`` action takes
    t_b - t_w for B and t_w for W (t_w defaults to t_b / 2); its activations are held until W.
    t_f, t_b, t_w may also be sequences indexed by stage (uneven stages: labkit.scale.pipeline feeds
    each stage's own op times); the makespan and bubble then read those times.

    strict (default): raises ScheduleError for a malformed schedule and DeadlockError,
    naming every stuck rank and what it waits on, if the ranks can never finish.
    ``strict=False``: runs whatever can run and reports the first error in the result
    (``error``, ``stuck``), to draw a wrong schedule with its first error marked.
    """
    lowered = lower(schedule)
    error = None
    try:
        p, m = check_schedule(lowered, n_stages, n_microbatches)
    except ScheduleError as err:
        if strict:
            raise
        error, p = err, lowered.n_stages
        m = 1 + max((a.mb for ops in lowered.ops for a in ops), default=0)
    ops, split = lowered.ops, lowered.split
    t_w = (t_b / 2 if not isinstance(t_b, (list, tuple)) else [b / 2 for b in t_b]) if t_w is None else t_w
    cost = {"F": t_f, "B": t_b, "W": t_w}

    def time_of(kind, stage):  # a unit time, or a stage's own
        value = cost[kind]
        return value[stage] if isinstance(value, (list, tuple)) else value

    n = len(ops)
    pc, clock = [0] * n, [0.0] * n  # next op and current time per rank
    sent = {}  # message -> time it is available (isend)
    waiting_send = {}  # message -> rank blocked in a rendezvous send
    spans = [[] for _ in ops]
    inflight, peak = [0] * n, [0] * n
    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pc[r] < len(ops[r]):
                a = ops[r][pc[r]]
                if a.kind in COMPUTE:
                    t = time_of(a.kind, a.stage) - (time_of("W", a.stage) if a.kind == "B" and (a.stage, a.mb) in split else 0)
                    spans[r].append((clock[r], clock[r] + t, a))
                    clock[r] += t
                    if a.kind == "F":
                        inflight[r] += 1
                    elif a.kind == "W" or (a.stage, a.mb) not in split:
                        inflight[r] -= 1  # the activations go with the last step that needs them
                    peak[r] = max(peak[r], inflight[r])
                elif a.kind in SENDS and not blocking_send:
                    sent[a.message] = clock[r] + t_msg
                elif a.kind in SENDS:
                    waiting_send[a.message] = r
                    if not _at_recv(ops, pc, a.peer, a.message):
                        break  # wait for the receiver to get there
                    clock[r] = clock[a.peer] = max(clock[r], clock[a.peer])
                    del waiting_send[a.message]
                    pc[a.peer] += 1
                else:  # a receive
                    if a.message in sent:
                        clock[r] = max(clock[r], sent.pop(a.message)) + t_recv
                    elif a.message in waiting_send:
                        sender = waiting_send.pop(a.message)
                        clock[r] = clock[sender] = max(clock[r], clock[sender])
                        pc[sender] += 1
                    else:
                        break
                pc[r] += 1
                progress = True
    stuck = {r: (clock[r], ops[r][pc[r]]) for r in range(n) if pc[r] < len(ops[r])}
    if stuck and error is None:
        lines = [f"rank {r} waits in the {a.describe()} (for {_compute_of(ops[r], pc[r])})" for r, (_, a) in stuck.items()]
        hint = (" Blocking sends are rendezvous: two neighbours that send to each other at the same time both wait;"
                " reorder the actions or use isend." if blocking_send else
                " Some receive waits on a message its sender only sends later: reorder the actions.")
        r0 = min(stuck)
        error = DeadlockError("the schedule deadlocks:\n  " + "\n  ".join(lines) + "\n" + hint,
                              r0, _compute_index(ops[r0], pc[r0]))
        if strict:
            raise error
    busy = [sum(e - s for s, e, _ in rank_spans) for rank_spans in spans]
    makespan = max([rank_spans[-1][1] for rank_spans in spans if rank_spans] + [t for t, _ in stuck.values()],
                   default=0.0)
    return SimResult(spans, makespan, busy, peak, p, m, t_f if not isinstance(t_f, (list, tuple)) else sum(t_f) / len(t_f),
                     t_b if not isinstance(t_b, (list, tuple)) else sum(t_b) / len(t_b), error, stuck)


def _at_recv(ops, pc, rank, message) -> bool:
    if rank is None or pc[rank] >= len(ops[rank]):
        return False
    a = ops[rank][pc[rank]]
    return a.kind in RECVS and a.message == message


def _compute_of(ops, i) -> Action:
    """The compute action a message at ops[i] belongs to (a receive precedes it, a send follows it)."""
    step = 1 if ops[i].kind in RECVS else -1
    while ops[i].kind not in COMPUTE:
        i += step
    return ops[i]


def _compute_index(ops, i) -> int:
    """Index, in the rank's compute list, of the compute action ops[i] belongs to."""
    target = _compute_of(ops, i)
    return [a for a in ops if a.kind in COMPUTE].index(target)


def validate(schedule, n_stages: int | None = None, n_microbatches: int | None = None, *,
             blocking_send: bool = False) -> tuple[int, int]:
    """Everything the executor checks before it communicates: well-formed and deadlock-free."""
    sim = simulate(schedule, blocking_send=blocking_send, n_stages=n_stages, n_microbatches=n_microbatches)
    return sim.n_stages, sim.n_microbatches


def peak_inflight(schedule) -> list[int]:
    """Per rank, the most micro-batches whose activations are held at once (F done, B not yet)."""
    return simulate(schedule).peak_inflight


def ideal_bubble(schedule, t_f: float = 1.0, t_b: float = 2.0) -> float:
    """Bubble fraction of the schedule in the unit-time simulation."""
    return simulate(schedule, t_f, t_b).bubble


def theoretical_bubble(n_stages: int, n_microbatches: int, n_chunks: int = 1) -> float:
    """(p - 1) / (m + p - 1): GPipe's and 1F1B's idle fraction with equal stages.

    With ``n_chunks`` = v stages per rank (interleaved 1F1B, p = ranks):
    (p - 1) / (v m + p - 1).
    """
    if n_stages < 1 or n_microbatches < 1 or n_chunks < 1:
        raise ValueError(f"need n_stages, n_microbatches and n_chunks >= 1, "
                         f"got {n_stages}, {n_microbatches}, {n_chunks}")
    return (n_stages - 1) / (n_chunks * n_microbatches + n_stages - 1)
