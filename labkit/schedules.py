"""Pipeline schedules as data: parse, check and simulate them without any process.

A schedule is a list of action lists, one per rank, in PyTorch's notation:
``"{stage}F{mb}"`` runs the forward of micro-batch ``mb`` on ``stage`` and
``"{stage}B{mb}"`` its backward. With 4 stages and 4 micro-batches, rank 1's 1F1B
list is ``["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"]``.

The communication model is the executor's (`solutions/pipeline.py`):

* ``F`` on stage s > 0 first receives the activation of stage s-1; ``F`` on stage
  s < p-1 then sends its output to stage s+1.
* ``B`` on stage s < p-1 first receives the gradient of its output from stage s+1;
  ``B`` on stage s > 0 then sends the gradient of its input to stage s-1.
* ``W`` (zero-bubble schedules) computes the stage's weight gradients of a micro-batch
  whose ``B`` then only computes the input gradient; it sends and receives nothing.
  Without a ``W``, ``B`` computes both.
* A receive blocks until the matching message was sent. Messages are matched by
  (kind, stage, micro-batch), as the executor's tags do, not by arrival order.
* ``blocking_send=False`` (the executor's default, ``isend``): a send never waits.
  ``blocking_send=True`` (plain gloo ``send``, which is a rendezvous even for one
  element): a send waits until the receiver posts the matching receive.

`check_schedule` raises `ScheduleError` (a ValueError) with a message that names the
offending rank and action; `simulate` raises `DeadlockError` naming what every stuck
rank waits on. The executor runs both checks before any rank communicates.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")


class ScheduleError(ValueError):
    """The schedule is malformed: the message says which rank and action, and why."""


class DeadlockError(ScheduleError):
    """Simulating the schedule found ranks that wait on each other forever."""


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # "F", "B" or "W"
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def parse_action(text: str) -> Action:
    """``"2F5"`` -> Action(stage=2, kind="F", mb=5); anything else raises ScheduleError."""
    match = _ACTION.match(text) if isinstance(text, str) else None
    if match is None:
        raise ScheduleError(
            f"bad action {text!r}: write '{{stage}}F{{microbatch}}' or '{{stage}}B{{microbatch}}' "
            "(or '{stage}W{microbatch}'), e.g. '0F3' or '1B0'")
    return Action(int(match[1]), match[2], int(match[3]))


def parse_schedule(schedule) -> list[list[Action]]:
    """Parse every rank's list; a rank or action that is not a string list raises ScheduleError."""
    if isinstance(schedule, (str, bytes)) or not hasattr(schedule, "__iter__"):
        raise ScheduleError(f"a schedule is a list of action lists, one per rank; got {type(schedule).__name__}")
    parsed = []
    for rank, actions in enumerate(schedule):
        if isinstance(actions, (str, bytes)) or not hasattr(actions, "__iter__"):
            raise ScheduleError(f"rank {rank}: expected a list of actions like ['0F0', '0B0'], got {actions!r}")
        out = []
        for i, text in enumerate(actions):
            try:
                out.append(parse_action(text))
            except ScheduleError as err:
                raise ScheduleError(f"rank {rank}, action #{i}: {err}") from None
        parsed.append(out)
    return parsed


def stage_ranks(schedule) -> dict[int, int]:
    """stage -> the rank that runs it (a stage lives on exactly one rank)."""
    owner = {}
    for rank, actions in enumerate(parse_schedule(schedule)):
        for a in actions:
            if owner.setdefault(a.stage, rank) != rank:
                raise ScheduleError(f"stage {a.stage} appears on rank {owner[a.stage]} and on rank {rank} "
                                    f"(action {a}): each stage lives on one rank")
    return owner


def check_schedule(schedule, n_stages: int | None = None, n_microbatches: int | None = None) -> tuple[int, int]:
    """Check each stage's own actions; return (n_stages, n_microbatches).

    Every stage 0..p-1 must run F and B of every micro-batch 0..m-1 exactly once,
    its F before its B. Dependencies between stages are checked by `simulate`
    (which `validate` also runs). Raises ScheduleError naming the rank and action.
    """
    parsed = parse_schedule(schedule)
    owner = stage_ranks(schedule)
    if not owner:
        raise ScheduleError("the schedule has no actions")
    p = n_stages if n_stages is not None else max(owner) + 1
    m = n_microbatches if n_microbatches is not None else max(a.mb for acts in parsed for a in acts) + 1
    for rank, actions in enumerate(parsed):
        done = set()
        for a in actions:
            where = f"rank {rank}, action {a}"
            if a.stage >= p:
                raise ScheduleError(f"{where}: stage {a.stage} does not exist with {p} stages")
            if a.mb >= m:
                raise ScheduleError(f"{where}: micro-batch {a.mb} does not exist with {m} micro-batches")
            if (a.stage, a.kind, a.mb) in done:
                raise ScheduleError(f"{where}: {a} appears twice; each micro-batch runs F and B once per stage")
            if a.kind == "B" and (a.stage, "F", a.mb) not in done:
                raise ScheduleError(f"{where}: backward before forward; {a.stage}F{a.mb} must come before {a}")
            if a.kind == "W" and (a.stage, "B", a.mb) not in done:
                raise ScheduleError(f"{where}: weight gradient before backward; {a.stage}B{a.mb} must come before {a}")
            done.add((a.stage, a.kind, a.mb))
    for stage in range(p):
        if stage not in owner:
            raise ScheduleError(f"stage {stage} has no actions on any rank (expected {p} stages)")
        rank = owner[stage]
        have = {(a.kind, a.mb) for a in parsed[rank] if a.stage == stage}
        missing = [f"{stage}{k}{mb}" for mb in range(m) for k in "FB" if (k, mb) not in have]
        if missing:
            raise ScheduleError(f"rank {rank}: stage {stage} is missing {', '.join(missing[:6])}"
                                f"{' ...' if len(missing) > 6 else ''}: every micro-batch needs F and B on every stage")
    return p, m


# --------------------------------------------------------------------------- simulation
@dataclass
class SimResult:
    """Unit-time simulation of a schedule: spans per rank, makespan, bubble, memory."""
    spans: list[list[tuple[float, float, Action]]]  # per rank: (start, end, action)
    makespan: float
    busy: list[float]
    peak_inflight: list[int]  # per rank: most activations held at once (F done, B not yet)
    n_stages: int
    n_microbatches: int
    t_f: float = 1.0
    t_b: float = 2.0

    @property
    def bubble(self) -> float:
        """Idle fraction: 1 - sum(busy) / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _ops(actions: list[Action], p: int, owner: dict[int, int], t_f: float, t_b: float, t_w: float, split):
    """The send/recv/compute operations a rank runs for its actions (the executor's order)."""
    ops = []
    for a in actions:
        s, mb = a.stage, a.mb
        if a.kind == "W":
            ops.append(("compute", t_w, None, a))
        elif a.kind == "F":
            if s > 0:
                ops.append(("recv", ("act", s - 1, mb), owner[s - 1], a))
            ops.append(("compute", t_f, None, a))
            if s < p - 1:
                ops.append(("send", ("act", s, mb), owner[s + 1], a))
        else:
            if s < p - 1:
                ops.append(("recv", ("grad", s + 1, mb), owner[s + 1], a))
            ops.append(("compute", t_b - t_w if (s, mb) in split else t_b, None, a))
            if s > 0:
                ops.append(("send", ("grad", s, mb), owner[s - 1], a))
    return ops


def _describe(op) -> str:
    kind, key, peer, a = op
    what = "activation" if key[0] == "act" else "input gradient"
    if kind == "recv":
        return f"receive of the {what} of stage {key[1]} micro-batch {key[2]} from rank {peer} (for {a})"
    return f"blocking send of the {what} of stage {key[1]} micro-batch {key[2]} to rank {peer} (after {a})"


def split_backwards(schedule) -> set[tuple[int, int]]:
    """(stage, mb) pairs whose backward is split into B (input gradient) and W (weights)."""
    return {(a.stage, a.mb) for acts in parse_schedule(schedule) for a in acts if a.kind == "W"}


def simulate(schedule, t_f: float = 1.0, t_b: float = 2.0, *, t_w: float | None = None, blocking_send: bool = False,
             n_stages: int | None = None, n_microbatches: int | None = None) -> SimResult:
    """Run the schedule on a unit-time model: F takes t_f, B takes t_b, messages are free.

    A backward split by a ``W`` action takes t_b - t_w for B and t_w for W (t_w
    defaults to t_b / 2); its activations are held until W.

    Raises ScheduleError for a malformed schedule and DeadlockError, naming every stuck
    rank and what it waits on, if the ranks can never finish.
    """
    p, m = check_schedule(schedule, n_stages, n_microbatches)
    parsed, owner = parse_schedule(schedule), stage_ranks(schedule)
    split = split_backwards(schedule)
    t_w = t_b / 2 if t_w is None else t_w
    ops = [_ops(acts, p, owner, t_f, t_b, t_w, split) for acts in parsed]
    pc = [0] * len(ops)  # next op per rank
    clock = [0.0] * len(ops)
    sent = {}  # key -> time the message is available (isend)
    waiting_send = {}  # key -> rank blocked in a rendezvous send
    spans = [[] for _ in ops]
    inflight, peak = [0] * len(ops), [0] * len(ops)
    progress = True
    while progress:
        progress = False
        for r in range(len(ops)):
            while pc[r] < len(ops[r]):
                kind, key, peer, a = ops[r][pc[r]]
                if kind == "compute":
                    spans[r].append((clock[r], clock[r] + key, a))
                    clock[r] += key
                    if a.kind == "F":
                        inflight[r] += 1
                    elif a.kind == "W" or (a.stage, a.mb) not in split:
                        inflight[r] -= 1  # the activations go with the last step that needs them
                    peak[r] = max(peak[r], inflight[r])
                elif kind == "send" and not blocking_send:
                    sent[key] = clock[r]
                elif kind == "send":
                    waiting_send[key] = r
                    if not _at_recv(ops, pc, peer, key):
                        break  # wait for the receiver to get there
                    t = max(clock[r], clock[peer])
                    clock[r] = clock[peer] = t
                    del waiting_send[key]
                    pc[peer] += 1
                else:  # recv
                    if key in sent:
                        clock[r] = max(clock[r], sent.pop(key))
                    elif key in waiting_send:
                        sender = waiting_send.pop(key)
                        t = max(clock[r], clock[sender])
                        clock[r] = clock[sender] = t
                        pc[sender] += 1
                    else:
                        break
                pc[r] += 1
                progress = True
    stuck = [r for r in range(len(ops)) if pc[r] < len(ops[r])]
    if stuck:
        lines = [f"rank {r} waits in the {_describe(ops[r][pc[r]])}" for r in stuck]
        hint = (" Blocking sends are rendezvous: two neighbours that send to each other at the same time both wait;"
                " reorder the actions or use isend." if blocking_send else
                " Some receive waits on a message its sender only sends later: reorder the actions.")
        raise DeadlockError("the schedule deadlocks:\n  " + "\n  ".join(lines) + "\n" + hint)
    busy = [sum(e - s for s, e, _ in rank_spans) for rank_spans in spans]
    makespan = max((rank_spans[-1][1] for rank_spans in spans if rank_spans), default=0.0)
    return SimResult(spans, makespan, busy, peak, p, m, t_f, t_b)


def _at_recv(ops, pc, rank, key) -> bool:
    if pc[rank] >= len(ops[rank]):
        return False
    kind, k, _, _ = ops[rank][pc[rank]]
    return kind == "recv" and k == key


def validate(schedule, n_stages: int | None = None, n_microbatches: int | None = None, *,
             blocking_send: bool = False) -> tuple[int, int]:
    """Everything the executor checks before it communicates: well-formed and deadlock-free."""
    simulate(schedule, blocking_send=blocking_send, n_stages=n_stages, n_microbatches=n_microbatches)
    return check_schedule(schedule, n_stages, n_microbatches)


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


def format_schedule(schedule) -> str:
    """One line per rank, for printing."""
    return "\n".join(f"rank {r}: " + " ".join(acts) for r, acts in enumerate(schedule))


def zero_bubble_schedule(n_stages: int, n_microbatches: int, max_inflight=None) -> list[list[str]]:
    """A zero-bubble-style schedule (after ZB-H1, Qi et al. 2024), built greedily; not an exercise.

    Every backward is split into B (the input gradient, which the previous stage waits
    for) and W (the weight gradient, which nobody waits for). In unit time (F = B = W = 1)
    each rank starts, as soon as it is free: a B if one is ready, else an F if it holds
    fewer than ``max_inflight`` micro-batches (held from F until W; default p - stage,
    1F1B's memory), else its oldest pending W. The W steps fill gaps that 1F1B leaves
    idle: for m >= p, with 1F1B's memory the idle time per rank drops from 3(p-1) to
    2(p-1) units; with ``max_inflight=n_microbatches`` every W can wait and it drops to
    p-1, at GPipe's memory. (The paper's hand-made ZB-H1/ZB-H2 trade memory and bubble
    more finely.) Simulate it with ``simulate(schedule, t_w=...)``.
    """
    p, m = n_stages, n_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need n_stages >= 1 and n_microbatches >= 1, got {p}, {m}")
    limit = [p - s if max_inflight is None else max_inflight for s in range(p)]
    done = {}  # (kind, stage, mb) -> finish time
    nxt_f, nxt_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    held, free_at, out = [0] * p, [0] * p, [[] for _ in range(p)]
    t = 0
    while any(len(acts) < 3 * m for acts in out):
        for s in range(p):
            if free_at[s] > t:
                continue
            b, f = nxt_b[s], nxt_f[s]
            grad_ready = done.get(("F", s, b) if s == p - 1 else ("B", s + 1, b), t + 1) <= t
            act_ready = s == 0 or done.get(("F", s - 1, f), t + 1) <= t
            if b < f and grad_ready:
                kind, mb = "B", b
                nxt_b[s] += 1
                pending_w[s].append(b)
            elif f < m and act_ready and held[s] < limit[s]:
                kind, mb = "F", f
                nxt_f[s] += 1
                held[s] += 1
            elif pending_w[s]:
                kind, mb = "W", pending_w[s].pop(0)
                held[s] -= 1
            else:
                continue
            done[kind, s, mb] = t + 1
            free_at[s] = t + 1
            out[s].append(f"{s}{kind}{mb}")
        t += 1
    return out
