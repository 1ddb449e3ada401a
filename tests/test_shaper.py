"""labkit.links.shaper: the in-process slow link counts bytes exactly, adds alpha + bytes/beta, changes no number.

One launch of 2 ranks (a few seconds). The only timing check is a lower bound that
time.sleep guarantees (elapsed >= the emulated seconds), never an upper one.
"""
import time

import pytest
import torch
import torch.distributed as dist

from labkit.launching.launcher import launch
from labkit.links.shaper import SlowLink, fit_alpha_beta, model_seconds, wire_bytes


def _ranks(rank, world_size):
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    want = t.clone()
    dist.all_reduce(want)
    out, original = {}, dist.all_reduce
    with SlowLink(bandwidth=4e6, latency=1e-3) as link:
        start = time.perf_counter()
        got = t.clone()
        dist.all_reduce(got)
        dist.broadcast(got, src=0)
        gathered = [torch.empty(10) for _ in range(world_size)]
        dist.all_gather(gathered, torch.ones(10))
        dist.all_reduce(torch.ones(5), async_op=True).wait()
        elapsed = time.perf_counter() - start
    out["equal"] = torch.equal(got, want)
    out["counters"] = (link.calls, link.payload_bytes, link.wire_bytes, dict(link.by_op))
    out["seconds"], out["elapsed"] = link.seconds, elapsed
    out["restored"] = dist.all_reduce is original
    return out


def test_slow_link_counts_bytes_sleeps_and_changes_no_number():
    results = launch(_ranks, 2, timeout=60)
    n = 2
    payload = 4000 + 4000 + 2 * 40 + 20
    wire = 4000 * 2 * (n - 1) / n + 4000 + 80 * (n - 1) / n + 20 * 2 * (n - 1) / n
    for r in results:
        assert r["equal"] and r["restored"]
        assert r["counters"] == (4, payload, wire, {"all_reduce": 2, "broadcast": 1, "all_gather": 1})
        assert r["seconds"] == pytest.approx(4 * 1e-3 + wire / 4e6, rel=1e-12)
        assert r["elapsed"] >= r["seconds"]  # time.sleep sleeps at least as long as asked


def test_wire_bytes_follow_the_bus_factors():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather_into_tensor", 1000, 4) == 750
    assert wire_bytes("broadcast", 1000, 4) == 1000
    assert wire_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("gossip", 1, 2)


def test_fit_alpha_beta_recovers_the_model():
    alpha, beta = 2e-3, 25e6
    sizes = [1e3, 1e5, 1e6, 4e6]
    got_alpha, got_beta = fit_alpha_beta(sizes, [model_seconds(s, beta, alpha) for s in sizes])
    assert got_alpha == pytest.approx(alpha, rel=1e-9) and got_beta == pytest.approx(beta, rel=1e-9)
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([1e3, 1e3], [1.0, 1.0])
    with pytest.raises(ValueError, match="did not grow"):
        fit_alpha_beta([1e3, 1e6], [2.0, 1.0])


def test_slow_link_bad_input_and_no_nesting():
    with pytest.raises(ValueError, match="bandwidth"):
        SlowLink(0)
    with pytest.raises(ValueError, match="latency"):
        SlowLink(1e6, latency=-1)
    original = dist.all_reduce
    with SlowLink(1e6, sleep=False):
        assert dist.all_reduce is not original
        with pytest.raises(RuntimeError, match="already active"):
            SlowLink(1e6).__enter__()
    assert dist.all_reduce is original
