"""Pipeline schedules as data: parse, lower, check and simulate them without any process.

A schedule is a list of action lists, one per rank, in PyTorch's notation:
``"{stage}F{mb}"`` runs the forward of micro-batch ``mb`` on ``stage``, ``"{stage}B{mb}"``
its backward and, in zero-bubble schedules, ``"{stage}W{mb}"`` its weight gradient (then
B computes only the input gradient). With 4 stages and 4 micro-batches, rank 1's 1F1B
list is ``["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"]``.

`lower` is the ONE place where the communication model lives. As in
``torch.distributed.pipelining`` (``_add_send_recv``) it turns that compute schedule into
what each rank runs: the compute actions with explicit messages around them,

    F on stage s:  s RECV_F mb  (from the rank of s-1, unless s = 0)   s F mb   s SEND_F mb (to s+1's rank, unless last)
    B on stage s:  s RECV_B mb  (from the rank of s+1, unless last)    s B mb   s SEND_B mb (to s-1's rank, unless s = 0)
    W on stage s:  s W mb       (no message)

Every consumer reads that same `Lowered` list: `simulate` (unit-time model, deadlock
check, peak in-flight activations), `validate`, the drawing (`labkit.measure.viz.plot_schedule`)
and the executor (``impl("pipeline").run_schedule``). So what is checked and drawn is
what runs. (torch places each receive by simulating its peer; here a receive sits just
before the compute that needs it, the simplest order that is still deadlock-free with
non-blocking sends for every valid schedule.)

Messages are matched by (kind, sender's stage, micro-batch) (`Action.message`, and its
integer `Action.tag` on real ranks), not by arrival order. ``blocking_send=False`` (isend):
a send never waits. ``blocking_send=True`` (plain gloo ``send``, a rendezvous even for one
element): a send waits until the receiver posts the matching receive.

Errors: `check_schedule` raises `ScheduleError` (a ValueError) naming the rank and the
first wrong action (its ``rank`` / ``index`` attributes locate it); `simulate` raises
`DeadlockError` naming what every stuck rank waits on, or, with ``strict=False``, returns
what ran up to the first error so that a wrong schedule can still be drawn.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")
COMPUTE = ("F", "B", "W")
SENDS, RECVS = ("SEND_F", "SEND_B"), ("RECV_F", "RECV_B")


class ScheduleError(ValueError):
    """The schedule is malformed: the message says which rank and action, and why.

    ``rank`` and ``index`` (position in that rank's action list) locate the first wrong
    action when there is one (None otherwise).
    """

    def __init__(self, message: str, rank: int | None = None, index: int | None = None):
        super().__init__(message)
        self.rank, self.index = rank, index


class DeadlockError(ScheduleError):
    """Simulating the schedule found ranks that wait on each other forever."""


@dataclass(frozen=True)
class Action:
    """One action of one rank: compute (F, B, W) or, once lowered, a message (SEND_F, ...).

    stage: the stage that computes, sends or receives; mb: the micro-batch;
    peer: for a message, the pipeline position (rank index in the schedule) of the other side.
    """
    stage: int
    kind: str  # "F", "B", "W" or "SEND_F", "RECV_F", "SEND_B", "RECV_B"
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @property
    def message(self) -> tuple[str, int, int]:
        """A message's identity, the same on both sides: ("act" | "grad", sender's stage, micro-batch)."""
        if self.kind == "SEND_F" or self.kind == "SEND_B":
            return ("act" if self.kind == "SEND_F" else "grad", self.stage, self.mb)
        if self.kind == "RECV_F":
            return ("act", self.stage - 1, self.mb)
        if self.kind == "RECV_B":
            return ("grad", self.stage + 1, self.mb)
        raise ValueError(f"{self} is a compute action, not a message")

    @property
    def tag(self) -> int:
        """`message` as a p2p tag: the same integer on the sender and on the receiver."""
        what, stage, mb = self.message
        return (stage << 20) | (mb << 1) | (what == "grad")

    def describe(self) -> str:
        """In words, for error messages: 'receive of the activation of stage 0 micro-batch 1 from rank 0'."""
        if self.kind in COMPUTE:
            return {"F": "forward", "B": "backward", "W": "weight gradient"}[self.kind] + f" {self}"
        what, stage, mb = self.message
        what = "activation" if what == "act" else "input gradient"
        if self.kind in RECVS:
            return f"receive of the {what} of stage {stage} micro-batch {mb} from rank {self.peer}"
        return f"blocking send of the {what} of stage {stage} micro-batch {mb} to rank {self.peer}"


def parse_action(text) -> Action:
    """``"2F5"`` -> Action(stage=2, kind="F", mb=5); an Action is returned as is; anything else raises."""
    if isinstance(text, Action):
        return text
    match = _ACTION.match(text) if isinstance(text, str) else None
    if match is None:
        raise ScheduleError(
            f"bad action {text!r}: write '{{stage}}F{{microbatch}}' or '{{stage}}B{{microbatch}}' "
            "(or '{stage}W{microbatch}'), e.g. '0F3' or '1B0'")
    return Action(int(match[1]), match[2], int(match[3]))


def parse_schedule(schedule) -> list[list[Action]]:
    """Parse every rank's list (strings or Actions); a rank or action that is not one raises ScheduleError."""
    if isinstance(schedule, Lowered):
        return [[a for a in ops if a.kind in COMPUTE] for ops in schedule.ops]
    if isinstance(schedule, (str, bytes)) or not hasattr(schedule, "__iter__"):
        raise ScheduleError(f"a schedule is a list of action lists, one per rank; got {type(schedule).__name__}")
    parsed = []
    for rank, actions in enumerate(schedule):
        if isinstance(actions, (str, bytes)) or not hasattr(actions, "__iter__"):
            raise ScheduleError(f"rank {rank}: expected a list of actions like ['0F0', '0B0'], got {actions!r}", rank)
        out = []
        for i, text in enumerate(actions):
            try:
                out.append(parse_action(text))
            except ScheduleError as err:
                raise ScheduleError(f"rank {rank}, action #{i}: {err}", rank, i) from None
        parsed.append(out)
    return parsed


def stage_ranks(schedule) -> dict[int, int]:
    """stage -> the rank that runs it (a stage lives on exactly one rank)."""
    owner = {}
    for rank, actions in enumerate(parse_schedule(schedule)):
        for i, a in enumerate(actions):
            if owner.setdefault(a.stage, rank) != rank:
                raise ScheduleError(f"stage {a.stage} appears on rank {owner[a.stage]} and on rank {rank} "
                                    f"(action {a}): each stage lives on one rank", rank, i)
    return owner


def check_schedule(schedule, n_stages: int | None = None, n_microbatches: int | None = None) -> tuple[int, int]:
    """Check each stage's own actions; return (n_stages, n_microbatches).

    Every stage 0..p-1 must run F and B of every micro-batch 0..m-1 exactly once,
    its F before its B (and a W after its B). Dependencies between stages are checked
    by `simulate` (which `validate` also runs). Raises ScheduleError naming the rank and
    the first wrong action.
    """
    parsed = parse_schedule(schedule)
    owner = stage_ranks(parsed)
    if not owner:
        raise ScheduleError("the schedule has no actions")
    p = n_stages if n_stages is not None else max(owner) + 1
    m = n_microbatches if n_microbatches is not None else max(a.mb for acts in parsed for a in acts) + 1
    for rank, actions in enumerate(parsed):
        done = set()
        for i, a in enumerate(actions):
            where = f"rank {rank}, action {a}"
            problem = None
            if a.stage >= p:
                problem = f"stage {a.stage} does not exist with {p} stages"
            elif a.mb >= m:
                problem = f"micro-batch {a.mb} does not exist with {m} micro-batches"
            elif (a.stage, a.kind, a.mb) in done:
                problem = f"{a} appears twice; each micro-batch runs F and B once per stage"
            elif a.kind == "B" and (a.stage, "F", a.mb) not in done:
                problem = f"backward before forward; {a.stage}F{a.mb} must come before {a}"
            elif a.kind == "W" and (a.stage, "B", a.mb) not in done:
                problem = f"weight gradient before backward; {a.stage}B{a.mb} must come before {a}"
            elif (a.kind == "F" and owner.get(a.stage - 1) == rank and a.stage > 0
                  and (a.stage - 1, "F", a.mb) not in done):
                problem = f"{a.stage - 1}F{a.mb} runs on this rank too and must come before {a} (no message between them)"
            elif (a.kind == "B" and owner.get(a.stage + 1) == rank and a.stage < p - 1
                  and (a.stage + 1, "B", a.mb) not in done):
                problem = f"{a.stage + 1}B{a.mb} runs on this rank too and must come before {a} (no message between them)"
            if problem:
                raise ScheduleError(f"{where}: {problem}", rank, i)
            done.add((a.stage, a.kind, a.mb))
    for stage in range(p):
        if stage not in owner:
            raise ScheduleError(f"stage {stage} has no actions on any rank (expected {p} stages)")
        rank = owner[stage]
        have = {(a.kind, a.mb) for a in parsed[rank] if a.stage == stage}
        missing = [f"{stage}{k}{mb}" for mb in range(m) for k in "FB" if (k, mb) not in have]
        if missing:
            raise ScheduleError(f"rank {rank}: stage {stage} is missing {', '.join(missing[:6])}"
                                f"{' ...' if len(missing) > 6 else ''}: every micro-batch needs F and B on every stage",
                                rank)
    return p, m


def is_v_placement(owner: dict[int, int], n_ranks: int) -> bool:
    """True when the stages sit in a V (ZB-V, DualPipeV): 2 n_ranks stages, rank r holds r and 2 n_ranks - 1 - r."""
    p = 2 * n_ranks
    return n_ranks > 1 and sorted(owner) == list(range(p)) and all(
        owner[s] == (s if s < n_ranks else p - 1 - s) for s in range(p))


# --------------------------------------------------------------------------- lowering
@dataclass(frozen=True)
class Lowered:
    """A schedule lowered to what each rank runs: ``ops[rank]`` is a list of `Action`s.

    ``print(lowered)`` shows one line per rank, messages with their peer:
    ``rank 1: 1RECV_F0<-0 1F0 1SEND_F0->2 ...``.
    """
    ops: list[list[Action]]
    n_stages: int
    stage_rank: dict[int, int] = field(repr=False)

    def __len__(self) -> int:
        return len(self.ops)

    def __getitem__(self, rank: int) -> list[Action]:
        return self.ops[rank]

    def __str__(self) -> str:
        def show(a):
            arrow = "" if a.peer is None else ("->" if a.kind in SENDS else "<-") + str(a.peer)
            return f"{a}{arrow}"
        return "\n".join(f"rank {r}: " + " ".join(show(a) for a in ops) for r, ops in enumerate(self.ops))

    def to_next_position(self, op: Action) -> bool:
        """Whether message ``op``'s other side is on the next pipeline position (else the previous one).

        Activations flow to the next position and gradients to the previous one, except on
        the way back up of a V placement (stages p..2p-1 of p ranks), where it is the reverse.
        """
        downstream = op.kind in ("SEND_F", "RECV_B")
        return downstream != (op.stage >= len(self.ops) and is_v_placement(self.stage_rank, len(self.ops)))

    @property
    def split(self) -> set[tuple[int, int]]:
        """(stage, mb) whose backward is split into B (input gradient) and a later W (weights)."""
        return {(a.stage, a.mb) for ops in self.ops for a in ops if a.kind == "W"}


def lower(schedule) -> Lowered:
    """Parse ``schedule`` once and insert its messages (see the module docstring); returns a `Lowered`.

    Only the stage placement is checked here (each stage on one rank, stage s+1 on the
    position after stage s's, wrapping round for interleaved schedules); `check_schedule`
    and `simulate` check the rest, so that a wrong schedule can still be lowered and drawn.
    A `Lowered` is returned as is.
    """
    if isinstance(schedule, Lowered):
        return schedule
    parsed = parse_schedule(schedule)
    owner = stage_ranks(parsed)
    n_ranks, p = len(parsed), max(owner, default=-1) + 1
    v_shape = is_v_placement(owner, n_ranks)
    for s in range(p - 1):  # messages only go to the previous / next position
        if not v_shape and s in owner and s + 1 in owner and owner[s + 1] != (owner[s] + 1) % n_ranks:
            raise ScheduleError(f"stage {s + 1} must run on the position after stage {s}'s "
                                f"({(owner[s] + 1) % n_ranks}), not on {owner[s + 1]} (or place the "
                                f"stages in a V: rank r holds stages r and 2p-1-r)", owner[s + 1])
    ops = []
    for rank, actions in enumerate(parsed):
        out = []
        for a in actions:
            s, mb = a.stage, a.mb
            # no message to the first / last stage's outside, nor between two stages of one rank (V)
            first, last = s == 0 or owner.get(s - 1) == rank, s == p - 1 or owner.get(s + 1) == rank
            if a.kind == "F":
                recv = [] if first else [Action(s, "RECV_F", mb, owner.get(s - 1))]
                send = [] if last else [Action(s, "SEND_F", mb, owner.get(s + 1))]
            elif a.kind == "B":
                recv = [] if last else [Action(s, "RECV_B", mb, owner.get(s + 1))]
                send = [] if first else [Action(s, "SEND_B", mb, owner.get(s - 1))]
            else:
                recv = send = []
            out += recv + [a] + send
        ops.append(out)
    return Lowered(ops, p, owner)


# --------------------------------------------------------------------------- simulation
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
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f, "B": t_b, "W": t_w}
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
                    t = cost[a.kind] - (t_w if a.kind == "B" and (a.stage, a.mb) in split else 0)
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
    return SimResult(spans, makespan, busy, peak, p, m, t_f, t_b, error, stuck)


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


def format_schedule(schedule) -> str:
    """One line per rank, for printing (a `Lowered` prints its messages with their peers)."""
    if isinstance(schedule, Lowered):
        return str(schedule)
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(schedule))


def first_difference(got, want) -> str | None:
    """Where two schedules first differ, in words ('rank 1, action #3: got 1F3, expected 1B0'); None if equal."""
    if not isinstance(got, (list, tuple)) or not all(isinstance(acts, (list, tuple)) for acts in got):
        return f"expected a list of per-rank action lists, got {got!r:.80}"
    got, want = [[str(a) for a in acts] for acts in got], [[str(a) for a in acts] for acts in want]
    if len(got) != len(want):
        return f"{len(got)} rank lists, expected {len(want)}"
    for r, (g, w) in enumerate(zip(got, want)):
        for i in range(max(len(g), len(w))):
            if i >= len(g) or i >= len(w) or g[i] != w[i]:
                have = g[i] if i < len(g) else "nothing (the list ends)"
                expected = w[i] if i < len(w) else "nothing (the list should end)"
                return f"rank {r}, action #{i}: got {have}, expected {expected} (first action out of order)"
    return None


# --------------------------------------------------------------------------- variants (not exercises)
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


def zero_bubble_schedule(n_stages: int, n_microbatches: int, max_inflight=None) -> list[list[str]]:
    """A greedy zero-bubble-style schedule (not an exercise, and not the paper's ZB-H1 / ZB-H2).

    Every backward is split into B (the input gradient, which the previous stage waits
    for) and W (the weight gradient, which nobody waits for). In unit time (F = B = W = 1)
    each rank starts, as soon as it is free: a B if one is ready, else an F if it holds
    fewer than ``max_inflight`` micro-batches (held from F until W; default p - stage,
    1F1B's memory), else its oldest pending W. For m >= p the idle time per rank drops
    from 1F1B's 3(p-1) units to 2(p-1) with 1F1B's memory; with
    ``max_inflight=n_microbatches`` every W can wait and it drops to p-1, at GPipe's memory.
    Qi et al. (2024) do better by hand: their ZB-H1 keeps 1F1B's peak memory and reaches an
    idle time of (p-1)(F + B - W) per rank, B being the input-gradient part (p-1 units
    here, a third of 1F1B's); ZB-H2 holds more micro-batches (about 2p) to remove the
    bubble altogether. Simulate it with ``simulate(schedule, t_w=...)``.
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
