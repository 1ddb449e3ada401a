"""An emulated slow link between ranks, in process: every collective also sleeps alpha + bytes / beta.

    from labkit.links.shaper import SlowLink
    with SlowLink(bandwidth=20e6, latency=2e-3) as link:   # inside a rank (labkit.launch)
        dist.all_reduce(t)           # the real all-reduce, then a sleep of 2 ms + wire bytes / 20 MB/s
    link.calls, link.payload_bytes, link.wire_bytes, link.seconds

Why in process: a real shaper (`tc qdisc ... netem` on a veth pair between two network
namespaces, `labkit.links.netem`) needs root, the netem kernel module and network namespaces.
This one needs nothing and is *deterministic*: the time it adds and the bytes it counts
depend only on the calls made, never on the machine's load, so tests can check them.

The contract, per call of a wrapped function on a group of N ranks:
- payload S = the collective's size in bytes, as nccl-tests counts it (all-reduce and
  broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the input;
  send/recv: the message);
- wire bytes = what one rank puts on its link = S x the bus factor of `labkit.links.bandwidth`
  (all-reduce 2(N-1)/N, all-gather and reduce-scatter (N-1)/N, broadcast, send, recv 1;
  0 when N = 1: nothing leaves the process);
- after the real call returns, the rank sleeps `latency + wire / bandwidth` (nothing when
  N = 1). Every rank makes the same calls, so every rank sleeps alike: the link is slow for all.

Only attribute look-ups through the `torch.distributed` module (`dist.all_reduce(...)`, as
the lab's code and torch's DDP communication hooks write it) go through the link; DDP's
own C++ reducer and torch's internal helpers do not. `async_op=True` calls sleep at once.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

# op name -> (bus factor for N ranks, how to get S in bytes from the call's arguments)
_BUS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "send": lambda n: 1.0, "recv": lambda n: 1.0, "isend": lambda n: 1.0, "irecv": lambda n: 1.0,
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _payload(op: str, args, kwargs) -> int:
    if op in ("all_gather", "all_gather_into_tensor"):
        return _nbytes(args[0] if args else kwargs.get("tensor_list", kwargs.get("output_tensor")))
    if op == "reduce_scatter_tensor":
        return _nbytes(args[1] if len(args) > 1 else kwargs["input"])
    return _nbytes(args[0] if args else kwargs["tensor"])


def wire_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank puts on its link for a collective of `payload` bytes on `world_size` ranks."""
    if op not in _BUS:
        raise ValueError(f"unknown collective {op!r}: known are {sorted(_BUS)}")
    return 0.0 if world_size == 1 else payload * _BUS[op](world_size)


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


class SlowLink:
    """Context manager: inside it, this process's collectives (see module docstring) are slowed and counted.

    ``SlowLink(bandwidth, latency=0.0, sleep=True)``: bandwidth in bytes/s (> 0, ``inf`` for
    an infinitely fast link that only counts), latency in seconds (>= 0). ``sleep=False``
    counts bytes and emulated seconds without sleeping. Counters: ``calls``, ``payload_bytes``,
    ``wire_bytes``, ``seconds`` (emulated time added) and ``by_op`` {op: calls}; ``reset()``.
    Not re-entrant: one SlowLink active per process at a time.
    """

    _active = None

    def __init__(self, bandwidth: float, latency: float = 0.0, sleep: bool = True):
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s (float('inf') for no limit); got {bandwidth!r}")
        if not latency >= 0:
            raise ValueError(f"latency must be >= 0 seconds; got {latency!r}")
        self.bandwidth, self.latency, self.sleep = float(bandwidth), float(latency), sleep
        self._saved = {}
        self.reset()

    def reset(self) -> None:
        self.calls, self.payload_bytes, self.wire_bytes, self.seconds, self.by_op = 0, 0, 0.0, 0.0, {}

    def _wrap(self, op: str, real):
        @functools.wraps(real)
        def slowed(*args, **kwargs):
            out = real(*args, **kwargs)
            n = dist.get_world_size(kwargs.get("group"))
            payload = _payload(op, args, kwargs)
            wire = wire_bytes(op, payload, n)
            delay = 0.0 if n == 1 else model_seconds(wire, self.bandwidth, self.latency)
            self.calls += 1
            self.by_op[op] = self.by_op.get(op, 0) + 1
            self.payload_bytes += payload
            self.wire_bytes += wire
            self.seconds += delay
            if self.sleep and delay > 0:
                time.sleep(delay)
            return out
        return slowed

    def __enter__(self) -> "SlowLink":
        if SlowLink._active is not None:
            raise RuntimeError("a SlowLink is already active in this process: leave it first")
        SlowLink._active = self
        for op in _BUS:
            self._saved[op] = getattr(dist, op)
            setattr(dist, op, self._wrap(op, self._saved[op]))
        return self

    def __exit__(self, *exc) -> None:
        for op, real in self._saved.items():
            setattr(dist, op, real)
        self._saved.clear()
        SlowLink._active = None

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

