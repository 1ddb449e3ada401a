"""labkit.links.netem: the real shaper (tc netem on a veth pair between two namespaces) when root allows it.

Where the kernel has no netem (or there is no root), the netem test is skipped and says why;
the plumbing (namespaces, veth, gloo over it) is still tested when root and `ip` are there.
Every test tears down what it built and checks that nothing is left. A few seconds.
"""
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from labkit.links import netem
from labkit.launching.launcher import launch

OK, WHY = netem.probe()
PLUMBING = netem.probe_plumbing()


def _leftovers():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.startswith("lab13")]


def _over_the_link(rank, world_size, link, numel):
    group = netem.shaped_group(link, rank)
    t = torch.full((numel,), float(rank + 1))
    dist.all_reduce(t, group=group)  # warm-up: the connections
    start = time.perf_counter()
    dist.all_reduce(t, group=group)
    return torch.equal(t, torch.full((numel,), 6.0)), time.perf_counter() - start


@pytest.mark.skipif(not PLUMBING[0], reason=f"no namespaces here: {PLUMBING[1]}")
def test_gloo_between_two_namespaces_over_a_veth_pair_then_nothing_left():
    with netem.NetemLink(shape=False) as link:
        results = launch(_over_the_link, 2, link, 1000, timeout=60)
    assert all(equal for equal, _ in results)
    assert _leftovers() == []


@pytest.mark.skipif(not OK, reason=f"tc netem unavailable, the in-process shaper is used instead: {WHY}")
def test_netem_link_is_at_most_its_rate_then_nothing_left():
    numel = 250_000  # 1 MB: at 8 Mbit/s (1 MB/s) the ring moves 1 MB per rank: >= 1 s
    with netem.NetemLink(rate_mbit=8, delay_ms=5) as link:
        results = launch(_over_the_link, 2, link, numel, timeout=120)
    for equal, seconds in results:
        assert equal
        assert seconds >= 4 * numel / link.bandwidth  # a rate limiter never delivers faster than its rate
    assert _leftovers() == []


def test_failed_setup_tears_down_and_bad_input_raises():
    with pytest.raises(ValueError, match="rate_mbit"):
        netem.NetemLink(rate_mbit=0)
    if PLUMBING[0] and not OK:  # netem missing: set-up fails at tc, and must leave nothing behind
        with pytest.raises(RuntimeError, match="netem"):
            netem.NetemLink().__enter__()
        assert _leftovers() == []
