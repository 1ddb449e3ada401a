"""The pipeline executor (solutions/pipeline.py run_schedule) beyond grading: bad input,
the blocking-send deadlock (stuck in `communicate`), synthetic stages whose spans follow the
lowered list, two pipelines whose pp axis is not the mesh's innermost (neighbours are not
rank +/- 1), the interleaved 1F1B and zero-bubble stretches,
and torch.distributed.pipelining's Schedule1F1B on the same stages.

Uses the reference module (the executor's own code is the same in exercises/, but it
calls the learner's forward/backward steps and communicate). About 45 s on 2 cores: the
deadlock test waits for its 8 s launcher timeout on purpose.
"""
import pytest
import torch
import torch.distributed as dist

from labkit.grading import impl
from labkit.launching.launcher import LaunchError, launch
from labkit.mesh import Mesh
from labkit.parallel.schedules import (DeadlockError, ScheduleError, interleaved_schedule, lower, simulate,
                              zero_bubble_schedule)
from labkit.measure.timeline import Timeline

# Pipelined gradients against one model, in float32: the same products, but each parameter's
# gradient is a sum over m <= 8 micro-batches instead of one batched reduction. Each extra addition
# rounds by at most 2**-24 of the running sum, so an element differs by at most
# m * 6e-8 * max|partial gradient| (~1e-1 here) = 5e-8 absolute and 5e-7 relative: atol 1e-6 and
# rtol 1e-4 leave 20x and 200x margin on any CPU, and a wrong micro-batch or stage is off by >1e-3.
F32_GRAD_TOL = dict(rtol=1e-4, atol=1e-6)

pl = impl("pipeline", "solutions")
ACT = (2, 4, 8)  # micro-batch, seq, d_model of the synthetic stages


def _synthetic_call(schedule, stage=0, rows=4, mesh=None, **kw):
    st = pl.SyntheticStage(stage, len(schedule), ACT, t_f=0.0)
    x = torch.zeros(rows, 4, dtype=torch.long)
    mesh = mesh or Mesh(len(schedule), pp=len(schedule), rank=stage)  # the layout only: no process group
    return pl.run_schedule(st, schedule, x, x, mesh=mesh, act_shape=ACT, **kw)


# ------------------------------------------------- bad input: raised before any message
def test_invalid_schedule_backward_before_forward_rejected_without_communicating():
    # no process group exists here: the error must come before the first send/recv
    with pytest.raises(ScheduleError, match=r"rank 1, action 1B0: backward before forward"):
        _synthetic_call([["0F0", "0B0"], ["1B0", "1F0"]])


def test_invalid_schedule_missing_microbatch_rejected_without_communicating():
    with pytest.raises(ScheduleError, match=r"stage 1 is missing 1F1, 1B1"):
        _synthetic_call([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0"]])


def test_deadlocking_schedule_rejected_without_communicating():
    with pytest.raises(DeadlockError, match="rank 0 waits in the receive of the input gradient"):
        _synthetic_call([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])


def test_one_f_one_b_with_blocking_sends_rejected_without_communicating():
    with pytest.raises(DeadlockError, match="blocking send"):
        _synthetic_call(pl.one_f_one_b_schedule(2, 2), blocking_send=True)


def test_batch_not_splitting_into_microbatches_rejected():
    with pytest.raises(ValueError, match="batch size 6 does not split into 4 equal micro-batches"):
        pl.activation_shape(torch.nn.Module(), 6, 16, 4)


def test_inputs_with_wrong_batch_rejected():
    with pytest.raises(ValueError, match=r"stage 0: inputs must be a batch of 4 rows"):
        _synthetic_call(pl.gpipe_schedule(2, 2), rows=6)


def test_more_stages_than_layers_rejected():
    from labkit.model import build_model, make_stage

    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        make_stage(build_model("tiny"), 0, 5)  # tiny has 4 layers


def test_schedule_for_another_pipeline_size_rejected():
    with pytest.raises(ValueError, match=r"the schedule has 2 pipeline ranks but the mesh's pp axis has 3"):
        _synthetic_call(pl.gpipe_schedule(2, 1), mesh=Mesh(6, dp=2, pp=3, rank=2))


# ------------------------------------------------------------------------ real ranks
def _blocking_only_communicate(op, tensor, peer, *, group=None, blocking=False):
    """What a learner writes first: the blocking version, whatever ``blocking`` says."""
    (dist.send if op.kind.startswith("SEND") else dist.recv)(tensor, peer, group=group, tag=op.tag)


def _non_blocking_missing_rank(rank, world_size, forget):
    if forget == "blocking only":
        pl.communicate = _blocking_only_communicate  # (in this forked rank only)
    else:  # the non-blocking branch posts its isend/irecv but forgets to return the Work
        pl.communicate = lambda op, t, peer, *, group=None, blocking=False: (
            (dist.isend if op.kind.startswith("SEND") else dist.irecv)(t, peer, group=group, tag=op.tag), None)[1]
    st = pl.SyntheticStage(rank, world_size, ACT, t_f=0.001)
    x = torch.zeros(ACT[0] * 4, 4, dtype=torch.long)
    pl.run_schedule(st, pl.one_f_one_b_schedule(world_size, 4), x, x, mesh=Mesh(world_size, pp=world_size), act_shape=ACT)


@pytest.mark.parametrize("forget", ["blocking only", "no return"])
def test_non_blocking_communicate_without_work_refused_at_once_by_name(forget):
    """1F1B with a communicate(blocking=False) that returns no Work: a one-line NotImplementedError
    naming the missing Work, in seconds (it used to be a 180 s deadlock, or a wrong buffer)."""
    import time

    start = time.monotonic()
    with pytest.raises(NotImplementedError, match=r"exercise communicate: the non-blocking version .* "
                                                  r"returned None instead of the Work"):
        launch(_non_blocking_missing_rank, 2, forget, timeout=60)
    assert time.monotonic() - start < 15
def _blocking_rank(rank, world_size):
    st = pl.SyntheticStage(rank, world_size, ACT, t_f=0.001)
    x = torch.zeros(ACT[0] * 4, 4, dtype=torch.long)
    pl.run_schedule(st, pl.one_f_one_b_schedule(world_size, 4), x, x, mesh=Mesh(world_size, pp=world_size),
                    act_shape=ACT, blocking_send=True, check=False)


def test_blocking_send_one_f_one_b_really_deadlocks():
    # what simulate() predicts: both ranks stuck in send; the launcher reports and kills them
    with pytest.raises(DeadlockError):
        simulate(pl.one_f_one_b_schedule(2, 4), blocking_send=True)
    with pytest.raises(LaunchError, match="send") as err:
        launch(_blocking_rank, 2, timeout=60, idle_timeout=2.0)  # both ranks wait, idle, in send
    # the stuck ranks' stacks point into communicate, the learner's exercise, at its blocking send
    assert str(err.value).count("in communicate: dist.send(") == 2, str(err.value)


def _synthetic_rank(rank, world_size, m):
    tl = Timeline()
    out, mesh = {}, Mesh(world_size, pp=world_size)
    for name in ("gpipe_schedule", "one_f_one_b_schedule"):
        st = pl.SyntheticStage(rank, world_size, ACT, t_f=0.002)
        x = torch.zeros(ACT[0] * m, 4, dtype=torch.long)
        stats = {}
        tl.sync()
        pl.run_schedule(st, getattr(pl, name)(world_size, m), x, x, mesh=mesh, act_shape=ACT,
                        timeline=tl, stats=stats)
        out[name] = (tl.gather(), stats)
    return out


def test_synthetic_stages_timeline_follows_schedule_and_peak_memory():
    p, m = 2, 4
    res = launch(_synthetic_rank, p, m, timeout=60)
    # the input path's delay saves x, the product saves that delay's output and the weight path's (4 bytes)
    bytes_per_mb = 2 * 4 * torch.Size(ACT).numel() + 4
    for name in ("gpipe_schedule", "one_f_one_b_schedule"):
        schedule = getattr(pl, name)(p, m)
        spans, _ = res[0][name]
        for rank in range(p):
            compute = [f"{s.stage}{s.kind}{s.mb}" for s in spans if s.rank == rank and s.kind in "FB"]
            assert compute == schedule[rank], f"{name}: rank {rank} ran its actions in schedule order"
            assert any(s.kind == ("recv" if rank else "send") for s in spans if s.rank == rank)
            # the executor runs the lowered list, message for message
            ran = [(s.kind, s.stage, s.mb) for s in spans if s.rank == rank and s.kind != "wait"]
            kinds = {"SEND_F": "send", "SEND_B": "send", "RECV_F": "recv", "RECV_B": "recv"}
            assert ran == [(kinds.get(a.kind, a.kind), a.stage, a.mb) for a in lower(schedule)[rank]], name
        peaks = simulate(schedule).peak_inflight
        for rank in range(p):
            stats = res[rank][name][1]
            assert stats == {"peak_inflight": peaks[rank], "peak_activation_bytes": peaks[rank] * bytes_per_mb}


def _subgroup_rank(rank, world_size, x, y, m):
    # two pipelines in Mesh(4, pp=2, tp=2): pp is not the innermost axis, so they are ranks [0, 2] and
    # [1, 3]: the executor must send to the mesh's neighbours (global ranks), not to position +/- 1
    from labkit.model import build_model, make_stage

    mesh = Mesh(world_size, pp=2, tp=2)
    stage = mesh.coord("pp")
    model = build_model("tiny", seed=0)
    st = make_stage(model, stage, 2)
    loss = pl.run_schedule(st, pl.one_f_one_b_schedule(2, m), x if stage == 0 else None, y if stage == 1 else None,
                           mesh=mesh, act_shape=pl.activation_shape(model.config, x.shape[0], x.shape[1], m))
    return {n: p.grad for n, p in st.named_parameters()}, loss


@pytest.mark.filterwarnings("ignore::labkit.launching.launcher.OversubscriptionWarning")
def test_pipelines_with_pp_not_innermost_global_neighbour_ranks_equal_single_model():
    from labkit.model import build_model, make_stages

    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 4096, (4, 8), generator=g), torch.randint(0, 4096, (4, 8), generator=g)
    results = launch(_subgroup_rank, 4, x, y, 2, timeout=60)
    ref = build_model("tiny", seed=0)
    loss = ref(x, y)
    loss.backward()
    stages = make_stages(ref, 2)
    for rank, (grads, got_loss) in enumerate(results):  # ranks 0, 1 hold stage 0; ranks 2, 3 stage 1
        for n, p in stages[rank // 2].named_parameters():
            torch.testing.assert_close(grads[n], p.grad, **F32_GRAD_TOL, msg=lambda m: f"rank {rank} {n}: {m}")
        if rank // 2:
            torch.testing.assert_close(got_loss, loss.detach())
        else:
            assert got_loss is None


# ------------------------------------------------- stretch: interleaved 1F1B (virtual stages)
@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (3, 2, 6), (4, 3, 8), (2, 1, 4)])
def test_interleaved_schedule_valid_and_bubble_shrinks_by_chunks(p, v, m):
    schedule = interleaved_schedule(p, v, m)
    assert validate_ok(schedule) == (p * v, m)
    for r, actions in enumerate(schedule):
        assert {int(a.split("F")[0]) for a in actions if "F" in a} == {c * p + r for c in range(v)}
    sim = simulate(schedule, t_f=1 / v, t_b=2 / v)  # each virtual stage is 1/v of a rank's layers
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))


def validate_ok(schedule):
    from labkit.parallel.schedules import validate

    return validate(schedule)


def test_interleaved_schedule_microbatches_not_multiple_of_ranks_rejected():
    with pytest.raises(ValueError, match=r"n_microbatches \(3\) to be a positive multiple of n_ranks \(2\)"):
        interleaved_schedule(2, 2, 3)


def test_interleaved_needs_a_module_per_stage():
    with pytest.raises(ValueError, match=r"rank 0 runs stages \[0, 2\]: pass stage_module as a dict"):
        _synthetic_call(interleaved_schedule(2, 2, 2))


def test_stage_on_wrong_position_rejected():
    # stage 1 on position 0 and stage 0 on position 1: position 1 sends to position 2
    with pytest.raises(ValueError, match=r"stage 1 must run on the position after stage 0's \(2\), not on 0"):
        _synthetic_call([["1F0", "1B0"], ["0F0", "0B0"], ["2F0", "2B0"]])


def _interleaved_rank(rank, world_size, x, y, v, ms):
    from labkit.model import build_model, make_stage

    model = build_model("tiny", seed=0)
    n_stages = world_size * v
    stages = {c * world_size + rank: make_stage(model, c * world_size + rank, n_stages) for c in range(v)}
    out, mesh = {}, Mesh(world_size, pp=world_size)
    for m in ms:
        model.zero_grad(set_to_none=True)
        loss = pl.run_schedule(stages, interleaved_schedule(world_size, v, m), x, y, mesh=mesh,
                               act_shape=pl.activation_shape(model.config, x.shape[0], x.shape[1], m))
        mine = {n: p.grad.clone() for s in stages.values() for n, p in s.named_parameters(prefix=f"stage{s.stage}")}
        out[m] = (mine, loss)
    return out


def test_interleaved_two_ranks_two_chunks_equals_single_model():
    from labkit.model import build_model, make_stages

    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 4096, (4, 8), generator=g), torch.randint(0, 4096, (4, 8), generator=g)
    results = launch(_interleaved_rank, 2, x, y, 2, (2, 4), timeout=60)
    ref = build_model("tiny", seed=0)
    loss = ref(x, y)
    loss.backward()
    want = {n: p.grad for s in make_stages(ref, 4) for n, p in s.named_parameters(prefix=f"stage{s.stage}")}
    for m in (2, 4):
        got = {**results[0][m][0], **results[1][m][0]}
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], **F32_GRAD_TOL, msg=lambda msg: f"m={m} {n}: {msg}")
        torch.testing.assert_close(results[1][m][1], loss.detach())  # stage 3 lives on rank 1
        assert results[0][m][1] is None


# ------------------------------------------------- stretch: zero-bubble (B and W split)
def _zero_bubble_rank(rank, world_size, x, y, m):
    from labkit.model import build_model, make_stage

    model = build_model("tiny", seed=0)
    st = make_stage(model, rank, world_size)
    stats = {}
    loss = pl.run_schedule(st, zero_bubble_schedule(world_size, m), x if rank == 0 else None,
                           y if rank == world_size - 1 else None, mesh=Mesh(world_size, pp=world_size), stats=stats,
                           act_shape=pl.activation_shape(model.config, x.shape[0], x.shape[1], m))
    return {n: p.grad for n, p in st.named_parameters()}, loss, stats


@pytest.mark.filterwarnings("ignore::labkit.launching.launcher.OversubscriptionWarning")
def test_zero_bubble_three_ranks_equals_single_model():
    from labkit.model import build_model, make_stages

    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 4096, (6, 8), generator=g), torch.randint(0, 4096, (6, 8), generator=g)
    results = launch(_zero_bubble_rank, 3, x, y, 3, timeout=60)
    ref = build_model("tiny", seed=0)
    loss = ref(x, y)
    loss.backward()
    for s, stage in enumerate(make_stages(ref, 3)):
        grads, got_loss, stats = results[s]
        for n, p in stage.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, **F32_GRAD_TOL, msg=lambda m: f"stage {s} {n}: {m}")
        assert stats["peak_inflight"] == 3 - s  # held from F until W: 1F1B's memory
    torch.testing.assert_close(results[2][1], loss.detach())


def _zb_synthetic_rank(rank, world_size, m):
    tl = Timeline()
    st = pl.SyntheticStage(rank, world_size, ACT, t_f=0.002)
    x = torch.zeros(ACT[0] * m, *ACT[1:])  # floating-point inputs: stage 0's B has an input gradient
    tl.sync()
    pl.run_schedule(st, zero_bubble_schedule(world_size, m), x, x[:, :, 0], mesh=Mesh(world_size, pp=world_size),
                    act_shape=ACT, timeline=tl)
    return tl.gather()


def test_zero_bubble_synthetic_timeline_follows_schedule():
    spans = launch(_zb_synthetic_rank, 2, 4, timeout=60)[0]
    schedule = zero_bubble_schedule(2, 4)
    for rank in range(2):
        compute = [f"{s.stage}{s.kind}{s.mb}" for s in spans if s.rank == rank and s.kind in ("F", "B", "W")]
        assert compute == schedule[rank]
        w = [s for s in spans if s.rank == rank and s.kind == "W"]
        assert len(w) == 4 and all(s.duration >= 0.002 for s in w)  # W sleeps t_w = t_b / 2 = t_f


# ------------------------------------------------- torch's own pipelining on the same stages
def _torch_pipelining_rank(rank, world_size, x, y, m):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from labkit.model import build_model, lm_loss, make_stage

    module = make_stage(build_model("tiny", seed=0), rank, world_size)
    ran = []
    module.register_forward_pre_hook(lambda *_: ran.append("F"))
    next(module.parameters()).register_hook(lambda g: ran.append("B"))
    schedule = Schedule1F1B(PipelineStage(module, rank, world_size, torch.device("cpu")), n_microbatches=m,
                            loss_fn=lm_loss)
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    ran = ran[1:]  # torch's shape inference runs micro-batch 0's forward once first
    return {n: p.grad for n, p in module.named_parameters()}, [f"{rank}{k}{ran[:i].count(k)}" for i, k in enumerate(ran)]


def test_torch_pipelining_schedule1f1b_on_gloo_equals_single_model_and_our_order():
    # notebook 06 runs torch.distributed.pipelining on CPU/gloo; this proves what it shows
    from labkit.model import build_model, make_stages

    g = torch.Generator().manual_seed(6)
    x, y = torch.randint(0, 4096, (4, 8), generator=g), torch.randint(0, 4096, (4, 8), generator=g)
    results = launch(_torch_pipelining_rank, 2, x, y, 4, timeout=60)
    ref = build_model("tiny", seed=0)
    ref(x, y).backward()
    for s, stage in enumerate(make_stages(ref, 2)):
        for n, p in stage.named_parameters():
            torch.testing.assert_close(results[s][0][n], p.grad, **F32_GRAD_TOL)
    assert [r[1] for r in results] == pl.one_f_one_b_schedule(2, 4)
