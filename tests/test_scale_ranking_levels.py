"""The published-layout criterion at its two levels (labkit/scale/ranking.py) and the class of a miss
(labkit/scale/misses.py): issue 34 item 5.

The layout level (dp, pp, cp, tp, schedule kind, each layout at its best configuration) is checked against an
enumeration written here, independently of ranking's scan: every configuration of a small space predicted, the
fitting ones grouped by parallel layout, each group's fastest kept, those ordered by labkit.scale.cost.ranked.
The flat model, 8B on 4 H100s, 4 sequences of 4,096 tokens.
"""
import functools
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest

from labkit.scale.bounds import divisors
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict, rank_key, ranked
from labkit.scale.layout import CP_METHODS, RECOMPUTE, ZERO_STAGES, Layout, LayoutError
from labkit.scale.misses import classify, memory
from labkit.scale.ranking import _axes, layout_key, rank_published, schedules_of
from labkit.scale.specs import LLAMA3
from labkit.scale.validation import layout_of

# runs written as published rows on 4 H100s: full recompute, which the model does not need at this batch (its own
# layout at its best drops it); dp2 cp2 is among the top layouts, dp2 pp2 is not
ROW = dict(id="test-8b", model="8b", dp=2, pp=1, cp=2, tp=1, zero="zero3", recompute="full", micro_batch=1,
           schedule="1f1b", virtual_stages=1, global_batch=4, seq_len=4096, published={"tps_per_gpu": 1.0})
PIPELINED = dict(ROW, cp=1, pp=2)
SET = dict(cluster="h100-sxm")


@functools.cache
def every_layout_at_its_best():
    """Independent of ranking's scan: each parallel layout's fastest fitting configuration, `ranked`."""
    cluster, spec = load_cluster(SET["cluster"]), LLAMA3[ROW["model"]]
    batch, seq, n = ROW["global_batch"], ROW["seq_len"], 4
    best = {}
    for (dp, pp, cp, tp), sched in itertools.product(_axes(n), schedules_of(Layout(), "flat")):
        if pp == 1 and sched["schedule"] != "1f1b":
            continue
        for mb, rc, zero, method in itertools.product(divisors(batch), RECOMPUTE, ZERO_STAGES,
                                                      CP_METHODS if cp > 1 else ("ring",)):
            for r in (d for d in divisors(dp) if d == 1 or (n // d) % cluster.gpus_per_node == 0):
                lay = Layout(dp=dp, pp=pp, cp=cp, tp=tp, micro_batch=mb, recompute=rc, zero=zero, cp_method=method,
                             dp_replicate=r, **sched)
                try:
                    p = predict(spec, lay, cluster, batch, seq, n)
                except LayoutError:
                    continue
                key = layout_key(lay)
                if p.fits and (key not in best or rank_key(p) < rank_key(best[key])):
                    best[key] = p
    return ranked(best.values())


def test_layout_level_equals_every_layout_at_its_best():
    """Rank, best configuration and gap of the published layout (pruned) equal the enumeration above; and
    the two levels differ here (full recompute costs the configuration its place, not the layout). Planted when
    written: the published configuration taken as its layout's best (no search over its own groups) ranks dp2 cp2
    11th instead of 2nd."""
    order = every_layout_at_its_best()
    for row in (ROW, PIPELINED):
        want = next(i for i, p in enumerate(order) if layout_key(p.layout) == layout_key(layout_of(row)))
        got = rank_published(row, SET, "flat", cap=10**9, layout_cap=10**9)
        assert got["layout"]["rank"] == want + 1, (row["pp"], got["layout"]["rank"], want + 1)
        assert got["layout"]["best"].layout == order[want].layout
        assert got["layout"]["gap"] == pytest.approx(order[want].tokens_per_s_per_gpu / got["top"].tokens_per_s_per_gpu - 1,
                                                     rel=1e-12)
        assert order[want].layout.recompute != "full" and got["rank"] > got["layout"]["rank"]


def test_memory_scales_the_tensors_not_the_reserve():
    """misses.memory: (peak x scale + reserve) / 2^30 against the GPU, the reserve (context, NCCL, workspace) not
    scaled by the model's error on tensors. Planted when written: (peak + reserve) x scale gives 86.25, not 85.5."""
    p = SimpleNamespace(peak_bytes=70 * 2**30, reserve={"total": 5 * 2**30})
    assert memory(p, 89.4) == (75.0, True)
    assert memory(p, 89.4, 1.15) == (pytest.approx(85.5), True)
    assert memory(p, 80.0, 1.15)[1] is False


def test_a_miss_inside_the_layout_is_a_choice_with_its_numbers():
    """The row above misses as a configuration and meets as a layout: class "config", and its line names what
    changes (full recompute dropped), both steps and the memory with the reserve; a row that publishes memory gets
    the check against the model's own error on it, "config-memory" when the faster configuration would not fit."""
    got = rank_published(ROW, SET, "flat")
    assert not got["meets"] and got["layout"]["meets"]
    verdict = classify(got, ROW, SET)
    assert verdict["class"] == "config"
    assert "recompute full->none" in verdict["line"] and "GiB with the reserve of 79.6" in verdict["line"]
    # published memory 3x the model's: the faster configuration, scaled by that, cannot fit 79.6 GiB
    row = dict(ROW, published={"tps_per_gpu": 1.0, "memory_gib": 3 * got["published"].reserved_gib})
    assert classify(got, row, SET)["class"] == "config-memory"
    piped = rank_published(PIPELINED, SET, "flat")
    verdict = classify(piped, PIPELINED, SET)
    assert not piped["layout"]["meets"] and verdict["class"] == "layout"
    assert "that layout -> the top" in verdict["line"] and "bubble" in verdict["line"]
