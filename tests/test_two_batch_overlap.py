"""The two-micro-batch overlap's checks catch what they are for (solutions/moe_overlap.py, labkit.measure.overlap).

- Planted inside the ranks (tests/grading/test_moe_overlap.py's cases take the forward to test):
  a SEQUENTIAL schedule (issue, wait, compute, half after half) still equals one process but fails
  the order-of-events check; halves put back in the wrong order fail the proof; the async
  all-to-all looked up on a copy of torch.distributed (as if bound at import) hides its bytes
  from count_traffic and fails the closed form.
- The measurement (a2a_exposures, check_two_batch) on a timeline worked out by hand, and the
  prediction's closed forms; then on real ranks over a shaped link of known length (SlowLink's
  overlap mode) with experts of known length (sleeps), against the prediction, and blind without it.
About 2 minutes on 2 busy cores (6 launches of 2 ranks; the shaped link's run sleeps by design).
"""
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.measure.overlap import a2a_exposures, all_to_all_seconds, check_two_batch, two_batch_overlap
from labkit.measure.timeline import Span, or_null

GRADING = Path(__file__).resolve().parent / "grading" / "test_moe_overlap.py"


def grading_cases():
    """tests/grading/test_moe_overlap.py as a module: its case bodies, run here with planted forwards."""
    name = "_grading_moe_overlap"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GRADING)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def sequential_forward(self, x):
    """Right results, no overlap: each half's dispatch is waited for before the next is issued."""
    from labkit.grading import impl
    ov = impl("moe_overlap")
    moe_lib = ov.moe_lib
    tl = or_null(self.timeline)
    routing = moe_lib.route(x, self.router.weight, self.top_k, self.capacity_factor)
    self.aux_loss, self.routing = routing.aux_loss, routing
    cut = x.shape[0] // 2
    ep = dist.get_world_size(self.group)
    ys = []
    for h, rows_of in enumerate((slice(0, cut), slice(cut, None))):
        xh, rh = x[rows_of], ov.half_routing(routing, rows_of)
        tokens, picks, counts = moe_lib.sort_by_expert(rh)
        send = counts.view(ep, -1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        ss, rs = send.sum(1).tolist(), recv.sum(1).tolist()
        got, pending = ov.start_all_to_all(xh.reshape(-1, xh.shape[-1])[tokens], rs, ss, group=self.group,
                                           timeline=tl, kind="dispatch", layer=self.layer, half=h)
        got = ov.finish_all_to_all(got, pending)
        with tl.span("F", stage=self.layer, mb=h):
            out = ov.timed_backward(got, lambda r: impl("expert_parallel").compute_experts(
                list(self.experts.values()), r, recv), self.timeline, self.layer, h)
        back, pending = ov.start_all_to_all(out, ss, rs, group=self.group, timeline=tl, kind="combine",
                                            layer=self.layer, half=h)
        back = ov.finish_all_to_all(back, pending)
        ys.append(moe_lib.unpermute(back, tokens, rh.gate.reshape(-1)[picks], xh.shape[0] * xh.shape[1]).view_as(xh))
    return torch.cat(ys)


def swapped_forward(self, x):
    """The reference schedule, halves concatenated B first."""
    from labkit.grading import impl
    cls = impl("moe_overlap").TwoBatchEPMoE
    y = cls._reference_forward(self, x)
    cut = x.shape[0] // 2
    return torch.cat([y[cut:], y[:cut]]) if y.shape[0] > 1 else y


def run_planted(rank, world, case, forward, bypass=False, **kwargs):
    from labkit.grading import impl
    case = getattr(grading_cases(), case)
    cls = impl("moe_overlap").TwoBatchEPMoE
    cls._reference_forward = cls.forward
    if bypass:  # the async all-to-all looked up on a copy of torch.distributed made before count_traffic
        module = impl("moe_overlap")
        module.dist = types.SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    try:
        case(rank, world, forward=forward, **kwargs)
    except AssertionError as e:
        return str(e)
    return None


def _launch(case, forward, bypass=False, **kwargs):
    return labkit.launch(run_planted, 2, case, forward, bypass, timeout=120, **kwargs)


@pytest.fixture(autouse=True)
def _solutions(monkeypatch):
    monkeypatch.setenv("LABKIT_IMPL", "solutions")  # the ranks take the caller's environment


def test_sequential_schedule_is_exact_but_fails_the_overlap_check():
    assert _launch("equal_case", sequential_forward, E=4, cf=0.75) == [None, None]
    got = _launch("order_case", sequential_forward)
    assert all(g and "does not overlap" in g and "half B's dispatch must be issued before" in g for g in got), got


def test_halves_put_back_in_the_wrong_order_fail_the_proof():
    got = _launch("equal_case", swapped_forward, E=4, cf=0.75)
    # every rank fails: the loss first, or (where layer 0's swapped rows change layer 1's routing) the drops
    assert all(got) and any("put back in order" in g for g in got), got


def test_an_all_to_all_hidden_from_the_interception_fails_the_closed_form():
    assert _launch("bytes_case", None) == [None, None]
    got = _launch("bytes_case", None, bypass=True)
    assert all(g and "the closed form 2 (M + R) D s" in g for g in got), got


# ------------------------------------------------------------------ the measurement, worked by hand

def _two_batch_timeline(overlap=True):
    """One layer's forward on 2 ranks, each all-to-all 1.0 from the last rank's issue, each half's experts 0.5.

    Rank 1 issues both dispatches 0.25 after rank 0. With overlap, B's dispatch and A's combine each
    span the other half's experts; without, every all-to-all is waited for before the next compute.
    """
    S = lambda kind, a, b, rank, mb: Span(kind, a, b, rank, stage=0, mb=mb)  # noqa: E731

    def A(kind, issue, wait, end, rank, mb):  # an all-to-all issued at `issue`, waited for from `wait` to `end`
        return [S(kind, issue, end, rank, mb), S("wait", wait, end, rank, mb)]
    if overlap:
        return [*A("dispatch", 0, 0, 1.25, 0, 0), *A("dispatch", 0, 1.75, 1.75, 0, 1), S("F", 1.25, 1.75, 0, 0),
                *A("combine", 1.75, 2.25, 3.0, 0, 0), S("F", 1.75, 2.25, 0, 1), *A("combine", 2.25, 3.0, 3.5, 0, 1),
                *A("dispatch", 0.25, 0.25, 1.25, 1, 0), *A("dispatch", 0.25, 1.75, 1.75, 1, 1),
                S("F", 1.25, 1.75, 1, 0), *A("combine", 2.0, 2.5, 3.0, 1, 0), S("F", 2.0, 2.5, 1, 1),
                *A("combine", 2.5, 3.0, 3.5, 1, 1)]
    return [*A("dispatch", 0, 0, 1.25, 0, 0), S("F", 1.25, 1.75, 0, 0), *A("combine", 1.75, 1.75, 3.0, 0, 0),
            *A("dispatch", 3.0, 3.0, 4.25, 0, 1), S("F", 4.25, 4.75, 0, 1), *A("combine", 4.75, 4.75, 6.0, 0, 1),
            *A("dispatch", 0.25, 0.25, 1.25, 1, 0), S("F", 1.25, 1.75, 1, 0), *A("combine", 2.0, 2.0, 3.0, 1, 0),
            *A("dispatch", 3.25, 3.25, 4.25, 1, 1), S("F", 4.25, 4.75, 1, 1), *A("combine", 5.0, 5.0, 6.0, 1, 1)]


def test_a2a_exposures_exact():
    rows = {(r["rank"], r["kind"], r["half"]): (r["hideable"], r["exposed_s"]) for r in a2a_exposures(_two_batch_timeline())}
    # rank 0: A's dispatch waited from 0 to 1.25, the last issue 0.25: 1.0 exposed (nothing to hide behind); B's
    # dispatch was done when its wait began: 0; A's combine waited from 2.25 (after B's experts) to 3.0: 0.75
    assert rows[0, "dispatch", 0] == (False, 1.0) and rows[0, "dispatch", 1] == (True, 0.0)
    assert rows[0, "combine", 0] == (True, 0.75) and rows[0, "combine", 1] == (False, 0.5)
    # rank 1: A's combine [2.0, 3.0] spans B's experts [2.0, 2.5], waited from 2.5: 0.5
    assert rows[1, "combine", 0] == (True, 0.5) and rows[1, "dispatch", 1] == (True, 0.0)
    # counting a late peer's delay (a planted mistake) would give rank 0's A dispatch 1.25, not 1.0
    with pytest.raises(ValueError, match="TwoBatchEPMoE"):
        a2a_exposures([Span("F", 0, 1, 0, stage=0, mb=0)])
    with pytest.raises(ValueError, match="no 'wait' span"):
        a2a_exposures([s for s in _two_batch_timeline() if s.kind != "wait"])


def test_two_batch_prediction_closed_forms():
    # 4 MB over 4 ranks, alpha 10 us, beta 1 GB/s: 3 x (10 us + 1 MB / 1 GB/s) = 3.03 ms
    assert all_to_all_seconds(4e6, 4, 1e-5, 1e9) == pytest.approx(3.03e-3)
    fig = two_batch_overlap(1.0, 0.5)
    assert fig["hideable_exposed_s"] == 0.5 and not fig["hidden"]
    assert fig["layer_exposed_s"] == 3.0 and fig["sequential_s"] == 4.0
    assert two_batch_overlap(1.0, 2.0)["hidden"] and two_batch_overlap(1.0, 2.0)["layer_exposed_s"] == 2.0
    with pytest.raises(ValueError, match=">= 0"):
        two_batch_overlap(-1.0, 0.0)


def test_check_two_batch_verdicts_and_a_sequential_run():
    # predicted: a2a 1.0 against the other half's 0.5 of experts: 0.5 exposed; margin 0.5
    pred = two_batch_overlap(1.0, 0.5)
    ok = check_two_batch(pred, _two_batch_timeline())
    assert ok["measured_exposed_s"] == 0.25 and ok["n"] == 4 and ok["agree"]  # median of 0, 0.75, 0, 0.5
    assert ok["ends_exposed_s"] == 0.75  # median of 1.0, 0.5, 1.0, 0.5 (B's combines waited from 3.0 only)
    # planted: the schedule run sequentially has no hideable all-to-all at all
    with pytest.raises(ValueError, match="overlapped"):
        check_two_batch(pred, _two_batch_timeline(overlap=False))
    # a prediction of "hidden" (a2a 0.2 against 0.5 of experts) is 0.25 from the measured median: more than its
    # margin, 0.1, so it does not agree
    assert not check_two_batch(two_batch_overlap(0.2, 0.5), _two_batch_timeline())["agree"]


# ------------------------------------------------------------------ the measurement on real ranks, shaped link

SLOW = 0.1  # every collective of the shaped link lasts 100 ms, one at a time


class SleepyExpert(torch.nn.Module):
    """An expert that takes at least `seconds` (a sleep, so the length is known on any machine) and returns 2x."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        import time
        time.sleep(self.seconds)
        return 2 * x


def shaped_link_run(rank, world, experts_s, overlap_link=True):
    """Two TwoBatchEPMoE layers over SlowLink(latency=SLOW, overlap=True); layer i's half takes experts_s[i]."""
    from labkit.grading import impl
    from labkit.links.shaper import SlowLink
    from labkit.measure.timeline import Timeline
    from labkit.mesh import Mesh
    from labkit.model import get_config, moe
    ov, ep = impl("moe_overlap"), impl("expert_parallel")
    cfg = get_config("tiny-moe", capacity_factor=2.0)
    mesh = Mesh(world, ep=world, combined=[("dp", "ep")])
    tl = Timeline()
    layers = []
    for i, seconds in enumerate(experts_s):
        torch.manual_seed(i)
        layer = ep.EPMoE(moe.MoE(cfg), group=mesh.group("ep"), ep_rank=mesh.index("ep"), ep_size=world, layer=i)
        for key in list(layer.experts):
            layer.experts[key] = SleepyExpert(seconds / len(layer.experts))
        layers.append(ov.TwoBatchEPMoE(layer, timeline=tl))
    x = torch.randn(4, 16, cfg.d_model, generator=torch.Generator().manual_seed(rank))
    tl.sync()
    with torch.no_grad(), SlowLink(float("inf"), latency=SLOW, overlap=overlap_link):
        for layer in layers:
            x = x + layer(x)
    return tl.all_gather()


def test_exposure_on_a_shaped_link_matches_the_prediction():
    """Known lengths: the link 100 ms per all-to-all, a half's experts at least 200 ms (layer 0) or 20 ms (layer 1).

    Predicted per hideable all-to-all: layer 0 max(0, 100 - 200) = 0, layer 1 max(0, 100 - 20) = 80 ms; the
    ends (A's dispatch, B's combine) 100 ms. Margins, in time the machine would have to lose for a wrong verdict:
    layer 0's hideable waits begin at least 100 ms after their transfer ended (the sleeps); the ends are waited
    for from right after the next issue, and fall under 50 ms only if a rank issues 50 ms after its peer (the
    counts' exchange just before puts them in step); the agreement margin is half an all-to-all, 50 ms.
    """
    spans = _launch_plain(shaped_link_run, [0.2, 0.02])
    by_layer = {i: [s for s in spans if s.stage == i] for i in (0, 1)}
    rows = a2a_exposures(spans)
    hidden = [r["exposed_s"] for r in rows if r["layer"] == 0 and r["hideable"]]
    ends = [r["exposed_s"] for r in rows if not r["hideable"]]
    assert len(hidden) == 4 and max(hidden) < SLOW / 2, hidden   # 2 ranks x (B's dispatch, A's combine)
    assert len(ends) == 8 and min(ends) > SLOW / 2, ends          # 2 ranks x 2 layers x (A's dispatch, B's combine)
    assert check_two_batch(two_batch_overlap(SLOW, 0.2), by_layer[0])["agree"]
    partly = check_two_batch(two_batch_overlap(SLOW, 0.02), by_layer[1])
    assert partly["predicted_exposed_s"] == pytest.approx(0.08) and partly["agree"], partly
    # planted: the link sleeping at the call (no overlap mode) takes the time before the compute, where no wait
    # sees it: the hideable waits measure ~0 in layer 1 too, and the prediction of 80 ms no longer agrees
    blind = _launch_plain(shaped_link_run, [0.2, 0.02], False)
    assert not check_two_batch(two_batch_overlap(SLOW, 0.02), [s for s in blind if s.stage == 1])["agree"]


def _launch_plain(fn, *args):
    return labkit.launch(fn, 2, *args, timeout=120)[0]
