"""DeepSpeed's ZeRO-3 of 2021 (labkit/scale/deepspeed_zero3.py): which uses gather a weight, and a step's clocks.

The rules are DeepSpeed v0.3.13's (stage3.py: fetch, prefetch, release; its defaults' 1e9-element reuse distance and
live-parameter limit); each test names the edge case it targets. Arithmetic only, well under a second.
"""
import pytest

from labkit.scale import deepspeed_zero3 as ds
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.specs import GPT_MEGATRON


def _numels(name):
    spec = GPT_MEGATRON[name]
    return {**ds.submodules(spec), "embedding": spec.embedding_params, "head": spec.head_params}


def test_full_recompute_gathers_a_weight_again_past_the_reuse_distance():
    """175B (d = 12,288), two layers, full recompute: the forward's use of every weight is freed (its replay is far);
    between a weight's replay and its backward lie the weights after it twice, so the MLP's second matrix (nothing in
    between) stays gathered and the QKV (2.7e9 elements between), the output (2.4e9) and the MLP's first (1.2e9) are
    gathered a third time; the head's forward and backward are adjacent (kept), the embedding's are not. Planted
    mistake: a distance over the backward's uses only (not the replay's) would keep the MLP's first matrix (w1: 4)."""
    got = ds.fetch_counts(_numels("175b"), layers=2, n_micro=1, recompute=True)
    assert got == {"embedding": 2, "qkv": 6, "wo": 6, "w1": 6, "w2": 4, "head": 1}
    # no replay: each weight is gathered for its forward and again for its backward (the last layer's MLP output too:
    # the head's forward and backward, 1.26e9 elements, lie between)
    assert ds.fetch_counts(_numels("175b"), layers=2, n_micro=1, recompute=False) == {
        "embedding": 2, "qkv": 4, "wo": 4, "w1": 4, "w2": 4, "head": 1}


def test_a_narrower_model_keeps_its_weights_from_replay_to_backward():
    """22B (d = 6,144): 18 d^2 = 6.8e8 elements lie between a QKV's replay and its backward, under the 1e9 default, so
    nothing is gathered a third time: at most twice a layer (the last layer's early weights once: from its forward to
    its replay, with the head between, fewer than 1e9 elements)."""
    counts = ds.fetch_counts(_numels("22b"), layers=4, n_micro=1, recompute=True)
    assert all(counts[n] <= 2 * 4 for n in ds.submodules(GPT_MEGATRON["22b"]))
    assert counts["qkv"] == 2 * 4 - 1


def _tiny(max_reuse, slowdown=0.0):
    numels = {"qkv": 10, "w2": 10, "embedding": 0, "head": 0}
    secs = {"f": {"qkv": 2.0, "w2": 2.0}, "r": {}, "b": {"qkv": 4.0, "w2": 4.0}}
    gather = {"qkv": 1.0, "w2": 1.0, "embedding": 0.0, "head": 0.0}
    scatter = {"qkv": 1.0, "w2": 1.0, "embedding": 0.0, "head": 0.0}
    return ds.zero3_step(numels, secs, gather, scatter, layers=1, n_micro=1, recompute=False, max_live=1e9,
                         max_reuse=max_reuse, prefetch=10, slowdown=slowdown)


def test_each_gather_is_issued_after_a_synchronize():
    """v0.3.13's _allgather_param calls torch.cuda.synchronize() before each weight's all-gather, fetch or prefetch.
    Edge case: the live limit (10 elements, one weight) stops the MLP's prefetch, so its gather is fetched while the
    QKV's forward (2 s) still runs: it waits for it, then 1 s, then 2 s of its own forward; the backward runs on as
    in `test_a_steps_clocks_by_hand`: 15 s. Planted mistake, checked: a gather issued without that wait overlaps the
    QKV's forward, 14 s."""
    numels = {"qkv": 10, "w2": 10, "embedding": 0, "head": 0}
    secs = {"f": {"qkv": 2.0, "w2": 2.0}, "r": {}, "b": {"qkv": 4.0, "w2": 4.0}}
    gather = {"qkv": 1.0, "w2": 1.0, "embedding": 0.0, "head": 0.0}
    scatter = {"qkv": 1.0, "w2": 1.0, "embedding": 0.0, "head": 0.0}
    got = ds.zero3_step(numels, secs, gather, scatter, layers=1, n_micro=1, recompute=False, max_live=10,
                        max_reuse=1e9, prefetch=10)
    assert got["step_s"] == 15.0 and got["gathers"] == {"embedding": 1, "qkv": 1, "w2": 1, "head": 1}


def test_a_steps_clocks_by_hand():
    """One layer of two weights (gather 1 s, forward 2 s, backward 4 s, reduce-scatter 1 s), the prefetch bucket one
    weight. Kept from forward to backward: the QKV's gather is waited for (1), the MLP's hides behind the QKV (the
    host ran ahead), 2 + 2 of forward, 4 + 4 of backward, each reduce-scatter after the backward that makes its
    gradient, the last one exposed: 1 + 4 + 8 + 1 = 14 s. Freed after every use: the backward's gathers are
    prefetched in the forward's shadow, and the embedding's (empty) fetch synchronizes once more: 15 s. Planted
    mistake: a reduce-scatter issued before its gradient exists (no `ready`) would give 13 s."""
    kept = _tiny(max_reuse=1e9)
    assert kept == {"step_s": 14.0, "gpu_s": 12.0, "network_s": 4.0, "contention_s": 0.0,
                    "gathers": {"embedding": 1, "qkv": 1, "w2": 1, "head": 1}}
    assert _tiny(max_reuse=0.0)["step_s"] == 15.0
    # the contention rule inside the clocks (slowdown 0.5): the QKV's forward meets the MLP's gather (1 s of it) and
    # its backward the MLP's reduce-scatter (1 s): each does 1 / 1.5 of its work in that second, 1/3 s more each
    slowed = _tiny(max_reuse=1e9, slowdown=0.5)
    assert slowed["step_s"] == pytest.approx(14 + 2 / 3, rel=1e-12)
    assert slowed["contention_s"] == pytest.approx(2 / 3, rel=1e-12)


def test_predict_counts_deepspeeds_collectives_and_runs_its_clock():
    """Megatron-LM 2021's ZeRO-3 175B on 384 A100s (Table 2): the step's dp traffic is fetch_counts' gathers of each
    weight in fp16 and one fp16 reduce-scatter of each per micro-batch (not FSDP2's fp32: a planted 4 bytes would
    add the reduce-scatters' bytes again); exposed_dp is what zero3_step's clocks add to the kernels."""
    spec, lay = GPT_MEGATRON["175b"], Layout(dp=384, zero="zero3", zero3_unit="module", recompute="full",
                                             micro_batch=4, sequence_parallel=False)
    p = predict(spec, lay, load_cluster("a100-sxm"), 1536, 2048, efficiency=None)
    numels = ds.numels(spec, lay)
    counts = ds.fetch_counts(numels, spec.n_layers, 1, True)
    ring = 383 / 384
    gathered = sum(2 * numels[n] * k for n, k in counts.items())
    scattered = sum(2 * v * (1 if n in ds.ENDS else spec.n_layers) for n, v in numels.items())
    assert p.traffic["dp"]["bytes"] == pytest.approx(ring * (gathered + scattered), rel=1e-12)
    assert p.traffic["dp"]["count"] == sum(counts.values()) + 4 * spec.n_layers + 2
    assert p.parts_s["exposed_dp"] > 0 and p.step_s == pytest.approx(sum(p.parts_s.values()), rel=1e-12)


@pytest.mark.parametrize("recompute", ("full", "selective-attn", "none"))
def test_segments_share_out_every_op_of_the_block(recompute):
    """Every op of a GPT block lands in one submodule's use: the forward's sum is the block's forward, the replay's
    and the backward's together are the block's backward (which holds the replay); the attention core goes with the
    QKV, the GeLU with the MLP's first matrix. Edge case: Megatron's selective recompute replays only the core."""
    from labkit.scale.gpu import load_gpu
    from labkit.scale.layer_ops import Options, Shape, block_ops, seconds

    spec = GPT_MEGATRON["175b"]
    blk = block_ops(spec, Shape(4, 2048, sequence_parallel=False), Options(recompute=recompute), load_gpu("a100-sxm"))
    seg = ds.segments(blk)
    assert sum(seg["forward"].values()) == pytest.approx(seconds(blk["forward"]), rel=1e-12)
    both = sum(seg["backward"].values()) + sum(seg["recompute"].values())
    assert both == pytest.approx(seconds(blk["backward"]), rel=1e-12)
    attention = sum(op.seconds for op in blk["forward"] if op.kind == "attention")
    assert seg["forward"]["qkv"] > attention > 0 and set(seg["forward"]) == {"qkv", "wo", "w1", "w2"}
    assert (sum(seg["recompute"].values()) > 0) == (recompute != "none")
