"""labkit.measure.overlap: the hiding arithmetic, on numbers worked out by hand."""
import pytest

from labkit.measure.overlap import (all_gather_seconds, message_seconds, pipeline_exposed_seconds,
                                    zero3_prefetch)


def test_message_and_pipeline_exposed():
    assert message_seconds(1e6, 1e-5, 1e9) == pytest.approx(1e-5 + 1e-3)
    assert pipeline_exposed_seconds(4, 2e-3) == pytest.approx(6 * 2e-3)  # 3 hops down, 3 back up
    assert pipeline_exposed_seconds(1, 2e-3) == 0
    with pytest.raises(ValueError, match="beta > 0"):
        message_seconds(1, 0, 0)


def test_zero3_prefetch_hides_from_min_tokens_on():
    # 1M parameters (4 MB) on 4 ranks, alpha 10 us, beta 1 GB/s: 3 x (10 us + 1 MB / 1 GB/s) = 3.03 ms
    assert all_gather_seconds(4e6, 4, 1e-5, 1e9) == pytest.approx(3 * (1e-5 + 1e-3))
    # at 1 TFLOP/s one token's forward through the layer is 2e6 / 1e12 = 2 us: 1515 tokens hide 3.03 ms
    fig = zero3_prefetch(1_000_000, 4, 1515, 1e12, 1e-5, 1e9)
    assert fig["min_tokens"] == pytest.approx(1515)
    assert zero3_prefetch(1_000_000, 4, 1516, 1e12, 1e-5, 1e9)["hidden"]
    short = zero3_prefetch(1_000_000, 4, 500, 1e12, 1e-5, 1e9)
    assert not short["hidden"] and short["exposed_s"] == pytest.approx(3.03e-3 - 1e-3)


# ------------------------------------------------------------------ pipeline: the theory with measured costs
from labkit.measure import overlap  # noqa: E402
from labkit.measure.overlap import (bubble_with_costs, check_prefetch, pipeline_costs,  # noqa: E402
                                    prefetch_exposures)
from labkit.measure.timeline import Span, bubble_fraction  # noqa: E402
from labkit.parallel.schedules import simulate  # noqa: E402

GPIPE_2x2 = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]


def test_simulate_t_recv_is_paid_after_both_sides_arrive():
    # worked by hand, F = 1, B = 2: rank 1 receives F0 at max(0, 1) + .5, F1 at max(2.5, 2) + .5 = 3, then
    # B0 [4, 6], B1 [6, 8]; rank 0 receives B0 at max(2, 6) + .5, B0 [6.5, 8.5], B1 at max(8.5, 8) + .5: ends at 11
    assert simulate(GPIPE_2x2, 1, 2, t_recv=0.5).makespan == 11
    # a message latency instead (available t_msg after the send) hides behind rank 1's F0 for F1: 10
    assert simulate(GPIPE_2x2, 1, 2, t_msg=0.5).makespan == 10
    assert simulate(GPIPE_2x2, 1, 2).makespan == 9


def _gpipe_2x2_timeline():
    """A measured-looking step: F = 1, B = 2, 0.25 between two computes, a receive 0.5 from the later arrival.

    It is simulate(GPIPE_2x2, 1.25, 2.25, t_recv=0.25) worked by hand, each compute's last 0.25 (the gap) cut off.
    """
    S = lambda kind, start, end, rank, mb: Span(kind, start, end, rank, stage=rank, mb=mb)  # noqa: E731
    return [S("F", 0, 1, 0, 0), S("F", 1.25, 2.25, 0, 1), S("recv", 2.25, 6.75, 0, 0), S("B", 6.75, 8.75, 0, 0),
            S("recv", 8.75, 9.25, 0, 1), S("B", 9.25, 11.25, 0, 1),
            S("recv", 0, 1.5, 1, 0), S("F", 1.5, 2.5, 1, 0), S("recv", 2.5, 3, 1, 1), S("F", 3, 4, 1, 1),
            S("B", 4.25, 6.25, 1, 0), S("B", 6.5, 8.5, 1, 1)]


def test_pipeline_costs_and_the_theory_with_them():
    spans = _gpipe_2x2_timeline()
    c = pipeline_costs(spans[::-1])  # any order
    assert (c["F"], c["B"], c["B_input"], c["W"]) == (1, 2, 0, 0)
    # gaps: rank 0 F0 -> F1, rank 1 F1 -> B0 and B0 -> B1; receives: rank 0's B0 (6.75 - max(2.25, 6.25)),
    # B1 (9.25 - max(8.75, 8.5)) and rank 1's F1 (3 - max(2.5, 1)); rank 1's F0 has no compute before it
    assert (c["gap"], c["n_gap"], c["recv"], c["n_recv"]) == (0.25, 3, 0.5, 3)
    assert bubble_with_costs(GPIPE_2x2, spans) == bubble_fraction(spans) == 1 - 12 / (2 * 11.25)


def test_pipeline_costs_catches_a_receive_timed_from_the_receiver_alone(monkeypatch):
    # planted mistake: forget the sender (a receive counted from the receiver's previous compute):
    # rank 0 then "waits" 4.5 for B0 and the theory with costs no longer equals the timeline's bubble
    monkeypatch.setattr(overlap, "_sender", lambda by_key, s: None if s.kind == "W" else Span("B", 0, 0, -1))
    spans = _gpipe_2x2_timeline()
    assert pipeline_costs(spans)["recv"] == (4.5 + 0.5 + 0.5) / 3
    assert bubble_with_costs(GPIPE_2x2, spans) != bubble_fraction(spans)


# ------------------------------------------------------------------ ZeRO-3 prefetch on a timeline
def _zero3_timeline(prefetch: bool):
    """3 blocks on 2 ranks, worked by hand: a gather takes 0.75 from the moment the LAST rank issued it.

    Rank 0's forwards last 0.5, rank 1's 1.0 plus 0.125 of hooks before its wait. With prefetch, block i+1's
    gather is issued as block i starts; without, after it ends (rank 1 is then the late peer: rank 0 waits
    for it first, 0.5, then for the gather, 0.75). The backward's gathers come later and must be ignored.
    """
    A = lambda start, end, rank, mb=None: Span("allgather", start, end, rank, mb=mb)  # noqa: E731
    F = lambda start, end, rank, mb: Span("F", start, end, rank, mb=mb)  # noqa: E731
    spans = [A(0, 0.5, r) for r in (0, 1)] + [A(0.5, 1.0, r, 0) for r in (0, 1)]
    spans += [A(5 + k, 6 + k, r, 2 - k) for r in (0, 1) for k in range(3)]  # the backward's
    if prefetch:  # rank 0 waits 1.75 - 1.5 and 2.875 - 2.25 (gather 2 issued by rank 1 at 2.125); rank 1 0.125
        return spans + [A(1.0, 1.75, 0, 1), F(1.0, 1.5, 0, 0), A(1.75, 2.875, 0, 2), F(1.75, 2.25, 0, 1),
                        F(2.875, 3.375, 0, 2),
                        A(1.0, 2.125, 1, 1), F(1.0, 2.0, 1, 0), A(2.125, 3.25, 1, 2), F(2.125, 3.125, 1, 1),
                        F(3.25, 4.25, 1, 2)]
    return spans + [F(1.0, 1.5, 0, 0), A(1.5, 2.75, 0, 1), F(2.75, 3.25, 0, 1), A(3.25, 4.5, 0, 2), F(4.5, 5, 0, 2),
                    F(1.0, 2.0, 1, 0), A(2.0, 2.75, 1, 1), F(2.75, 3.75, 1, 1), A(3.75, 4.5, 1, 2), F(4.5, 5.5, 1, 2)]


def test_prefetch_exposures_exact():
    assert prefetch_exposures(_zero3_timeline(prefetch=True)[::-1]) == [0.25, 0.625, 0.125, 0.125]
    # without prefetch every gather is exposed in full, 0.75: rank 0's first 0.5 of waiting is for its late
    # peer (counting it, a planted mistake, would give rank 0 1.25 per gather)
    assert prefetch_exposures(_zero3_timeline(prefetch=False)) == [0.75] * 4
    with pytest.raises(ValueError, match="ZeRO3"):
        prefetch_exposures([Span("F", 0, 1, 0, mb=0)])


def test_check_prefetch_verdicts_and_a_missing_prefetch():
    # predicted: gather 0.75 against compute 1.0 (hidden) or 0.25 (0.5 exposed); margin half a gather, 0.375
    hidden = dict(gather_s=0.75, compute_s=1.0, hidden=True, exposed_s=0.0)
    exposed = dict(gather_s=0.75, compute_s=0.25, hidden=False, exposed_s=0.5)
    ok = check_prefetch(hidden, _zero3_timeline(prefetch=True))
    assert ok["measured_exposed_s"] == (0.125 + 0.25) / 2 and ok["margin_s"] == 0.375 and ok["n"] == 4  # median
    assert ok["agree"] and ok["measured_hidden"] and ok["predicted_hidden"]
    # planted mistake, the learner's prefetch missing: the gather waits in full, 0.75, against a predicted 0
    missing = check_prefetch(hidden, _zero3_timeline(prefetch=False))
    assert missing["measured_exposed_s"] == 0.75 and not missing["agree"] and not missing["measured_hidden"]
    # a prediction of 0.5 exposed agrees with 0.75 measured (within 0.375); one of 0.75 (no compute to hide
    # behind) does not agree with the prefetching timeline's 0.1875
    assert check_prefetch(exposed, _zero3_timeline(prefetch=False))["agree"]
    unhidden = dict(exposed, compute_s=0.0, exposed_s=0.75)
    assert not check_prefetch(unhidden, _zero3_timeline(prefetch=True))["agree"]


def test_check_prefetch_pools_steps_one_stalled_step_is_outvoted():
    # a step whose gathers all stalled (no prefetch's 0.75 each) beside two that hid them (median 0.1875 each):
    # the median of the step medians is 0.1875, within the margin 0.375; the pooled median of the 12 gathers,
    # (0.25 + 0.625) / 2, would not be; judged on the stalled step alone the verdict flips
    hidden = dict(gather_s=0.75, compute_s=1.0, hidden=True, exposed_s=0.0)
    stalled, fine = _zero3_timeline(prefetch=False), _zero3_timeline(prefetch=True)
    pooled = check_prefetch(hidden, stalled, fine, fine)
    assert pooled["n"] == 12 and pooled["measured_exposed_s"] == 0.1875 and pooled["agree"]
    assert not check_prefetch(hidden, stalled)["agree"]
    # and a prefetch missing in every step is still caught
    assert not check_prefetch(hidden, stalled, stalled, stalled)["agree"]
