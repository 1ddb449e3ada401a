"""labkit.measure.timeline: exact numbers on synthetic spans, plus one multi-rank gather and clock test."""
import json

import pytest

from labkit.launching.launcher import launch
from labkit.measure.timeline import (NullTimeline, Span, Timeline, bubble_fraction, busy_time, chrome_trace,
                             rank_stats, window, write_chrome_trace)

# GPipe, p = 2, m = 2, t_F = 1, t_B = 2 (the unit-time picture), with communication spans
SPANS = [
    Span("F", 0, 1, rank=0, stage=0, mb=0), Span("F", 1, 2, rank=0, stage=0, mb=1),
    Span("B", 5, 7, rank=0, stage=0, mb=0), Span("B", 7, 9, rank=0, stage=0, mb=1),
    Span("send", 1, 1.1, rank=0, stage=0, mb=0),
    Span("F", 1, 2, rank=1, stage=1, mb=0), Span("F", 2, 3, rank=1, stage=1, mb=1),
    Span("B", 3, 5, rank=1, stage=1, mb=0), Span("B", 5, 7, rank=1, stage=1, mb=1),
    Span("recv", 0, 1, rank=1, stage=1, mb=0),
]


def test_busy_idle_and_bubble_exact():
    assert window(SPANS) == (0, 9)
    assert busy_time(SPANS) == {0: 6, 1: 6}
    assert rank_stats(SPANS) == {0: {"busy": 6, "idle": 3, "window": 9}, 1: {"busy": 6, "idle": 3, "window": 9}}
    assert bubble_fraction(SPANS) == pytest.approx(1 / 3)  # (p-1)/(m+p-1) = 1/3


def test_communication_spans_are_not_busy():
    assert busy_time(SPANS, kinds=("send", "recv")) == {0: pytest.approx(0.1), 1: 1}


def test_overlapping_spans_counted_once():
    spans = [Span("F", 0, 2, rank=0), Span("B", 1, 3, rank=0), Span("F", 5, 6, rank=0)]
    assert busy_time(spans) == {0: 4}
    assert bubble_fraction(spans) == pytest.approx(1 - 4 / 6)


def test_window_without_compute_spans_raises():
    with pytest.raises(ValueError, match="no spans of kinds"):
        bubble_fraction([Span("send", 0, 1)])


def test_span_label():
    assert Span("F", 0, 1, mb=3).label == "F3"
    assert Span("allreduce", 0, 1).label == "allreduce"


def test_chrome_trace_format(tmp_path):
    trace = chrome_trace(SPANS)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(SPANS)
    b = next(e for e in events if e["name"] == "B0" and e["pid"] == 0)
    assert (b["ts"], b["dur"], b["tid"], b["args"]) == (5e6, 2e6, 0, {"stage": 0, "mb": 0})
    send = next(e for e in events if e["cat"] == "send")
    assert send["tid"] == 1 and send["dur"] == pytest.approx(1e5)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    path = write_chrome_trace(SPANS, tmp_path / "t.json")
    assert json.loads(open(path).read()) == json.loads(json.dumps(trace))


def test_record_and_span_relative_to_origin():
    tl = Timeline(rank=3)
    tl.origin = 100.0
    tl.record("F", 101.0, 101.5, stage=2, mb=1)
    assert tl.spans == [Span("F", 1.0, 1.5, 3, 2, 1)]
    with tl.span("B", stage=2, mb=1):
        pass
    last = tl.spans[-1]
    assert (last.kind, last.rank, last.stage, last.mb) == ("B", 3, 2, 1) and last.end >= last.start


def test_null_timeline_records_nothing():
    tl = NullTimeline()
    with tl.span("F", 0, 0):
        pass
    assert list(tl.spans) == []


def _gather_rank(rank, world_size, estimate):
    tl = Timeline()
    offset = tl.sync(estimate=estimate)
    tl.record("F", tl.origin + rank, tl.origin + rank + 0.5, stage=rank, mb=0)
    tl.record("send", tl.origin + rank + 0.5, tl.origin + rank + 0.6, stage=rank, mb=0)
    return tl.gather(dst=0), tl.all_gather(), tl.origin, offset


@pytest.mark.filterwarnings("ignore::labkit.launching.launcher.OversubscriptionWarning")
@pytest.mark.parametrize("estimate", [False, True], ids=["one_host_shared_clock", "ping_pong_estimate"])
def test_gather_three_ranks(estimate):
    out = launch(_gather_rank, 3, estimate, timeout=60)
    gathered, everywhere, origins, offsets = zip(*out)
    assert gathered[1] is None and gathered[2] is None
    expected = sorted([Span("F", r, r + 0.5, r, r, 0) for r in range(3)]
                      + [Span("send", r + 0.5, r + 0.6, r, r, 0) for r in range(3)], key=lambda s: (s.start, s.rank))
    key = lambda spans: [(s.kind, s.rank, s.stage, s.mb) for s in spans]
    times = lambda spans: [t for s in spans for t in (s.start, s.end)]
    for got in (gathered[0],) + everywhere:
        assert key(got) == key(expected)
        assert times(got) == pytest.approx(times(expected), abs=1e-9)
    assert offsets[0] == 0.0
    if estimate:  # one host: the true offset is 0, the estimate is off by at most half a round trip
        assert max(abs(o) for o in offsets) < 0.05
    else:  # one host: every rank takes rank 0's reading as t = 0
        assert origins[0] == origins[1] == origins[2]


# ------------------------------------------------------------------ the pictures (labkit.measure.viz)
def _bars(ax):
    """(x, width, row) of every compute box drawn, rows read back from their y position."""
    out = []
    for coll in ax.collections:
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(0), path.vertices.max(0)
            if y1 - y0 > 0.5:  # compute boxes are 0.8 high, communication bars 0.12
                out.append((round(x0, 6), round(x1 - x0, 6), round((y0 + y1) / 2)))
    return sorted(out)


def test_plot_timeline_draws_every_compute_span_at_its_time():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.measure import viz

    fig = viz.plot_timeline(SPANS, unit="s")
    ax = fig.axes[0]
    want = sorted((s.start, s.duration, s.rank) for s in SPANS if s.kind in "FB")
    assert _bars(ax) == want
    assert ax.get_title() == "measured: bubble 33.3%"


def test_plot_schedule_draws_the_simulation():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.measure import viz

    schedule = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    fig = viz.plot_schedule(schedule)
    assert _bars(fig.axes[0]) == sorted((s.start, s.duration, s.rank) for s in SPANS if s.kind in "FB")
    fig = viz.plot_schedule_vs_timeline(schedule, SPANS, name="GPipe")
    assert "theory (p-1)/(m+p-1) = 33.3%, measured 33.3%" in fig._suptitle.get_text()


def test_plot_timeline_starts_at_the_first_span_drawn_and_has_a_legend_with_distinct_comm_colours():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.measure import viz

    spans = [Span("dispatch", 0.0, 0.5, rank=0, stage=0), Span("F", 0.5, 1.0, rank=0, stage=0, mb=0),
             Span("combine", 1.0, 1.5, rank=0, stage=0), Span("send", 1.5, 1.6, rank=0)]
    ax = viz.plot_timeline(spans, unit="s").axes[0]
    starts = [path.vertices[:, 0].min() for c in ax.collections for path in c.get_paths()]
    assert min(starts) == 0.0, "the dispatch before the first compute is drawn from 0, never at a negative time"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["forward", "combine", "dispatch", "send"]
    colours = {h.get_label(): tuple(h.get_facecolor()) for h in ax.get_legend().legend_handles}
    assert len(set(colours.values())) == 4, f"every kind its own colour: {colours}"
