"""The capstone's proof matrix (labkit/compose/matrix.py: LAYOUTS, shared with notebook 14): every parallelism composed on one Mesh trains exactly as one process (notebook 14).

Each layout trains K = 3 AdamW steps in float64 on the same global batches as one process, and every
loss and every parameter (gathered back to its full shape by labkit.compose.state, with labkit's own
placement, not the learner's) equals the single process's. Layouts of one world size share one launch
(each builds its own Mesh), and each layout is its own test, reading that launch's results:
    2 ranks   every axis alone: dp, pp, cp, tp, and ep (borrowed from dp, on the MoE model); ep folded over
              cp (the ring's two ranks are the EP group) and over tp; HSDP with one rank per replica
    4 ranks   every pair of axes (the ep pairs on the MoE model), and ZeRO-1/2/3 composed with them; ep=4
              folded over dp x cp; HSDP 2 x 2 (ZeRO-2), and with ep inside each replica (ZeRO-1, MoE)
    8 ranks   3-axis layouts: dp x pp x tp, tp x cp x pp, dp x cp x tp, ep x pp x tp (MoE), with ZeRO; with ep
              folded over cp: dp x pp x cp x ep and pp x cp x tp x ep (every axis but one: all five at once
              need dp x pp x cp x tp >= 16 ranks, since ep takes none)
    cp methods  2 cp x 2 tp by all-gather K/V and by Ulysses (4 ranks), 4 cp x 2 tp by the hybrid (8 ranks:
              all-to-all inside pairs of cp ranks, a ring across the 2 pairs); the ring is cp's default above
    16 ranks  dp x pp x cp x tp (dense, ZeRO-1), and all five at once (MoE; ep folded over dp x cp)
Runs on the solutions (the learner's own are graded by tests/grading/test_placement.py).

Tolerance, float64: the ranks sum in other orders than one process (partial sums over tp, the ring's
log-sum-exp merges, all-reduces), a relative rounding of ~1e-16 per operation; AdamW's update
lr m/(sqrt(v)+eps) is at most lr/eps = 1e6 times more sensitive to a gradient than the gradient's own
size where |g| ~ eps, so after 3 steps a difference stays far below atol = 1e-9 (observed: ~2e-14),
while a gradient summed over a wrong group moves a weight by O(lr) = 1e-2.
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from labkit import launch
from labkit.compose.dims import ParallelDims
from labkit.grading.cases import launch_timeout
from labkit.grading.diagnose import assert_same_named
from labkit.model import build_model, get_config

K, BATCH, SEQ = 3, 8, 16
RTOL, ATOL = 1e-7, 1e-9


def config(moe: bool):
    if moe:  # dropless (capacity_factor >= n_experts / top_k): required when cp x tp > 1
        return get_config("tiny-moe", d_model=32, n_heads=4, hidden_dim=32, vocab_size=128, context=64,
                          capacity_factor=2.0)
    return get_config("tiny", d_model=32, n_heads=4, n_layers=4, hidden_dim=64, vocab_size=128, context=64)


def batches(cfg):
    t = torch.randint(0, cfg.vocab_size, (K, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return t[..., :-1], t[..., 1:]


from labkit.compose.matrix import DPCP, DPCPTP, LAYOUTS, L, name  # noqa: E402,F401 (the matrix, shared with notebook 14)


def run_layouts(rank, world_size, layouts):
    """In each rank: every layout of this world size in turn; [(losses, reported state, seconds)]."""
    from labkit.compose.model import parallelize
    from labkit.compose.state import full_state
    from labkit.compose.step import ComposedOptimizer, train_step

    out = []
    for dims, moe in layouts:
        t0 = time.perf_counter()
        cfg = config(moe)
        try:
            dims.check(cfg, batch=BATCH, seq_len=SEQ, world_size=world_size)
            mesh = dims.build_mesh(world_size)
            stage = parallelize(build_model(cfg, seed=0).double(), mesh=mesh, cp_method=dims.cp_method,
                                ep_overlap=dims.ep_overlap)
            opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero)
            X, Y = batches(cfg)
            losses = [train_step(stage, opt, X[k], Y[k], mesh=mesh, microbatches=dims.microbatches) for k in range(K)]
            opt.begin_step()  # ZeRO-3: the parameters live in the shards between steps
            out.append((losses, full_state(stage, mesh=mesh), time.perf_counter() - t0))
        except Exception as e:
            raise RuntimeError(f"layout {name((dims, moe))}: {type(e).__name__}: {e}") from e
    return out


def reference(moe: bool):
    """One process, the same model, batches and AdamW."""
    from labkit.compose.step import ADAMW

    cfg = config(moe)
    model = build_model(cfg, seed=0).double()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    X, Y = batches(cfg)
    losses = []
    for k in range(K):
        opt.zero_grad()
        loss = model(X[k], Y[k])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references():
    return {moe: reference(moe) for moe in (False, True)}


@pytest.fixture(scope="module")
def results():
    """{world size: that launch's per-layout results}, each world launched once, lazily."""
    cache = {}

    def get(world):
        if world not in cache:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LABKIT_IMPL", "solutions")
                per_rank = launch(run_layouts, world, LAYOUTS[world], timeout=launch_timeout(60 + 8 * world))
            cache[world] = [
                ([r[i] for r in per_rank]) for i in range(len(LAYOUTS[world]))]
        return cache[world]
    return get


CASES = [(world, i) for world in LAYOUTS for i in range(len(LAYOUTS[world]))]


@pytest.mark.parametrize("world,i", CASES, ids=[f"{w}ranks-{name(LAYOUTS[w][i]).replace(' ', '-')}" for w, i in CASES])
def test_layout_trains_as_one_process(world, i, results, references):
    from labkit.compose.state import merge

    per_rank = results(world)[i]
    layout = LAYOUTS[world][i]
    ref_losses, ref_state = references[layout[1]]
    losses = per_rank[0][0]
    for r, (other, _, _) in enumerate(per_rank):
        assert other == losses, f"{name(layout)}: rank {r} reports losses {other}, rank 0 {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{name(layout)}: losses {losses} vs one process {ref_losses}: {m}")
    state = merge(s for _, s, _ in per_rank)
    assert set(state) == set(ref_state), f"{name(layout)}: missing {sorted(set(ref_state) - set(state))[:4]}"
    assert_same_named(state, ref_state, what="parameter after 3 AdamW steps", where=name(layout), rtol=RTOL, atol=ATOL)


def test_every_axis_pair_and_the_required_layouts_are_covered():
    """The matrix the issue asks for: each single axis at 2, each pair, dp x pp x tp and tp x cp x pp,
    a 4-axis layout of 16 ranks, all five at once, ZeRO 1, 2 and 3 with other axes."""
    def axes(layout):
        dims, _ = layout
        return frozenset(a for a in ("dp", "pp", "cp", "tp", "ep") if getattr(dims, a) > 1 and
                         not (a == "dp" and dims.ep == dims.dp))  # dp's ranks all lent to ep: ep alone
    have = {axes(lay) for w in LAYOUTS for lay in LAYOUTS[w]}
    five = ("dp", "pp", "cp", "tp", "ep")
    for a in five:
        assert frozenset([a]) in have, a
        for b in five:
            if a < b:
                assert frozenset([a, b]) in have or frozenset([a, b, "dp"]) in have, (a, b)
    assert {frozenset(["dp", "pp", "tp"]), frozenset(["tp", "cp", "pp"])} <= have
    assert any(len(s) == 4 for s in (axes(lay) for lay in LAYOUTS[16]))
    assert frozenset(five) - {"dp"} in have or frozenset(five) in have
    assert {dims.zero for w in LAYOUTS for dims, _ in LAYOUTS[w] if dims.world_size > dims.dp} >= {1, 2, 3}
    every = [dims for w in LAYOUTS for dims, _ in LAYOUTS[w]]
    assert {DPCP, DPCPTP} <= {dims.folded for dims in every if dims.ep > 1}, "ep folded over cp and over tp"
    assert any(dims.folded == DPCP and dims.ep > 1 and all(getattr(dims, a) > 1 for a in five if a != "ep")
               for dims in every), "all five at once with ep folded over cp"
    assert any(1 < dims.dp_replicate < dims.dp and dims.zero for dims in every), "HSDP with real shards"
    assert any(dims.dp_replicate > 1 and dims.ep > 1 for dims in every), "HSDP with experts"


BAD = [  # (what the issue names, dims, model, batch, seq_len, world, words the error must hold)
    ("product is not the world", ParallelDims(dp=2, tp=2), False, 8, 16, 8, "= 4 ranks, but 8 are running"),
    ("tp does not divide the heads", ParallelDims(tp=8), False, 8, 16, 8, "tp=8 does not divide n_heads=4"),
    ("tp does not divide the hidden size", ParallelDims(tp=3), False, 6, 18, 3, "tp=3 does not divide n_heads=4"),
    ("cp zigzag cannot split the sequence", ParallelDims(cp=2), False, 8, 18, 2, "seq_len=18 does not split"),
    ("SP cannot split a cp piece", ParallelDims(cp=2, tp=2), False, 8, 20, 4, "use a multiple of 8"),
    ("ep does not divide the experts", ParallelDims(dp=3, ep=3), True, 6, 16, 3, "ep=3 does not divide n_experts=4"),
    ("pp greater than the layers", ParallelDims(pp=8), False, 8, 16, 8, "pp=8 is more stages than"),
    ("micro-batches do not split the batch", ParallelDims(dp=2, pp=2, microbatches=3), False, 8, 16, 4,
     "does not split into dp=2 replicas x microbatches=3"),
    ("ep on a dense model", ParallelDims(dp=2, ep=2), False, 8, 16, 2, "ep=2 on a dense model"),
    ("ep not tiling dp", ParallelDims(dp=1, ep=2, tp=2), True, 8, 16, 2, "does not divide the ranks it is folded over, "
     "dp_shard=1 = 1: choose ep among the divisors of 1, or fold it over more axes (ep_over=('dp', 'tp')"),
    ("ep not dividing dp x cp", ParallelDims(cp=2, ep=4, ep_over=("dp", "cp")), True, 8, 16, 2,
     "ep=4 does not divide the ranks it is folded over, dp_shard=1 x cp=2 = 2"),
    ("ep cutting across dp x cp", ParallelDims(dp=2, cp=3, ep=2, ep_over=("dp", "cp")), True, 8, 24, 6,
     "ep=2 cuts across the folded axes"),
    ("ep folded over pp", ParallelDims(pp=2, ep=2, ep_over=("pp",)), True, 8, 16, 2, "ep_over=('pp',)"),
    ("replicas x shards is not dp", ParallelDims(dp=4, dp_replicate=2, dp_shard=3), False, 8, 16, 4,
     "dp_replicate x dp_shard = 2 x 3 = 6, but dp=4"),
    ("replicas not dividing dp", ParallelDims(dp=4, dp_replicate=3), False, 8, 16, 4, "dp_replicate x dp_shard = 3 x 1"),
    ("a MoE that can drop tokens under cp", ParallelDims(cp=2), "drops", 8, 16, 2, "dropless"),
    ("ep_overlap without ep", ParallelDims(dp=2, ep_overlap=True), True, 8, 16, 2, "ep=1 has none"),
    ("ep_overlap with one sequence per rank", ParallelDims(dp=2, ep=2, ep_overlap=True), True, 2, 16, 2,
     "gives 1 sequence per rank: use a batch of at least 4"),
    ("ZeRO stage 4", ParallelDims(dp=2, zero=4), False, 8, 16, 2, "zero=4"),
    ("an unknown CP method", ParallelDims(cp=2, cp_method="tree"), False, 8, 16, 2,
     "cp_method='tree' is not a context-parallel method: choose one of ring, allgather, ulysses, hybrid"),
    ("heads not divisible by cp for Ulysses", ParallelDims(cp=4, tp=2, cp_method="ulysses"), False, 8, 16, 8,
     "gives each of 4 ranks heads/4 whole heads, but each tp rank holds 2"),
    ("heads not divisible by the hybrid's all-to-all", ParallelDims(cp=4, tp=4, cp_method="hybrid"), False, 8, 32,
     16, "gives each of 2 ranks heads/2 whole heads, but each tp rank holds 1"),
    ("the hybrid with one node", ParallelDims(cp=2, cp_method="hybrid"), False, 8, 16, 2, "use 'ulysses' or 'ring'"),
]


@pytest.mark.parametrize("what,dims,moe,batch,seq,world,words", BAD, ids=[b[0].replace(" ", "-") for b in BAD])
def test_bad_layouts_are_refused_before_any_process_work(what, dims, moe, batch, seq, world, words):
    """Pure arithmetic, in this process: the error names the problem and the fix."""
    cfg = replace(config(True), capacity_factor=1.25) if moe == "drops" else config(moe)
    if what == "tp does not divide the hidden size":
        cfg = get_config("tiny", d_model=48, n_heads=6, hidden_dim=64, vocab_size=96, context=64)
        words = "tp=3 does not divide hidden_dim=64"
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        dims.check(cfg, batch=batch, seq_len=seq, world_size=world)
