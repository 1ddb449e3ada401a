"""Float8 rowwise casts timed by torchao's measured table (labkit.scale.float8, issue 34): the model reproduces
the table at its grid points, carries it off the grid as stated, and refuses a malformed table. Pure
arithmetic, no process: well under a second."""
from __future__ import annotations

import json

import pytest

from labkit.scale import float8 as F8
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.gpu import GPU_DIR, GPUError, load_gpu
from labkit.scale.layout import Layout
from labkit.scale.specs import LLAMA3

H500 = load_gpu("h100-sxm-500w")
H100 = load_gpu("h100-sxm")
TETON = load_cluster("h100-grand-teton")


def _bench_speedup(m, k, n, gpu):
    """torchao's benchmark in the kernel model: (bf16 GEMMs + neighbours) / (rowwise GEMMs + casts + neighbours)."""
    bf16, around = F8.bench_seconds(m, k, n, gpu, "bf16")
    fp8, _ = F8.bench_seconds(m, k, n, gpu, "fp8_rowwise")
    casts = sum(op.seconds for op in F8.float8_casts("bench", "rowwise", m, k, n, gpu, True))
    return (bf16 + around) / (fp8 + casts + around)


def test_the_model_reproduces_torchaos_rowwise_table_at_every_grid_point():
    """All 216 points of pytorch/ao fdddb2cf's 'Rowwise scaling' table, exactly; at the one point where the table
    leaves the casts less time than their counted bytes take at the streaming rate (M, K, N = 32,768, 16,384,
    32,768: 1.73, 0.9 of that time) the floor holds, and the model is 1% under the table there. Planted mistake:
    the counted bytes alone (factor 1) miss the table by 47% at the median (checked when this test was written)."""
    ms, ks, ns, table = H500.fp8_rowwise_linear
    assert len(table) == 6 * 6 * 6 and table[(1024, 1024, 1024)] == 0.42 and table[(32768, 16384, 32768)] == 1.73
    floored = []
    for (m, k, n), speedup in table.items():
        got = _bench_speedup(m, k, n, H500)
        if F8.cast_factor(m, k, n, H500) == 1.0:
            floored.append((m, k, n))
            assert speedup * 0.99 < got < speedup
        else:
            assert got == pytest.approx(speedup, rel=1e-9)
    assert floored == [(32768, 16384, 32768)]


def test_rowwise_casts_are_counted_bytes_times_the_tables_rate_off_the_grid():
    """Off the grid: log-linear between grid points, the edge's factor beyond (M of 98,304 runs at M = 32,768's,
    N = 128 at N = 1,024's), applied to the shape's own counted bytes; a kind without the table keeps them at the
    streaming rate. Planted mistake: taking the edge's seconds instead of its rate would make wk's casts (n = 128)
    as long as a 1,024-wide linear's, not a shape's own."""
    rows, k = 98304, 4096
    edge = F8.cast_factor(32768, 4096, 1024, H500)
    assert F8.cast_factor(rows, k, 128, H500) == pytest.approx(edge, rel=1e-12)
    f, b = F8.float8_casts("wk", "rowwise", rows, k, 128, H500, True)
    plain = F8.float8_casts("wk", "rowwise", rows, k, 128, H100, True)
    fwd_bytes, bwd_bytes, _, _ = F8.counted_bytes("rowwise", rows, k, 128)
    assert (f.bytes, b.bytes) == (fwd_bytes, bwd_bytes) == (plain[0].bytes, plain[1].bytes)
    assert f.seconds == pytest.approx(edge * fwd_bytes / H500.hbm_bytes_per_s, rel=1e-12)
    assert plain[0].seconds == pytest.approx(fwd_bytes / H100.hbm_bytes_per_s, rel=1e-12)
    lo, hi = F8.cast_factor(32768, 4096, 2048, H500), F8.cast_factor(32768, 4096, 4096, H500)
    mid = F8.cast_factor(32768, 4096, 2896, H500)  # about the geometric middle
    assert min(lo, hi) < mid < max(lo, hi)
    tensorwise = F8.float8_casts("wk", "tensorwise", rows, k, 128, H500, True)
    assert tensorwise[0].seconds == pytest.approx(tensorwise[0].bytes / H500.hbm_bytes_per_s, rel=1e-12)


def test_rowwise_makes_torchtitans_8b_tp8_step_slower_than_bf16_as_measured():
    """torchtitan's async TP file: 8B on 64 H100s at TP 8, rowwise 3,708 tok/s against bf16's 4,378 (issue #1207:
    the small wk and wv linears). The model now says rowwise is the slower, and tensorwise the faster."""
    lay = Layout(dp=8, tp=8, zero="zero3", recompute="selective-op", micro_batch=12)
    kw = dict(efficiency=None, compile=True)
    bf16, tw, rw = (predict(LLAMA3["8b"], lay, TETON, 96, 8192, float8=f, **kw) for f in (False, True, "rowwise"))
    assert rw.step_s > bf16.step_s > tw.step_s


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("n"), "must be an object with 'm', 'k', 'n'"),
    (lambda t: t.update(m=[2048, 1024, 4096, 8192, 16384, 32768]), "ascending positive ints"),
    (lambda t: t["speedup"].pop(), "must hold 36 rows"),
    (lambda t: t["speedup"][0].__setitem__(0, 42), "0.42, not 42 percent"),
])
def test_a_malformed_table_names_the_field_and_the_fix(edit, match):
    values = json.loads((GPU_DIR / "h100-sxm-500w.json").read_text())
    edit(values["fp8_rowwise_linear"])
    with pytest.raises(GPUError, match=match):
        load_gpu(values)


def test_float8_tensorwise_tp_gathers_float8_and_scatters_bf16():
    """torchao's float8 TP (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, which torchtitan
    runs with tensorwise float8): the all-gathers move 1-byte values, the reduce-scatters bf16 partials. 8B at tp 8
    under torchtitan's op policy (6 all-gathers and 4 reduce-scatters a block): TP's bytes are 7/10 of bf16's, and
    plain TP exposes each kind at its own time, 2 of each forward, 4 gathers and 2 scatters backward. The rowwise
    recipe keeps plain TP, bf16's bytes. Planted mistake: both kinds in float8 would give 1/2."""
    lay = Layout(dp=8, tp=8, zero="zero3", recompute="selective-op", micro_batch=12)
    kw = dict(efficiency=None, compile=True)
    bf16, tensorwise, rowwise = (predict(LLAMA3["8b"], lay, TETON, 96, 8192, **kw, float8=f)
                                 for f in (False, True, "rowwise"))
    assert tensorwise.traffic["tp"]["bytes"] == pytest.approx(0.7 * bf16.traffic["tp"]["bytes"], rel=1e-12)
    assert rowwise.traffic["tp"]["bytes"] == bf16.traffic["tp"]["bytes"]
    calls = tensorwise.traffic["tp"]["calls"]
    gather, scatter = calls["all_gather"], calls["reduce_scatter"]
    assert gather < scatter and bf16.traffic["tp"]["calls"]["all_gather"] > gather
    blocks = LLAMA3["8b"].n_layers * tensorwise.n_micro
    assert tensorwise.parts_s["exposed_tp"] == pytest.approx(blocks * (6 * gather + 4 * scatter), rel=1e-12)
    assert F8.tp_gather_bytes("tensorwise", 2) == 1 and F8.tp_gather_bytes("rowwise", 2) == 2
    assert F8.tp_gather_bytes(None, 4) == 4


H200 = load_cluster("h200-sxm")
# Llama 3.1 8B's block linears, as torchtitan's model.py shapes them (d 4096, 8 K/V heads of 128, hidden 14,336):
# wq and wo d x d, wk and wv d x 1,024, w1 and w3 d x 14,336, w2 14,336 x d
BLOCK_LINEARS = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336


def test_fsdp_float8_all_gather_moves_the_block_linears_in_float8_and_nothing_else():
    """torchao's float8 all-gather under FSDP2 (torchtitan's enable_fsdp_float8_all_gather, the Trainy H200 rows):
    8B on 32 H200s, FSDP, local batch 2: the step's two all-gathers (forward, backward) move 1 byte for each of the
    32 blocks' linear weights instead of 2, the rest (norms, embedding, head) stays bf16, the reduce-scatter is
    unchanged: each GPU sends 31/32 of 2 x 32 x BLOCK_LINEARS bytes fewer. The weights' casts lose their forward
    (torchao casts the shard before the gather) and their backward keeps one layout copy (2 bytes, not 3).
    Where FSDP does not gather (plain DP) the option changes nothing, as torchtitan ignores it without dp_shard.
    Planted when written: every parameter in float8 (the embedding and head too) sends 2 x 31/32 x 2 x 525M more
    bytes fewer and fails the first assert."""
    lay = Layout(dp=32, zero="zero3", recompute="selective-op", micro_batch=2)
    kw = dict(efficiency=None, compile=True, float8=True)
    plain, gathered = (predict(LLAMA3["8b"], lay, H200, 64, 8192, **kw, float8_all_gather=g) for g in (False, True))
    saved = plain.traffic["dp"]["bytes"] - gathered.traffic["dp"]["bytes"]
    assert saved == pytest.approx(2 * 31 / 32 * 32 * BLOCK_LINEARS, rel=1e-12)
    assert gathered.step_s < plain.step_s
    shape = (16384, 4096, 14336)  # w1: 2 x 8,192 rows, k = d, n = hidden
    fwd, bwd = (op.seconds for op in F8.float8_casts("w1", "tensorwise", *shape, H100, True))
    fwd_g, bwd_g = (op.seconds for op in F8.float8_casts("w1", "tensorwise", *shape, H100, True, True))
    weight = 4096 * 14336 / H100.hbm_bytes_per_s
    assert fwd - fwd_g == pytest.approx(5 * weight, rel=1e-9) and bwd - bwd_g == pytest.approx(1 * weight, rel=1e-9)
    ddp = Layout(dp=8, zero="dp", recompute="selective-op", micro_batch=1)
    a, b = (predict(LLAMA3["8b"], ddp, H200, 8, 8192, **kw, float8_all_gather=g) for g in (False, True))
    assert a.step_s == b.step_s and a.traffic["dp"]["bytes"] == b.traffic["dp"]["bytes"]


@pytest.mark.parametrize("float8", (False, "rowwise"))
def test_float8_all_gather_outside_tensorwise_float8_names_the_fix(float8):
    """torchtitan asserts that float8 all-gather runs with the tensorwise recipe only; without float8 it means nothing."""
    from labkit.scale.layout import LayoutError

    lay = Layout(dp=32, zero="zero3", recompute="selective-op", micro_batch=2)
    with pytest.raises(LayoutError, match="float8_all_gather=True needs float8=True .tensorwise."):
        predict(LLAMA3["8b"], lay, H200, 64, 8192, efficiency=None, float8=float8, float8_all_gather=True)
