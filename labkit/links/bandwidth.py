"""Measuring collectives: time, algbw, busbw and the ring cost model (notebook 03, bench/allreduce.py).

Definitions follow nccl-tests (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
- time: per call, the slowest rank's time (a collective is done when every rank is);
  over the iterations, the median (robust to a noisy neighbour on a shared machine);
- algbw = S / time, S the tensor's size in bytes;
- busbw = algbw x factor, the factor making busbw comparable to the link's bandwidth
  whatever N: all-reduce 2(N-1)/N, all-gather and reduce-scatter (N-1)/N, others 1.

The ring cost model: 2(N-1) steps, each moving one chunk of S/N bytes over every
link at once, so time = 2(N-1) x (latency + S / (N x B)) ~ 2(N-1)/N x S / B for
large S. The naive (master) all-reduce pushes (N-1) x S into rank 0 and (N-1) x S
out: time = 2(N-1) x (latency + S / B).

Everything here except the pure formulas is collective: call it on every rank
(inside `labkit.launch`). Timing uses torch's own `dist.barrier` and `dist.all_reduce`.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: how fast the user's S bytes got all-reduced."""
    return nbytes / seconds


def busbw(nbytes: int, seconds: float, world_size: int, collective: str = "all_reduce") -> float:
    """Bus bandwidth in bytes/s (nccl-tests): algbw x the collective's factor."""
    return algbw(nbytes, seconds) * BUSBW_FACTOR[collective](world_size)


def ring_model_seconds(nbytes: int, world_size: int, bandwidth: float, latency: float = 0.0) -> float:
    """Predicted ring all-reduce time: 2(N-1) steps of one S/N chunk per link."""
    n = world_size
    return 0.0 if n == 1 else 2 * (n - 1) * (latency + nbytes / n / bandwidth)


def naive_model_seconds(nbytes: int, world_size: int, bandwidth: float, latency: float = 0.0) -> float:
    """Predicted master all-reduce time: rank 0 takes in (N-1) x S, then sends out (N-1) x S."""
    n = world_size
    return 0.0 if n == 1 else 2 * (n - 1) * (latency + nbytes / bandwidth)


def _max_over_ranks(values: list, group=None) -> list:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def time_collectives(fns: dict, numel: int, dtype=torch.float32, iters: int = 5, warmup: int = 1,
                     group=None) -> dict:
    """Seconds per call of each `fn(tensor, group=group)` in `fns`, on a tensor of `numel` elements.

    The functions are interleaved (one call of each per iteration) so that load
    from other processes hits them alike; each call starts after a barrier.
    Returns {name: median over iterations of the slowest rank's time}, the
    same on every rank. The tensor holds zeros, so repeated sums stay finite.
    """
    names = list(fns)
    tensor = torch.zeros(numel, dtype=dtype)
    times = {name: [] for name in names}
    for it in range(warmup + iters):
        for name in names:
            dist.barrier(group=group)
            start = time.perf_counter()
            fns[name](tensor, group=group)
            elapsed = time.perf_counter() - start
            if it >= warmup:
                times[name].append(elapsed)
    flat = _max_over_ranks([t for name in names for t in times[name]], group)
    return {name: statistics.median(flat[i * iters:(i + 1) * iters]) for i, name in enumerate(names)}


def measure_link(nbytes: int = 4 << 20, iters: int = 7, group=None) -> dict:
    """Bandwidth (bytes/s) and latency (s) of one link, two ways; the same dict on every rank.

    - "ring": every rank sends `nbytes` to its right neighbour while receiving as
      much from its left (one ring step), all links busy at once. This is the B
      of the ring model: on one machine all "links" share the same cores and
      memory, so a link alone looks faster than it is inside a ring.
    - "single": group rank 0 sends to group rank 1, the others idle: the B of
      the naive model, whose root moves one message at a time.
    Latency is the same exchange with 4 bytes; bandwidth = nbytes / time (for a large
    message the latency is negligible, and subtracting two noisy times could go negative).
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return dict(ring_bandwidth=float("inf"), ring_latency=0.0,
                    single_bandwidth=float("inf"), single_latency=0.0)

    # Buffers allocated (and touched) once, outside the timed calls: page faults are not link time.
    buffers = {numel: (torch.zeros(numel, dtype=torch.uint8), torch.zeros(numel, dtype=torch.uint8))
               for numel in (4, nbytes)}

    def ring_step(numel):
        out, into = buffers[numel]
        works = [dist.isend(out, group_dst=(r + 1) % n, group=group),
                 dist.irecv(into, group_src=(r - 1) % n, group=group)]
        for work in works:
            work.wait()

    def single(numel):
        out, into = buffers[numel]
        if r == 0:
            dist.send(out, group_dst=1, group=group)
        elif r == 1:
            dist.recv(into, group_src=0, group=group)

    fns = {"ring small": lambda t, group: ring_step(4), "ring large": lambda t, group: ring_step(nbytes),
           "single small": lambda t, group: single(4), "single large": lambda t, group: single(nbytes)}
    s = time_collectives(fns, 1, iters=iters, group=group)
    return dict(ring_bandwidth=nbytes / s["ring large"], ring_latency=s["ring small"],
                single_bandwidth=nbytes / s["single large"], single_latency=s["single small"])


def collective_cost_in_a_step(sizes=(4 << 10, 64 << 10, 1 << 20), calls: int = 60, work: int = 160,
                              group=None) -> dict:
    """Mean seconds that one all-reduce adds to a loop of compute and collectives, per size (bytes).

    A step's collectives are not back to back: each rank reaches the next one from its own compute,
    and on a shared CPU its peers may not be on a core at that moment (a rank that waits sleeps, and
    is woken). `measure_link` times exchanges that every rank enters together, right after a
    barrier. Here every call follows a short compute (a `work` x `work` matmul, about 0.1 ms), and the
    cost of a call is the loop's time with the collectives minus the same loop without them, over
    `calls` calls: the MEAN, because a step pays the sum of its collectives, slow ones included.
    Returns {bytes: seconds}, the slowest rank's, the same on every rank. Collective.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return {nbytes: 0.0 for nbytes in sizes}
    a = torch.randn(work, work, generator=torch.Generator().manual_seed(0))
    cost = []
    for nbytes in sizes:
        tensor = torch.zeros(max(1, nbytes // 4))

        def loop(with_collective: bool) -> float:
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(calls):
                a @ a
                if with_collective:
                    dist.all_reduce(tensor, group=group)
            return time.perf_counter() - start
        loop(True)  # warm-up: the buffers of this size
        cost.append((loop(True) - loop(False)) / calls)
    return dict(zip(sizes, _max_over_ranks(cost, group)))


def sweep(fns: dict, sizes: list, iters_for=lambda nbytes: 5, dtype=torch.float32, group=None,
          link_bytes: int | None = None) -> list:
    """Time every function in `fns` at every size (bytes); one row per (name, size).

    Rows are dicts: name, world_size, bytes, seconds, algbw, busbw (bytes/s), plus
    rows named "ring model" and "naive model" predicted from `measure_link`. Collective.
    """
    n = dist.get_world_size(group)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    link_bytes = link_bytes or max(1 << 20, min(max(sizes), 64 << 20) // max(n, 1))
    link = measure_link(link_bytes, group=group)
    rows = []
    for nbytes in sizes:
        seconds = time_collectives(fns, nbytes // itemsize, dtype=dtype, iters=iters_for(nbytes), group=group)
        seconds["ring model"] = ring_model_seconds(nbytes, n, link["ring_bandwidth"], link["ring_latency"])
        seconds["naive model"] = naive_model_seconds(nbytes, n, link["single_bandwidth"], link["single_latency"])
        for name, s in seconds.items():
            rows.append(dict(name=name, world_size=n, bytes=nbytes, seconds=s,
                             algbw=algbw(nbytes, s) if s else float("inf"),
                             busbw=busbw(nbytes, s, n) if s else float("inf")))
    return rows


def format_table(rows: list) -> str:
    """A readable table of `sweep` rows: one line per (world size, bytes), one column per name."""
    names = list(dict.fromkeys(row["name"] for row in rows))
    keys = list(dict.fromkeys((row["world_size"], row["bytes"]) for row in rows))
    cell = {(row["world_size"], row["bytes"], row["name"]): row for row in rows}
    lines = ["busbw GB/s (ms)".ljust(16) + "".join(f"{name:>19}" for name in names)]
    for n, nbytes in keys:
        line = f"N={n} {human_bytes(nbytes):>8}".ljust(16)
        for name in names:
            row = cell.get((n, nbytes, name))
            line += f"{'-':>19}" if row is None else f"{row['busbw'] / 1e9:>9.3f} ({row['seconds'] * 1e3:>7.1f})"
        lines.append(line)
    return "\n".join(lines)


def human_bytes(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}"
        nbytes /= 1024
