"""labkit.scale.collectives: one collective's time from measured bus bandwidth (nccl-tests' convention) and the
cluster file's sourced figures. Pure arithmetic, no process."""
from __future__ import annotations

import json

import pytest

from labkit.comm.ops import OPS
from labkit.scale.cluster import CLUSTER_DIR, ClusterError, load_cluster
from labkit.scale.collectives import BUS_FACTOR, collective_time, steps

H100 = load_cluster("h100-sxm")


def test_node_busbw_reproduces_the_cited_nccl_tests_figure():
    """h100-sxm.json: nccl-tests all_reduce busbw 460 GB/s on 8 H100 SXM5; a100-sxm.json: 230 GB/s. A large
    all-reduce's busbw = wire / time tends to it (latency negligible at 8 GiB)."""
    for name, want in (("h100-sxm", 460e9), ("a100-sxm", 230e9)):
        cluster = load_cluster(name)
        size = 8 * 2**30
        wire, t = collective_time("all_reduce", size, 8, "node", cluster)
        assert wire == pytest.approx(2 * 7 / 8 * size)
        alpha = cluster.link("node")[0]
        assert wire / (t - 14 * alpha) == pytest.approx(want, rel=1e-12)
        # the latency's share at 8 GiB: 14 x 3 us against ~33 ms (H100), ~65 ms (A100): under 0.2%
        assert wire / t == pytest.approx(want, rel=2e-3)


def test_bus_factors_are_the_closed_forms_of_the_comm_layer():
    """nccl-tests' bus factors, read from labkit.comm's op table: all-reduce 2(n-1)/n, the ring ops (n-1)/n, send 1."""
    for n in (2, 8, 64):
        assert BUS_FACTOR["all_reduce"](n) == pytest.approx(2 * (n - 1) / n)
        for kind in ("all_gather", "reduce_scatter", "all_to_all"):
            assert BUS_FACTOR[kind](n) == pytest.approx((n - 1) / n)
        assert BUS_FACTOR["send"](n) == 1.0
    assert OPS["all_reduce"].bus_factor(8) == BUS_FACTOR["all_reduce"](8)


def test_steps_ring_inside_a_node_tree_across_nodes():
    """Ring all-reduce 2(n-1) steps; across nodes NCCL's tree 2 ceil(log2 n); all-gather n-1; send 1; one rank 0."""
    assert steps("all_reduce", 8, "node") == 14
    assert steps("all_reduce", 64, "network") == 12
    assert steps("all_gather", 8, "network") == 7 and steps("send", 2, "node") == 1 and steps("all_reduce", 1, "node") == 0
    alpha, beta = H100.link("network")
    _, t = collective_time("all_reduce", 1e6, 64, "network", H100)
    assert t == pytest.approx(12 * alpha + 2 * 63 / 64 * 1e6 / beta)


def test_small_messages_are_latency_bound_large_are_bandwidth_bound():
    """algbw = S / t rises with S towards busbw / bus factor (the shape of an nccl-tests curve)."""
    algbw = [s / collective_time("all_gather", s, 8, "node", H100)[1] for s in (1e3, 1e6, 1e9)]
    assert algbw[0] < algbw[1] < algbw[2] < 460e9 * 8 / 7


def test_cluster_busbw_unit_off_by_1000_is_named():
    values = json.loads((CLUSTER_DIR / "h100-sxm.json").read_text())
    with pytest.raises(ClusterError, match="node_busbw_gbytes_per_s=460000 .*a unit off by 1,000"):
        load_cluster(dict(values, node_busbw_gbytes_per_s=460000))
    with pytest.raises(Exception, match="no GPU kind named 'h100-sxn'"):
        load_cluster(dict(values, gpu="h100-sxn"))
