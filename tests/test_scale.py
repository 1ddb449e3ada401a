"""labkit.scale: clusters, model shapes, memory, traffic and step time of a layout (notebook 15).

Each figure is checked against an independent source: labkit.model's own parameter count
(FLOPs against torch's FlopCounterMode: tests/test_scale_simulate.py), labkit.measure.activations' formula (itself checked against
autograd's saved tensors in tests/test_activations.py) for the activations, labkit.measure.memory for
the model states, hand-derived closed forms for the traffic, torchtitan's published runs for the
whole model. Bad input: each error names the field or axis and what to use. Arithmetic only:
about 2 s in all.
"""
import dataclasses
import json
import math

import pytest
from labkit.measure.activations import block_activation_elements, recompute_peak_elements
from labkit.measure.memory import memory_per_rank, param_count
from labkit.model import build_model, get_config
from labkit.scale import published
from labkit.scale.cluster import ClusterError, check_fields, list_clusters, load_cluster
from labkit.scale.cost import predict
from labkit.scale.footprint import block_activation_bytes, peak_memory
from labkit.scale.layout import Layout, LayoutError, check_layout
from labkit.scale.specs import LLAMA3, spec_from_config
from labkit.scale.collectives import ring_time

H100 = load_cluster("h100-sxm")
GOOD = json.loads((__import__("labkit.scale.cluster", fromlist=["x"]).CLUSTER_DIR / "h100-sxm.json").read_text())


# --- clusters -------------------------------------------------------------------------------

def test_shipped_clusters_load_and_cite_their_sources():
    assert {"h100-sxm", "a100-sxm", "h100-grand-teton"} <= set(list_clusters())
    for name in list_clusters():
        cluster = load_cluster(name)
        raw = json.loads((__import__("labkit.scale.cluster", fromlist=["x"]).CLUSTER_DIR / f"{name}.json").read_text())
        assert raw["sources"] and "peak_bf16_flops" in " ".join(raw["sources"]), name
        assert cluster.link("network")[1] < cluster.link("node")[1]  # NVLink is the faster level


def test_cluster_missing_field_is_named_with_its_unit():
    values = dict(GOOD)
    del values["network_gbits_per_s"]
    with pytest.raises(ClusterError, match=r"no field 'network_gbits_per_s'.*Gb/s"):
        load_cluster(values)


@pytest.mark.parametrize("field,scale,unit", [
    ("peak_bf16_flops", 1e-12, "FLOP/s"),      # written in TFLOP/s
    ("nvlink_gbytes_per_s", 1e3, "GB/s"),      # written in MB/s
    ("network_latency_us", 1e-3, "microseconds"),  # written in ms
    ("memory_gib", 1e3, "GiB"),                # written in MiB
])
def test_cluster_unit_off_by_1000_names_the_field_and_the_unit(field, scale, unit):
    values = dict(GOOD, **{field: GOOD[field] * scale})
    with pytest.raises(ClusterError, match=rf"{field}=.*off by 1,000.*{unit}"):
        load_cluster(values)


def test_cluster_file_path_and_wrong_type(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(dict(GOOD, gpus_per_node="eight")))
    with pytest.raises(ClusterError, match=r"gpus_per_node='eight' must be a number"):
        load_cluster(path)
    path.write_text(json.dumps(GOOD))
    assert load_cluster(path) == load_cluster(GOOD)
    assert check_fields(GOOD)["peak_bf16_flops"] == 989e12


# --- model shapes and FLOPs ---------------------------------------------------------------

def test_param_counts_match_labkit_model_and_llama3():
    for name in ("tiny", "seed", "tiny-moe"):
        spec = spec_from_config(name)
        assert spec.n_params == build_model(name).num_params(), name
    assert spec_from_config("tiny").n_params == param_count("tiny")
    # the parameter counts Meta publishes (Hugging Face's model pages): exact
    assert LLAMA3["8b"].n_params == 8_030_261_248
    assert LLAMA3["70b"].n_params == 70_553_706_496
    assert LLAMA3["405b"].n_params == 405_853_388_800


def test_recompute_flops():
    spec = LLAMA3["8b"]
    assert spec.recompute_flops_per_token(8192, "none") == 0
    full = spec.recompute_flops_per_token(8192, "full")
    # full recompute = one more forward of the blocks = a third of their forward + backward
    blocks = spec.flops_per_token(8192) - 6 * spec.head_params
    assert full == pytest.approx(blocks / 3 - 2 * spec.n_layers * 2 * spec.d_model, rel=1e-12)
    assert 0 < spec.recompute_flops_per_token(8192, "selective") < full


# --- memory --------------------------------------------------------------------------------

def test_block_activations_reduce_to_labkit_activations_formula():
    """kv heads = heads, no TP/CP, nothing recomputed: labkit.measure.activations' per-block elements x 2 bytes; of
    them the MLP sublayer's (its norm, 3 b s d + b s, and SwiGLU's 4 b s H) are "mlp"."""
    cfg = get_config("seed")
    spec = spec_from_config(cfg)
    b, s = 3, 256
    none = block_activation_bytes(spec, Layout(recompute="none"), b, s)
    assert none == {"saved": 2 * block_activation_elements(b, s, cfg.d_model, cfg.n_heads, cfg.hidden_dim),
                    "rebuilt": 0, "mlp": 2 * (3 * b * s * cfg.d_model + b * s + 4 * b * s * cfg.hidden_dim)}
    full = block_activation_bytes(spec, Layout(recompute="full"), b, s)
    assert cfg.n_layers * full["saved"] + full["rebuilt"] == 2 * recompute_peak_elements(
        b, s, cfg.d_model, cfg.n_heads, cfg.hidden_dim, cfg.n_layers)


def test_block_activations_split_by_tp_with_sp_and_by_cp():
    """With Megatron's SP (each linear keeps its input's shard) a block's saved bytes split by tp x cp; torchtitan's
    plan saves the two all-gathered sublayer inputs whole, 2 x b (s / cp) d more in bf16, recomputed under "full"."""
    spec = dataclasses.replace(LLAMA3["70b"], sp_saves_shard=True)
    one = block_activation_bytes(spec, Layout(recompute="none"), 1, 8192)["saved"]
    lay = Layout(dp=1, tp=8, cp=2, recompute="none")
    split = block_activation_bytes(spec, lay, 1, 8192)["saved"]
    assert split == pytest.approx(one / 16, rel=1e-12)
    titan = block_activation_bytes(LLAMA3["70b"], lay, 1, 8192)
    assert titan["saved"] - split == 2 * 2 * 4096 * 8192
    full = dataclasses.replace(lay, recompute="full")
    assert (block_activation_bytes(LLAMA3["70b"], full, 1, 8192)["rebuilt"]
            - block_activation_bytes(spec, full, 1, 8192)["rebuilt"]) == 2 * 2 * 4096 * 8192
    assert block_activation_bytes(LLAMA3["70b"], Layout(tp=1, cp=2, recompute="none"), 1, 8192)["saved"] == \
        block_activation_bytes(spec, Layout(tp=1, cp=2, recompute="none"), 1, 8192)["saved"]  # no SP, nothing gathered


def test_model_states_are_labkit_memory_formulas():
    spec = LLAMA3["8b"]
    mem = peak_memory(spec, Layout(dp=8, zero="zero3"), n_micro=1, seq_len=8192)
    ref = memory_per_rank(spec.n_params, 8, "zero3", "fp32")
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (ref["params"], ref["grads"], ref["optimizer"])
    mem = peak_memory(spec, Layout(dp=4, tp=2, zero="zero1"), n_micro=1, seq_len=8192)
    ref = memory_per_rank(math.ceil(spec.n_params / 2), 4, "zero1", "mixed")
    assert mem["optimizer"] == ref["optimizer"] and mem["params"] == ref["params"]


# --- traffic -------------------------------------------------------------------------------

def test_ring_closed_forms():
    alpha, beta = 1e-5, 1e9
    assert ring_time("all_reduce", 800, 8, alpha, beta) == (2 * 7 / 8 * 800, 14 * alpha + 1400 / beta)
    assert ring_time("all_gather", 800, 8, alpha, beta) == (700, 7 * alpha + 700 / beta)
    assert ring_time("reduce_scatter", 800, 1, alpha, beta) == (0, 0)


def test_fsdp_bytes_per_step_are_two_gathers_and_a_reduce_scatter():
    spec = LLAMA3["8b"]
    p = predict(spec, Layout(dp=8, micro_batch=2), H100, global_batch=16, seq_len=8192)
    n = 8
    assert p.traffic["dp"]["bytes"] == pytest.approx((2 + 2 + 4) * spec.n_params * (n - 1) / n, rel=1e-12)
    assert "tp" not in p.traffic or p.traffic["tp"]["bytes"] == 0


def test_tp_bytes_per_step_follow_megatron_sp_and_the_recompute_policy():
    """Per block and micro-batch, A = b s d bf16, each collective (tp-1)/tp A on the wire:
        with SP     (2 all-gathers + 2 reduce-scatters) forward and backward, + r the backward runs again:
                    r = 0 (none, Megatron's selective), 2 all-gathers (torchtitan's op policy saves
                    reduce_scatter_tensor, not all_gather_into_tensor), 4 (full)
        without SP  2 all-reduces each way (2 (tp-1)/tp A each), + 0 / 2 / 2 (op policy: all_reduce not saved)
    Planted mistake: the op policy replaying no collective (the rule before) gives 8 per block, not 10."""
    spec = LLAMA3["70b"]
    n_micro, tp, L = 4, 8, spec.n_layers
    act = 2 * 4 * 8192 * spec.d_model
    for sp, per_collective, counts in ((True, 1, {"none": 8, "selective-attn": 8, "selective-op": 10, "full": 12}),
                                       (False, 2, {"none": 4, "selective-attn": 4, "selective-op": 6, "full": 6})):
        for policy, n in counts.items():
            lay = Layout(dp=32, tp=tp, micro_batch=4, recompute=policy, sequence_parallel=sp)
            p = predict(spec, lay, H100, 512, 8192)
            assert p.traffic["tp"]["bytes"] == pytest.approx(L * n_micro * n * per_collective * (tp - 1) / tp * act,
                                                             rel=1e-12), (sp, policy)
            assert p.traffic["tp"]["count"] == L * n_micro * n
    planted = L * n_micro * 8 * (tp - 1) / tp * act
    op = predict(spec, Layout(dp=32, tp=tp, micro_batch=4, recompute="selective"), H100, 512, 8192)
    assert op.traffic["tp"]["bytes"] != pytest.approx(planted, rel=1e-6)


def test_pp_bytes_per_step_are_v_times_more_when_interleaved():
    """Per micro-batch, a middle rank sends its activation forward and its gradient back: 2 A/tp (SP) bytes,
    v times with v virtual stages per rank (each micro-batch goes round the ranks v times; Narayanan et al.
    2021, section 2.2.2). Without the factor v the interleaved count would equal 1F1B's."""
    spec = LLAMA3["8b"]
    n_micro, tp, mb, seq = 8, 2, 1, 8192
    act = 2 * mb * seq * spec.d_model / tp
    plain = predict(spec, Layout(dp=2, pp=4, tp=tp, zero="zero1", micro_batch=mb), H100, 2 * n_micro, seq)
    assert plain.traffic["pp"]["bytes"] == pytest.approx(2 * n_micro * act, rel=1e-12)
    assert plain.traffic["pp"]["count"] == 2 * n_micro
    for v in (2, 4):
        inter = predict(spec, Layout(dp=2, pp=4, tp=tp, zero="zero1", micro_batch=mb, schedule="interleaved",
                                     virtual_stages=v), H100, 2 * n_micro, seq)
        assert inter.traffic["pp"]["bytes"] == pytest.approx(v * 2 * n_micro * act, rel=1e-12)
        assert inter.traffic["pp"]["count"] == v * 2 * n_micro


def test_tp_across_nodes_costs_more_than_inside():
    """The same TP 8 group on nodes of 8 GPUs (NVLink) and of 4 (half of it over the network): across nodes its rings
    cross on the 4 NICs of its 4 GPUs in each node (NCCL's channels, Cluster.link's per_node), 4 x 46 GB/s.
    Planted (checked when written): one NIC's 46 GB/s, the rate before the rails were counted, gives 7.4x."""
    spec, layout = LLAMA3["70b"], Layout(dp=32, tp=8, recompute="full", micro_batch=4)
    inside = predict(spec, layout, H100, 512, 8192)
    across = predict(spec, layout, load_cluster(dict(GOOD, gpus_per_node=4)), 512, 8192)
    assert layout.level("tp", 8) == "node" and layout.level("tp", 4) == "network"
    assert inside.traffic["tp"]["bytes"] == across.traffic["tp"]["bytes"]
    ratio = across.traffic["tp"]["seconds"] / inside.traffic["tp"]["seconds"]
    act = 2 * 4 * 8192 * spec.d_model  # one all-gather's or reduce-scatter's tensor: 512 MiB, 340.94 GB/s on NVLink
    nvlink, nic = H100.link("node", "all_gather", act)[1], H100.link("network", "all_gather", act)[1]
    assert nvlink == H100.link("node", "reduce_scatter", act)[1] == 340.94e9 and nic == 46e9
    assert layout.ranks_per_node("tp", 4) == 4
    assert ratio == pytest.approx(nvlink / (4 * nic), rel=0.05)  # bandwidth-bound: the links' ratio, 1.85x
    assert across.tokens_per_s_per_gpu < inside.tokens_per_s_per_gpu


def test_a_group_that_does_not_tile_the_node_straddles_two():
    """tp 3 on 8-GPU nodes: tp groups are ranks 0-2, 3-5, 6-8, ...; 6-8 crosses into the next node, so tp's level is
    the network (the slowest group sets the pace), and the same for cp 3 behind tp 2 (span 6). tp 4 and 8 tile it."""
    assert Layout(dp=8, tp=3).level("tp", 8) == "network"
    assert Layout(dp=8, cp=3, tp=2).level("cp", 8) == "network"
    assert Layout(dp=6, tp=4).level("tp", 8) == "node" and Layout(dp=3, tp=8).level("tp", 8) == "node"
    assert Layout(dp=16, tp=2).level("tp", 6) == "node" and Layout(dp=16, tp=4).level("tp", 6) == "network"


def test_ep_borrows_cp_ranks_first():
    lay = Layout(dp=4, pp=2, cp=2, tp=2, ep=2)
    assert lay.level("ep", 8) == "node"          # ep 2 x tp 2 = 4 neighbouring GPUs
    lay = Layout(dp=4, pp=2, cp=2, tp=2, ep=4)   # beyond cp: dp's ranks, pp x cp x tp apart
    assert lay.level("ep", 8) == "network"


# --- step time -----------------------------------------------------------------------------

def test_bubble_is_pp_minus_one_over_micro_batches():
    spec = LLAMA3["8b"]
    for m, pp in ((8, 4), (16, 4), (8, 8)):
        p = predict(spec, Layout(dp=2, pp=pp, zero="zero1", micro_batch=1), H100, 2 * m, 8192)
        assert p.parts_s["bubble"] == pytest.approx((pp - 1) / m * p.parts_s["compute"], rel=1e-12)
        inter = predict(spec, Layout(dp=2, pp=pp, zero="zero1", micro_batch=1, schedule="interleaved",
                                     virtual_stages=2), H100, 2 * m, 8192)
        assert inter.parts_s["bubble"] == pytest.approx(p.parts_s["bubble"] / 2, rel=1e-12)


def test_tokens_per_second_and_mfu_are_consistent():
    spec = LLAMA3["8b"]
    p = predict(spec, Layout(dp=8, micro_batch=2), H100, 16, 8192)
    assert p.tokens_per_s_per_gpu * p.step_s * 8 == pytest.approx(16 * 8192)
    assert p.mfu == pytest.approx(p.tokens_per_s_per_gpu * spec.flops_per_token(8192) / H100.peak_bf16_flops)


def test_published_bf16_rows_within_goals():
    """The aimed rows of torchtitan's table: throughput within 25%, peak memory within 15%."""
    aimed = [r for r in published.predict_published() if r["aimed"]]
    assert len(aimed) == 2
    for r in aimed:
        assert abs(r["tps_error"]) < 0.25 and abs(r["memory_error"]) < 0.15, r


def test_published_check_catches_a_planted_flops_mistake(monkeypatch):
    """Forgetting attention's 12 L d s (a classic) moves the 8B rows past the goal: the check can fail."""
    from labkit.scale.specs import ModelSpec

    monkeypatch.setattr(ModelSpec, "flops_per_token", lambda self, s: 6 * self.active_params)
    aimed = [r for r in published.predict_published() if r["aimed"]]
    assert any(abs(r["tps_error"]) >= 0.25 for r in aimed)


# --- bad layouts ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout,match", [
    (Layout(dp=4, tp=4), r"= 16 GPUs, but the cluster has 32"),
    (Layout(dp=2, tp=16), r"tp=16 does not divide llama3-70b's 64 heads and 8 KV heads: use a tp that divides 8"),
    (Layout(dp=1, pp=4, virtual_stages=40, schedule="interleaved", tp=8, zero="zero1"), r"160 stages"),
    (Layout(dp=4, cp=8), r"cp=8: the sequence of 8200 tokens must split into 2 x cp = 16 zigzag chunks"),
    (Layout(dp=16, ep=2, tp=2), r"ep=2 on the dense model"),
    (Layout(dp=32, micro_batch=3), r"do not split into micro-batches of 3"),
    (Layout(dp=4, pp=8, micro_batch=4), r"pp=8 needs at least 8 micro-batches"),
    (Layout(dp=32, zero="zero4"), r"zero='zero4': choose one of"),
])
def test_bad_layouts_name_the_fix(layout, match):
    seq = 8200 if layout.cp > 1 else 8192
    with pytest.raises(LayoutError, match=match):
        check_layout(LLAMA3["70b"], layout, 32, 8, 64, seq)


def test_gpus_not_a_whole_number_of_nodes():
    with pytest.raises(LayoutError, match="not a whole number of nodes of 8"):
        check_layout(LLAMA3["8b"], Layout(dp=12), 12, 8, 48, 8192)


def test_step_time_overlap_rules():
    """DP hides behind compute (but for one layer's share), CP behind attention, TP is paid in full."""
    from labkit.scale.cost import step_time

    lay = Layout(dp=2, tp=2, cp=2)
    step, parts = step_time(10.0, 2.0, {"dp": 4.0, "cp": 1.5, "tp": 0.5}, lay, n_micro=1, layers_per_rank=8)
    assert parts["exposed_dp"] == 4.0 / 8 and parts["exposed_cp"] == 0 and parts["exposed_tp"] == 0.5
    assert step == 10.0 + 0.5 + 0.5
    step, parts = step_time(10.0, 2.0, {"dp": 14.0, "cp": 3.0}, lay, n_micro=1, layers_per_rank=7)
    assert parts["exposed_dp"] == 4.0 + 2.0 and parts["exposed_cp"] == 1.0


def test_too_big_for_any_layout_says_how_many_gpus():
    from labkit.scale.cost import min_gpus, no_layout_fits

    # 16 bytes x 405.85e9 parameters over 79.6 GiB GPUs: 76.1 -> 80 GPUs (10 nodes of 8)
    assert min_gpus(LLAMA3["405b"], H100) == 80
    assert min_gpus(LLAMA3["8b"], H100) == 8  # 1.5 GPUs' worth: one whole node
    err = no_layout_fits(LLAMA3["405b"], H100, 64, None)
    assert "llama3-405b needs at least 80 GPUs of this kind, h100-sxm (79.6 GiB each)" in str(err)
    assert "the least memory of any layout is 90.0 GiB" in str(no_layout_fits(LLAMA3["8b"], H100, 64, 90 * 2**30))
