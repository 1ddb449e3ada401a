"""A pipeline schedule's actions: parse and check them, lower them to what each rank runs (the one
communication model), print them. The overview (notation, lowering, messages, errors) is
`labkit.parallel.schedules`' docstring; the names here are importable from there too.
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
