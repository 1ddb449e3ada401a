"""labkit.scale's place for the layouts of issue 35: HSDP (dp_replicate), the context-parallel methods
(cp_method) and EP's two-micro-batch overlap (ep_overlap), in the checks, the traffic, the step time and
the memory (notebook 15).

Each figure is set against a closed form written here, from the lab's own measured forms
(labkit.scale.traffic.cp_attention_bytes and hsdp_traffic are tested against labkit.comm's counts of the
running code in tests/test_cp_given_methods.py and tests/test_hsdp_checks.py). Arithmetic only: under a second.
"""
import math

import pytest
from labkit.measure.memory import memory_per_rank
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict, step_time
from labkit.scale.footprint import block_activation_bytes, peak_memory
from labkit.scale.layout import Layout, LayoutError, check_layout
from labkit.scale.specs import LLAMA3, ModelSpec
from labkit.scale.traffic import CP_METHODS, cp_attention_bytes, cp_layer_traffic

H100 = load_cluster("h100-sxm")
MOE = ModelSpec("small-moe", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4, hidden_dim=8192,
                vocab_size=32000, n_experts=8, top_k=2)


# --- bad input: LayoutError before any arithmetic, naming the fix ----------------------------

@pytest.mark.parametrize("model,layout,gpus,match", [
    (LLAMA3["8b"], Layout(dp=8, dp_replicate=3), 8, r"dp_replicate=3 does not divide dp=8: .*one of \[1, 2, 4, 8\]"),
    (LLAMA3["8b"], Layout(dp=16, dp_replicate=2, zero="dp"), 16, r"with zero='dp'.*use zero='zero1'"),
    (LLAMA3["8b"], Layout(dp=1, cp=16, tp=4, cp_method="ulysses"), 64,
     r"ulysses' with cp=16: llama3-8b's 8 heads per tp rank \(tp=4\) do not split over 16"),
    (LLAMA3["8b"], Layout(dp=1, cp=8, tp=2, cp_method="hybrid"), 16, None),  # 4 per node, 16 heads: fine
    (ModelSpec("h12", d_model=1536, n_layers=4, n_heads=12, n_kv_heads=4, hidden_dim=4096, vocab_size=1000),
     Layout(dp=1, cp=16, tp=1, cp_method="hybrid"), 16, r"hybrid' with 8 cp ranks per node: h12's 12 heads"),
    (LLAMA3["8b"], Layout(dp=1, cp=16, cp_method="hybrid"), 16, None),  # 8 per node, 32 heads: fine
    (LLAMA3["8b"], Layout(dp=1, cp=8, tp=1, cp_method="hybrid"), 8, r"so the hybrid would be Ulysses alone"),
    (LLAMA3["8b"], Layout(dp=1, cp=8, tp=8, cp_method="hybrid"), 64, r"the ring alone: use cp_method='ring'"),
    (LLAMA3["8b"], Layout(dp=1, cp=2, cp_method="tree"), 2, r"cp_method='tree': choose one of"),
    (MOE, Layout(dp=16, dp_replicate=4, ep=8, zero="zero3"), 16,
     r"ep=8 borrows its ranks from dp_shard x cp x tp = 4 x 1 x 1 = 4 \(inside a replica, dp_replicate=4\): it must "
     r"divide 4; the ep that work here \(dividing it and the 8 experts\): \[1, 2, 4\]"),
    (MOE, Layout(dp=2, tp=2, ep=8), 4,
     r"ep=8 borrows its ranks from dp x cp x tp = 2 x 1 x 2 = 4: it must divide 4; the ep that work here .*\[1, 2, 4\]"),
    (MOE, Layout(dp=2, tp=2, ep=4), 4, None),  # folded over tp: 4 divides dp x cp x tp
    (MOE, Layout(dp=2, tp=2, ep=4, sequence_parallel=False), 4, r"folded over tp .* use sequence_parallel=True"),
    (MOE, Layout(dp=16, ep=1, ep_overlap=True), 16, r"ep_overlap=True with ep=1"),
    (LLAMA3["8b"], Layout(dp=8, zero="zero2", zero3_unit="module"), 8, r"zero3_unit='module' with zero='zero2'.*needs zero='zero3'"),
    (LLAMA3["8b"], Layout(dp=8, zero3_unit="layer"), 8, r"zero3_unit='layer' .*one of \('block', 'module', 'flat'\)"),
    (LLAMA3["8b"], Layout(dp=8, zero="dp", zero3_unit="flat"), 8, r"zero3_unit='flat' with zero='dp'.*'flat' \(FSDP1\)"),
    (LLAMA3["8b"], Layout(dp=8, zero="zero2", zero3_unit="flat"), 8, None),  # FSDP1's SHARD_GRAD_OP
    (LLAMA3["8b"], Layout(dp=4, pp=2, zero="zero3", zero3_unit="flat"), 8,
     r"zero3_unit='flat' \(FSDP1\) with pp=2, ep=1.*zero3_unit='block' \(FSDP2\)"),
    (LLAMA3["8b"], Layout(dp=4, pp=2, zero="zero3", zero3_unit="module"), 8,
     r"zero3_unit='module' \(DeepSpeed's ZeRO-3 of 2021.*pp=2.*use pp = dp_replicate = ep = 1"),
])
def test_new_layout_choices_refused_with_the_fix(model, layout, gpus, match):
    args = (model, layout, gpus, 8, 64, 8192)
    if match is None:
        check_layout(*args)
        return
    with pytest.raises(LayoutError, match=match):
        check_layout(*args)


# --- context parallelism by method ------------------------------------------------------------

@pytest.mark.parametrize("method", CP_METHODS)
@pytest.mark.parametrize("cp,local", [(2, 1), (4, 2), (8, 2), (8, 4), (16, 8)])
def test_cp_layer_traffic_adds_up_to_the_measured_closed_form(method, cp, local):
    """Forward + backward of cp_layer_traffic = cp_attention_bytes (the lab's code as labkit.comm counts it).
    Planted: the ring without the home hop of dK, dV (3 (c-1) hops, axis_traffic's old rule) is 2 kv short."""
    q, kv = 3.0, 5.0
    if method == "hybrid" and local in (1, cp):
        return
    parts = cp_layer_traffic(method, cp, q, kv, local)
    sent = sum(p[1] for d in ("forward", "backward") for p in parts[d])
    assert sent == pytest.approx(sum(cp_attention_bytes(method, cp, q, kv, local).values()), rel=1e-15)
    if method == "ring":
        assert sent - 2 * kv * 3 * (cp - 1) == 2 * kv  # the old count missed exactly one K,V pair


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_by_one_all_gather_moves_the_ring_s_bytes_and_hides_behind_its_first_step(cp):
    """Edge case: torch's default K/V rotation (kv_rotation="allgather"): each direction's K/V in one all-gather,
    marked "first" (only the ring's first step hides it), dK/dV still hop by hop (hideable); the bytes are the
    ring's, cp_attention_bytes. step_time hides it behind attention / cp only. Planted: hidden behind all of
    attention, as the hop-by-hop ring, it would expose 0.5 s less below."""
    q, kv = 3.0, 5.0
    parts = cp_layer_traffic("ring", cp, q, kv, rotation="allgather")
    sent = sum(p[1] for d in ("forward", "backward") for p in parts[d])
    assert sent == pytest.approx(sum(cp_attention_bytes("ring", cp, q, kv).values()), rel=1e-15)
    assert [(p[4], p[5]) for p in parts["forward"]] == [("first", "all_gather")]
    assert [(p[4], p[5]) for p in parts["backward"]] == [("first", "all_gather"), (True, "send")]
    assert parts["backward"][1][1] == 2 * kv * cp  # dK, dV: cp hops, home included
    _, got = step_time(10.0, 2.0, {"cp": 3.0}, Layout(cp=4), n_micro=1, layers_per_rank=4, cp_hideable_s=1.0,
                       cp_first_s=1.0)
    assert got["exposed_cp"] == 0.0 + (1.0 - 2.0 / 4) + 1.0  # the hops hidden; the gather behind 1/4; the rest
    with pytest.raises(ValueError, match="rotation='ring'.*p2p, allgather"):
        cp_layer_traffic("ring", cp, q, kv, rotation="ring")


def test_kv_rotation_is_named_in_the_layout_and_checked():
    assert Layout(cp=8, kv_rotation="allgather").short().endswith(" kv-allgather")
    assert Layout(cp=8, cp_method="ulysses", kv_rotation="allgather").short().endswith("cp-ulysses")  # ring only
    with pytest.raises(LayoutError, match=r"kv_rotation='hops'.*\('p2p', 'allgather'\)"):
        check_layout(LLAMA3["8b"], Layout(cp=2, kv_rotation="hops"), 2, 8, 2, 8192)


def test_axis_traffic_prices_the_gather_at_its_own_bus_bandwidth_and_keeps_the_bytes():
    """Edge case: the same layout, its ring's K/V hop by hop or by one all-gather: the same bytes; the gather's
    seconds in "first_step_seconds", only dK/dV's in "hideable_seconds"; across nodes the gather is exposed where
    it outlasts the first step. Planted: the rotation ignored, first_step_seconds stays 0."""
    spec, seq, lay = LLAMA3["8b"], 131072, Layout(cp=16, tp=2)
    hop = predict(spec, lay, H100, 1, seq).traffic["cp"]
    gather = predict(spec, Layout(cp=16, tp=2, kv_rotation="allgather"), H100, 1, seq).traffic["cp"]
    assert gather["bytes"] == pytest.approx(hop["bytes"], rel=1e-12) and hop["first_step_seconds"] == 0
    assert gather["first_step_seconds"] > 0
    assert gather["hideable_seconds"] + gather["first_step_seconds"] == pytest.approx(gather["seconds"], rel=1e-12)


def layer_bytes(model, layout, seq, mb=1):
    """axis_traffic's cp bytes per layer and micro-batch, written out: q = T d / tp, kv = T d_kv / tp values
    (bf16), T = mb s / cp; Ulysses' K/V heads replicated to lcm(n_kv / tp, cp)."""
    T = mb * seq // layout.cp
    hd = model.d_model // model.n_heads
    kv_heads = model.n_kv_heads // layout.tp
    if layout.cp_method == "ulysses":
        kv_heads = math.lcm(kv_heads, layout.cp)
    local = layout.cp_local(H100.gpus_per_node)
    if layout.cp_method == "hybrid":
        kv_heads = math.lcm(kv_heads, local)
    return sum(cp_attention_bytes(layout.cp_method, layout.cp, 2 * T * model.d_model / layout.tp,
                                  2 * T * hd * kv_heads, local).values())


@pytest.mark.parametrize("method", CP_METHODS)
def test_predict_cp_bytes_per_method_equal_closed_form(method):
    spec, seq = LLAMA3["8b"], 131072
    lay = Layout(dp=1, cp=16, tp=2, cp_method=method, recompute="selective")
    p = predict(spec, lay, H100, 1, seq)
    assert p.traffic["cp"]["bytes"] == pytest.approx(spec.n_layers * layer_bytes(spec, lay, seq), rel=1e-12)


def test_gqa_ulysses_replicates_kv_heads_beyond_n_kv_per_tp_rank():
    """Llama 3 8B: 8 K/V heads, tp 4 -> 2 per rank; Ulysses over cp 8 replicates them to 8: 4x the K/V bytes."""
    spec, seq = LLAMA3["8b"], 65536
    ring = predict(spec, Layout(cp=8, tp=4, cp_method="allgather"), H100, 1, seq)
    uly = predict(spec, Layout(cp=8, tp=4, cp_method="ulysses"), H100, 1, seq)
    T = seq // 8
    q, kv = 2 * T * 4096 / 4, 2 * T * 128 * 2
    assert uly.traffic["cp"]["bytes"] == pytest.approx(32 * 4 * (q + 4 * kv) * 7 / 8, rel=1e-12)
    assert ring.traffic["cp"]["bytes"] == pytest.approx(32 * 4 * kv * 7, rel=1e-12)


def test_full_recompute_repeats_the_forward_cp_traffic():
    spec, seq = LLAMA3["8b"], 65536
    for method in ("ring", "allgather", "ulysses"):
        sel = predict(spec, Layout(cp=8, cp_method=method, recompute="selective"), H100, 1, seq).traffic["cp"]
        full = predict(spec, Layout(cp=8, cp_method=method, recompute="full"), H100, 1, seq).traffic["cp"]
        fwd = {"ring": 7 / 22, "allgather": 1 / 2, "ulysses": 1 / 2}[method]  # forward's share of a layer's bytes
        assert full["bytes"] == pytest.approx(sel["bytes"] * (1 + fwd), rel=1e-12)


def test_cp_exposure_ring_hides_behind_attention_collectives_do_not():
    """step_time: the ring's part overlaps attention, the rest is paid. Planted: treating every method's
    time as hideable (the old rule) gives 0 exposed for the all-gather below, not 2."""
    lay = Layout(cp=2)
    _, parts = step_time(10.0, 2.0, {"cp": 3.0}, lay, n_micro=1, layers_per_rank=4, cp_hideable_s=1.0)
    assert parts["exposed_cp"] == 2.0  # 2 s of collectives + max(0, 1 - 2)
    _, parts = step_time(10.0, 2.0, {"cp": 3.0}, lay, n_micro=1, layers_per_rank=4, cp_hideable_s=3.0)
    assert parts["exposed_cp"] == 1.0  # the ring alone: max(0, 3 - 2)
    spec, seq = LLAMA3["8b"], 131072
    for method in ("allgather", "ulysses"):
        p = predict(spec, Layout(cp=16, tp=2, cp_method=method), H100, 1, seq)
        assert p.traffic["cp"]["hideable_seconds"] == 0 and p.parts_s["exposed_cp"] == p.traffic["cp"]["seconds"]
    ring = predict(spec, Layout(cp=16, tp=2), H100, 1, seq)
    assert ring.traffic["cp"]["hideable_seconds"] == ring.traffic["cp"]["seconds"]


def test_cp_memory_allgather_holds_every_k_v_ulysses_the_ring_s_count():
    spec, seq, b = LLAMA3["8b"], 65536, 1
    ring = block_activation_bytes(spec, Layout(cp=8, tp=2, recompute="none"), b, seq)["saved"]
    ag = block_activation_bytes(spec, Layout(cp=8, tp=2, recompute="none", cp_method="allgather"), b, seq)["saved"]
    uly = block_activation_bytes(spec, Layout(cp=8, tp=2, recompute="none", cp_method="ulysses"), b, seq)["saved"]
    s, dkv = seq // 8, spec.kv_dim
    assert ag - ring == 2 * (2 * b * 7 * s * dkv / 2)  # bf16 x the other 7 ranks' K and V of this tp rank's heads
    # Ulysses: 4 K/V heads per tp rank replicated to lcm(4, 8) = 8: twice the ring's k, v
    assert uly - ring == 2 * (2 * b * s * dkv / 2)
    uly4 = block_activation_bytes(spec, Layout(cp=4, tp=2, recompute="none", cp_method="ulysses"), b, seq)["saved"]
    assert uly4 == block_activation_bytes(spec, Layout(cp=4, tp=2, recompute="none"), b, seq)["saved"]


# --- HSDP -------------------------------------------------------------------------------------

def test_hsdp_dp_traffic_by_level_equals_closed_form():
    """Llama 3 8B, 64 GPUs (8 nodes), dp 64 = 8 replicas x 8 shards, ZeRO-3: per GPU, P parameters,
    shard (NVLink): (S-1)/S (2 + 2 + 4) P; replica (network): 2 (R-1)/R 4 P / S. Planted: the flat rule
    (R = 1) sends (W-1)/W 8 P, all on the network: the assertions on both levels fail for it. Planted (checked when
    written): each call's bus bandwidth read at the whole model's bytes, not one block's, fails the seconds."""
    spec = LLAMA3["8b"]
    P = spec.n_params  # dp only: every GPU holds the whole model before sharding
    R, S = 8, 8
    p = predict(spec, Layout(dp=64, dp_replicate=R, zero="zero3"), H100, 64, 8192)
    dp = p.traffic["dp"]
    assert dp["shard_bytes"] == pytest.approx((S - 1) / S * 8 * P, rel=1e-12)
    assert dp["replica_bytes"] == pytest.approx(2 * (R - 1) / R * 4 * P / S, rel=1e-12)
    flat = predict(spec, Layout(dp=64, zero="zero3"), H100, 64, 8192).traffic["dp"]
    assert flat["bytes"] == pytest.approx(63 / 64 * 8 * P, rel=1e-12) and "replica_bytes" not in flat
    # the shard group's all-gathers and reduce-scatter at their own bus bandwidth, read at one block's size (FSDP goes
    # block by block: 2 P / L and 4 P / L bytes, on H100's curve between its 256 MiB and 1 GiB rows), the replicas'
    # all-reduce at the NIC's
    L = spec.n_layers
    (a_n, b_ag), (_, b_rs) = H100.link("node", "all_gather", 2 * P / L), H100.link("node", "reduce_scatter", 4 * P / L)
    _, b_x = H100.link("network", "all_reduce", 4 * P / S / L)
    assert 330.94e9 < b_ag < b_rs < 349.36e9
    # every block's call pays its own latency (L calls of each); across nodes a step's latency by NCCL's model
    # (Cluster.ring_step_latency): the replicas' all-reduce crosses a node at each of its 2 (R - 1) steps
    a_x = H100.ring_step_latency("all_reduce", R, 1)
    assert a_x == pytest.approx((8.4 + 2 * (R - 1) * 14) * 1e-6 / (2 * (R - 1)))
    seconds = ((2 * L * 7 * a_n + 2 * (S - 1) / S * 2 * P / b_ag) + (L * 7 * a_n + (S - 1) / S * 4 * P / b_rs)
               + (L * 2 * (R - 1) * a_x + 2 * (R - 1) / R * 4 * P / S / b_x))
    assert dp["seconds"] == pytest.approx(seconds, rel=1e-12)
    # flat FSDP's rings hold all 8 GPUs of each node: they cross between nodes on all 8 NICs (NCCL's channels,
    # Cluster.link's per_node), capped by the node's own curve: per NIC no more bytes than the replicas' all-reduce,
    # so on these nodes HSDP saves no network time (it pays its NVLink phase on top). Planted (checked when written):
    # one NIC's 46 GB/s for the flat rings, the rate before the rails were counted, makes flat 6x slower than HSDP.
    (_, f_ag), (_, f_rs) = (H100.link("network", k, b / L, 64, per_node=8) for k, b in
                            (("all_gather", 2 * P), ("reduce_scatter", 4 * P)))
    assert f_ag == H100.link("node", "all_gather", 2 * P / L, 64)[1] < 8 * 46e9  # the node's curve caps the rails
    # the flat ring's 63 steps: 7 node crossings at the network's 14 us, 56 over NVLink at 3 us, and NCCL's base
    a_f = H100.ring_step_latency("all_gather", 64, 8)
    assert a_f == pytest.approx((8.4 + 56 * 3 + 7 * 14) * 1e-6 / 63)
    flat_seconds = 2 * (L * 63 * a_f + 63 / 64 * 2 * P / f_ag) + (L * 63 * a_f + 63 / 64 * 4 * P / f_rs)
    assert flat["seconds"] == pytest.approx(flat_seconds, rel=1e-12)
    assert flat["seconds"] < dp["seconds"]


def test_hsdp_shards_states_over_dp_shard_times_cp_only():
    spec = LLAMA3["8b"]
    lay = Layout(dp=32, dp_replicate=4, cp=2, zero="zero3")
    mem = peak_memory(spec, lay, n_micro=1, seq_len=8192)
    want = memory_per_rank(spec.n_params, 8 * 2, "zero3", "fp32")  # dp_shard 8 x cp 2
    assert mem["params"] == want["params"] and mem["optimizer"] == want["optimizer"]
    flat = peak_memory(spec, Layout(dp=32, cp=2, zero="zero3"), n_micro=1, seq_len=8192)
    assert flat["optimizer"] == memory_per_rank(spec.n_params, 64, "zero3", "fp32")["optimizer"]


# --- EP's two-micro-batch overlap ---------------------------------------------------------------

def test_ep_overlap_exposes_what_the_other_half_cannot_hide():
    """Per layer and micro-batch, 4 half all-to-alls each way (t each): 2 exposed, 2 exposed by max(0, t - c)
    (c: a half's experts forward, 2c backward). Same bytes as without, twice the calls. Planted: exposing all
    of it (overlap ignored) or hiding all of it both miss the closed form."""
    lay = Layout(dp=16, ep=8, zero="zero3", micro_batch=1)
    plain = predict(MOE, lay, H100, 16, 4096)
    over = predict(MOE, Layout(dp=16, ep=8, zero="zero3", micro_batch=1, ep_overlap=True), H100, 16, 4096)
    assert over.traffic["ep"]["bytes"] == pytest.approx(plain.traffic["ep"]["bytes"], rel=1e-12)
    assert over.traffic["ep"]["count"] == 2 * plain.traffic["ep"]["count"]
    L, m = MOE.n_layers, over.n_micro
    t = over.traffic["ep"]["seconds"] / (8 * L * m)
    rate = H100.peak_bf16_flops * 0.40
    c = 2 * MOE.top_k * MOE.expert_params * (4096 / 2) / rate  # a half of one sequence, one layer, forward
    want = L * m * (4 * t + 2 * max(0.0, t - c) + 2 * max(0.0, t - 2 * c))
    assert over.parts_s["exposed_ep"] == pytest.approx(want, rel=1e-12)
    assert plain.parts_s["exposed_ep"] == plain.traffic["ep"]["seconds"]
    assert over.step_s < plain.step_s


def test_ep_overlap_with_no_expert_compute_exposes_everything():
    lay = Layout(dp=2, ep=2, ep_overlap=True)
    _, parts = step_time(1.0, 0.0, {"ep": 0.8}, lay, n_micro=2, layers_per_rank=5, experts_s=0.0)
    assert parts["exposed_ep"] == pytest.approx(0.8, rel=1e-15)
    _, parts = step_time(1.0, 0.0, {"ep": 0.8}, lay, n_micro=2, layers_per_rank=5, experts_s=100.0)
    assert parts["exposed_ep"] == pytest.approx(0.4, rel=1e-15)  # only A's dispatch and B's combine


# --- EP folded over dp_shard x cp x tp (torchtitan's expert mesh) --------------------------------

def test_ep_folded_over_tp_bytes_equal_closed_form():
    """small-moe on 16 H100s, dp 4 x tp 4, ep 8: 8 does not divide dp x cp = 4, so ep is folded over tp
    (torchtitan's [pp, dp_replicate, efsdp, ep], efsdp = dp x cp x tp / ep = 2), whole experts (etp = 1).
    Per GPU per step, L = 16 blocks, m = 4 micro-batches of one 4,096-token sequence, T / tp = 1,024 tokens:
        ep  4 L m x (ep-1)/ep x 2 top_k (T/tp) d                     (traffic.py's docstring)
        dp  m [(dp cp - 1)/(dp cp) x 8 D  +  (n_e - 1)/n_e x 8 E]     (ZeRO-3: 2 + 2 + 4 bytes a parameter
                                                                        each micro-batch, zero_calls.zero3_calls)
    with D = the dense parameters / tp and E = L x the 8 experts / ep (not / tp: whole experts), n_e = 2.
    The ep group is the innermost 8 of (dp, cp, tp) flattened: tp's 4, then 2 dp ranks 4 apart, one node.
    Planted (checked when written): the experts split over tp as well (/ (tp ep)) or reduced over the
    unfolded dp x cp / ep ranks each break the dp term; ep borrowed from cp first (span ep x tp = 32) puts
    the all-to-all on the network and breaks its seconds."""
    lay = Layout(dp=4, tp=4, ep=8, zero="zero3")
    assert lay.ep_over_tp and lay.expert_tp == 1 and lay.efsdp == 2 and lay.level("ep", 8) == "node"
    p = predict(MOE, lay, H100, 16, 4096)
    L, m, d, k = MOE.n_layers, p.n_micro, MOE.d_model, MOE.top_k
    assert (L, m) == (16, 4)
    tokens = 2 * k * (4096 // 4) * d
    assert p.traffic["ep"]["bytes"] == 4 * L * m * 7 / 8 * tokens
    a, b = H100.link("node", "all_to_all", tokens)
    assert b == 370e9  # the all-to-all's own bus bandwidth on H100's NVLink, not the all-reduce's (NVLink SHARP)
    assert p.traffic["ep"]["seconds"] == pytest.approx(4 * L * m * (7 * a + 7 / 8 * tokens / b), rel=1e-12)
    D = (L * MOE.layer_dense_params + MOE.embedding_params + MOE.head_params) / 4
    E = L * MOE.expert_params * MOE.n_experts / 8
    assert p.traffic["dp"]["bytes"] == pytest.approx(m * (3 / 4 * 8 * D + 1 / 2 * 8 * E), rel=1e-12)
    # the memory follows the same mesh: the experts' states ZeRO-3-sharded over efsdp = 2
    mem = peak_memory(MOE, lay, n_micro=m, seq_len=4096)
    want = {key: memory_per_rank(math.ceil(D), 4, "zero3", "fp32")[key] + memory_per_rank(math.ceil(E), 2, "zero3",
            "fp32")[key] for key in ("params", "grads", "optimizer")}
    assert {key: mem[key] for key in want} == want


def test_ep_folded_over_tp_only_where_it_must_be_and_hsdp_inside_a_replica():
    """ep dividing dp_shard x cp keeps the earlier model (experts split over tp, efsdp = dp_shard x cp / ep);
    under HSDP the folded ep stays inside a replica: efsdp = dp_shard x cp x tp / ep, the replicas across."""
    plain = Layout(dp=4, tp=4, ep=4)
    assert not plain.ep_over_tp and plain.expert_tp == 4 and plain.efsdp == 1
    assert Layout(dp=4, pp=2, tp=4, ep=8).level("ep", 8) == "network"  # 2 dp ranks pp x tp = 8 apart: span 16
    hsdp = Layout(dp=8, dp_replicate=2, tp=2, ep=8, zero="zero3")
    assert hsdp.ep_over_tp and hsdp.efsdp == 1
    p = predict(MOE, hsdp, H100, 16, 4096)
    E = MOE.n_layers * MOE.expert_params * MOE.n_experts / 8
    D = (MOE.n_layers * MOE.layer_dense_params + MOE.embedding_params + MOE.head_params) / 2
    # shard group: the dense over dp_shard = 4 (8 bytes), the experts over efsdp = 1 (nothing); replicas: R = 2;
    # each of the m = 2 micro-batches (zero_calls.zero3_calls: no pipeline)
    m = p.n_micro
    assert m == 2
    assert p.traffic["dp"]["shard_bytes"] == pytest.approx(m * 3 / 4 * 8 * D, rel=1e-12)
    assert p.traffic["dp"]["replica_bytes"] == pytest.approx(m * 2 * 1 / 2 * 4 * (D / 4 + E), rel=1e-12)


# --- HSDP where practitioners run it -----------------------------------------------------------

def test_hsdp_pays_where_the_flat_ring_is_latency_bound():
    """On nodes with a NIC per GPU a flat FSDP ring crosses on all 8 NICs, so HSDP saves no bandwidth (above); it
    pays where the ring's latency does not hide: Llama 3 8B on 2,048 H100s (256 nodes), one sequence of 1,024 tokens
    per GPU, full recompute: each of a step's 96 flat calls (a gather or reduce-scatter a block) takes 2,047 steps,
    255 of them node crossings, about 9 ms by NCCL's latency model, and 16 or 32 replicas of 128 or 64 shards run
    3.8x as fast as R = 1; at 256 GPUs and 2,048 tokens both hide behind the compute (within 3%). Too many replicas
    pay the replicas' all-reduce on one NIC each (R = 256 is slowest of R >= 8). The search's grading cases
    (tests/grading/test_scale_search.py) rank HSDP too. Planted (checked when written): without the latency (NVLink's
    and the network's per step near 0) R = 1 comes within 8% of the best, R = 8."""
    spec = LLAMA3["8b"]

    def speed(n, seq, r):
        return predict(spec, Layout(dp=n, dp_replicate=r, zero="zero3", recompute="full"), H100, n, seq
                       ).tokens_per_s_per_gpu

    many = {r: speed(2048, 1024, r) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    assert max(many, key=many.get) in (16, 32), many
    assert many[32] > 3 * many[1] and many[256] < min(many[r] for r in (8, 16, 32, 64, 128))
    few = [speed(256, 2048, r) for r in (1, 2, 4, 8)]
    assert max(few) < 1.03 * min(few)
