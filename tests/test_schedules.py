"""labkit.parallel.schedules: parsing, lowering, checks and the unit-time simulation, on hand-written schedules.

No processes; the whole file runs in about a second (the torch comparison imports torch).
"""
import pytest

from labkit.parallel.schedules import (Action, DeadlockError, ScheduleError, check_schedule, first_difference,
                              format_schedule, ideal_bubble, lower, parse_action, parse_schedule, peak_inflight,
                              simulate, theoretical_bubble, validate, zero_bubble_schedule)

# p = 2 stages, m = 2 micro-batches, written out by hand
GPIPE_2x2 = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
ONE_F_ONE_B_2x2 = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]


def test_parse_action_roundtrip():
    assert parse_action("12B34") == Action(12, "B", 34)
    assert str(parse_action("0F7")) == "0F7"


@pytest.mark.parametrize("bad", ["F0", "0X1", "0F", "0f1", " 0F1", "0F1 ", "-1F0", "", 3, None])
def test_parse_action_bad_string_names_the_action(bad):
    with pytest.raises(ScheduleError, match=r"bad action .*'\{stage\}F\{microbatch\}'"):
        parse_action(bad)


def test_parse_schedule_reports_rank_and_position():
    with pytest.raises(ScheduleError, match=r"rank 1, action #2: bad action '1X0'"):
        parse_schedule([["0F0", "0B0"], ["1F0", "1B0", "1X0"]])


def test_parse_schedule_rejects_a_flat_list():
    with pytest.raises(ScheduleError, match="rank 0: expected a list of actions"):
        parse_schedule(["0F0", "0B0"])


def test_check_backward_before_forward_rejected():
    with pytest.raises(ScheduleError, match=r"rank 1, action 1B0: backward before forward"):
        check_schedule([["0F0", "0B0"], ["1B0", "1F0"]])


def test_check_missing_microbatch_rejected():
    with pytest.raises(ScheduleError, match=r"rank 1: stage 1 is missing 1F1, 1B1"):
        check_schedule([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0"]])


def test_check_duplicate_action_rejected():
    with pytest.raises(ScheduleError, match=r"rank 0, action 0F0: 0F0 appears twice"):
        check_schedule([["0F0", "0F0", "0B0"], ["1F0", "1B0"]])


def test_check_stage_on_two_ranks_rejected():
    with pytest.raises(ScheduleError, match=r"stage 0 appears on rank 0 and on rank 1"):
        check_schedule([["0F0", "0B0"], ["0F1", "1F0", "1B0"]])


def test_check_missing_stage_rejected():
    with pytest.raises(ScheduleError, match=r"stage 1 has no actions"):
        check_schedule([["0F0", "0B0"], [], ["2F0", "2B0"]])


def test_check_returns_stages_and_microbatches():
    assert check_schedule(GPIPE_2x2) == (2, 2)
    with pytest.raises(ScheduleError, match="rank 0: stage 0 is missing 0F2, 0B2"):
        check_schedule(GPIPE_2x2, n_microbatches=3)


def test_simulate_gpipe_2x2_exact_spans():
    sim = simulate(GPIPE_2x2, t_f=1, t_b=2)
    spans = [[(s, e, str(a)) for s, e, a in rank] for rank in sim.spans]
    assert spans[0] == [(0, 1, "0F0"), (1, 2, "0F1"), (5, 7, "0B0"), (7, 9, "0B1")]
    assert spans[1] == [(1, 2, "1F0"), (2, 3, "1F1"), (3, 5, "1B0"), (5, 7, "1B1")]
    assert sim.makespan == 9 and sim.busy == [6, 6]
    assert sim.bubble == pytest.approx(1 - 12 / 18)
    assert sim.bubble == pytest.approx(theoretical_bubble(2, 2))
    assert sim.peak_inflight == [2, 2]


def test_simulate_one_f_one_b_2x2_peak_memory():
    assert peak_inflight(ONE_F_ONE_B_2x2) == [2, 1]
    assert ideal_bubble(ONE_F_ONE_B_2x2) == pytest.approx(theoretical_bubble(2, 2))


def test_theoretical_bubble_values():
    assert theoretical_bubble(4, 4) == pytest.approx(3 / 7)
    assert theoretical_bubble(1, 8) == 0
    assert theoretical_bubble(4, 8, n_chunks=2) == pytest.approx(3 / 19)  # interleaved: (p-1)/(vm+p-1)
    with pytest.raises(ValueError, match=r"n_microbatches and n_chunks >= 1, got 4, 0, 1"):
        theoretical_bubble(4, 0)


def test_deadlock_cross_stage_order_names_both_ranks():
    # stage 0 waits for 1B0's gradient before sending 0F1; stage 1 wants 1F1 first
    bad = [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]
    with pytest.raises(DeadlockError) as err:
        simulate(bad)
    msg = str(err.value)
    assert "rank 0 waits in the receive of the input gradient of stage 1 micro-batch 0 from rank 1" in msg
    assert "rank 1 waits in the receive of the activation of stage 0 micro-batch 1 from rank 0" in msg


def test_deadlock_blocking_send_one_f_one_b():
    # 1F1B with rendezvous sends: rank 0 sends 0F1's output while rank 1 sends 1B0's gradient
    assert simulate(ONE_F_ONE_B_2x2, blocking_send=False).makespan == 9
    with pytest.raises(DeadlockError, match=r"(?s)rank 0 waits in the blocking send.*rank 1 waits in the blocking send"):
        simulate(ONE_F_ONE_B_2x2, blocking_send=True)


def test_blocking_send_gpipe_is_fine():
    assert simulate(GPIPE_2x2, blocking_send=True).makespan == 9


def test_validate_is_a_value_error():
    with pytest.raises(ValueError):
        validate([["0F0"], ["1F0", "1B0"]])


def test_format_schedule():
    assert format_schedule(GPIPE_2x2).splitlines()[1] == "rank 1: 1F0 1F1 1B0 1B1"


# ---------------------------------------------- zero-bubble: W actions (weight gradient)
ZB_2x1 = [["0F0", "0B0", "0W0"], ["1F0", "1B0", "1W0"]]


def test_weight_gradient_before_backward_rejected():
    with pytest.raises(ScheduleError, match=r"rank 1, action 1W0: weight gradient before backward"):
        check_schedule([["0F0", "0B0"], ["1F0", "1W0", "1B0"]])


def test_simulate_split_backward_exact_spans():
    sim = simulate(ZB_2x1, t_f=1, t_b=2, t_w=1)  # B = t_b - t_w, W = t_w
    spans = [[(s, e, str(a)) for s, e, a in rank] for rank in sim.spans]
    assert spans[1] == [(1, 2, "1F0"), (2, 3, "1B0"), (3, 4, "1W0")]
    assert spans[0] == [(0, 1, "0F0"), (3, 4, "0B0"), (4, 5, "0W0")]  # 0B0 needs only 1B0, not 1W0
    assert sim.makespan == 5 and sim.peak_inflight == [1, 1]


def test_split_backward_holds_activations_until_w():
    late_w = [["0F0", "0F1", "0B0", "0B1", "0W0", "0W1"], ["1F0", "1B0", "1W0", "1F1", "1B1", "1W1"]]
    assert simulate(late_w).peak_inflight == [2, 1]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_zero_bubble_schedule_memory_and_idle_time(p):
    for m in range(p, p + 8):
        schedule = zero_bubble_schedule(p, m)
        validate(schedule)
        sim = simulate(schedule, t_f=1, t_b=2, t_w=1)
        assert sim.peak_inflight == [p - r for r in range(p)], f"p={p} m={m}: 1F1B's memory"
        assert sim.makespan - 3 * m == 2 * (p - 1), f"p={p} m={m}: idle 2(p-1), 1F1B's is 3(p-1)"
        relaxed = simulate(zero_bubble_schedule(p, m, max_inflight=m), t_f=1, t_b=2, t_w=1)
        assert relaxed.makespan - 3 * m == p - 1, f"p={p} m={m}: every W deferred"


# ---------------------------------------------- lowering: the one communication model
def test_lower_one_f_one_b_2x2_exact_messages_and_peers():
    lowered = lower(ONE_F_ONE_B_2x2)
    assert str(lowered).splitlines() == [
        "rank 0: 0F0 0SEND_F0->1 0F1 0SEND_F1->1 0RECV_B0<-1 0B0 0RECV_B1<-1 0B1",
        "rank 1: 1RECV_F0<-0 1F0 1B0 1SEND_B0->0 1RECV_F1<-0 1F1 1B1 1SEND_B1->0"]
    assert lowered[1][0] == Action(1, "RECV_F", 0, peer=0)
    assert lowered[1][0].message == lowered[0][1].message == ("act", 0, 0)  # both sides name the same message
    assert lowered[1][0].tag == lowered[0][1].tag
    assert lowered[0][4].message == lowered[1][3].message == ("grad", 1, 0)
    assert len({a.tag for ops in lowered.ops for a in ops if a.kind not in "FBW"}) == 4  # 4 distinct messages
    assert lower(lowered) is lowered and parse_schedule(lowered) == parse_schedule(ONE_F_ONE_B_2x2)


def test_lower_interleaved_wraps_round_and_w_sends_nothing():
    lowered = lower([["0F0", "2F0", "2B0", "0B0"], ["1F0", "3F0", "3B0", "1B0"]])
    assert [str(a) for a in lowered[1][:3]] == ["1RECV_F0", "1F0", "1SEND_F0"] and lowered[1][2].peer == 0
    assert [str(a) for a in lower(ZB_2x1)[0]] == ["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0W0"]
    assert lower(ZB_2x1).split == {(0, 0), (1, 0)}


def test_lower_stage_not_on_the_next_position_rejected():
    with pytest.raises(ScheduleError, match=r"stage 1 must run on the position after stage 0's \(2\), not on 0"):
        lower([["1F0", "1B0"], ["0F0", "0B0"], ["2F0", "2B0"]])


def test_simulate_consumes_the_lowered_list():
    lowered = lower(GPIPE_2x2)
    assert simulate(lowered).makespan == simulate(GPIPE_2x2).makespan == 9


def test_not_strict_draws_a_wrong_schedule_and_locates_the_first_error():
    sim = simulate([["0F0", "0B0"], ["1B0", "1F0"]], strict=False)
    assert (sim.error.rank, sim.error.index) == (1, 0) and "backward before forward" in str(sim.error)
    assert sum(len(s) for s in sim.spans) == 4  # everything ran and can be drawn
    dead = simulate([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]], strict=False)
    assert isinstance(dead.error, DeadlockError) and set(dead.stuck) == {0, 1}
    assert [str(a) for _, a in dead.stuck.values()] == ["0RECV_B0", "1RECV_F1"]
    assert dead.stuck[0][0] == 1 and dead.stuck[1][0] == 2  # rank 0 after 0F0, rank 1 after 1F0 (which waited for 0F0)
    assert (dead.error.rank, dead.error.index) == (0, 1)  # rank 0's 0B0 waits


def test_first_difference_names_the_first_action_out_of_order():
    assert first_difference(GPIPE_2x2, GPIPE_2x2) is None
    assert first_difference(GPIPE_2x2, ONE_F_ONE_B_2x2) == (
        "rank 1, action #1: got 1F1, expected 1B0 (first action out of order)")
    assert "the list ends" in first_difference([["0F0"], []], [["0F0"], ["1F0"]])
    assert "expected a list" in first_difference(None, GPIPE_2x2)


def _torch_order(schedule_class, p, m):
    """The F/B order torch's schedule EXECUTES on each stage (its `_step_microbatches`, with a recording stage).

    (Its `pipeline_order` IR is only a drawing, and in torch 2.13 it starts 1F1B's last stage at F1.)
    """
    from types import SimpleNamespace

    order = []
    for rank in range(p):
        done = []
        stage = SimpleNamespace(
            stage_index=rank, num_stages=p,
            forward_one_chunk=lambda mb, *a, **k: done.append(f"{rank}F{mb}"),
            backward_one_chunk=lambda mb, **k: done.append(f"{rank}B{mb}"),
            get_fwd_recv_ops=lambda mb: [], get_fwd_send_ops=lambda mb: [],
            get_bwd_recv_ops=lambda mb: [], get_bwd_send_ops=lambda mb: [], perform_reduce_grad=lambda n: None)
        fake = SimpleNamespace(
            _stage=stage, _n_microbatches=m, _num_stages=p, scale_grads=True,
            _check_inputs=lambda a, k, t, l: (a, k), _initialize_stage=lambda *a: None,
            _maybe_compute_loss=lambda *a: None, _maybe_get_loss=lambda *a: None, _update_losses=lambda *a: None)
        schedule_class._step_microbatches(fake, [()] * m, [{}] * m)
        order.append(done)
    return order


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (6, 6)])
def test_gpipe_and_one_f_one_b_match_torch_distributed_pipelining(p, m):
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    from labkit.grading import impl

    pl = impl("pipeline", "solutions")
    assert pl.gpipe_schedule(p, m) == _torch_order(ScheduleGPipe, p, m)
    assert pl.one_f_one_b_schedule(p, m) == _torch_order(Schedule1F1B, p, m)


# ---------------------------------------------- drawing a WRONG schedule: draw, then mark the first error
def _texts(ax):
    return [t.get_text() for t in ax.texts]


def _red_outlines(ax):
    import matplotlib.patches

    return [(round(p.get_x(), 6), round(p.get_y() + p.get_height() / 2)) for p in ax.patches
            if isinstance(p, matplotlib.patches.Rectangle) and not p.get_fill()]


@pytest.fixture
def agg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def test_plot_schedule_draws_backward_before_forward_and_outlines_it(agg):
    from labkit.measure import viz

    ax = viz.plot_schedule([["0F0", "0B0"], ["1B0", "1F0"]]).axes[0]
    assert ax.get_title().startswith("WRONG: rank 1, action 1B0: backward before forward")
    assert _red_outlines(ax) == [(0.0, 1)]  # 1B0 runs first on rank 1, at t = 0
    assert "first error" in _texts(ax)


def test_plot_schedule_draws_a_deadlock_and_marks_where_each_rank_waits(agg):
    from labkit.measure import viz

    ax = viz.plot_schedule([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]).axes[0]
    assert ax.get_title().startswith("WRONG: the schedule deadlocks")
    assert {"waits in 0RECV_B0<-1", "waits in 1RECV_F1<-0"} <= set(_texts(ax))
    ax = viz.plot_schedule([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]], blocking_send=True).axes[0]
    assert {"waits in 0SEND_F1->1", "waits in 1SEND_B0->0"} <= set(_texts(ax))


def test_plot_schedule_of_an_unparseable_schedule_shows_the_error(agg):
    from labkit.measure import viz

    ax = viz.plot_schedule([["0F0", "0B0"], ["1F0", "1b0"]]).axes[0]
    assert "cannot draw this schedule" in _texts(ax)[0] and "'1b0'" in _texts(ax)[0]


def test_plot_timeline_marks_the_first_span_out_of_the_schedules_order(agg):
    from labkit.measure import viz
    from labkit.measure.timeline import Span

    ran = [Span(kind, start, start + (1.0 if kind == "F" else 2.0), rank, rank, mb)  # GPipe, measured
           for rank, kind, mb, start in [(0, "F", 0, 0.0), (0, "F", 1, 1.0), (0, "B", 0, 5.0), (0, "B", 1, 7.0),
                                         (1, "F", 0, 1.0), (1, "F", 1, 2.0), (1, "B", 0, 3.0), (1, "B", 1, 5.0)]]
    ax = viz.plot_timeline(ran, unit="s", schedule=ONE_F_ONE_B_2x2).axes[0]
    assert ax.get_title() == "measured: rank 1 ran 1F1 where the schedule has 1B0"
    assert _red_outlines(ax) == [(2.0, 1)]
    ax = viz.plot_timeline(ran, unit="s", schedule=GPIPE_2x2).axes[0]
    assert _red_outlines(ax) == [] and ax.get_title().startswith("measured: bubble")


def test_simulate_message_time_on_the_critical_path():
    # GPipe 2x2 with messages of 0.5: stage 1 starts 0.5 later, stage 0's backward 1 later (a hop each way)
    sim = simulate(GPIPE_2x2, t_f=1, t_b=2, t_msg=0.5)
    spans = [[(s, e, str(a)) for s, e, a in rank] for rank in sim.spans]
    assert spans[1][0] == (1.5, 2.5, "1F0") and spans[0][2] == (5.5 + 0.5, 8.0, "0B0")
    assert sim.makespan == 10  # 9 without messages + one hop down + one hop back
    # 1F1B's steady state has no slack: every cycle pays its hops, so the excess grows with m
    from labkit.grading import impl

    ofob = impl("pipeline", "solutions").one_f_one_b_schedule
    excess = [simulate(ofob(4, m), 1, 2, t_msg=0.1).makespan - simulate(ofob(4, m), 1, 2).makespan for m in (4, 8, 16)]
    assert excess[0] < excess[1] < excess[2]
