"""labkit.grading.search_reference.explain: the first place a learner's search differs from brute force, in words
(notebook 15's check cell and tests/grading/test_scale_search.py print it). Hand-made lists of predictions,
no search: well under a second.

Issue 36, planted in a learner's search (every other loop right): micro-batch sizes of 1 only. On notebook 15's
check case (Llama 3 8B, 8 H100s, batch 8 x 8,192) brute force's #2 is cp8 zero2 none mb2; the message names the
field and the value its loop never tried (checked by hand with the planted search; the case below is that run's
pair of layouts).
"""
from labkit.grading.search_reference import explain
from labkit.scale.cluster import load_cluster
from labkit.scale.cost import predict
from labkit.scale.layout import Layout
from labkit.scale.specs import LLAMA3

H100 = load_cluster("h100-sxm")


def pred(**kw):
    return predict(LLAMA3["8b"], Layout(zero="zero2", recompute="none", **kw), H100, 8, 8192)


def test_a_value_never_tried_is_named():
    want = [pred(cp=8, micro_batch=2)]
    got = [pred(dp=2, cp=4, micro_batch=1)]
    msg = explain(got, want, got + [pred(cp=8, micro_batch=1)])  # dp=1 and cp=8 tried, micro_batch=2 never
    assert msg.startswith("search's result #1 should be cp8 zero2 none mb2")
    assert msg.endswith("search never tried micro_batch=2 in any layout; its loop over micro_batch misses that value")


def test_values_tried_but_not_this_combination_get_the_checklist():
    want = [pred(cp=8, micro_batch=2)]
    got = [pred(dp=2, cp=4, micro_batch=1)]
    everything = got + [pred(dp=2, cp=4, micro_batch=2), pred(cp=8, micro_batch=1)]
    assert "search never kept it; do your loops try every divisor" in explain(got, want, everything)


def test_found_but_ranked_lower_and_equal_lists():
    a, b = pred(cp=8, micro_batch=2), pred(dp=2, cp=4, micro_batch=1)
    assert "search found it, but ranked it #2" in explain([b, a], [a, b], [b, a])
    assert explain([a], [a], [a]) == "search's list equals brute force's (1 layouts)"


def test_more_layouts_than_asked_and_the_right_layout_with_another_prediction():
    """Planted (walked through as a learner, notebook 15's check): a search that ignores `top` was told its
    list equals brute force's; one that predicts with another efficiency passed on its layouts alone."""
    import dataclasses

    a, b = pred(cp=8, micro_batch=2), pred(dp=2, cp=4, micro_batch=1)
    msg = explain([a, b], [a], [a, b])
    assert msg.startswith("search's first 1 layouts equal brute force's, but it returned 2 layouts, brute force 1; "
                          "#2 is dp2 cp4 zero2 none mb1"), msg
    fast = dataclasses.replace(a, tokens_per_s_per_gpu=1.25 * a.tokens_per_s_per_gpu)
    msg = explain([fast], [a], [fast])
    assert msg.startswith("search's result #1 is the right layout, cp8 zero2 none mb2, but its tokens/s/GPU is"), msg
    assert "(got = 1.25 x expected): predict each layout with predict(model, layout, cluster" in msg
