"""V-shaped schedules (ZB-V, DualPipeV) as data: action for action against torch's own lists.

Pure Python, about two seconds (torch's schedule classes are imported once), and one launch of
2 ranks that runs both on the tiny model against one model (a few seconds).
"""
import pytest
import torch

import labkit

from labkit.launching.launcher import launch
from labkit.parallel.torch_schedules import torch_schedule
from labkit.parallel.v_schedules import dualpipev_schedule, zbv_schedule
from labkit.parallel.schedules import ScheduleError, check_schedule, first_difference, lower, simulate, validate


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zbv_equals_torch_schedule_zbv_zero_bubble(p):
    for m in range(1, 2 * p + 4):  # fewer micro-batches than 2p - 1 too: torch drops the extra ones
        got, want = zbv_schedule(p, m), torch_schedule("ZBVZeroBubble", p, m)
        assert got == want, f"p={p}, m={m}: {first_difference(got, want)}"


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_dualpipev_equals_torch_schedule_dualpipev(p):
    for m in range(2 * p, 2 * p + 6):
        got, want = dualpipev_schedule(p, m), torch_schedule("DualPipeV", p, m)
        assert got == want, f"p={p}, m={m}: {first_difference(got, want)}"
    with pytest.raises(ValueError, match=r"DualPipeV needs n_microbatches >= 2 x n_ranks \(8\)"):
        dualpipev_schedule(4, 7)


def test_a_swapped_action_is_caught_by_the_torch_comparison():
    planted = zbv_schedule(4, 8)
    planted[1][5], planted[1][6] = planted[1][6], planted[1][5]  # the check above must see this
    assert first_difference(planted, torch_schedule("ZBVZeroBubble", 4, 8)).startswith("rank 1, action #5")


@pytest.mark.parametrize("build", [zbv_schedule, dualpipev_schedule])
@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_v_schedules_run_deadlock_free_with_idle_p_minus_1(build, p):
    for m in (2 * p, 2 * p + 3, 4 * p):
        validate(build(p, m), n_stages=2 * p, n_microbatches=m)
        sim = simulate(build(p, m), t_f=1, t_b=2, t_w=1)  # F = B = W = 1 per stage, 6m per rank
        assert sim.makespan == 6 * m + p - 1, f"p={p} m={m}: only the ramp's p - 1 units idle"


def test_v_lowering_keeps_the_turn_on_one_rank_and_sends_back_up():
    lowered = lower(zbv_schedule(2, 3))
    assert lowered.stage_rank == {0: 0, 1: 1, 2: 1, 3: 0}
    rank1 = [str(a) for a in lowered[1]]
    assert "1SEND_F0" not in rank1 and "2RECV_F0" not in rank1  # stage 1 -> 2 stays on rank 1
    send = next(a for a in lowered[1] if str(a) == "2SEND_F0")
    assert send.peer == 0 and not lowered.to_next_position(send)
    four = lower(zbv_schedule(4, 8))
    up = next(a for a in four[2] if str(a) == "5SEND_F0")  # stage 5 on rank 2 sends to stage 6 on rank 1
    down = next(a for a in four[2] if str(a) == "2SEND_F0")
    assert (up.peer, four.to_next_position(up)) == (1, False) and (down.peer, four.to_next_position(down)) == (3, True)


def test_v_local_order_is_checked():
    bad = zbv_schedule(2, 2)
    bad[1] = ["2F0"] + [a for a in bad[1] if a != "2F0"]  # stage 2 before stage 1, on the same rank
    with pytest.raises(ScheduleError, match=r"rank 1, action 2F0: 1F0 runs on this rank too and must come before 2F0"):
        check_schedule(bad)


def test_plot_schedule_draws_every_action_of_a_v_schedule():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.measure import viz

    schedule = dualpipev_schedule(4, 8)
    ax = viz.plot_schedule(schedule, t_w=1.0).axes[0]
    boxes = sum(len(c.get_paths()) for c in ax.collections)
    assert boxes == sum(len(actions) for actions in schedule)  # one box per compute action
    assert ax.get_title().startswith("ideal: bubble 5.9%")  # 3 idle units of 51 (6m + p - 1)
    plt.close("all")


def _v_rank(rank, world_size, x, y, m):
    from labkit.grading import impl
    from labkit.model import build_model, make_stage

    pl = impl("pipeline", "solutions")
    out = {}
    for name, build in (("ZB-V", zbv_schedule), ("DualPipeV", dualpipev_schedule)):
        model = build_model("tiny", seed=0).double()
        stages = {s: make_stage(model, s, 2 * world_size) for s in (rank, 2 * world_size - 1 - rank)}
        loss = pl.run_schedule(stages, build(world_size, m), x if rank == 0 else None, y if rank == 0 else None,
                               mesh=labkit.Mesh(world_size, pp=world_size), act_shape=pl.activation_shape(model.config, x.shape[0], x.shape[1], m))
        out[name] = ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss)
    return out


def test_v_schedules_on_two_ranks_equal_one_model_in_float64():
    """The V runs on real ranks: rank 0 holds the embedding stage and the loss stage. Float64, one
    model summed over 4 micro-batches in another order: ~1e-16 relative, rtol 1e-10 has margin."""
    from labkit.launching.launcher import OversubscriptionWarning
    from labkit.model import build_model
    import warnings

    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 4096, (4, 8), generator=g), torch.randint(0, 4096, (4, 8), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversubscriptionWarning)
        results = launch(_v_rank, 2, x, y, 4, timeout=60)
    ref = build_model("tiny", seed=0).double()
    ref_loss = ref(x, y)
    ref_loss.backward()
    for name in ("ZB-V", "DualPipeV"):
        grads = {**results[0][name][0], **results[1][name][0]}  # each rank's own stages
        assert set(grads) == {n for n, _ in ref.named_parameters()}, name
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}, {n}: {m}")
        torch.testing.assert_close(results[0][name][1], ref_loss.detach(), rtol=1e-12, atol=0)
