"""labkit.scale's memory and recompute: activations against Korthikanti et al.'s closed forms, the recompute
policies, pipeline stages that hold only the embedding or only the loss, and the runs that ran do fit.

Korthikanti et al. 2022 (arXiv 2205.05198), sec. 4.1, bytes one GPT block keeps for backward (s tokens,
b sequences, width h, a heads, TP t, 2-byte activations and 1-byte dropout masks):
    no parallelism                    34 sbh + 5 a s^2 b
    TP                                sbh (10 + 24/t + 5 a s/(h t))
    TP + SP                           sbh/t (34 + 5 a s/h)
    TP + SP + selective recompute     34 sbh / t          (the attention core, 5 a s^2 b / t, rebuilt)
    TP + selective recompute          sbh (10 + 24/t)
    full recompute                    2 sbh (/ t with SP)
The shapes below are powers of two, so every term is an integer or an exact binary fraction in float64:
the element-by-element sum in labkit.scale.footprint and the closed form agree exactly (==).
Arithmetic only: well under a second.
"""
import dataclasses

import pytest
from labkit.measure.memory import memory_per_rank
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.footprint import block_activation_bytes, korthikanti_layer_bytes, stage_memory
from labkit.scale.layout import Layout, LayoutError, check_layout
from labkit.scale.specs import GPT_MEGATRON, LLAMA3, RECOMPUTE, gpt_spec, normalize_recompute
from labkit.scale.validation import load_sets, predict_row

S, B, H, A = 2048, 2, 1024, 16
GPT = gpt_spec("gpt-hand", d_model=H, n_layers=4, n_heads=A)


def closed_forms(t: int) -> dict:
    """(layout, expected saved, expected rebuilt) for each row of the paper's table, TP t."""
    sbh = S * B * H
    core = 5 * A * S * S * B
    return {
        "none, no TP": (Layout(recompute="none", sequence_parallel=False), 34 * sbh + core, 0),
        "TP": (Layout(tp=t, recompute="none", sequence_parallel=False), sbh * (10 + 24 / t + 5 * A * S / (H * t)), 0),
        "TP + SP": (Layout(tp=t, recompute="none"), sbh / t * (34 + 5 * A * S / H), 0),
        "TP + SP + selective": (Layout(tp=t, recompute="selective-attn"), 34 * sbh / t, core / t),
        "TP + selective, no SP": (Layout(tp=t, recompute="selective-attn", sequence_parallel=False),
                                  sbh * (10 + 24 / t), core / t),
        "full, TP": (Layout(tp=t, recompute="full", sequence_parallel=False), 2 * sbh, None),
        "full, TP + SP": (Layout(tp=t, recompute="full"), 2 * sbh / t, None),
    }


def mismatches(layer_bytes, t: int = 4) -> list[str]:
    out = []
    for name, (layout, saved, rebuilt) in closed_forms(t).items():
        got = layer_bytes(GPT, layout, B, S)
        if got["saved"] != saved or (rebuilt is not None and got["rebuilt"] != rebuilt):
            out.append(f"{name}: {got} != saved {saved}, rebuilt {rebuilt}")
    return out


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_gpt_activations_equal_korthikanti_closed_forms(t):
    assert mismatches(korthikanti_layer_bytes, t) == []
    assert mismatches(block_activation_bytes, t) == []  # the footprint's entry point takes the same path


def test_closed_form_check_catches_a_forgotten_dropout_mask():
    def planted(model, layout, b, s):  # the attention core's dropout mask (a s^2 b bytes / t) left out
        got = korthikanti_layer_bytes(model, layout, b, s)
        if layout.recompute == "none":
            got = dict(got, saved=got["saved"] - model.n_heads * s * s * b / layout.tp)
        return got
    assert len(mismatches(planted)) == 3  # the three rows that keep the core


def test_recompute_policies_and_the_old_name():
    assert RECOMPUTE == ("none", "selective-op", "selective-attn", "full")
    assert Layout(recompute="selective").recompute == "selective-op" == normalize_recompute("selective")
    with pytest.raises(ValueError, match=r"'bogus' is not a policy.*'selective-op', 'selective-attn'"):
        LLAMA3["8b"].recompute_flops_per_token(8192, "bogus")
    with pytest.raises(LayoutError, match=r"recompute='bogus' is not a policy the model knows.*selective-attn"):
        check_layout(LLAMA3["8b"], Layout(dp=8, recompute="bogus"), 8, 8, 8, 8192)
    with pytest.raises(LayoutError, match=r"'selective-op' is torchtitan's op policy.*gelu MLP.*'selective-attn'"):
        check_layout(GPT, Layout(dp=8, recompute="selective-op"), 8, 8, 8, S)


def test_recompute_flops_and_megatron_eq3():
    """Eq. 3 (Narayanan et al. 2021) against the spec's counts, exactly: without recomputation it is
    6 N + 12 l h s less the norm weights (6 x (2 h l + h)), which eq. 3 leaves out; the recomputed
    forward it adds is the spec's "full" recompute; Megatron's selective recompute is 4 l h s."""
    for m in GPT_MEGATRON.values():
        h, l, s = m.d_model, m.n_layers, 2048
        base = m.paper_flops_per_token(s, recompute=False)
        assert m.flops_per_token(s) - base == pytest.approx(6 * (2 * h * l + h), rel=1e-9)
        assert m.paper_flops_per_token(s, recompute=True) - base == pytest.approx(
            m.recompute_flops_per_token(s, "full"), rel=1e-12)
        assert m.recompute_flops_per_token(s, "selective-attn") == 4 * l * h * s
    with pytest.raises(ValueError, match="GPT-shaped"):
        LLAMA3["8b"].paper_flops_per_token(8192, recompute=True)


def test_megatron_parameter_counts_match_table1():
    """Megatron's count P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) (tied embedding, learned positions)
    for the specs' shapes gives Table 1's parameter column (as its row's quote has it)."""
    rows = load_sets()["megatron-2021-table1"]["rows"]
    for row in rows:
        m = GPT_MEGATRON[row["model"]]
        l, h, V = m.n_layers, m.d_model, m.vocab_size
        P = 12 * l * h * h * (1 + 13 / (12 * h) + (V + 2048) / (12 * l * h))
        assert round(P / 1e9, 1) == row["params_billion"], row["id"]


# --- stages -----------------------------------------------------------------------------------

def test_llama3_split_embedding_and_loss_stages():
    lay = Layout(dp=64, pp=16, tp=8, schedule="interleaved", virtual_stages=8,
                 first_stage_embedding_only=True, last_stage_loss_only=True)
    assert lay.stage_layers(126) == [0] + [1] * 126 + [0]
    assert lay.rank_layers(126) == [7] + [8] * 14 + [7]
    assert lay.layers_per_rank(126) == 8
    assert Layout(pp=8).stage_layers(126) == [16] * 6 + [15] * 2
    assert Layout(pp=8, schedule="interleaved", virtual_stages=2).rank_layers(126) == [16] * 6 + [15] * 2


def test_stage_memory_of_the_embedding_only_rank():
    spec = LLAMA3["405b"]
    lay = Layout(dp=64, pp=16, tp=8, zero="zero2", recompute="none", schedule="interleaved", virtual_stages=8,
                 first_stage_embedding_only=True, last_stage_loss_only=True)
    first = stage_memory(spec, lay, 0, 32, 8192)
    dense = -(-(7 * spec.layer_dense_params + spec.embedding_params) // 8)
    want = memory_per_rank(dense, 64, "zero2", "mixed")
    assert (first["params"], first["grads"], first["optimizer"]) == (want["params"], want["grads"], want["optimizer"])


def test_stage_refusals():
    with pytest.raises(LayoutError, match=r"8 stages.*2 stage\(s\) would hold no block and are not an embedding or loss"):
        Layout(pp=4, schedule="interleaved", virtual_stages=2).stage_layers(6)
    ends = Layout(pp=4, schedule="interleaved", virtual_stages=2, first_stage_embedding_only=True, last_stage_loss_only=True)
    assert ends.stage_layers(6) == [0, 1, 1, 1, 1, 1, 1, 0]
    with pytest.raises(LayoutError, match="hold no block"):
        ends.stage_layers(5)
    with pytest.raises(LayoutError, match=r"first_stage_embedding_only=True with pp=1"):
        check_layout(LLAMA3["8b"], Layout(dp=8, first_stage_embedding_only=True), 8, 8, 8, 8192)
    with pytest.raises(LayoutError, match=r"stages.*for 32 layers.*hold no block"):
        check_layout(LLAMA3["8b"], Layout(pp=8, schedule="interleaved", virtual_stages=5), 8, 8, 64, 8192)


# --- the runs that ran fit ----------------------------------------------------------------------

def test_published_runs_that_ran_fit():
    for name, info in load_sets().items():
        for row in info["rows"]:
            r = predict_row(row, info)
            assert r["fits"], (row["id"], r["predicted_gib"], r["gpu_gib"])
    # Narayanan et al. 2021 sec. 5.2's ZeRO-3 530B on 640 A100s (no model parallelism, full recomputation,
    # one sequence per micro-batch: the same choices as the validation set's Megatron rows)
    p = predict(GPT_MEGATRON["530b"], Layout(dp=640, zero="zero3", recompute="full"), load_cluster("a100-sxm"),
                global_batch=2560, seq_len=2048)
    assert p.fits, p.peak_gib


def test_deepspeed_zero3_gathers_a_submodule_not_a_block():
    """DeepSpeed's ZeRO-3 (Megatron 2021's Table 2 rows) holds its largest weight twice (being computed, and
    prefetched) and that weight's gradient, 2 bytes each, plus its gradient bucket of 5e8 elements: for the 530B
    GPT the MLP's 4h^2, so 6 x 4h^2 + 2 x 5e8 bytes. FSDP2 gathers a block, 10 bytes x 12h^2 (and more): with it,
    Table 2's ZeRO-3 530B on 640 GPUs in micro-batches of 4, a run that ran, would not fit."""
    m, h = GPT_MEGATRON["530b"], 20480
    lay = Layout(dp=640, zero="zero3", zero3_unit="module", recompute="full", micro_batch=4)
    assert stage_memory(m, lay, 0, 1, 2048)["gathered"] == 6 * 4 * h * h + 2 * 5e8
    block = dataclasses.replace(lay, zero3_unit="block")
    assert stage_memory(m, block, 0, 1, 2048)["gathered"] == 10 * m.layer_dense_params
    cluster = load_cluster("a100-sxm")
    assert predict(m, lay, cluster, global_batch=2560, seq_len=2048).fits
    assert not predict(m, block, cluster, global_batch=2560, seq_len=2048).fits



def _backward_rise(module, forward) -> int:
    """Bytes `module`'s backward holds at its peak above what `forward()` left alive (its saved tensors, its output
    and the gradient flowing in), the parameters' gradients left out: labkit.measure.activations.LiveBytes."""
    import torch
    from labkit.measure.activations import LiveBytes

    with LiveBytes(module) as live:
        y = forward()
        grad = torch.ones_like(y)
        start = live.mark()
        y.backward(grad)
    return live.rise(start, ignore=[p.grad for p in module.parameters()])


def _gelu_mlp(d, hidden):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(d, hidden, bias=False), nn.GELU(), nn.Linear(hidden, d, bias=False))


# (d, hidden): each moment of mlp_backward_elements is the peak in at least one shape
@pytest.mark.parametrize("gated,d,hidden", [(True, 64, 256), (True, 64, 96), (True, 128, 32), (True, 128, 48),
                                            (False, 64, 256), (False, 256, 64), (False, 256, 32)])
def test_mlp_backward_peak_equals_live_bytes(gated, d, hidden):
    """Edge case: which moment peaks. SwiGLU's gate (2 b s H) where H is wide, its input gradients (3 b s d - 4 b s H)
    where H is narrow, as TP makes it (H / tp); GELU's alike. Measured op by op in fp32 on a CPU: exact."""
    import torch
    from labkit.model.llama import ModelConfig, SwiGLU
    from labkit.scale.footprint import mlp_backward_elements

    torch.manual_seed(0)
    b, s = 2, 16
    mlp = SwiGLU(ModelConfig(d_model=d, n_heads=4, hidden_dim=hidden, context=s)) if gated else _gelu_mlp(d, hidden)
    x = torch.randn(b, s, d, requires_grad=True)
    assert _backward_rise(mlp, lambda: mlp(x)) == 4 * mlp_backward_elements(b, s, d, hidden, gated=gated)


@pytest.mark.parametrize("recompute", [False, True])
def test_block_backward_peak_is_its_mlp_at_llama_widths(recompute):
    """Edge case: a whole labkit.model block (norms, attention, SwiGLU at LLaMA's H = 8 d / 3) with and without
    recomputation: its backward peaks in the MLP, mlp_backward_elements above what it saved, and with recompute
    above the block's rebuilt activations (block_activation_elements, less its input, which the checkpoint keeps)."""
    import torch
    from labkit.measure.activations import block_activation_elements
    from labkit.model.llama import Block, ModelConfig, Rotary, run_block
    from labkit.scale.footprint import mlp_backward_elements

    torch.manual_seed(0)
    b, s, cfg = 2, 32, ModelConfig(d_model=64, n_heads=4, context=32, n_layers=1)
    block, rope = Block(cfg), Rotary(cfg.head_dim, s, cfg.rope_theta)
    x = torch.randn(b, s, cfg.d_model, requires_grad=True)
    rise = _backward_rise(block, lambda: run_block(block, x, rope, recompute=recompute))
    mlp = mlp_backward_elements(b, s, cfg.d_model, cfg.hidden_dim)
    rebuilt = block_activation_elements(b, s, cfg.d_model, cfg.n_heads, cfg.hidden_dim) - b * s * cfg.d_model
    assert rise == 4 * (mlp + (rebuilt if recompute else 0))


def test_stage_memory_backward_takes_the_rings_moment_where_it_is_larger():
    """Edge case: torchtitan's 8B at cp 8 without TP, K/V repeated (as its Table 2 rows ran), K/V by all-gather: the
    ring's backward (ring_backward_bytes, q and k as wide: b s d each, cp 8), with the attention output's gradient
    (b s d) and less the block's MLP activations (its norm 3 b s d + b s, SwiGLU 4 b s H: freed before the
    attention's backward) is larger than the MLP's moment (its gate, 2 b s H) and sets the block's backward.
    Planted mistake: the MLP's activations kept (the moments on one baseline) gives 4 b s (d + 2 H + ...) more.
    A ring whose moment is smaller (tp 8: a kv head of 32 q heads per rank) keeps the MLP's."""
    from labkit.scale.footprint import BF16, ring_backward_bytes

    m = dataclasses.replace(LLAMA3["8b"], kv_repeated=True)
    lay = Layout(cp=8, kv_rotation="allgather", micro_batch=1)
    tokens, d, h = 32768 // 8, m.d_model, m.hidden_dim
    got = stage_memory(m, lay, 0, 1, 32768)["backward"]
    ring = ring_backward_bytes(tokens * d, tokens * d, 8, "allgather") + BF16 * tokens * d
    mlp_acts = BF16 * tokens * (3 * d + 1 + 4 * h)
    assert got == BF16 * tokens * d + ring - mlp_acts
    assert ring - mlp_acts > BF16 * tokens * 2 * h  # larger than the MLP's moment
    assert got != BF16 * tokens * d + ring
    tp8 = Layout(cp=2, tp=8, micro_batch=2)
    assert stage_memory(LLAMA3["8b"], tp8, 0, 1, 8192)["backward"] == \
        stage_memory(LLAMA3["8b"], dataclasses.replace(tp8, cp_method="allgather"), 0, 1, 8192)["backward"]


def test_stage_memory_counts_one_block_backward():
    """Edge case: TP with SP and CP: the gradient flowing in is a tp-th of the rank's b s / cp tokens' width, the MLP's
    moment is at H / tp (Llama 8B at tp 8: its input gradients; without TP: its gate); a pipeline rank that holds no block (an embedding-only stage) holds no block's backward."""
    from labkit.scale.footprint import BF16

    m = LLAMA3["8b"]
    got = stage_memory(m, Layout(dp=2, cp=2, tp=8, micro_batch=2), 0, 1, 8192)["backward"]
    tokens = 2 * 8192 // 2
    assert got == BF16 * (tokens * m.d_model / 8 + tokens * (3 * m.d_model - 4 * m.hidden_dim // 8))
    assert 3 * m.d_model - 4 * m.hidden_dim / 8 > 2 * m.hidden_dim / 8  # at tp 8 the 8B's input gradients peak
    assert stage_memory(m, Layout(dp=4, cp=2, micro_batch=2), 0, 1, 8192)["backward"] == \
        BF16 * tokens * (m.d_model + 2 * m.hidden_dim)  # without TP, its gate
    lay = Layout(pp=4, first_stage_embedding_only=True)
    assert lay.rank_layers(m.n_layers)[0] == 0
    assert stage_memory(m, lay, 0, 4, 8192)["backward"] == 0


def test_a_compiled_loss_holds_4_bytes_per_logit_an_eager_one_12():
    """The loss of one micro-batch on the last stage: eager, the fp32 log-softmax output, its gradient and its
    input's gradient (12 bytes a logit); compiled (torchtitan's loss under --training.compile from bbb1b61), the
    head's bf16 output kept for the backward and a bf16 gradient (4). 8B, 2 x 8,192 tokens, tp 2: 8 bytes x 16,384 x
    128,256 / 2 apart, exactly; predict compiles the loss with the model unless told (compiled_loss), and the
    torchtitan-2024-12 set, whose 9dec370 ran it eager, says so. Planted when written: the compiled loss at 12 bytes
    left the Trainy rows' memory at +38% and +37% of their published 48.0 and 47.0 GiB (now +6%, +4%)."""
    lay = Layout(dp=4, tp=2, zero="zero3", recompute="selective-op", micro_batch=2)
    spec, cluster = LLAMA3["8b"], load_cluster("h200-sxm")
    eager, compiled = (stage_memory(spec, lay, 0, 1, 8192, compiled_loss=c)["logits"] for c in (False, True))
    assert eager - compiled == 8 * 16384 * 128256 / 2
    kw = dict(efficiency=None, compile=True)
    default, told = (predict(spec, lay, cluster, 8, 8192, **kw, **more) for more in ({}, {"compiled_loss": False}))
    assert default.memory["logits"] == compiled and told.memory["logits"] == eager
    assert predict(spec, lay, cluster, 8, 8192, efficiency=None).memory["logits"] == eager  # no compile: eager
    sets = load_sets()
    assert sets["torchtitan-2024-12"]["compiled_loss"] is False
    row = sets["torchtitan-2024-12"]["rows"][1]  # FSDP + torch.compile, 8B, local batch 2: its loss ran eager
    got = predict_row(row, sets["torchtitan-2024-12"], "kernels")["prediction"]
    assert got.memory["logits"] == stage_memory(spec, Layout(dp=8, zero="zero3", recompute="selective-op",
                                                             micro_batch=2), 0, 1, 8192)["logits"]
    for row in sets["torchtitan-h200-2025-06"]["rows"]:
        r = predict_row(row, sets["torchtitan-h200-2025-06"], "kernels")
        assert abs(r["memory_error"]) <= 0.15, (row["id"], r["memory_error"])


def test_megatrons_loss_runs_in_place_on_fp32_logits():
    """Megatron-LM's vocabulary-parallel cross-entropy (mpu/cross_entropy.py, on logits gpt_model.py casts to fp32):
    the softmax and its gradient overwrite the fp32 logits in place, so the loss holds 6 bytes a logit at its peak
    (4 fp32, 2 fp16 beside them), not torch's eager 12; its passes read and write 38 bytes a logit forward (cast,
    max, sub_, exp, sum, div_) and 14 backward (mul_, the cast back). GPT 1.7B at tp 2, 4 x 2,048 tokens: the loss
    ops and the logits against those counts, exactly. Planted when written: the Llama loss (14 and 14 bytes, 12 held)
    for GPT models fails all three."""
    from labkit.scale.gpu import load_gpu
    from labkit.scale.layer_ops import Options, Shape, end_ops

    gpu, spec = load_gpu("a100-sxm"), GPT_MEGATRON["1.7b"]
    lay = Layout(dp=4, tp=2, zero="dp", recompute="full", micro_batch=4, sequence_parallel=False)
    logits = 4 * 2048 * spec.vocab_size / 2
    head = end_ops(spec, Shape(4, 2048, 2, sequence_parallel=False), Options(attention="unfused"), gpu, "head")
    loss_f, loss_b = (next(op for op in head[d] if op.name == "loss") for d in ("forward", "backward"))
    rate = gpu.hbm_bytes_per_s
    assert loss_f.seconds == pytest.approx(38 * logits / rate, rel=1e-12)
    assert loss_b.seconds == pytest.approx(14 * logits / rate, rel=1e-12)
    assert stage_memory(spec, lay, 0, 1, 2048)["logits"] == 6 * logits
