"""cost.predict's kernel model (efficiency=None): the step is the sum of its parts, each overlap rule as its
docstring states it, pipelines through the schedule simulator. Pure arithmetic, no process: a few seconds."""
from __future__ import annotations

import json

import pytest

from labkit.scale import async_tp as atp
from labkit.scale.cluster import CLUSTER_DIR, load_cluster
from labkit.scale.cost import predict
from labkit.scale.cost_kernels import _block_comm, contention
from labkit.scale.gpu import load_gpu
from labkit.scale.pace import paced
from labkit.scale.layer_ops import Options, Shape, block_ops, end_ops, seconds
from labkit.scale.layout import Layout, LayoutError
from labkit.scale.specs import LLAMA3

H100 = load_cluster("h100-sxm")
H100_PATH = CLUSTER_DIR / "h100-sxm.json"
GPU = load_gpu("h100-sxm")
NODE = paced(GPU, 8)  # what a step over 8 GPUs or more times its kernels on: its slowest GPU's pace (pace.paced)
SPEC = LLAMA3["8b"]


def fsdp_copies_s(params: float, gathers: int, scatters: int) -> float:
    """FSDP2's copies on the compute stream, counted from torch's _fsdp_collectives.py by hand: each all-gather's
    copy-out (split_with_sizes_copy: read and write the bf16 parameters, 2 + 2 bytes a parameter) and each
    reduce-scatter's copy-in (chunk_cat: read the bf16 gradients, write fp32, 2 + 4)."""
    return (4 * gathers + 6 * scatters) * params / GPU.hbm_bytes_per_s


def test_single_stage_step_is_micro_batches_times_forward_and_backward_plus_dp_and_optimizer():
    """pp = tp = 1: step = m (L (F_block + B_block) + embedding + head) + FSDP's copies + exposed dp + optimizer,
    exactly; each pass (a block's forward, its backward, the embedding's, the head's) a stretch of ops,
    layer_ops.seconds. Without a pipeline FSDP2 gathers twice and reduce-scatters once per micro-batch (the edge
    case is 2 micro-batches: 4 gathers and 2 scatters, in the traffic and in the copies alike); only FSDP2's
    ZeRO-3 copies: ZeRO-2 and DeepSpeed's per-module ZeRO-3 have none."""
    from labkit.scale.cost_kernels import params_per_gpu
    lay = Layout(dp=8, zero="zero3", recompute="selective", micro_batch=1)
    p = predict(SPEC, lay, H100, 16, 4096, efficiency=None)
    shape, opts = Shape(1, 4096), Options(recompute="selective")
    blk = block_ops(SPEC, shape, opts, NODE)
    ends = sum(seconds(end_ops(SPEC, shape, opts, NODE, which)[d]) for which in ("embedding", "head")
               for d in ("forward", "backward"))
    work = p.n_micro * (SPEC.n_layers * (seconds(blk["forward"]) + seconds(blk["backward"])) + ends)
    copies = fsdp_copies_s(sum(params_per_gpu(SPEC, lay).values()), 4, 2)
    assert copies > 1e-3 * work  # large enough that a wrong count shows
    assert p.n_micro == 2 and p.parts_s["compute"] == pytest.approx(work, rel=1e-12)
    assert p.parts_s["fsdp_copies"] == pytest.approx(copies, rel=1e-12)
    assert p.traffic["dp"]["count"] == 4 + 2
    for other in (Layout(dp=8, zero="zero2", recompute="selective", micro_batch=1),
                  Layout(dp=8, zero="zero3", zero3_unit="module", recompute="selective", micro_batch=1)):
        q = predict(SPEC, other, H100, 16, 4096, efficiency=None)
        assert q.parts_s["compute"] == pytest.approx(work, rel=1e-12) and q.parts_s["fsdp_copies"] == 0.0
    rest = p.parts_s["exposed_dp"] + p.parts_s["contention_dp"] + p.parts_s["optimizer"]
    assert p.step_s == pytest.approx(work + copies + rest, rel=1e-12)
    assert p.step_s == pytest.approx(sum(p.parts_s.values()), rel=1e-12)


def test_fsdp1_copies_only_its_gradients():
    """FSDP1 (zero3_unit="flat": FullyShardedDataParallel per block, llm-foundry's) gathers into the flat parameter
    the block reads, so it runs no copy-out after its all-gathers; it still casts each bf16 gradient to fp32 before
    its reduce-scatter (_runtime_utils._post_backward_hook): 2 + 4 bytes a parameter per scatter. Same traffic,
    memory and compute as FSDP2's blocks; its SHARD_GRAD_OP (zero2) as well. Planted (checked when written): FSDP2's
    copy-outs on the flat unit fail."""
    from labkit.scale.cost_kernels import params_per_gpu
    lay = Layout(dp=8, zero="zero3", zero3_unit="flat", recompute="selective", micro_batch=1)
    p = predict(SPEC, lay, H100, 16, 4096, efficiency=None)
    block = predict(SPEC, Layout(dp=8, zero="zero3", recompute="selective", micro_batch=1), H100, 16, 4096,
                    efficiency=None)
    held = sum(params_per_gpu(SPEC, lay).values())
    assert p.parts_s["fsdp_copies"] == pytest.approx(fsdp_copies_s(held, 0, 2), rel=1e-12)
    assert block.parts_s["fsdp_copies"] == pytest.approx(fsdp_copies_s(held, 4, 2), rel=1e-12)
    assert p.parts_s["compute"] == block.parts_s["compute"] and p.traffic["dp"] == block.traffic["dp"]
    assert p.peak_bytes == block.peak_bytes
    # SHARD_GRAD_OP (zero2, "flat"): the same casts per reduce-scatter, and fp32 gradients on the wire, where the
    # model's ZeRO-2 reduces bf16 (planted, checked when written: bf16 bytes or no copies fail here)
    z2 = predict(SPEC, Layout(dp=8, zero="zero2", zero3_unit="flat", recompute="selective", micro_batch=1), H100, 16,
                 4096, efficiency=None)
    plain = predict(SPEC, Layout(dp=8, zero="zero2", recompute="selective", micro_batch=1), H100, 16, 4096,
                    efficiency=None)
    assert z2.parts_s["fsdp_copies"] == pytest.approx(fsdp_copies_s(held, 0, 2), rel=1e-12)
    assert plain.parts_s["fsdp_copies"] == 0.0
    P = held  # every parameter, reduce-scattered twice (two micro-batches) and gathered once, over 8 ranks
    assert z2.traffic["dp"]["bytes"] == pytest.approx(7 / 8 * (2 * 4 * P + 2 * P), rel=1e-12)
    assert plain.traffic["dp"]["bytes"] == pytest.approx(7 / 8 * (2 * 2 * P + 2 * P), rel=1e-12)


def test_fsdp_inside_a_pipeline_gathers_and_scatters_once_a_step_whatever_the_micro_batches():
    """With a pipeline, torchtitan keeps each stage gathered (reshard_after_forward=False) and torch's pipelining
    syncs gradients on the last backward only: one all-gather and one reduce-scatter a step for 2 or 8
    micro-batches, and their copies once (the edge case: the count must not follow the micro-batches as it does
    without a pipeline); the footprint holds the stage gathered and its fp32 gradient (6 bytes a parameter)."""
    from labkit.scale.cost_kernels import params_per_gpu
    from labkit.scale.footprint import stage_memory
    for batch in (8, 32):
        lay = Layout(dp=4, pp=2, zero="zero3", recompute="selective", micro_batch=1)
        p = predict(SPEC, lay, H100, batch, 4096, efficiency=None)
        assert p.n_micro == batch // 4 and p.traffic["dp"]["count"] == 1 + 1
        held = sum(params_per_gpu(SPEC, lay).values())
        assert p.parts_s["fsdp_copies"] == pytest.approx(fsdp_copies_s(held, 1, 1), rel=1e-12)
        gathered = stage_memory(SPEC, lay, 1, p.n_micro, 4096)["gathered"]
        assert gathered == pytest.approx(6 * held, rel=0.02)  # the stage's own params (the head's on the last)


def test_fsdp_hides_behind_all_compute_dp_buckets_behind_the_last_micro_batchs_backward_only():
    """The same rule, four windows: ZeRO-3 exposes max(0, t - compute) + t/L (compute: every kernel of the compute
    stream, FSDP's copies among them); plain DP and ZeRO-1, whose micro-batches accumulate locally,
    max(0, t - B_last) + t/L with B_last the last micro-batch's backward (not all of them: the edge case is 2
    micro-batches); ZeRO-2 without a pipeline, which reduce-scatters each micro-batch's gradient in its backward
    (2 reduce-scatters, 1 all-gather), behind all of them; Megatron-LM's local DDP (grad_reduce="after") all of t,
    nothing hidden (t: the dp traffic's seconds). A slow network (1 Gb/s) makes every window too short to hide it."""
    shape, opts = Shape(1, 4096), Options(recompute="none")
    blk = block_ops(SPEC, shape, opts, NODE)
    ends_b = sum(seconds(end_ops(SPEC, shape, opts, NODE, w)["backward"]) for w in ("embedding", "head"))
    values = json.loads(H100_PATH.read_text())
    del values["network_busbw_gbytes_per_s"]  # the 400 Gb/s NIC's measured figure: a 1 Gb/s NIC is priced at its line rate
    slow = load_cluster(dict(values, network_gbits_per_s=1))
    for cluster in (H100, slow):
        for zero, reduce in (("zero3", "overlap"), ("dp", "overlap"), ("zero1", "overlap"), ("zero2", "overlap"),
                             ("dp", "after")):
            lay = Layout(dp=16, zero=zero, recompute="none", grad_reduce=reduce)
            p = predict(SPEC, lay, cluster, 32, 4096, efficiency=None)
            t = p.traffic["dp"]["seconds"]
            assert p.n_micro == 2 and t > 0
            if reduce == "after":
                assert p.parts_s["exposed_dp"] == pytest.approx(t, rel=1e-12)
                continue
            last = SPEC.n_layers * seconds(blk["backward"]) + ends_b
            window = {"zero3": p.parts_s["compute"] + p.parts_s["fsdp_copies"],  # both on the compute stream
                      "zero2": p.n_micro * last}.get(zero, last)
            assert p.traffic["dp"]["count"] == {"zero3": 4 + 2, "zero2": 2 + 1}.get(zero, 1)
            assert p.parts_s["exposed_dp"] == pytest.approx(max(0.0, t - window) + t / SPEC.n_layers, rel=1e-12)


def test_an_unknown_grad_reduce_is_refused_by_name():
    with pytest.raises(LayoutError, match=r"grad_reduce='later'.*one of \('overlap', 'after'\)"):
        predict(SPEC, Layout(dp=8, zero="dp", grad_reduce="later"), H100, 16, 4096, efficiency=None)


def _tp(seconds, calls):
    """A block's TP traffic of `seconds` in `calls` alike collectives (axis_traffic's "tp" entry: its one-call times)."""
    return {"tp": {"seconds": seconds, "calls": {"all_gather": seconds / calls, "reduce_scatter": seconds / calls}}}


def _comm(traffic, layout, async_tp=False):
    blk = block_ops(SPEC, Shape(1, 8192, cp=layout.cp, tp=layout.tp), Options(), GPU)
    chunk = block_ops(SPEC, Shape(1, 8192 // layout.tp, cp=layout.cp, tp=layout.tp), Options(), GPU)
    return blk, _block_comm(blk, traffic, layout, 1, async_tp, chunk)


def test_cp_ring_hidden_only_where_attention_outlasts_its_transfer():
    """exposed = max(0, t_ring - t_attention) + the non-hideable part. Planted mistake: a ring always hidden
    (the rule before issue 34) would expose 0 for a ring longer than attention."""
    lay = Layout(cp=2)
    blk, _ = _comm({}, lay)
    attn = sum(op.seconds for op in blk["forward"] + blk["backward"] if op.kind == "attention")
    short = _comm({"cp": {"seconds": 0.5 * attn, "hideable_seconds": 0.5 * attn}}, lay)[1]["cp"]
    long = _comm({"cp": {"seconds": 3 * attn, "hideable_seconds": 3 * attn}}, lay)[1]["cp"]
    mixed = _comm({"cp": {"seconds": 1.0, "hideable_seconds": 0.0}}, lay)[1]["cp"]
    assert short == 0 and long == pytest.approx(2 * attn) and mixed == 1.0
    planted_always_hidden = 0.0
    assert long != planted_always_hidden


def test_cp_all_gather_rotation_hidden_only_behind_the_first_step():
    """Edge case: kv_rotation="allgather": the K/V all-gather ("first_step_seconds") hides behind 1/cp of the block's
    attention, the ring's first step, not all of it: half the attention's time, on 4 cp ranks, exposes a quarter.
    Planted mistake: the hop-by-hop rule would hide it whole (0)."""
    lay = Layout(cp=4, kv_rotation="allgather")
    blk, _ = _comm({}, lay)
    attn = sum(op.seconds for op in blk["forward"] + blk["backward"] if op.kind == "attention")
    got = _comm({"cp": {"seconds": 0.5 * attn, "hideable_seconds": 0.0, "first_step_seconds": 0.5 * attn}}, lay)[1]
    assert got["cp"] == pytest.approx(0.5 * attn - attn / 4, rel=1e-12) and got["cp"] != 0.0


def test_the_rings_hidden_hops_slow_the_attention_beside_them():
    """A ring hidden behind attention costs k x its time (k = s / (1 + s)); one longer than the slowed attention
    costs only its exposed part; plain TP, all exposed, costs nothing more."""
    lay = Layout(cp=2)
    blk = block_ops(SPEC, Shape(1, 8192, cp=2), Options(), GPU)
    attn = sum(op.seconds for op in blk["forward"] + blk["backward"] if op.kind == "attention")
    for ring, want in ((0.5 * attn, 0.5 * attn * 0.2), (3 * attn, 0.0), (1.1 * attn, 1.1 * attn * 0.2 - 0.1 * attn)):
        comm = _block_comm(blk, {"cp": {"seconds": ring, "hideable_seconds": ring}}, lay, 1, False, None, 0.25)
        assert comm["contention"] == pytest.approx(want, rel=1e-12, abs=1e-18)
        assert comm["forward"] + comm["backward"] == pytest.approx(comm["cp"] + comm["contention"], rel=1e-12)
    tp = Layout(tp=2)
    blk2 = block_ops(SPEC, Shape(1, 8192, tp=2), Options(), GPU)
    assert _block_comm(blk2, _tp(1.0, 10), tp, 1, False, None, 0.25)["contention"] == 0.0


def test_tp_exposed_unless_async_then_decomposed_behind_its_gemms():
    """Plain TP: all of it on the block's path. Async TP: labkit.scale.async_tp's decomposition, each of the
    8 collectives (4 per pass) a quarter of a pass's time (tests/test_scale_mechanisms.py: its closed form)."""
    lay = Layout(tp=8, recompute="none")
    blk, plain = _comm(_tp(1.0, 8), lay)
    assert plain["tp"] == 1.0
    chunk = block_ops(SPEC, Shape(1, 8192 // 8, tp=8), Options(), GPU)
    _, hidden = _comm(_tp(1.0, 8), lay, async_tp=True)
    assert hidden["tp"] == pytest.approx(sum(atp.exposed(blk, chunk, 1.0 / 8, 1.0 / 8, 8, "none")))
    assert 0 < hidden["tp"] < 1.0


def test_pipeline_step_goes_through_the_simulator_and_the_last_stage_carries_the_head():
    """pp = 4 of 8B: the bubble is the simulator's (makespan - busiest rank's work), never below zero; the rank
    with the head (vocabulary 128K) is the busiest; interleaving (v = 2) shrinks the bubble."""
    one = predict(SPEC, Layout(dp=2, pp=4, zero="zero1", recompute="none", micro_batch=1), H100, 16, 4096,
                  efficiency=None)
    inter = predict(SPEC, Layout(dp=2, pp=4, zero="zero1", recompute="none", micro_batch=1, schedule="interleaved",
                                 virtual_stages=2), H100, 16, 4096, efficiency=None)
    assert one.parts_s["bubble"] > 0 and inter.parts_s["bubble"] < one.parts_s["bubble"]
    with pytest.raises(LayoutError, match="not a multiple"):
        predict(SPEC, Layout(dp=2, pp=4, zero="zero1", micro_batch=1, schedule="interleaved", virtual_stages=2),
                H100, 12, 4096, efficiency=None)


def test_compile_and_float8_make_the_step_shorter_flat_model_unchanged_by_them():
    lay = Layout(dp=8, zero="zero3", recompute="selective", micro_batch=2)
    eager, comp = (predict(SPEC, lay, H100, 16, 8192, efficiency=None, compile=c) for c in (False, True))
    f8 = predict(SPEC, lay, H100, 16, 8192, efficiency=None, compile=True, float8=True)
    assert f8.step_s < comp.step_s < eager.step_s
    flat = predict(SPEC, lay, H100, 16, 8192)
    assert flat.step_s == predict(SPEC, lay, H100, 16, 8192, compile=True).step_s
    with pytest.raises(LayoutError, match="no fp8"):
        predict(SPEC, Layout(dp=8), load_cluster("a100-sxm"), 8, 4096, efficiency=None, float8=True)


# --- overlapped collectives slow the compute beside them -----------------------------------------

@pytest.mark.parametrize("traffic,exposed,want", [
    (2.0, 0.0, 2.0 * 0.25 / 1.25),            # hidden whole: C k, k = s / (1 + s)
    (10.0, 5.0, 0.0),                         # W = 5, C >= W (1 + s) = 6.25: the traffic sets the step
    (6.0, 1.0, 6.0 * 0.25 / 1.25 - 1.0),       # W = 5 < C < 6.25: the slowed compute outlasts it, by 0.2
    (6.25, 1.25, 0.0),                         # the boundary, from either side
    (0.0, 0.0, 0.0),
])
def test_contention_regimes(traffic, exposed, want):
    """contention(C, exposed, s) = max(0, k min(C, W (1 + s)) - exposed), W = C - exposed: beyond max(C, W), what
    max(C, W + k min(C, W (1 + s))) adds. s = 0.25 keeps every value a binary fraction's neighbour."""
    assert contention(traffic, exposed, 0.25) == pytest.approx(want, abs=1e-15)
    assert contention(traffic, exposed, 0.0) == 0.0


def test_fsdp_traffic_hidden_behind_compute_costs_its_contention():
    """ZeRO-3 over 8 GPUs of one node: its traffic hides behind the compute, and the step grows by exactly
    k x the dp traffic (GPU.overlap_slowdown s, k = s / (1 + s)) over the same GPU without the slowdown."""
    import dataclasses

    import labkit.scale.cost_kernels as ck
    lay = Layout(dp=8, zero="zero3", recompute="selective", micro_batch=1)
    with_s = predict(SPEC, lay, H100, 16, 4096, efficiency=None)
    s = GPU.overlap_slowdown
    assert s == 0.189  # labkit/scale/gpus/h100-sxm.json, Lee et al. 2025's average
    real = ck.load_gpu
    try:
        ck.load_gpu = lambda name: dataclasses.replace(real(name), overlap_slowdown=0.0)
        without = predict(SPEC, lay, H100, 16, 4096, efficiency=None)
    finally:
        ck.load_gpu = real
    t = with_s.traffic["dp"]["seconds"]
    assert t < with_s.parts_s["compute"] and without.parts_s["contention_dp"] == 0.0
    assert with_s.parts_s["contention_dp"] == pytest.approx(t * s / (1 + s), rel=1e-12)
    assert with_s.step_s - without.step_s == pytest.approx(t * s / (1 + s), rel=1e-9)



@pytest.mark.parametrize("name, batch, seq", [("tiny", 64, 128), ("seed", 64, 256)])
def test_a_launch_bound_step_is_its_kernel_count_times_the_cost_of_one(name, batch, seq):
    """The lab's own models on one H200 (bench/scale.py --small, bench/gpu_check.py's predict row): every pass of
    the tiny model waits for the CPU, so the predicted step is exactly step_kernels' count x eager_op_us, the
    count that the predict row sets beside the profiler's. The seed model's longer GEMMs make some of its time
    the GPU's, so its step is longer than the CPU's time alone, never shorter."""
    from labkit.model import get_config
    from labkit.scale.layer_ops import step_kernels
    from labkit.scale.specs import spec_from_config

    spec, h200 = spec_from_config(get_config(name, context=seq)), load_cluster("h200-sxm")
    gpu = load_gpu(h200.gpu)
    count = step_kernels(spec, gpu, batch, seq)
    assert count["host_s"] == pytest.approx(count["kernels"] * gpu.eager_op_us * 1e-6, rel=1e-12)
    p = predict(spec, Layout(zero="dp", recompute="none", micro_batch=batch, sequence_parallel=False), h200,
                batch, seq, n_gpus=1, efficiency=None)
    if name == "tiny":
        assert p.step_s == pytest.approx(count["host_s"], rel=1e-12)
    else:
        assert count["host_s"] < p.step_s < count["host_s"] + count["gpu_s"]


def test_mpt_blocks_run_layernorm_learned_positions_and_a_tied_head():
    """specs.MPT (llm-foundry's): a block has no rotary op (positions are learned, added once to the embedding), its
    norms are torch's one-kernel LayerNorm (the fused-norm bytes), its GeLU MLP saves w1's and GeLU's outputs (2 b s
    H, not SwiGLU's 4; its LayerNorm its input and statistics); its head is the embedding's matrix: held once on a single stage, and as a copy on a
    pipeline's last stage (Megatron-LM's way), while its FLOPs stay. Planted (checked when written): the Llama
    block's rotary and eager RMSNorm appear if positions/norm are ignored."""
    from labkit.scale.footprint import block_activation_bytes, stage_params
    from labkit.scale.specs import MODELS
    m = MODELS["mpt-7b"]
    shape, opts = Shape(2, 2048), Options(recompute="none")
    names = {op.name for op in block_ops(m, shape, opts, GPU)["forward"]}
    llama_names = {op.name for op in block_ops(SPEC, shape, opts, GPU)["forward"]}
    assert "rotary" in llama_names and "rotary" not in names and "gelu" in names
    norm = next(op for op in block_ops(m, shape, opts, GPU)["forward"] if op.name == "norm1")
    assert norm.kernels == 1
    b, s, d, h = 2, 2048, m.d_model, m.hidden_dim
    mlp = block_activation_bytes(m, Layout(recompute="none"), b, s)["mlp"]
    assert mlp == pytest.approx(2 * (b * s * d + b * s + 2 * b * s * h), rel=1e-12)  # LayerNorm: input, statistics
    V = m.vocab_size * d
    one = stage_params(m, Layout(), first=True, last=True)[0]
    assert one == m.n_layers * m.layer_dense_params + V + d
    last = stage_params(m, Layout(pp=2), first=False, last=True, layers=16)[0]
    assert last == 16 * m.layer_dense_params + V + d
    assert m.active_params == m.n_layers * m.layer_params + V + d


def test_llm_foundrys_flash_path_unpads_q_k_v_and_pads_the_output_with_host_syncs():
    """unpadded_attention (llm-foundry's attn_impl 'flash', flash_attn's bert_padding): per block and micro-batch,
    forward 4 bytes an element for each of q, k and v gathered, 6 for the output padded back (zeros, index_put), 23
    kernels, and the 18 launched after q's torch.nonzero sync on the GPU's clock too, at eager PyTorch's cost each;
    backward 4 + 6 x 3 bytes an element in 7 kernels, no sync. Only where the row sets it (the triton path indexes
    nothing), and the full recompute runs it again. Planted (checked when written): without the waited launches the
    MPT 1B step on 128 GPUs is 3.5% shorter, and without the flag 7.2%."""
    import dataclasses

    from labkit.scale import kernels as K
    from labkit.scale.specs import MODELS

    b, s = 12, 2048
    plain = MODELS["mpt-1b"]
    m = dataclasses.replace(plain, unpadded_attention=True)
    d = m.d_model
    q = kv = b * s * d  # MHA: K and V as wide as q
    fwd, bwd = K.unpadded_attention("forward", q, kv, GPU), K.unpadded_attention("backward", q, kv, GPU)
    bw = GPU.hbm_bytes_per_s
    assert fwd.bytes == 4 * 3 * q + 6 * q and fwd.kernels == 23
    assert fwd.seconds == pytest.approx(fwd.bytes / bw + 18 * GPU.eager_op_us * 1e-6)
    assert fwd.host_s == pytest.approx(23 * GPU.eager_op_us * 1e-6)
    assert bwd.bytes == 4 * q + 6 * 3 * q and bwd.kernels == 7 and bwd.seconds == pytest.approx(bwd.bytes / bw)
    for recompute, times in (("none", 1), ("full", 2)):
        ops = block_ops(m, Shape(b, s), Options(recompute=recompute), GPU)
        unpad = [op for op in ops["forward"] + ops["backward"] if op.name.startswith("unpad")]
        assert [op.name for op in unpad] == ["unpad and pad forward"] * times + ["unpad and pad backward"]
        plain_ops = block_ops(plain, Shape(b, s), Options(recompute=recompute), GPU)
        assert not any(op.name.startswith("unpad") for op in plain_ops["forward"] + plain_ops["backward"])
        added = seconds(ops["forward"] + ops["backward"]) - seconds(plain_ops["forward"] + plain_ops["backward"])
        assert added == pytest.approx(times * fwd.seconds + bwd.seconds, rel=1e-9)
