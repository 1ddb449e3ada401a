"""The search's order with ties (labkit.scale.cost.ranked, TIE = 0.5%): layouts whose predicted tokens/s lie within
TIE of the fastest layout left are ties, ordered by the least memory per GPU, then the layout's fields; the search,
brute force (tests/grading/test_scale_search.py) and labkit.scale.ranking all order by it. Hand-made predictions
(one real prediction, its figures replaced): well under a second.

Planted: the order before (tokens/s rounded at 1e-6 absolute, `absolute_rounding` below) lets a layout 0.0003
tokens/s faster win while it costs 16 GiB more; each test shows that order fails it.
"""
import dataclasses
import random

import pytest

from labkit.scale.cluster import load_cluster
from labkit.scale.cost import TIE, predict, rank_key, ranked, tie_key
from labkit.scale.layout import Layout
from labkit.scale.specs import LLAMA3

GIB = 2**30
BASE = predict(LLAMA3["8b"], Layout(dp=8, zero="zero3", recompute="full", micro_batch=1), load_cluster("h100-sxm"),
               8, 8192)


def pred(tps: float, gib: float, dp: int = 8):
    return dataclasses.replace(BASE, layout=dataclasses.replace(BASE.layout, dp=dp), tokens_per_s_per_gpu=tps,
                               peak_bytes=gib * GIB)


def absolute_rounding(predictions):
    """The planted mistake: the order before ties, tokens/s rounded at 1e-6 absolute, then the memory."""
    return sorted(predictions, key=lambda p: (-round(p.tokens_per_s_per_gpu, 6), round(p.peak_bytes)))


def test_near_tie_goes_to_the_least_memory():
    big = pred(4000.0003, 60.0, dp=1)   # 0.0003 tokens/s faster, 16 GiB more
    small = pred(4000.0, 44.0, dp=2)
    assert ranked([big, small]) == [small, big]
    assert absolute_rounding([big, small]) == [big, small]  # the planted order picks the 16 GiB costlier one


def test_tie_groups_are_led_by_the_fastest_layout_left():
    """A, B 0.3% slower, C 0.6% slower than A (0.3% than B), least memory last to first: {A, B} tie (B first, less
    memory); C is not within TIE of A, the group's leader, so it comes after both, though within TIE of B."""
    a, b, c = pred(1000.0, 70.0, dp=1), pred(997.0, 60.0, dp=2), pred(994.0, 50.0, dp=4)
    assert TIE == 0.005
    assert ranked([c, a, b]) == [b, a, c]
    assert absolute_rounding([c, a, b]) == [a, b, c]
    assert ranked([a, pred(1000.0 * (1 - TIE), 1.0, dp=2)])[0].layout.dp == 2  # exactly TIE below: a tie
    assert ranked([a, pred(1000.0 * (1 - TIE) - 1e-6, 1.0, dp=2)])[0].layout.dp == 1


def test_ranked_depends_on_the_set_only_and_its_prefix_is_ranked():
    rng = random.Random(0)
    ps = [pred(1000.0 * (1 - 0.002 * rng.random() * i), rng.uniform(20, 70), dp=i + 1) for i in range(40)]
    want = ranked(ps)
    for _ in range(5):
        rng.shuffle(ps)
        assert ranked(ps) == want
    for k in (1, 3, 7, 20):  # a search that keeps its `top` returns ranked(...)[:top], itself ranked
        assert ranked(want[:k]) == want[:k]
    assert sorted(want, key=rank_key) != want  # these 40 do have ties that memory decides
    assert all(tie_key(p) != tie_key(q) for p, q in zip(want, want[1:]))


def test_tolerance_out_of_range_is_refused():
    with pytest.raises(ValueError, match="0 <= tolerance < 1"):
        ranked([BASE], tolerance=1.5)
