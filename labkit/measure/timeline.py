"""Timelines: what every rank did and when, on one clock.

    tl = Timeline()                      # after the process group exists
    tl.sync()                            # align clocks, t = 0 is now (collective)
    with tl.span("F", stage=1, mb=3):    # cheap: two perf_counter calls and an append
        out = stage(x)
    spans = tl.gather()                  # on rank 0: every rank's spans; None elsewhere
    bubble_fraction(spans)               # idle share of the compute window
    write_chrome_trace(spans, "trace.json")   # open in https://ui.perfetto.dev or chrome://tracing

**One clock.** Spans are stored as seconds since a common origin. `sync` runs a
barrier, then the group's first rank broadcasts its `time.perf_counter()` reading and
every rank keeps ``offset = local perf_counter - reference``. On one host this is exact
up to the barrier's exit skew, because `perf_counter` is the system-wide monotonic
clock (CLOCK_MONOTONIC on Linux) that every process reads alike: ranks on one host
skip the estimate and share the reference reading itself. Across hosts the clocks
differ, so each rank estimates its offset to the first rank NTP-style: several
ping-pongs, the one with the shortest round trip wins, offset = remote reading minus
(send time + round trip / 2); the error is at most half that round trip.

**Kinds.** Compute spans are ``F``, ``B`` (and ``W`` for a split weight-gradient
step); communication spans are ``send``, ``recv``, ``wait``, ``allreduce``. Only
compute spans count as busy in `busy_time` and `bubble_fraction`.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import asdict, dataclass

COMPUTE_KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Span:
    kind: str  # "F", "B", "W", "send", "recv", "wait", "allreduce", ...
    start: float  # seconds since the common origin
    end: float
    rank: int = 0
    stage: int | None = None
    mb: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """What a box shows: 'F3' for micro-batch 3's forward, else the kind."""
        return f"{self.kind}{self.mb}" if self.mb is not None else self.kind


def _cuda_synchronize():
    import torch

    torch.cuda.synchronize()


def _profiler_annotation(kind, mb):
    """A torch.profiler record_function named like the span's box, if torch's profiler is recording, else None.

    (Checked per span; torch is not imported for it: without torch loaded there is no profiler.)
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.autograd.profiler._is_profiler_enabled:
        return None
    annotation = torch.profiler.record_function(f"{kind}{mb}" if mb is not None else kind)
    annotation.__enter__()
    return annotation


class _SpanContext:
    __slots__ = ("tl", "kind", "stage", "mb", "t0", "annotation")

    def __init__(self, tl, kind, stage, mb):
        self.tl, self.kind, self.stage, self.mb = tl, kind, stage, mb

    def __enter__(self):
        # entered before the first clock read and left after the last: the profiler's span contains ours
        self.annotation = _profiler_annotation(self.kind, self.mb)
        if self.tl.cuda_sync:
            _cuda_synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.tl.cuda_sync:
            _cuda_synchronize()
        self.tl.record(self.kind, self.t0, time.perf_counter(), stage=self.stage, mb=self.mb)
        if self.annotation is not None:
            self.annotation.__exit__(*exc)
        return False


class Timeline:
    """Spans recorded by one rank. Construct after `init_process_group` (or pass rank).

    ``cuda_sync=True`` calls ``torch.cuda.synchronize()`` at both ends of every span, so
    that a span measures the GPU work it launched, not only the launch (slower; GPU only).
    """

    def __init__(self, rank: int | None = None, cuda_sync: bool = False):
        self.cuda_sync = cuda_sync
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self.origin = time.perf_counter()  # local perf_counter reading of the common t = 0
        self.spans: list[Span] = []

    def span(self, kind: str, stage: int | None = None, mb: int | None = None) -> _SpanContext:
        """Context manager that records one span around its body."""
        return _SpanContext(self, kind, stage, mb)

    def record(self, kind: str, t0: float, t1: float, stage: int | None = None, mb: int | None = None) -> None:
        """Add a span from two raw `time.perf_counter()` readings of this rank."""
        self.spans.append(Span(kind, t0 - self.origin, t1 - self.origin, self.rank, stage, mb))

    def clear(self) -> None:
        self.spans.clear()

    def sync(self, group=None, rounds: int = 8, estimate: bool | None = None) -> float:
        """Align this rank's clock with the group's first rank; t = 0 becomes the barrier's exit.

        A collective: every rank of ``group`` must call it. Clears recorded spans and
        returns this rank's estimated offset in seconds (0 on the reference rank).
        ``estimate`` forces (True) or skips (False) the ping-pong estimate; by default
        it runs only when the ranks are on more than one host.
        """
        import torch
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        ref = ranks[0]
        me = dist.get_rank()
        hosts = [None] * len(ranks)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        dist.barrier(group=group)
        mine = torch.tensor([time.perf_counter()], dtype=torch.float64)
        if estimate is None:
            estimate = len(set(hosts)) > 1
        if not estimate:
            # one host: one monotonic clock, so take the reference reading as it is
            dist.broadcast(mine, src=ref, group=group)
            offset = 0.0
            self.origin = float(mine[0])
        else:
            offset = 0.0 if me == ref else None
            for other in ranks[1:]:  # ping-pong between the reference and each rank, in turn
                best = None
                for _ in range(rounds):
                    if me == ref:
                        t0 = time.perf_counter()
                        dist.send(torch.tensor([t0], dtype=torch.float64), other, group=group)
                        reply = torch.zeros(1, dtype=torch.float64)
                        dist.recv(reply, other, group=group)
                        rtt = time.perf_counter() - t0
                        dist.send(torch.tensor([t0, rtt], dtype=torch.float64), other, group=group)
                    elif me == other:
                        ping = torch.zeros(1, dtype=torch.float64)
                        dist.recv(ping, ref, group=group)
                        local = time.perf_counter()
                        dist.send(torch.tensor([local], dtype=torch.float64), ref, group=group)
                        info = torch.zeros(2, dtype=torch.float64)
                        dist.recv(info, ref, group=group)
                        t0, rtt = float(info[0]), float(info[1])
                        if best is None or rtt < best[0]:
                            best = (rtt, local - (t0 + rtt / 2))
                if me == other:
                    offset = best[1]
            dist.broadcast(mine, src=ref, group=group)  # the reference's barrier exit is t = 0
            self.origin = float(mine[0]) + offset
        self.spans.clear()
        return offset

    def gather(self, dst: int = 0, group=None) -> list[Span] | None:
        """Collective: every rank's spans, sorted by start, on global rank ``dst``; None elsewhere."""
        import torch.distributed as dist

        size = dist.get_world_size(group)
        out = [None] * size if dist.get_rank() == dst else None
        dist.gather_object([asdict(s) for s in self.spans], out, dst=dst, group=group)
        return None if out is None else merge_spans(out)

    def all_gather(self, group=None) -> list[Span]:
        """Collective: every rank's spans, sorted by start, on every rank."""
        import torch.distributed as dist

        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, [asdict(s) for s in self.spans], group=group)
        return merge_spans(out)


def merge_spans(per_rank) -> list[Span]:
    """Every rank's spans (each a list of `Span` fields as dicts, as they travel) as one list, sorted by start
    (then rank): what `Timeline.gather` returns and a session's `%ranks timeline` draws."""
    return sorted((Span(**d) for rank_spans in per_rank for d in rank_spans), key=lambda s: (s.start, s.rank))


class NullTimeline:
    """Stands in when no timeline is wanted: `span` costs one call, records nothing."""
    rank, spans = 0, ()

    class _Null:
        __slots__ = ()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    _null = _Null()

    def span(self, kind, stage=None, mb=None):
        return self._null

    def record(self, *args, **kwargs):
        pass


def or_null(timeline: Timeline | None) -> Timeline | NullTimeline:
    """The lab's one optional-timeline idiom: a function takes ``*, timeline: Timeline | None = None``
    and records into ``or_null(timeline)``: the timeline itself, or a NullTimeline that records nothing."""
    return timeline if timeline is not None else NullTimeline()


# --------------------------------------------------------------------------- analysis
def _union(intervals) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def ranks_of(spans) -> list[int]:
    return sorted({s.rank for s in spans})


def window(spans, kinds=COMPUTE_KINDS) -> tuple[float, float]:
    """(first start, last end) over every rank's spans of ``kinds`` (None: all kinds)."""
    chosen = [s for s in spans if kinds is None or s.kind in kinds]
    if not chosen:
        raise ValueError(f"no spans of kinds {kinds} to measure")
    return min(s.start for s in chosen), max(s.end for s in chosen)


def busy_time(spans, kinds=COMPUTE_KINDS) -> dict[int, float]:
    """rank -> seconds spent in spans of ``kinds`` (overlapping spans counted once)."""
    return {r: _union((s.start, s.end) for s in spans if s.rank == r and s.kind in kinds)
            for r in ranks_of(spans)}


def rank_stats(spans, kinds=COMPUTE_KINDS) -> dict[int, dict[str, float]]:
    """rank -> {"busy", "idle", "window"}: idle = window - busy, the window common to all ranks."""
    t0, t1 = window(spans, kinds)
    return {r: {"busy": b, "idle": (t1 - t0) - b, "window": t1 - t0} for r, b in busy_time(spans, kinds).items()}


def bubble_fraction(spans, kinds=COMPUTE_KINDS) -> float:
    """1 - total busy / (ranks x window): the share of the step the ranks sat idle.

    The window runs from the first compute span's start to the last one's end over all
    ranks, so one step's spans give that step's bubble; for GPipe or 1F1B with equal
    stages it tends to (p-1)/(m+p-1).
    """
    t0, t1 = window(spans, kinds)
    busy = busy_time(spans, kinds)
    return 1.0 - sum(busy.values()) / (len(busy) * (t1 - t0))


def chrome_trace(spans) -> dict:
    """Chrome trace-event JSON: one process per rank, compute and communication on two rows."""
    events = []
    for r in ranks_of(spans):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "communication"}})
    for s in spans:
        events.append({"name": s.label, "cat": s.kind, "ph": "X", "pid": s.rank,
                       "tid": 0 if s.kind in COMPUTE_KINDS else 1,
                       "ts": round(s.start * 1e6, 3), "dur": round(s.duration * 1e6, 3),
                       "args": {"stage": s.stage, "mb": s.mb}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans, path) -> str:
    """Write `chrome_trace(spans)` to ``path`` and return the path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(spans), f)
    return str(path)
