"""The kernel model's mechanisms for torchtitan's async TP and float8 recipes (issue 34), each against its closed
form and each constant against its cited figure. Pure arithmetic, no process: well under a second."""
from __future__ import annotations

import json

import pytest

from labkit.scale import async_tp as atp
from labkit.scale import float8 as F8
from labkit.scale import kernels as K
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.gpu import GPU_DIR, GPUError, load_gpu
from labkit.scale.layer_ops import Options, Shape, block_ops
from labkit.scale.layout import Layout, LayoutError
from labkit.scale.specs import LLAMA3

H500 = load_gpu("h100-sxm-500w")
H100 = load_gpu("h100-sxm")
TETON = load_cluster("h100-grand-teton")


def _tflops(m, n, k, gpu, dtype):
    op = K.gemm("g", m, n, k, gpu, dtype)
    return op.flops / op.seconds / 1e12


def test_decomposed_collective_closed_form():
    """g + (tp - 1) max(g, c) - G, c = t / (tp - 1), never below 0: a free link leaves the split GEMMs' slowdown
    tp g - G; a slow one the transfer less what hides it. Planted mistake: the rule before, everything hidden
    behind the GEMMs (max(0, t - G)), gives 0 where the decomposition does not."""
    assert atp.decomposed(8.0, 1.25, 0.0, 8) == pytest.approx(8 * 1.25 - 8.0)       # free link: 2.0
    assert atp.decomposed(8.0, 1.25, 14.0, 8) == pytest.approx(1.25 + 14.0 - 8.0)  # c = 2 > g
    assert atp.decomposed(8.0, 0.9, 0.0, 8) == 0.0                                  # a split faster than whole
    assert atp.decomposed(8.0, 1.25, 5.0, 1) == 0.0
    planted_all_hidden = max(0.0, 7.0 - 8.0)
    assert atp.decomposed(8.0, 1.25, 7.0, 8) == pytest.approx(2.0) != planted_all_hidden


def test_async_tp_pairs_each_collective_with_the_gemms_it_feeds():
    """atp.exposed on 70B at tp 8 (torchtitan's async TP rows: 16 x 8K tokens, float8 tensorwise, full recompute)
    equals the closed form summed over the four groups of each pass, G and g computed here from kernels.gemm
    directly (T = 131,072 rows; a chunk T / 8); full recompute runs the forward's four again in the backward.
    Edge case: the backward's two reduce-scatters sum several matmuls' input gradients (w1 + w3; wq + wk + wv),
    which torch's micro-pipeline pass does not fuse: each costs the whole collective, t, as plain TP's. Planted
    mistake: decomposing them too (the rule before) hides part of that t behind their matmuls."""
    spec, tp, T = LLAMA3["70b"], 8, 16 * 8192
    d, kv, H = spec.d_model, spec.kv_dim, spec.hidden_dim
    opts = Options(compile=True, float8=True, recompute="full")
    blk = block_ops(spec, Shape(16, 8192, tp=tp), opts, H500)
    chunk = block_ops(spec, Shape(16, 8192 // tp, tp=tp), opts, H500)

    def g(rows, shapes):  # the group's GEMMs, (n, k) each, on `rows` rows
        return sum(K.gemm("x", rows, n, k, H500, "fp8").seconds for n, k in shapes)

    fwd = [[(d // tp, d), (kv // tp, d), (kv // tp, d)], [(d, d // tp)], [(H // tp, d), (H // tp, d)], [(d, H // tp)]]
    bwd = [[(H // tp, d)], [(d, H // tp), (d, H // tp)], [(d // tp, d)], [(d, d // tp), (d, kv // tp), (d, kv // tp)]]
    t = 3e-3
    want_f = sum(atp.decomposed(g(T, s), g(T // tp, s), t, tp) for s in fwd)
    want_b = atp.decomposed(g(T, bwd[0]), g(T // tp, bwd[0]), t, tp) + t + \
        atp.decomposed(g(T, bwd[2]), g(T // tp, bwd[2]), t, tp) + t + want_f
    got_f, got_b = atp.exposed(blk, chunk, t, t, tp, recompute="full")
    assert got_f == pytest.approx(want_f, rel=1e-12) and got_b == pytest.approx(want_b, rel=1e-12)
    planted = sum(atp.decomposed(g(T, s), g(T // tp, s), t, tp) for s in bwd) + want_f
    assert got_b > planted * (1 + 1e-6)
    assert got_f > 0  # fp8 GEMMs at tp 8 are shorter than their chunks' transfers: part of TP shows


@pytest.mark.parametrize("recompute, backward", [("none", 0), ("selective-op", 0), ("full", 2)])
def test_each_async_reduce_scatter_closes_with_its_sum(recompute, backward):
    """torch's fused_matmul_reduce_scatter sums the stacked partials after its pipelined loop: reduce_s once per
    fused reduce-scatter, 2 in the forward (wo, w2), none in the backward (its two, after the w1 + w3 and the
    wq + wk + wv input gradients, are NCCL's: not fused), 2 in a fully recomputing backward (its forward's wo and
    w2 again) and none for the op policy's re-run all-gathers."""
    spec, tp = LLAMA3["8b"], 8
    opts = Options(recompute=recompute)
    blk = block_ops(spec, Shape(2, 8192, tp=tp), opts, H500)
    chunk = block_ops(spec, Shape(2, 8192 // tp, tp=tp), opts, H500)
    f0, b0 = atp.exposed(blk, chunk, 1e-3, 1e-3, tp, recompute)
    f1, b1 = atp.exposed(blk, chunk, 1e-3, 1e-3, tp, recompute, reduce_s=0.25)
    assert (f1 - f0, b1 - b0) == pytest.approx((2 * 0.25, backward * 0.25), rel=1e-12)


def test_async_tp_sum_in_predict_reads_the_stacked_partials():
    """predict's reduce_s for 8B at tp 8 on 2 x 8K tokens: the bf16 stacked partials (T x d) read and T / tp x d
    written at the kind's HBM rate, 2 in the forward (the backward's reduce-scatters are not fused) with no
    recompute: exposed TP grows by exactly 2 L m of it over the
    same step without the sum (async_tp.exposed with reduce_s = 0, patched in)."""
    import labkit.scale.cost_kernels as ck
    lay = Layout(dp=8, tp=8, zero="zero3", recompute="none", micro_batch=2)
    with_sum = predict(LLAMA3["8b"], lay, TETON, 32, 8192, efficiency=None, async_tp=True)
    real = ck.atp.exposed
    try:
        ck.atp.exposed = lambda *a: real(*a[:6])
        without = predict(LLAMA3["8b"], lay, TETON, 32, 8192, efficiency=None, async_tp=True)
    finally:
        ck.atp.exposed = real
    T, d = 2 * 8192, LLAMA3["8b"].d_model
    reduce_s = 2 * T * d * (1 + 1 / 8) / H500.hbm_bytes_per_s
    grown = with_sum.parts_s["exposed_tp"] - without.parts_s["exposed_tp"]
    assert grown == pytest.approx(2 * LLAMA3["8b"].n_layers * with_sum.n_micro * reduce_s, rel=1e-9)


def test_async_tp_in_predict_lies_between_all_hidden_and_all_exposed():
    lay = Layout(dp=32, tp=8, zero="zero3", recompute="full", micro_batch=16)
    kw = dict(efficiency=None, compile=True, float8=True)
    plain = predict(LLAMA3["70b"], lay, TETON, 512, 8192, **kw)
    hidden = predict(LLAMA3["70b"], lay, TETON, 512, 8192, async_tp=True, **kw)
    assert 0 < hidden.parts_s["exposed_tp"] < plain.parts_s["exposed_tp"]
    assert hidden.step_s == pytest.approx(sum(hidden.parts_s.values()), rel=1e-12)


def test_rowwise_gemm_reproduces_fbgemm_figure_tensorwise_keeps_the_mamf_efficiency():
    """FBGEMM 3ad9031d's 'H100 500W' table: fp8 rowwise (CUTLASS) 1125.51 TFLOP/s at 8192^3, exactly; tensorwise
    (the MAMF's per-SM efficiency at the fp8 peak, and a tile's prologue and epilogue and the kernel's fixed time as
    long as in bf16) 1148.5 there. A kind without a rowwise figure (h100-sxm) runs both recipes alike. Planted
    mistake: rowwise at the tensorwise rate would give 1148.5, not 1125.51."""
    assert _tflops(8192, 8192, 8192, H500, "fp8_rowwise") == pytest.approx(1125.51, rel=1e-9)
    tensorwise = _tflops(8192, 8192, 8192, H500, "fp8")
    assert tensorwise == pytest.approx(1148.5, rel=1e-3) and tensorwise != pytest.approx(1125.51, rel=1e-3)
    assert _tflops(4096, 1024, 8192, H100, "fp8_rowwise") == _tflops(4096, 1024, 8192, H100, "fp8")


def test_float8_casts_are_torchaos_count_per_recipe():
    """torchao's roofline_utils (fuse_with_prev=False): tensorwise 6 rk + 8 kn + 6 rn bytes in 3 + 4 + 3 kernels,
    rowwise 8 rk + 10 kn + 8 rn in 2 + 3 + 2 (X: rows x k, W: k x n, dY: rows x n); the input's in the forward,
    dY's in the backward, the weight's split 5 | 3 (tensorwise) and 3 | 7 (rowwise)."""
    r, k, n = 4096, 1024, 512
    for recipe, (a, w, wf, kern, kern_f) in {"tensorwise": (6, 8, 5, 10, 6), "rowwise": (8, 10, 3, 7, 3)}.items():
        f, b = F8.float8_casts("x", recipe, r, k, n, H500, True)
        assert f.bytes + b.bytes == a * r * k + w * k * n + a * r * n
        assert f.bytes == a * r * k + wf * k * n and f.kernels + b.kernels == kern and f.kernels == kern_f
    with pytest.raises(ValueError, match="not a recipe"):
        F8.float8_casts("x", "blockwise", r, k, n, H500, True)
    with pytest.raises(LayoutError, match="not a recipe"):
        predict(LLAMA3["8b"], Layout(dp=8), TETON, 8, 8192, efficiency=None, float8="blockwise")


def test_rowwise_block_runs_rowwise_gemms_and_casts_and_a_longer_step():
    """A block under float8="rowwise" times its linears with the rowwise GEMM and the rowwise casts (True is
    tensorwise, torchao's default); the step is longer than tensorwise's (tests/test_scale_float8.py: how much)."""
    spec, T = LLAMA3["8b"], 12 * 8192
    blk = {f: block_ops(spec, Shape(12, 8192, tp=8), Options(compile=True, float8=f), H500) for f in (True, "rowwise")}
    for f, dtype, recipe in ((True, "fp8", "tensorwise"), ("rowwise", "fp8_rowwise", "rowwise")):
        wq = [op for op in blk[f]["forward"] if op.name == "wq"][0]
        cast = [op for op in blk[f]["forward"] if op.name == "wq cast"][0]
        assert wq.seconds == K.gemm("wq", T, spec.d_model // 8, spec.d_model, H500, dtype).seconds
        assert cast == F8.float8_casts("wq", recipe, T, spec.d_model, spec.d_model // 8, H500, True)[0]
    lay = Layout(dp=8, tp=8, zero="zero3", recompute="selective-op", micro_batch=12)
    tw, rw = (predict(spec, lay, TETON, 96, 8192, efficiency=None, compile=True, float8=f) for f in (True, "rowwise"))
    assert rw.step_s > tw.step_s


def test_500w_hbm_is_the_hosts_published_bandwidth_and_torchaos_measured_fraction():
    """torchtitan's async TP file: '96GB HBM2e with 2.4 TB/sec'; torchao: pointwise kernels 'about 2.2k GBPS on
    Meta's H100 variant', 0.92 of it."""
    assert H500.hbm_tbytes_per_s == 2.4 and round(2.2 / 2.4, 2) == H500.hbm_fraction
    assert H500.hbm_bytes_per_s == pytest.approx(2.4e12 * 0.92)


def test_rowwise_figure_checked_like_every_field():
    values = json.loads((GPU_DIR / "h100-sxm-500w.json").read_text())
    with pytest.raises(GPUError, match="fp8_rowwise_tflops.*unit off by 1,000"):
        load_gpu(dict(values, fp8_rowwise_tflops=1125.51e3))
    with pytest.raises(GPUError, match="fp8_rowwise_shape"):
        load_gpu({k: v for k, v in values.items() if k != "fp8_rowwise_shape"})


def test_op_policy_replays_its_all_gathers_behind_the_recomputed_wk_and_w3():
    """torchtitan's op policy saves reduce-scatter outputs, not all-gathers (labkit.scale.traffic.TP_RECOMPUTED), so
    under async TP its backward decomposes two more all-gathers, each behind the one recomputed matmul it feeds:
        backward = sum over BACKWARD_GROUPS + decomposed(G_wk, g_wk, t) + decomposed(G_w3, g_w3, t)
    (8B at tp 8, torchtitan's async TP rows: 12 x 8K tokens, compile, bf16; G, g from kernels.gemm here). Planted
    mistake: the policy replaying nothing (the rule before) gives the plain backward, less by those two terms."""
    spec, tp, T = LLAMA3["8b"], 8, 12 * 8192
    d, kv, H = spec.d_model, spec.kv_dim, spec.hidden_dim
    opts = Options(compile=True, recompute="selective-op")
    blk = block_ops(spec, Shape(12, 8192, tp=tp), opts, H500)
    chunk = block_ops(spec, Shape(12, 8192 // tp, tp=tp), opts, H500)

    def g(rows, n, k):
        return K.gemm("x", rows, n, k, H500).seconds

    t = 1.5e-3  # about one all-gather of 12 x 8K x 4096 bf16 at 460 GB/s, over 7 steps' worth
    replayed = atp.decomposed(g(T, kv // tp, d), g(T // tp, kv // tp, d), t, tp) + \
        atp.decomposed(g(T, H // tp, d), g(T // tp, H // tp, d), t, tp)
    f_op, b_op = atp.exposed(blk, chunk, t, t, tp, recompute="selective-op")
    f_none, b_none = atp.exposed(blk, chunk, t, t, tp, recompute="none")
    assert f_op == f_none and b_op == pytest.approx(b_none + replayed, rel=1e-12)
    assert replayed > 0 and b_op != pytest.approx(b_none, rel=1e-6)  # wk (n = 128) hides little of its gather


def test_kernel_model_splits_tp_by_pass_as_the_policy_replays_it():
    """Plain TP, 8B at tp 8 under each policy: the block's TP time t splits into forward 4/n t and backward
    (4 + r)/n t, n = 8 + r (r = 0, 2, 4: none, op policy, full), and exposed_tp = L m t exactly.
    Planted mistake: the op policy split as 'none' (4/8 forward) would put 0.5 t in the forward, not 0.4 t."""
    from labkit.scale.cost_kernels import _block_comm

    blk = block_ops(LLAMA3["8b"], Shape(1, 8192, tp=8), Options(), H100)
    for policy, r in (("none", 0), ("selective-op", 2), ("full", 4)):
        one = {"all_gather": 1.0 / (8 + r), "reduce_scatter": 1.0 / (8 + r)}  # axis_traffic's one-call times
        got = _block_comm(blk, {"tp": {"seconds": 1.0, "calls": one}}, Layout(tp=8, recompute=policy), 1, False)
        assert got["forward"] == pytest.approx(4 / (8 + r)) and got["backward"] == pytest.approx((4 + r) / (8 + r))
        assert got["tp"] == pytest.approx(1.0)
    one = {"all_gather": 0.1, "reduce_scatter": 0.1}
    op = _block_comm(blk, {"tp": {"seconds": 1.0, "calls": one}}, Layout(tp=8, recompute="selective-op"), 1, False)
    assert op["forward"] != pytest.approx(0.5)
