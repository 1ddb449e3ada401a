"""Grading tests for notebook 15_at_scale: the configuration search (search).

Run: pytest tests/grading/test_scale_search.py   (add --impl=solutions for the reference)
The reference is brute force (labkit/grading/search_reference.py), written independently of the
learner's loops: every value of every field of the search space (dp, pp, cp, tp from 1 to the GPU
count, every micro-batch size from 1 to the global batch, every ZeRO stage and recompute mode,
every ep for a MoE, every dp_replicate whose replicas are whole nodes, every cp_method when cp > 1,
ep_overlap both ways when ep > 1), each layout predicted by labkit.scale.cost.predict, the ones check_layout
refuses dropped, the ones that do not fit dropped, ordered by labkit.scale.cost.ranked (ties within 0.5% by memory). About 15 s on 2 busy cores (3.5-5 s
before those three choices, measured back to back): the MoE case is the longest.
"""
import functools
import re

import pytest

from labkit.grading import impl
from labkit.grading.search_reference import brute_force, explain
from labkit.scale.cost import predict, ranked
from labkit.scale.layout import LayoutError
from labkit.scale.specs import LLAMA3, ModelSpec

# 6.7B parameters, 8 experts of 8192: ZeRO-3's gathered layer (all experts) is what ep splits
SMALL_MOE = ModelSpec("small-moe", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=4, hidden_dim=8192,
                      vocab_size=32000, n_experts=8, top_k=2)


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
    if [(p.layout, p.tokens_per_s_per_gpu) for p in got] != [(p.layout, p.tokens_per_s_per_gpu) for p in want]:
        everything = impl("scale_search").search(model, cluster, batch, seq, gpus, top=10**9)
        pytest.fail(explain(got, want, everything), pytrace=False)


@pytest.mark.exercise("search")
def test_search_equals_brute_force_under_the_kernel_model():
    """cost_model=: the same search under the kernel model (every op by a roofline, the schedule simulator),
    on one node (8B, 8 H100s, 4 sequences of 8K). Its ranking differs from the flat model's (planted when
    written: a search that ignores cost_model and calls predict itself returns the flat model's list)."""
    kernels = functools.partial(predict, efficiency=None)
    args = (LLAMA3["8b"], "h100-sxm", 4, 8192, 8)
    got = impl("scale_search").search(*args, top=5, cost_model=kernels)
    want = brute_force(*args, top=5, cost_model=kernels)
    if [p.layout for p in got] != [p.layout for p in want]:
        everything = impl("scale_search").search(*args, top=10**9, cost_model=kernels)
        pytest.fail(explain(got, want, everything) + " (under cost_model=the kernel model: pass your predictions "
                    "through the cost_model argument, not predict)", pytrace=False)
    assert [p.tokens_per_s_per_gpu for p in got] == [p.tokens_per_s_per_gpu for p in want]
    assert [p.layout for p in want] != [p.layout for p in brute_force(*args, top=5)]


@pytest.mark.exercise("search")
def test_search_returns_fitting_layouts_fastest_first():
    model, cluster, batch, seq, gpus = CASES["8b-on-16-h100"]
    got = impl("scale_search").search(model, cluster, batch, seq, gpus, top=8)
    assert len(got) == 8, f"search(..., top=8) returned {len(got)} layouts, expected 8 (the 8 best that fit)"
    for p in got:
        assert p.fits, (f"search returned {p.layout.short()}, which needs {p.peak_gib:.1f} GiB per GPU, more than "
                        "the GPU's memory: keep only the predictions with p.fits")
        assert p.layout.world_size == gpus, (f"search returned {p.layout.short()}, a layout of {p.layout.world_size} "
                                             f"GPUs, expected {gpus}: dp * pp * cp * tp must equal n_gpus")
    order = ranked(got)
    i = next((i for i, (a, b) in enumerate(zip(got, order)) if a != b), None)
    assert i is None, (f"search's result #{i + 1} is {got[i].layout.short()} ({got[i].tokens_per_s_per_gpu:,.0f} "
                       f"tokens/s/GPU, {got[i].peak_gib:.1f} GiB), expected {order[i].layout.short()} "
                       f"({order[i].tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {order[i].peak_gib:.1f} GiB) there: order the "
                       "fitting layouts with ranked(fitting), fastest first, ties within 0.5% by the least memory")


def expect_layout_error(args, pattern, what):
    """search(*args) must raise LayoutError with a message matching `pattern`, else say in words what it did."""
    try:
        got = impl("scale_search").search(*args)
    except LayoutError as err:
        if not re.search(pattern, str(err)):
            pytest.fail(f"search({what}) raised LayoutError({str(err)!r}), expected a message matching {pattern!r}: "
                        "raise no_layout_fits(model, cluster, n_gpus, smallest), smallest the least peak memory of "
                        "every layout predict accepted, whether it fits or not", pytrace=False)
        return
    first = f" (first {got[0].layout.short()}, {got[0].peak_gib:.1f} GiB per GPU, fits={got[0].fits})" if got else ""
    pytest.fail(f"search({what}) returned {len(got)} layouts{first}, expected LayoutError matching {pattern!r}: "
                "when no layout fits the GPUs' memory, raise no_layout_fits(model, cluster, n_gpus, smallest) instead "
                "of returning layouts that do not fit (or none)", pytrace=False)


@pytest.mark.exercise("search")
def test_search_model_too_big_says_how_many_gpus():
    expect_layout_error((LLAMA3["405b"], "h100-sxm", 8, 8192, 8), r"llama3-405b needs at least 80 GPUs of this kind",
                        "llama3-405b on 8 H100s")


@pytest.mark.exercise("search")
def test_search_nothing_fits_for_activations():
    """Enough GPUs for the model states, but not for a 70B's activations at this batch and length."""
    expect_layout_error((LLAMA3["70b"], "h100-sxm", 16, 131072, 16),
                        r"no layout of llama3-70b on 16 GPUs .* fits; the least memory",
                        "llama3-70b on 16 H100s at 131,072 tokens")
