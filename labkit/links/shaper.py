"""An emulated slow link between ranks, in process: every collective also sleeps alpha + bytes / beta.

    from labkit.links.shaper import SlowLink
    with SlowLink(bandwidth=20e6, latency=2e-3) as link:   # inside a rank (labkit.launch)
        dist.all_reduce(t)           # the real all-reduce, then a sleep of 2 ms + wire bytes / 20 MB/s
    link.calls, link.payload_bytes, link.wire_bytes, link.seconds

Why in process: a real shaper (`tc qdisc ... netem` on a veth pair between two network
namespaces, `labkit.links.netem`) needs root, the netem kernel module and network namespaces.
This one needs nothing and is *deterministic*: the time it adds and the bytes it counts
depend only on the calls made, never on the machine's load, so tests can check them.

The contract, per call of a `labkit.comm.ops` op on a group of N ranks (every op the lab
calls: the *_single/_tensor forms, all_to_all_single, point-to-point, batch_isend_irecv, barrier):
- payload S = the op's size in bytes, as nccl-tests counts it (the table in labkit.comm.ops);
- wire bytes = what one rank puts on its link = S x the op's bus factor (all-reduce 2(N-1)/N,
  all-gather, reduce-scatter and all-to-all (N-1)/N, broadcast, send, recv 1, barrier 0;
  0 when N = 1: nothing leaves the process);
- after the real call returns, the rank sleeps `latency + wire / bandwidth` (nothing when
  N = 1). Every rank makes the same calls, so every rank sleeps alike: the link is slow for all.

It is a hook of `labkit.comm.intercept`: only calls looked up on the `torch.distributed`
module at call time (`dist.all_reduce(...)`, as the lab's code and torch's DDP communication
hooks write it) go through the link; DDP's own C++ reducer, torch's internal helpers and an op
bound at import time do not. `async_op=True` calls sleep at once, unless the link is made with
``overlap=True``: then the link carries one transfer at a time (each starts when the previous one
ends, or at its call), an async call returns at once, and its Work's ``wait()`` sleeps until its
transfer's end; a blocking call sleeps until its own. Compute issued in between overlaps the
emulated transfer as it would a real one (solutions/moe_overlap.py's tests).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.comm import ops
from labkit.comm.intercept import Hook, intercept

def wire_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank puts on its link for a collective of `payload` bytes on `world_size` ranks."""
    return float(ops.wire(op, payload, world_size))


def model_seconds(wire: float, bandwidth: float, latency: float, calls: int = 1) -> float:
    """The alpha-beta model: `calls` x latency + wire bytes / bandwidth."""
    return calls * latency + wire / bandwidth


def fit_alpha_beta(wire: list, seconds: list) -> tuple[float, float]:
    """Least-squares fit of seconds = alpha + wire / beta; returns (alpha seconds, beta bytes/s).

    Needs at least two distinct sizes. A fitted slope <= 0 (noise swamped the sizes) raises
    ValueError: measure larger messages.
    """
    if len(set(wire)) < 2 or len(wire) != len(seconds):
        raise ValueError(f"need >= 2 distinct sizes with one time each; got sizes {wire}, {len(seconds)} times")
    a = torch.tensor([[1.0, float(w)] for w in wire], dtype=torch.float64)
    b = torch.tensor([float(s) for s in seconds], dtype=torch.float64)
    alpha, inv_beta = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).tolist()
    if inv_beta <= 0:
        raise ValueError(f"fitted 1/beta = {inv_beta:.3g} <= 0: the times did not grow with size; "
                         "measure larger messages or more iterations")
    return alpha, 1.0 / inv_beta


class DelayedWork:
    """A Work whose wait() also sleeps until `deadline` (a perf_counter reading): an emulated transfer in flight."""

    def __init__(self, work, deadline: float):
        self._work, self.deadline = work, deadline

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        left = self.deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self.deadline

    def __getattr__(self, name):
        return getattr(self._work, name)


class SlowLink(Hook):
    """Context manager: inside it, this process's collectives (see module docstring) are slowed and counted.

    ``SlowLink(bandwidth, latency=0.0, sleep=True)``: bandwidth in bytes/s (> 0, ``inf`` for
    an infinitely fast link that only counts), latency in seconds (>= 0). ``sleep=False``
    counts bytes and emulated seconds without sleeping. Counters: ``calls``, ``payload_bytes``,
    ``wire_bytes``, ``seconds`` (emulated time added) and ``by_op`` {op: calls}; ``reset()``.
    ``overlap=True``: transfers queue on the link one at a time; an ``async_op=True`` call returns
    at once and its Work's wait() sleeps until its transfer ends (default False: every call sleeps
    its own delay at once).
    Not re-entrant: one SlowLink active per process at a time (it composes with other hooks,
    e.g. `labkit.comm.traffic.count_traffic`).
    """

    _active = None

    def __init__(self, bandwidth: float, latency: float = 0.0, sleep: bool = True, overlap: bool = False):
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s (float('inf') for no limit); got {bandwidth!r}")
        if not latency >= 0:
            raise ValueError(f"latency must be >= 0 seconds; got {latency!r}")
        self.bandwidth, self.latency, self.sleep, self.overlap = float(bandwidth), float(latency), sleep, overlap
        self._block = None
        self._free_at = 0.0  # overlap mode: when the link's last queued transfer ends (perf_counter)
        self.reset()

    def reset(self) -> None:
        self.calls, self.payload_bytes, self.wire_bytes, self.seconds, self.by_op = 0, 0, 0.0, 0.0, {}

    def after(self, call, result) -> None:
        wire = float(call.wire)
        delay = model_seconds(wire, self.bandwidth, self.latency) if call.member and len(call.ranks) > 1 else 0.0
        self.calls += 1
        self.by_op[call.op] = self.by_op.get(call.op, 0) + 1
        self.payload_bytes += call.payload
        self.wire_bytes += wire
        self.seconds += delay
        if self.sleep and delay > 0:
            if self.overlap:  # one transfer at a time: this one starts when the link is free
                self._free_at = max(time.perf_counter(), self._free_at) + delay
                if call.arguments.get("async_op") and result is not None:
                    return DelayedWork(result, self._free_at)  # the wait pays what is left
                time.sleep(max(0.0, self._free_at - time.perf_counter()))
                return None
            time.sleep(delay)

    def __enter__(self) -> "SlowLink":
        if SlowLink._active is not None:
            raise RuntimeError("a SlowLink is already active in this process: leave it first")
        SlowLink._active = self
        self._block = intercept(self)
        self._block.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        block, self._block = self._block, None
        SlowLink._active = None
        block.__exit__(*exc)

    def __repr__(self) -> str:
        return (f"SlowLink({self.bandwidth / 1e6:g} MB/s, {self.latency * 1e3:g} ms: {self.calls} calls, "
                f"{self.wire_bytes / 1e6:.3f} MB on the wire, {self.seconds:.3f} s added)")


def measure_alpha_beta(sizes=(1 << 10, 1 << 16, 1 << 18), iters: int = 3, group=None) -> tuple[float, float]:
    """Fit (alpha, beta) of the all-reduce as this process sees it, link included. Collective.

    Times `dist.all_reduce` on float32 tensors of `sizes` bytes (slowest rank, median of
    `iters`) and fits seconds = alpha + wire / beta with wire = 2(N-1)/N x S.
    """
    from labkit.links.bandwidth import time_collectives

    n = dist.get_world_size(group)
    wire, seconds = [], []
    for size in sizes:
        t = time_collectives({"ar": lambda x, group: dist.all_reduce(x, group=group)}, size // 4,
                             iters=iters, group=group)["ar"]
        wire.append(wire_bytes("all_reduce", size, n))
        seconds.append(t)
    return fit_alpha_beta(wire, seconds)

