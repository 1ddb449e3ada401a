"""Grading tests for notebook 07_hybrid: the (dp, pp) mesh and the hybrid training step.

Run: pytest tests/grading/test_hybrid.py   (add --impl=solutions for the reference)
The two equivalence tests launch 4 and 6 ranks on the tiny model: about 20 s on 2 cores.
Those launches also record the rows that reach each replica's first stage (and the targets its
last stage reads): each replica must train on its own B/dp rows, which "equals one process"
alone cannot see (every replica training on the whole batch averages to the same gradient).
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit.grading import diagnose
from labkit.data import get_batch, load_tokens
from labkit.grading import impl
from labkit.launching.launcher import launch
from labkit.mesh import Mesh
from labkit.model import build_model, make_stage
from labkit.grading.cases import launch_timeout

# The grid torch.arange(world).view(dp, pp), written out by hand: rows are pipelines,
# columns are the replicas of one stage.
EXPECTED = {
    (2, 3): dict(pipelines=[(0, 1, 2), (3, 4, 5)], replicas=[(0, 3), (1, 4), (2, 5)]),
    (2, 2): dict(pipelines=[(0, 1), (2, 3)], replicas=[(0, 2), (1, 3)]),
    (1, 4): dict(pipelines=[(0, 1, 2, 3)], replicas=[(0,), (1,), (2,), (3,)]),
    (4, 1): dict(pipelines=[(0,), (1,), (2,), (3,)], replicas=[(0, 1, 2, 3)]),
}


def expected_place(dp, pp, rank):
    """(dp_rank, pp_rank, pipeline, replicas, prev, next) of rank, read from EXPECTED."""
    layout = EXPECTED[(dp, pp)]
    dp_rank = next(i for i, row in enumerate(layout["pipelines"]) if rank in row)
    pipeline = layout["pipelines"][dp_rank]
    pp_rank = pipeline.index(rank)
    replicas = layout["replicas"][pp_rank]
    prev = pipeline[pp_rank - 1] if pp_rank > 0 else None
    nxt = pipeline[pp_rank + 1] if pp_rank + 1 < len(pipeline) else None
    return dp_rank, pp_rank, pipeline, replicas, prev, nxt


@pytest.mark.exercise("make_mesh")
@pytest.mark.parametrize("dp,pp", list(EXPECTED))
def test_make_mesh_layout_every_rank(dp, pp):
    hybrid = impl("hybrid")
    for rank in range(dp * pp):
        mesh = hybrid.make_mesh(dp * pp, dp, pp, rank=rank)
        assert isinstance(mesh, Mesh), f"make_mesh must return a labkit.mesh.Mesh, got {type(mesh).__name__}"
        dp_rank, pp_rank, pipeline, replicas, prev, nxt = expected_place(dp, pp, rank)
        got = (mesh.rank, mesh.coord("dp"), mesh.coord("pp"), tuple(mesh.ranks("pp")),
               tuple(mesh.ranks("dp")), mesh.prev_rank("pp"), mesh.next_rank("pp"))
        assert got == (rank, dp_rank, pp_rank, pipeline, replicas, prev, nxt), f"rank {rank}"
        assert mesh.is_first("pp") == (pp_rank == 0)
        assert mesh.is_last("pp") == (pp_rank == pp - 1)


@pytest.mark.exercise("make_mesh")
@pytest.mark.parametrize("world_size,dp,pp", [(6, 2, 2), (4, 2, 3), (5, 1, 4), (4, 0, 4)])
def test_make_mesh_world_size_not_dp_times_pp_raises(world_size, dp, pp):
    with pytest.raises(ValueError, match="dp"):
        impl("hybrid").make_mesh(world_size, dp, pp, rank=0)


@pytest.mark.exercise("make_mesh")
def test_make_mesh_rank_out_of_range_raises():
    with pytest.raises(ValueError, match="rank"):
        impl("hybrid").make_mesh(4, 2, 2, rank=4)


def _groups_rank(rank, world_size, dp, pp):
    mesh = impl("hybrid").make_mesh(world_size, dp, pp)
    # Each group must contain exactly the expected ranks and really communicate: the sum
    # of the global ranks over the group, computed by torch's all_reduce on that group.
    out = {"pp_ranks": dist.get_process_group_ranks(mesh.group("pp")),
           "dp_ranks": dist.get_process_group_ranks(mesh.group("dp"))}
    for name, group in (("pp_sum", mesh.group("pp")), ("dp_sum", mesh.group("dp"))):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[name] = t.item()
    out["place"] = (mesh.coord("dp"), mesh.coord("pp"), mesh.prev_rank("pp"), mesh.next_rank("pp"))
    return out


@pytest.mark.exercise("make_mesh")
def test_make_mesh_groups_on_six_launched_ranks():
    dp, pp = 2, 3
    results = launch(_groups_rank, 6, dp, pp, timeout=launch_timeout(30))
    for rank, out in enumerate(results):
        dp_rank, pp_rank, pipeline, replicas, prev, nxt = expected_place(dp, pp, rank)
        assert out["pp_ranks"] == list(pipeline)
        assert out["dp_ranks"] == list(replicas)
        assert out["pp_sum"] == sum(pipeline) and out["dp_sum"] == sum(replicas)
        assert out["place"] == (dp_rank, pp_rank, prev, nxt)


def _world_mismatch_rank(rank, world_size):
    try:
        impl("hybrid").make_mesh(world_size, 2, 3)
    except ValueError as err:  # raised before any (collective) group creation
        return str(err)
    return None  # no error: the test fails


@pytest.mark.exercise("make_mesh")
def test_make_mesh_world_size_not_dp_times_pp_raises_in_launched_ranks():
    messages = launch(_world_mismatch_rank, 4, timeout=launch_timeout(20))
    assert all(m is not None and "dp" in m for m in messages), messages


# ------------------------------------------------------------------ the hybrid training step
SEQ, STEPS, LR = 16, 2, 0.5


def _batches(dp, n_micro):
    """K deterministic global batches of dp * n_micro rows from the shipped corpus."""
    tokens = load_tokens("tinystories")
    return [get_batch(tokens, dp * n_micro, SEQ, step) for step in range(STEPS)]


def _reference(dp, n_micro):
    """Single-process training on the whole global batch: the weights after STEPS steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight the ranks for 2 cores
    try:
        return _train_reference(dp, n_micro)
    finally:
        torch.set_num_threads(threads)


# float64: the hybrid sums each gradient over micro-batches and replicas in another order than one
# process; in float64 the difference is ~1e-16 relative, and SGD with momentum adds it up over
# STEPS steps scaled by lr, so the weights and losses agree to ~1e-13: 1e-10 holds on any CPU.
RTOL = ATOL = 1e-10


def _train_reference(dp, n_micro):
    model = build_model("tiny", seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in _batches(dp, n_micro):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, torch.stack(losses)


def _hybrid_rank(rank, world_size, dp, pp, n_micro, per_microbatch=False):
    hybrid = impl("hybrid")
    torch.set_num_threads(1)
    mesh = hybrid.make_mesh(world_size, dp, pp)
    model = build_model("tiny", seed=0).double()  # float64: see RTOL
    stage = make_stage(model, mesh.coord("pp"), pp)
    opt = torch.optim.SGD(stage.parameters(), lr=LR, momentum=0.9)
    module, sync = stage, True
    if per_microbatch:
        module, sync = hybrid.PerMicrobatchAllReduce(stage, mesh.group("dp")), False
    seen = []  # per step: the token ids each forward of this stage received, and the targets

    def record(_module, args, kwargs):
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        if not args[0].is_floating_point():  # token ids: the first stage
            seen[-1]["inputs"].append(args[0].detach().clone())
        if targets is not None:
            seen[-1]["targets"].append(targets.detach().clone())
    stage.register_forward_pre_hook(record, with_kwargs=True)
    losses = []
    for x, y in _batches(dp, n_micro):
        seen.append({"inputs": [], "targets": []})
        loss = hybrid.hybrid_step(module, x, y, n_micro, opt, mesh=mesh, sync_grads=sync)
        losses.append(loss)
    mine = {id(p) for p in stage.parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in mine}
    return {"weights": weights, "losses": None if losses[0] is None else torch.stack(losses), "seen": seen}


def _check_against_reference(results, reference, pp):
    ref_weights, ref_losses = reference
    seen = set()
    for rank, out in enumerate(results):
        assert out["weights"], f"rank {rank} owns no parameters"
        # the first parameter of this stage (in the model's order) that differs, and by how much
        diagnose.assert_same_named(out["weights"], {n: ref_weights[n] for n in out["weights"]}, "weight",
                                   f"rank {rank} (replica {rank // pp}, stage {rank % pp}) against one "
                                   f"process", rtol=RTOL, atol=ATOL)
        seen.update(out["weights"])
        if rank % pp == pp - 1:  # a last stage reports the global batch's loss
            torch.testing.assert_close(out["losses"], ref_losses, rtol=RTOL, atol=ATOL)
        else:
            assert out["losses"] is None
    assert seen == set(ref_weights), "every parameter is owned by some stage"


def _rows_named(batch, rows):
    """Which rows of `batch` the tensor `rows` holds, as row indices (-1: a row not in the batch)."""
    return [next((i for i in range(len(batch)) if torch.equal(batch[i], row)), -1) for row in rows]


def check_replica_rows(results, dp, pp, m):
    """Each replica's first stage got exactly its own rows of every global batch, in m
    micro-batches of B/(dp m) rows in order, and its last stage the matching targets.
    Fails naming the first step, replica, micro-batch and the global rows it held."""
    for step, (x, y) in enumerate(_batches(dp, m)):
        b = len(x) // dp
        for rank, out in enumerate(results):
            replica, stage = divmod(rank, pp)
            own = range(replica * b, (replica + 1) * b)
            for kind, batch, needed in (("inputs", x, stage == 0), ("targets", y, stage == pp - 1)):
                if not needed:
                    continue
                got = out["seen"][step][kind]
                where = (f"step {step}: replica {replica}'s {'first' if kind == 'inputs' else 'last'} stage "
                         f"(rank {rank}) received {kind}")
                want = f"replica {replica} trains on rows {own[0]}-{own[-1]} of the global batch of {len(x)} " \
                       f"only (B/dp = {b} rows, in {m} micro-batches of {b // m}): pass replica_rows(x, mesh=mesh)"
                assert len(got) == m, f"{where} in {len(got)} forwards, expected {m} micro-batches"
                for mb, rows in enumerate(got):
                    expected = list(own[mb * b // m:(mb + 1) * b // m])
                    held = _rows_named(batch, rows)
                    assert held == expected, (f"{where} for micro-batch {mb}: global rows {held}, expected rows "
                                              f"{expected}; {want}")


@functools.lru_cache(maxsize=None)
def _launch_hybrid(dp, pp, m, timeout):
    """One launch per mesh, shared by the tests that read it (a failure is returned, then raised)."""
    try:
        return launch(_hybrid_rank, dp * pp, dp, pp, m, timeout=timeout)
    except Exception as error:
        return error


def _launched(dp, pp, m, timeout):
    results = _launch_hybrid(dp, pp, m, timeout)
    if isinstance(results, Exception):
        raise results
    return results


@pytest.mark.exercise("hybrid_step", "make_mesh")
def test_hybrid_step_dp2_pp2_equals_single_process():
    dp, pp, m = 2, 2, 2
    # the reference first: the ranks fork from a process that has loaded the data and
    # warmed up torch (optimizer, autograd), instead of each paying for it on 2 cores
    reference = _reference(dp, m)
    _check_against_reference(_launched(dp, pp, m, 60), reference, pp)


@pytest.mark.exercise("hybrid_step", "make_mesh")
def test_hybrid_step_dp2_pp3_three_microbatches_equals_single_process():
    dp, pp, m = 2, 3, 3
    reference = _reference(dp, m)
    _check_against_reference(_launched(dp, pp, m, 90), reference, pp)


@pytest.mark.exercise("hybrid_step", "make_mesh")
@pytest.mark.parametrize("dp,pp,m", [(2, 2, 2), (2, 3, 3)])
def test_hybrid_step_each_replica_first_stage_sees_only_its_own_rows(dp, pp, m):
    check_replica_rows(_launched(dp, pp, m, 60 if pp == 2 else 90), dp, pp, m)


@pytest.mark.exercise("hybrid_step", "make_mesh")
def test_hybrid_step_allreduce_per_microbatch_same_weights():
    # the slow way (an all-reduce after every micro-batch) must give the same weights
    dp, pp, m = 2, 2, 2
    reference = _reference(dp, m)
    results = launch(_hybrid_rank, dp * pp, dp, pp, m, per_microbatch=True, timeout=launch_timeout(30))
    _check_against_reference(results, reference, pp)


def _bad_batch_rank(rank, world_size):
    hybrid = impl("hybrid")
    mesh = hybrid.make_mesh(world_size, 2, 1)
    stage = make_stage(build_model("tiny", seed=0), 0, 1)
    x = torch.zeros(3, SEQ, dtype=torch.long)  # 3 rows cannot split over 2 replicas
    try:
        hybrid.hybrid_step(stage, x, x, 1, mesh=mesh)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.exercise("hybrid_step", "make_mesh")
def test_hybrid_step_batch_not_divisible_by_dp_raises():
    messages = launch(_bad_batch_rank, 2, timeout=launch_timeout(20))
    assert all(m is not None for m in messages), messages
