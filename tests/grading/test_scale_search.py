"""Grading tests for notebook 15_at_scale: the configuration search (search).

Run: pytest tests/grading/test_scale_search.py   (add --impl=solutions for the reference)
The reference is brute force, written here independently of the learner's loops: every value
of every field of the search space (dp, pp, cp, tp from 1 to the GPU count, every micro-batch
size from 1 to the global batch, every ZeRO stage and recompute mode, every ep for a MoE),
each layout predicted by labkit.scale.cost.predict, the ones check_layout refuses dropped, the
ones that do not fit dropped, ranked by rank_key. About 5 s on 2 cores.
"""
import itertools

import pytest

from labkit.grading import impl
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict, rank_key
from labkit.scale.layout import RECOMPUTE, ZERO_STAGES, Layout, LayoutError
from labkit.scale.specs import LLAMA3, ModelSpec

# 6.7B parameters, 8 experts of 8192: ZeRO-3's gathered layer (all experts) is what ep splits
SMALL_MOE = ModelSpec("small-moe", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4, hidden_dim=8192,
                      vocab_size=32000, n_experts=8, top_k=2)


def brute_force(model, cluster, global_batch, seq_len, n_gpus, top):
    cluster = load_cluster(cluster)
    sizes = range(1, n_gpus + 1)
    eps = range(1, model.n_experts + 1) if model.n_experts else [1]
    found = []
    for dp, pp, cp, tp in itertools.product(sizes, repeat=4):
        if dp * pp * cp * tp != n_gpus:
            continue
        for ep, mb, zero, rc in itertools.product(eps, range(1, global_batch + 1), ZERO_STAGES, RECOMPUTE):
            try:
                p = predict(model, Layout(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, zero=zero, recompute=rc,
                                          micro_batch=mb), cluster, global_batch, seq_len, n_gpus)
            except LayoutError:
                continue
            if p.fits:
                found.append(p)
    return sorted(found, key=rank_key)[:top]


def explain(got, want, everything) -> str:
    """The first place where the learner's list differs from brute force's, in words
    (`everything`: the learner's search with no limit on the results)."""
    i = next(i for i, (g, w) in enumerate(zip(got + [None] * len(want), want)) if g is None or g.layout != w.layout)
    w = want[i]
    head = (f"search's result #{i + 1} should be {w.layout.short()} ({w.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
            f"{w.peak_gib:.1f} GiB)")
    if i >= len(got):
        return head + f", but search returned only {len(got)} layouts"
    g = got[i]
    mine = f"; search returned {g.layout.short()} ({g.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {g.peak_gib:.1f} GiB)"
    if not g.fits:
        return head + mine + ", which does not fit the GPUs' memory (keep only p.fits)"
    if w.layout in [p.layout for p in everything]:
        return head + mine + f": search found it, but ranked it #{[p.layout for p in everything].index(w.layout) + 1} " \
                             "(sort with rank_key)"
    return head + mine + (": search never kept it; do your loops try every divisor of the GPUs for each axis, "
                          "every micro-batch size, every ZeRO stage and recompute mode, every ep of a MoE?")


CASES = {
    "8b-on-16-h100": (LLAMA3["8b"], "h100-sxm", 16, 8192, 16),
    "70b-on-32-a100": (LLAMA3["70b"], "a100-sxm", 16, 4096, 32),
    # 3 nodes and a batch of 16: the factor 3 cannot go to dp, so the pipeline takes it
    "8b-on-24-h100": (LLAMA3["8b"], "h100-sxm", 16, 8192, 24),
    "moe-on-16-a100": (SMALL_MOE, "a100-sxm", 8, 4096, 16),  # the best layouts use ep
}


@pytest.mark.exercise("search")
@pytest.mark.parametrize("case", CASES)
def test_search_equals_brute_force(case):
    model, cluster, batch, seq, gpus = CASES[case]
    try:
        got = impl("scale_search").search(model, cluster, batch, seq, gpus, top=5)
    except LayoutError as err:
        want = brute_force(model, cluster, batch, seq, gpus, top=5)
        pytest.fail(f"search raised LayoutError ({err}), but {want[0].layout.short()} fits "
                    f"({want[0].peak_gib:.1f} GiB): do your loops try every divisor of the GPUs for each axis?",
                    pytrace=False)
    want = brute_force(model, cluster, batch, seq, gpus, top=5)  # after: an unwritten stub fails at once
    if [p.layout for p in got] != [p.layout for p in want]:
        everything = impl("scale_search").search(model, cluster, batch, seq, gpus, top=10**9)
        pytest.fail(explain(got, want, everything), pytrace=False)
    assert [p.tokens_per_s_per_gpu for p in got] == [p.tokens_per_s_per_gpu for p in want]


@pytest.mark.exercise("search")
def test_search_returns_fitting_layouts_fastest_first():
    model, cluster, batch, seq, gpus = CASES["8b-on-16-h100"]
    got = impl("scale_search").search(model, cluster, batch, seq, gpus, top=8)
    assert len(got) == 8 and all(p.fits for p in got)
    assert got == sorted(got, key=rank_key)
    assert all(p.layout.world_size == gpus for p in got)


@pytest.mark.exercise("search")
def test_search_model_too_big_says_how_many_gpus():
    with pytest.raises(LayoutError, match=r"llama3-405b needs at least 80 GPUs of this kind"):
        impl("scale_search").search(LLAMA3["405b"], "h100-sxm", 8, 8192, 8)


@pytest.mark.exercise("search")
def test_search_nothing_fits_for_activations():
    """Enough GPUs for the model states, but not for a 70B's activations at this batch and length."""
    with pytest.raises(LayoutError, match=r"no layout of llama3-70b on 16 GPUs .* fits; the least memory"):
        impl("scale_search").search(LLAMA3["70b"], "h100-sxm", 16, 131072, 16)
