"""labkit.measure.profiling: torch.profiler traces of a multi-rank run, merged; the Timeline against them.

One launch of 2 ranks running 1F1B on synthetic stages under torch.profiler (about 5 s), and
one MemTracker step of the tiny model.
"""
import json

import pytest
import torch

import labkit

from labkit.launching.launcher import launch
from labkit.measure.profiling import (load_rank_traces, memory_by_category, merge_traces, profiler_annotations,
                                      timeline_on_trace_clock)


def _profiled_rank(rank, world_size, out_dir):
    from labkit.grading import impl
    from labkit.measure.profiling import rank_trace
    from labkit.measure.timeline import Timeline

    pl = impl("pipeline", "solutions")
    act, m = (2, 8, 16), 4
    stage = pl.SyntheticStage(rank, world_size, act, t_f=0.005)
    tokens = torch.zeros(act[0] * m, act[1], dtype=torch.long)
    tl = Timeline()
    tl.sync()
    with rank_trace(out_dir, timeline=tl):
        pl.run_schedule(stage, pl.one_f_one_b_schedule(world_size, m), tokens, tokens, mesh=labkit.Mesh(world_size, pp=world_size), act_shape=act,
                        timeline=tl)
    return tl.gather()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    spans = launch(_profiled_rank, 2, str(out), timeout=60)[0]
    return out, spans


def test_one_trace_per_rank_merged_into_one_chrome_trace(profiled, tmp_path):
    out, spans = profiled
    merged = merge_traces(out, tmp_path / "trace.json", timeline_spans=spans)
    assert json.loads((tmp_path / "trace.json").read_text()) == merged  # what a viewer loads
    events = merged["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    timed = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in timed} == {0, 1} and min(e["ts"] for e in timed) == 0
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in timed)
    for rank in (0, 1):  # every labkit span is in the file, on its rank's row, next to the profiler's ops
        ours = [e for e in timed if e["pid"] == rank and e.get("cat") == "labkit"]
        assert sorted(e["name"] for e in ours) == sorted(s.label for s in spans if s.rank == rank)
        assert any(e.get("cat") == "cpu_op" for e in timed if e["pid"] == rank)


def test_timeline_spans_lie_inside_the_profilers_record_functions(profiled):
    """Every Timeline span has a profiler span of the same name that contains it, on one clock.

    Tolerance, derived: the record_function is entered before the span's first clock read and
    left after its last (labkit/measure/timeline.py), so containment is exact up to the conversion
    between the clocks, whose error `clock_offset` bounds (half the gap of the two perf_counter
    reads around time.time(), plus its 1 us granularity), and the profiler's own rounding (1 ns).
    """
    out, spans = profiled
    traces = load_rank_traces(out)
    for rank in (0, 1):
        mine = [s for s in spans if s.rank == rank]
        labels = {s.label for s in mine}
        annotations = [a for a in profiler_annotations(traces[rank]) if a["name"] in labels]  # not gloo's own
        assert sorted(a["name"] for a in annotations) == sorted(s.label for s in mine)
        eps = traces[rank]["labkit"]["offset_error"] * 1e6 + 0.002
        # pair the k-th span named L with the profiler's k-th event named L (both in time order)
        by_name = {}
        for a in sorted(annotations, key=lambda a: a["ts"]):
            by_name.setdefault(a["name"], []).append(a)
        seen = {}
        for s, (start, end) in sorted(zip(mine, timeline_on_trace_clock(mine, traces)), key=lambda x: x[1][0]):
            a = by_name[s.label][seen.setdefault(s.label, 0)]
            seen[s.label] += 1
            assert a["ts"] <= start + eps and a["ts"] + a["dur"] >= end - eps, (
                f"rank {rank}, {s.label}: the profiler's span [{a['ts']:.1f}, {a['ts'] + a['dur']:.1f}] us does not "
                f"contain the Timeline's [{start:.1f}, {end:.1f}] (eps {eps:.2f} us)")


def test_a_wrong_clock_conversion_is_caught(profiled):
    """A planted error in the conversion 1 ms longer than the profiler's own span: no shifted span can then lie
    inside it (a fixed 1 ms was not enough where a loaded CPU stretched that span past 11 ms, make test-stress)."""
    out, spans = profiled
    traces = load_rank_traces(out)
    s = next(s for s in spans if s.rank == 0 and s.kind == "F")
    longest = max(a["dur"] for a in profiler_annotations(traces[0]) if a["name"] == s.label)  # us
    traces[0]["labkit"]["wall_minus_perf"] += longest * 1e-6 + 1e-3
    start, end = timeline_on_trace_clock([s], traces)[0]
    eps = traces[0]["labkit"]["offset_error"] * 1e6 + 0.002
    assert not [a for a in profiler_annotations(traces[0])
                if a["name"] == s.label and a["ts"] <= start + eps and a["ts"] + a["dur"] >= end - eps]


def test_memory_by_category_of_one_training_step():
    from labkit.model import build_model

    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4096, (2, 16))

    def step():
        model(x, x).backward()
        opt.step()

    mem = memory_by_category(model, step, opt)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mem["parameters"] == param_bytes and mem["gradients"] == param_bytes
    assert mem["optimizer"] >= 2 * param_bytes  # AdamW's exp_avg and exp_avg_sq, one of each per parameter
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
