"""labkit.scale.collectives: one collective's time from measured bus bandwidth (nccl-tests' convention) and the
cluster file's sourced figures. Pure arithmetic, no process."""
from __future__ import annotations

import json
import math

import pytest

from labkit.comm.ops import OPS
from labkit.scale.cluster import CLUSTER_DIR, RING_BASE_US, ClusterError, load_cluster
from labkit.scale.collectives import BUS_FACTOR, collective_time, ring_link, ring_time, steps

H100 = load_cluster("h100-sxm")


def test_node_busbw_prices_a_kind_without_a_curve():
    """node_busbw_gbytes_per_s, nccl-tests' large-message all-reduce figure (h100-sxm.json 460 GB/s, a100-sxm.json
    230), is the level's link; a kind with no curve of its own (the A100's all-to-all) is priced at it, with the
    ring's latency steps: busbw = wire / (time - 7 alpha) is the figure, and the latency is under 0.2% at 8 GiB."""
    assert H100.link("node")[1] == 460e9
    a100 = load_cluster("a100-sxm")
    size = 8 * 2**30
    wire, t = collective_time("all_to_all", size, 8, "node", a100)
    alpha, beta = a100.link("node", "all_to_all", size)
    assert beta == 230e9 and alpha == 3e-6
    assert wire == pytest.approx(7 / 8 * size)
    assert wire / (t - 7 * alpha) == pytest.approx(230e9, rel=1e-12)
    assert wire / t == pytest.approx(230e9, rel=2e-3)


@pytest.mark.parametrize("name, gbps", [("a100-sxm", 24), ("h100-sxm", 46), ("h100-grand-teton", 46), ("h200-sxm", 46)])
def test_network_busbw_reproduces_nccls_per_nic_figure(name, gbps):
    """Across nodes a GPU's collectives move what its NIC does in nccl-tests: 24 GB/s per 200 Gb/s HDR NIC, 46 GB/s
    (the low end of 46-48) per 400 Gb/s NIC, NCCL's maintainers' figures in the cluster files, not the line rate
    (25, 50). An 8 GiB all-gather over 16 nodes: busbw = wire / (time - 15 alpha) is the figure. Planted (checked
    when written): the line rate, network_gbits_per_s / 8, fails here. alpha: NCCL's base per collective and the
    network's latency at each of the 15 crossings (Cluster.ring_step_latency)."""
    cluster = load_cluster(name)
    assert cluster.link("network")[1] == gbps * 1e9 < cluster.network_gbits_per_s / 8 * 1e9
    wire, t = collective_time("all_gather", 8 * 2**30, 16, "network", cluster)
    alpha = ring_link(cluster, "network", "all_gather", 8 * 2**30, 16)[0]  # NCCL's ring latency, one rank a node
    assert alpha * 15 == pytest.approx(RING_BASE_US * 1e-6 + 15 * cluster.link("network")[0])
    assert wire / (t - 15 * alpha) == pytest.approx(gbps * 1e9, rel=1e-12)


def test_eight_rails_reproduce_nvidias_aggregate_across_h100_nodes():
    """A ring collective whose group holds all 8 GPUs of each node crosses between nodes on all 8 NICs (NCCL's
    channels): 8 x 46 = 368 GB/s of bus bandwidth for an 8 GiB all-reduce across nodes. NVIDIA's figure for CX7
    nodes: 'around 48GB/s from each CX7 NIC at 400Gbps ... aggregated to achieve up to ~396GB/s with the RING
    protocol' (nccl-tests #319); measured on 4 HGX nodes, 32 GPU-NIC pairs, 365.84 GB/s (nccl-tests #309).
    Planted (checked when written): one NIC's 46 GB/s, the rate before the rails, is 8x off both."""
    beta = H100.link("network", "all_reduce", 8 * 2**30, 32, per_node=8)[1]
    assert beta == pytest.approx(8 * 46e9)
    assert beta <= 396e9 and beta == pytest.approx(365.84e9, rel=0.01)


@pytest.mark.parametrize("per_node", [1, 2, 4, 8])
def test_ring_collectives_spread_over_the_groups_nics_up_to_the_node(per_node):
    """k ranks of a group in each node: its all-gathers, reduce-scatters and all-reduces cross on k NICs, never faster
    than the same collective inside the node (the H100 all-gather curve: 362 GB/s at 8 GiB, under 8 x 46); an
    all-to-all or a send moves each rank's own bytes out through its own NIC: one NIC's, whatever k."""
    size, n = 8 * 2**30, 64
    node_ag = H100.link("node", "all_gather", size, n)[1]
    assert H100.link("network", "all_gather", size, n, per_node)[1] == pytest.approx(min(per_node * 46e9, node_ag))
    assert H100.link("network", "reduce_scatter", size, n, per_node)[1] == pytest.approx(min(per_node * 46e9, node_ag))
    for kind in ("all_to_all", "send"):
        assert H100.link("network", kind, size, n, per_node)[1] == 46e9
    assert H100.link("network", "all_gather", size, n, 8)[1] == node_ag < 8 * 46e9


def test_a_groups_ranks_per_node_follow_the_mesh():
    """Layout.ranks_per_node counts one group's ranks in a node (mesh order dp, pp, cp, tp, innermost last): FSDP
    over all 128 GPUs has 8 in each node; behind tp 8 the dp group has one; dp x cp behind tp 2 has 4; a tp 8 group
    on nodes of 4 has 4; EP borrowed from cp (stride tp) then dp."""
    from labkit.scale.layout import Layout
    assert Layout(dp=128).ranks_per_node("dpcp", 8) == 8
    assert Layout(dp=32, tp=8).ranks_per_node("dpcp", 8) == 1
    assert Layout(dp=16, cp=2, tp=2).ranks_per_node("dpcp", 8) == 4
    assert Layout(dp=8, pp=4, tp=4).ranks_per_node("dpcp", 8) == 1 and Layout(dp=8, pp=4, tp=4).ranks_per_node("pp", 8) == 2
    assert Layout(dp=32, tp=8).ranks_per_node("tp", 4) == 4
    assert Layout(dp=16, cp=4, tp=2, ep=8).ranks_per_node("ep", 8) == 4  # cp's 4 (stride 2), then dp's (stride 8)


@pytest.mark.parametrize("value, message", [
    (368, r"network_busbw_gbytes_per_s=368 is above the NIC's line rate, network_gbits_per_s / 8 = 50 GB/s.*Gb/s"),
    (46000, r"network_busbw_gbytes_per_s=46000 is outside 5..5000 \(a unit off by 1,000\?\)"),
])
def test_network_busbw_in_the_wrong_unit_is_named(value, message):
    """46 GB/s written as 368 (Gb/s) is in any plausible range, but above what the NIC's line rate allows: named
    with the unit; in MB/s, the range catches it."""
    values = json.loads((CLUSTER_DIR / "h100-sxm.json").read_text())
    with pytest.raises(ClusterError, match=message):
        load_cluster(dict(values, network_busbw_gbytes_per_s=value))


def test_bus_factors_are_the_closed_forms_of_the_comm_layer():
    """nccl-tests' bus factors, read from labkit.comm's op table: all-reduce 2(n-1)/n, the ring ops (n-1)/n, send 1."""
    for n in (2, 8, 64):
        assert BUS_FACTOR["all_reduce"](n) == pytest.approx(2 * (n - 1) / n)
        for kind in ("all_gather", "reduce_scatter", "all_to_all"):
            assert BUS_FACTOR[kind](n) == pytest.approx((n - 1) / n)
        assert BUS_FACTOR["send"](n) == 1.0
    assert OPS["all_reduce"].bus_factor(8) == BUS_FACTOR["all_reduce"](8)


def test_steps_are_nccls_rings_and_a_ring_across_nodes_takes_its_latency_model():
    """Every kind is NCCL's ring: all-reduce 2(n-1) steps, all-gather n-1, send 1, one rank 0, at either level.
    Across nodes a ring's alpha is NCCL's own latency model (Cluster.ring_step_latency), so collective_time is the
    cost model's price of a call (traffic.call_seconds): one model of a collective in the lab. Planted (checked when
    written): NCCL's tree, 2 ceil(log2 64) = 12 steps at the network's latency, is 1.5 ms short of the ring here."""
    from labkit.scale.layout import Layout
    from labkit.scale.traffic import call_seconds

    assert steps("all_reduce", 8) == 14 and steps("all_reduce", 64) == 126
    assert steps("all_gather", 8) == 7 and steps("send", 2) == 1 and steps("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="kind='all_reduse'"):
        steps("all_reduse", 8)
    beta = H100.link("network")[1]
    _, t = collective_time("all_reduce", 1e6, 64, "network", H100)
    latency = (8.4 + 126 * 14) * 1e-6  # one rank a node: each of the 126 steps crosses (min(126, 2 x 64 nodes))
    assert t == pytest.approx(latency + 2 * 63 / 64 * 1e6 / beta)
    assert t - (12 * H100.link("network")[0] + 2 * 63 / 64 * 1e6 / beta) > 1.5e-3
    lay = Layout(dp=64, zero="dp")  # 8 nodes of 8 ranks: the cost model's price of the same call
    eight = collective_time("all_reduce", 1e6, 64, "network", H100, per_node=8)[1]
    assert call_seconds(lay, H100, "dp", "all_reduce", 1e6, 64)[1] == pytest.approx(eight) and eight < t


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
    over 8 ranks timed by collective_time has busbw = wire / time = the row's figure (within the curve's sizes the
    measurement holds the latency: none is added). The all-gather reads the same curve (the file's source: one
    figure for every kind NVLink SHARP does not speed up); the all-reduce has its own, faster one. Planted (checked
    when written): the all-reduce's 460 for every kind fails the first assertion at every row."""
    for cluster in (H100, load_cluster("h100-grand-teton"), load_cluster("h200-sxm")):
        for size, gbps in RS_1047:
            assert cluster.link("node", "reduce_scatter", size) == (0.0, gbps * 1e9)
            assert cluster.link("node", "all_gather", size)[1] == gbps * 1e9
            wire, t = collective_time("reduce_scatter", size, 8, "node", cluster)
            assert wire / t == pytest.approx(gbps * 1e9, rel=1e-12)
        assert cluster.link("node", "all_reduce", 2**30)[1] == 463.58e9 > cluster.link("node", "all_gather", 2**30)[1]
        assert cluster.link("node", "all_to_all", 2**30)[1] == cluster.link("node", "send", 1e3)[1] == 370e9
        assert cluster.link("network", "reduce_scatter", 2**30) == cluster.link("network")  # no figure: the NIC's


# stas00/ml-engineering network/README.md, 'Real network throughput': all-reduce busbw (GB/s) on one node of 8, at
# 32 KiB, 64 KiB, ... 16 GiB. A100 (NVLink 3): nccl-tests all_reduce_perf; H200 (NVLink 4, SHARP): all_reduce_bench.py
AR_A100 = (1.31, 2.45, 4.43, 7.47, 11.41, 18.00, 36.18, 72.33, 109.93, 106.16, 138.49, 171.54, 176.92, 194.07, 222.72,
           229.04, 231.41, 233.88, 234.61, 234.89)
AR_H200 = (1.44, 2.93, 5.73, 11.74, 23.94, 39.93, 64.53, 107.16, 155.53, 219.89, 275.84, 346.51, 401.93, 436.15, 450.29,
           463.58, 469.17, 473.10, 477.45, 482.26)


@pytest.mark.parametrize("name, kinds, figures", [
    ("a100-sxm", ("all_reduce", "all_gather", "reduce_scatter"), AR_A100),
    ("h200-sxm", ("all_reduce",), AR_H200),
    ("h100-sxm", ("all_reduce",), AR_H200),
    ("h100-grand-teton", ("all_reduce",), AR_H200),
])
def test_all_reduce_curves_reproduce_the_cited_sweeps_latency_included(name, kinds, figures):
    """Every row of the cited sweep, exactly, 32 KiB to 16 GiB: the kind's busbw at the row's size, and an 8-rank
    all-reduce of that size timed by collective_time has busbw = wire / time = the row's figure. The A100's
    all-gather and reduce-scatter read the same curve (a ring's equal bytes per step, the file's derivation); the
    H100 nodes take the H200's (the same NVLink 4 fabric, the file's stated transfer). Planted (checked when
    written): adding the ring's 14 latency steps on top of a measured row, as before this curve, gives 0.67 GB/s
    for the A100's 1.31 at 32 KiB, and fails at every row."""
    cluster = load_cluster(name)
    for k, gbps in enumerate(figures):
        size = 2 ** (15 + k)
        for kind in kinds:
            assert cluster.link("node", kind, size) == (0.0, gbps * 1e9)
        wire, t = collective_time("all_reduce", size, 8, "node", cluster)
        assert wire / t == pytest.approx(gbps * 1e9, rel=1e-12)


def test_nvlink_latency_is_the_measured_sweeps_smallest_all_reduce():
    """nvlink_latency_us (3 us) is derived from the cited sweeps' smallest row: 14 ring steps at it, plus the wire bytes
    at the curve's large end, give 42.2 us for an 8-GPU all-reduce of 32 KiB, where the A100 measured 43.83 us and the
    H200 40.0 us (32 KiB at 0.82 GB/s). Within 6% of both, the rounding of one figure to one digit."""
    for name, measured_us, top in (("a100-sxm", 43.83, 234.89e9), ("h200-sxm", 32768 / 0.82e9 * 1e6, 482.26e9)):
        cluster = load_cluster(name)
        alpha = cluster.link("node")[0]
        assert alpha == 3e-6
        modelled_us = (14 * alpha + 2 * 7 / 8 * 32768 / top) * 1e6
        assert modelled_us == pytest.approx(measured_us, rel=0.06)


def test_a_smaller_group_reads_the_node_curve_at_the_same_per_step_chunk():
    """A node's curve is measured over all 8 GPUs; a group of n reads it at S x 8 / n. Exact for a ring: with a curve
    made by the alpha-beta ring itself on 8 ranks (busbw = c / (a + c / B), c = S / 8), a 4-rank all-reduce of S timed
    from it equals the 4-rank ring's own 2 (n-1) (a + S / (n B)), at every size whose 2 S is a row. A send moves its
    whole message whatever the group. Planted (checked when written): reading the curve at S itself fails here."""
    a, B = 3e-6, 230e9
    sizes = [2**k for k in range(16, 34)]
    curve = [[S, (S / 8) / (a + S / 8 / B) / 1e9] for S in sizes]
    values = json.loads((CLUSTER_DIR / "a100-sxm.json").read_text())
    cluster = load_cluster(dict(values, busbw_by_kind={"node": {"all_reduce": curve, "send": curve}}))
    for S in sizes[:-1]:
        for n in (2, 4):
            if S * 8 // n not in sizes:
                continue
            _, t = collective_time("all_reduce", S, n, "node", cluster)
            assert t == pytest.approx(2 * (n - 1) * (a + S / (n * B)), rel=1e-12)
        assert cluster.link("node", "send", S, 4)[1] == cluster.link("node", "send", S)[1]


def test_megatron_tp4_reads_the_a100_curve_at_twice_its_size():
    """Megatron-LM's 7.5B at tp 4 all-reduces a 2 x 2,048 x 4,096-byte activation (16 MiB) among 4 GPUs: the ring's
    chunk is S / 4, which the 8-GPU sweep moves at 32 MiB, so its busbw is the 32 MiB row's 138.49 GB/s, not the
    16 MiB row's 106.16."""
    a100 = load_cluster("a100-sxm")
    act = 2 * 2048 * 4096
    assert act == 2**24
    assert a100.link("node", "all_reduce", act, 4) == (0.0, 138.49e9)
    assert a100.link("node", "all_reduce", act, 8) == (0.0, 106.16e9)


def test_latency_is_added_outside_a_measured_curve_only():
    """Below a curve's first size (H100's reduce-scatter curve starts at 128 MiB) the first row's figure is held and
    the ring's 7 latency steps are added: the measurement does not cover that size; within it, none."""
    alpha = H100.link("node")[0]
    wire, t = collective_time("reduce_scatter", 2**24, 8, "node", H100)
    assert t == pytest.approx(7 * alpha + wire / 311.34e9, rel=1e-12)
    wire, t = collective_time("reduce_scatter", 2**27, 8, "node", H100)
    assert t == pytest.approx(wire / 311.34e9, rel=1e-12)


def test_megatron_tp_all_reduce_reads_the_a100_curve_at_its_own_size():
    """Megatron-LM's 175B at tp 8 without SP all-reduces a 2 x 2,048 x 12,288-byte activation (48 MiB) four times a
    block and micro-batch (and twice more recomputed): each at the A100 curve between its 32 MiB and 64 MiB rows,
    138.49 + (171.54 - 138.49) log2(1.5) = 157.82 GB/s, not the 230 of its large end (46% longer)."""
    from labkit.scale.cost import predict
    from labkit.scale.layout import Layout
    from labkit.scale.specs import MODELS

    a100 = load_cluster("a100-sxm")
    spec = MODELS["175b"]
    act = 2 * 2048 * spec.d_model
    assert act == 48 * 2**20
    beta = a100.link("node", "all_reduce", act)[1]
    assert beta == pytest.approx((138.49 + (171.54 - 138.49) * math.log2(1.5)) * 1e9, rel=1e-12)
    p = predict(spec, Layout(dp=1, pp=12, tp=8, zero="dp", recompute="full", sequence_parallel=False), a100, 96, 2048,
                efficiency=None)
    tp = p.traffic["tp"]
    assert tp["seconds"] == pytest.approx(tp["count"] * 2 * 7 / 8 * act / beta, rel=1e-12)


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
    assert H100.fastest_busbw("node") == 482.26e9
    # across nodes the fastest a ring gets is all 8 rails (Cluster.link's per_node), under the node's own fastest
    assert H100.fastest_busbw("network") == 8 * H100.link("network")[1] == 368e9


def test_tp_collectives_on_h100_take_the_reduce_scatter_curve():
    """Llama 3 70B, tp 8, one micro-batch of 8,192 tokens (SP): each all-gather and reduce-scatter moves a 128 MiB
    activation (2 x 8192 x 8192 bytes), so the block's TP time is the count x (7 alpha + 7/8 x 128 MiB / 311.34 GB/s),
    where the all-reduce's figure, 460 GB/s, made its bandwidth term 32% shorter (128 MiB is the curve's first row:
    the measurement holds the latency, none is added). Planted (checked when written): that figure for every kind
    fails here."""
    from labkit.scale.cost import predict
    from labkit.scale.layout import Layout
    from labkit.scale.specs import LLAMA3

    spec = LLAMA3["70b"]
    p = predict(spec, Layout(dp=4, tp=8, recompute="none"), H100, 4, 8192, efficiency=None)
    act = 2 * 8192 * spec.d_model
    assert act == 2**27
    tp = p.traffic["tp"]
    assert tp["seconds"] == pytest.approx(tp["count"] * 7 / 8 * act / 311.34e9, rel=1e-12)


@pytest.mark.parametrize("figure, message", [
    ({"node": {"reduce_scatter": [[2**27, 311340.0]]}}, r"311340 at 1.34218e\+08 bytes is outside 5..5000 \(a unit off by 1,000\?\).*GB/s"),
    ({"node": {"reduce_scatter": [[2**28, 330.0], [2**27, 311.0]]}}, "the sizes must increase, in bytes"),
    ({"node": {"allgather": 370}}, "'allgather' is not a collective kind the model times"),
    ({"rack": {"all_gather": 370}}, "the levels are 'node' and 'network'"),
    ({"node": {"all_gather": [[2**27]]}}, r"must be a number \(GB/s\) or a list of \[bytes, GB/s\] pairs"),
    ({"node": {"all_gather": 0.37}}, r"0.37 at 0 bytes is outside 5..5000 \(a unit off by 1,000\?\)"),
    ({"node": {"all_reduce": [[2**15, 1310.0], [2**34, 234890.0]]}}, r"234890 at 1.71799e\+10 bytes is outside 5..5000 "
                                                                      r"\(a unit off by 1,000\?\)"),
    ({"node": {"all_reduce": [[2**15, 0.0], [2**34, 234.89]]}}, "every busbw must be positive"),
])
def test_busbw_by_kind_bad_input_is_named(figure, message):
    """A busbw figure in MB/s or TB/s (a curve's unit is checked at its large end: 1.31 GB/s at 32 KiB is real), sizes
    out of order, a zero, a misspelt kind or level, a malformed point: each ClusterError names the level and kind, and
    the fix."""
    values = json.loads((CLUSTER_DIR / "h100-sxm.json").read_text())
    with pytest.raises(ClusterError, match=message):
        load_cluster(dict(values, busbw_by_kind=figure))


def test_a_ring_across_nodes_pays_nccls_latency_model_once_per_call():
    """NCCL's own tuner (src/graph/tuning.cc, Ring/Simple): a base of 8.4 us per collective, then each step at its
    hop's latency, the node crossings at the network's (nodes - 1 of an all-gather's n - 1 steps; 2 x nodes of an
    all-reduce's 2 (n - 1)), the rest over NVLink (Cluster.ring_step_latency, its mean per step). 512 ranks, 8 to
    a node: 8.4 + 448 x 3 + 63 x 14 = 2,234 us, where the network's latency on every step would be 7,154 us. The
    cost model (collectives.ring_link, in every call) uses it for ring kinds across nodes and no curve, and a count
    that folds FSDP's block-by-block calls pays it once a call: 32 blocks, 32 latencies. Planted (checked when written): the old rule,
    one latency for the folded call, is 31 x 2.2 ms short."""
    from labkit.scale.layout import Layout
    from labkit.scale.traffic import call_seconds

    a = H100.ring_step_latency("all_gather", 512, 8)
    assert a * 511 == pytest.approx((8.4 + 448 * 3 + 63 * 14) * 1e-6)
    assert H100.ring_step_latency("reduce_scatter", 512, 8) == a
    ar = H100.ring_step_latency("all_reduce", 512, 8)
    assert ar * 2 * 511 == pytest.approx((8.4 + (1022 - 128) * 3 + 128 * 14) * 1e-6)
    one_per_node = H100.ring_step_latency("all_gather", 16, 1)  # every step a crossing
    assert one_per_node * 15 == pytest.approx((8.4 + 15 * 14) * 1e-6)
    assert ring_link(H100, "network", "all_gather", 1e8, 512, 8)[0] == a
    assert ring_link(H100, "network", "send", 1e8, 2, 8)[0] == H100.network_latency_us * 1e-6  # not a ring
    assert ring_link(H100, "node", "all_to_all", 1e8, 8, 8) == H100.link("node", "all_to_all", 1e8, 8, 8)
    lay, block = Layout(dp=512, zero="zero3"), 2e8
    sent, secs = call_seconds(lay, H100, "dp", "all_gather", 32 * block, 512, message=block)
    one_sent, one = ring_time("all_gather", block, 512, *ring_link(H100, "network", "all_gather", block, 512, 8))
    assert sent == pytest.approx(32 * one_sent) and secs == pytest.approx(32 * one)
    assert secs - call_seconds(lay, H100, "dp", "all_gather", 32 * block, 512)[1] > 31 * 2.2e-3
