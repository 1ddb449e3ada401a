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


# --- a collective kind's own bus bandwidth against size (Cluster.busbw_by_kind) ----------------------------

# nccl/issues/1047: reduce_scatter_perf, 8 H100 80GB HBM3, ring, out-of-place: (size column, busbw column)
RS_1047 = [(2**27, 311.34), (2**28, 330.94), (2**29, 340.94), (2**30, 349.36), (2**31, 354.81), (2**32, 357.76),
           (2**33, 362.16)]


def test_reduce_scatter_curve_reproduces_the_cited_nccl_tests_rows():
    """Every row of the cited table, exactly: the link's beta at the row's size, and a reduce-scatter of that size
    over 8 ranks timed by collective_time has busbw = wire / (time - its 7 latency steps) = the row's figure.
    The all-gather reads the same curve (the file's source: one figure for every kind NVLink SHARP does not speed
    up); the all-reduce keeps the node's 460 GB/s. Planted (checked when written): the all-reduce's 460 for every
    kind fails the first assertion at every row."""
    for cluster in (H100, load_cluster("h100-grand-teton"), load_cluster("h200-sxm")):
        for size, gbps in RS_1047:
            assert cluster.link("node", "reduce_scatter", size)[1] == gbps * 1e9
            assert cluster.link("node", "all_gather", size)[1] == gbps * 1e9
            wire, t = collective_time("reduce_scatter", size, 8, "node", cluster)
            assert wire / (t - 7 * cluster.link("node")[0]) == pytest.approx(gbps * 1e9, rel=1e-12)
        assert cluster.link("node", "all_reduce", 2**30)[1] == cluster.link("node")[1] == 460e9
        assert cluster.link("node", "all_to_all", 2**30)[1] == cluster.link("node", "send", 1e3)[1] == 370e9
        assert cluster.link("network", "reduce_scatter", 2**30) == cluster.link("network")  # no figure: the NIC's
    assert load_cluster("a100-sxm").link("node", "all_gather", 2**30)[1] == 230e9  # A100: no SHARP, one figure


def test_busbw_between_rows_is_log_linear_in_size_and_flat_beyond_the_ends():
    """Between two measured sizes, busbw is linear in log(size): at their geometric mean, the mean of the two.
    Beyond the table, the nearest row's figure (a 16 MiB tensor: 311.34, the 128 MiB row; 64 GiB: 362.16).
    Planted (checked when written): interpolating linearly in the size gives 319.46 at 2^27.5, not 321.14."""
    mid = 2**27.5
    assert H100.link("node", "reduce_scatter", mid)[1] == pytest.approx((311.34 + 330.94) / 2 * 1e9, rel=1e-12)
    assert H100.link("node", "reduce_scatter", 2**24)[1] == 311.34e9
    assert H100.link("node", "reduce_scatter", 2**36)[1] == 362.16e9
    sizes = [2**k for k in range(20, 38)]
    betas = [H100.link("node", "all_gather", s)[1] for s in sizes]
    assert betas == sorted(betas)  # never falls with size
    assert H100.fastest_busbw("node") == 460e9 and H100.fastest_busbw("network") == H100.link("network")[1]


def test_tp_collectives_on_h100_take_the_reduce_scatter_curve():
    """Llama 3 70B, tp 8, one micro-batch of 8,192 tokens (SP): each all-gather and reduce-scatter moves a 128 MiB
    activation (2 x 8192 x 8192 bytes), so the block's TP time is the count x (7 alpha + 7/8 x 128 MiB / 311.34 GB/s),
    where the all-reduce's figure, 460 GB/s, made its bandwidth term 32% shorter. Planted (checked when written):
    that figure for every kind fails here."""
    from labkit.scale.cost import predict
    from labkit.scale.layout import Layout
    from labkit.scale.specs import LLAMA3

    spec = LLAMA3["70b"]
    p = predict(spec, Layout(dp=4, tp=8, recompute="none"), H100, 4, 8192, efficiency=None)
    act = 2 * 8192 * spec.d_model
    assert act == 2**27
    tp = p.traffic["tp"]
    a = H100.link("node")[0]
    assert tp["seconds"] == pytest.approx(tp["count"] * (7 * a + 7 / 8 * act / 311.34e9), rel=1e-12)


@pytest.mark.parametrize("figure, message", [
    ({"node": {"reduce_scatter": [[2**27, 311340.0]]}}, r"311340 at 1.34218e\+08 bytes is outside 5..5000 \(a unit off by 1,000\?\).*GB/s"),
    ({"node": {"reduce_scatter": [[2**28, 330.0], [2**27, 311.0]]}}, "the sizes must increase, in bytes"),
    ({"node": {"allgather": 370}}, "'allgather' is not a collective kind the model times"),
    ({"rack": {"all_gather": 370}}, "the levels are 'node' and 'network'"),
    ({"node": {"all_gather": [[2**27]]}}, r"must be a number \(GB/s\) or a list of \[bytes, GB/s\] pairs"),
    ({"node": {"all_gather": 0.37}}, r"0.37 at 0 bytes is outside 5..5000 \(a unit off by 1,000\?\)"),
])
def test_busbw_by_kind_bad_input_is_named(figure, message):
    """A busbw figure in MB/s or TB/s, sizes out of order, a misspelt kind or level, a malformed point: each
    ClusterError names the level and kind, and the fix."""
    values = json.loads((CLUSTER_DIR / "h100-sxm.json").read_text())
    with pytest.raises(ClusterError, match=message):
        load_cluster(dict(values, busbw_by_kind=figure))
