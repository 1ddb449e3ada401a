"""The configuration search's reference (notebook 15): brute force over every layout, and the first
place where a search's list differs from it, in words.

Written independently of the learner's loops: every value of every field of the search space (dp,
pp, cp, tp from 1 to the GPU count, every micro-batch size from 1 to the global batch, every ZeRO
stage and recompute mode, every ep for a MoE (check_layout keeps the ones that divide dp_shard x cp x tp); every dp_replicate from 1 to dp whose replicas are whole
nodes, every cp_method when cp > 1, ep_overlap both ways when ep > 1), each layout predicted by
labkit.scale.cost.predict (or the cost model passed), the ones check_layout refuses dropped, the ones that do not fit dropped, ordered by `ranked` (ties within 0.5% by memory). Used by
tests/grading/test_scale_search.py and by notebook 15's check after the search exercise.
"""
from __future__ import annotations

import itertools

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import TIE, predict, rank_key, ranked
from labkit.scale.layout import CP_METHODS, RECOMPUTE, ZERO_STAGES, Layout, LayoutError


def brute_force(model, cluster, global_batch, seq_len, n_gpus, top, *, cost_model=predict):
    """The `top` fitting layouts by `ranked`; cost_model as the search's (predict: the flat model)."""
    cluster = load_cluster(cluster)
    sizes = range(1, n_gpus + 1)
    eps = range(1, model.n_experts + 1) if model.n_experts else [1]
    found = []
    for dp, pp, cp, tp in itertools.product(sizes, repeat=4):
        if dp * pp * cp * tp != n_gpus:
            continue
        # HSDP as it is run: each replica a whole number of nodes (n_gpus / R GPUs), the replicas across them
        replicas = [r for r in range(1, dp + 1)
                    if r == 1 or (dp % r == 0 and (n_gpus // r) % cluster.gpus_per_node == 0)]
        for ep, mb, zero, rc, r, method, overlap in (
                (ep, *rest, overlap) for ep in eps for rest in itertools.product(
                    range(1, global_batch + 1), ZERO_STAGES, RECOMPUTE, replicas, CP_METHODS if cp > 1 else ["ring"])
                for overlap in ([False, True] if ep > 1 else [False])):
            try:
                p = cost_model(model, Layout(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, zero=zero, recompute=rc,
                                          micro_batch=mb, dp_replicate=r, cp_method=method, ep_overlap=overlap),
                            cluster, global_batch, seq_len, n_gpus)
            except LayoutError:
                continue
            if p.fits:
                found.append(p)
    return ranked(found)[:top]


def explain(got, want, everything) -> str:
    """The first place where the learner's list differs from brute force's, in words: a layout missing,
    misplaced or too big, more layouts than asked for, or the right layout with another prediction
    (`everything`: the learner's search with no limit on the results)."""
    i = next((i for i, (g, w) in enumerate(zip(got + [None] * len(want), want)) if g is None or g.layout != w.layout), None)
    if i is None and len(got) > len(want):  # the right layouts first, then more than were asked for
        extra = got[len(want)]
        return (f"search's first {len(want)} layouts equal brute force's, but it returned {len(got)} layouts, brute "
                f"force {len(want)}; #{len(want) + 1} is {extra.layout.short()} ({extra.peak_gib:.1f} GiB, "
                f"fits={extra.fits}): return only the `top` best that fit (ranked(fitting)[:top])")
    if i is None:
        j = next((j for j, (g, w) in enumerate(zip(got, want)) if g.tokens_per_s_per_gpu != w.tokens_per_s_per_gpu), None)
        if j is None:
            return f"search's list equals brute force's ({len(want)} layouts)"
        g, w = got[j], want[j]
        return (f"search's result #{j + 1} is the right layout, {w.layout.short()}, but its tokens/s/GPU is "
                f"{g.tokens_per_s_per_gpu:,.1f}, expected {w.tokens_per_s_per_gpu:,.1f} (got = "
                f"{g.tokens_per_s_per_gpu / w.tokens_per_s_per_gpu:.4g} x expected): predict each layout with "
                "predict(model, layout, cluster, global_batch, seq_len, n_gpus) and predict's defaults")
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
        at = [p.layout for p in everything].index(w.layout) + 1
        if [p.layout for p in got] == [p.layout for p in sorted(got, key=rank_key)] and g.layout != w.layout \
                and abs(g.tokens_per_s_per_gpu / w.tokens_per_s_per_gpu - 1) <= TIE:
            return head + mine + (f": search found it, but ranked it #{at}; the two are within {TIE:.1%} of each other, "
                                  "a tie, which goes to the least memory: order with ranked(fitting), not by the "
                                  "exact tokens/s (sorted(..., key=rank_key))")
        return head + mine + f": search found it, but ranked it #{at} (order with ranked(fitting))"
    fields = ("dp", "pp", "cp", "tp", "ep", "zero", "recompute", "micro_batch", "dp_replicate", "cp_method", "ep_overlap")
    never = [f"{f}={getattr(w.layout, f)!r}" for f in fields
             if getattr(w.layout, f) not in {getattr(p.layout, f) for p in everything}]
    if never:  # the first wrong place, in words: a value of a field that no layout of the learner's has
        return head + mine + f": search never tried {' or '.join(never)} in any layout; its loop over " \
                             f"{never[0].split('=')[0]} misses that value"
    return head + mine + (": search never kept it; do your loops try every divisor of the GPUs for each axis, "
                          "every micro-batch size, every ZeRO stage and recompute mode, every ep of a MoE, every dp_replicate "
                          "whose replicas are whole nodes, every cp_method when cp > 1, ep_overlap both ways when ep > 1?")
