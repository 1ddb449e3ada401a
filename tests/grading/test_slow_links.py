"""Grading tests for notebook 13_slow_links_and_failures (solutions/slow_links.py): DiLoCo and PowerSGD.

Run: pytest tests/grading/test_slow_links.py   (add --impl=solutions for the reference)

The references: single-process training on the whole global batch (DP's proof), torch's
own all-reduce, and the error-feedback bookkeeping summed by hand. Where N ranks and one
process add in different orders, the proofs run in float64 (tolerances below). Bytes are
counted with `labkit.links.shaper.SlowLink` (infinite bandwidth: it only counts). ONE launch per
world size (2 and 3) runs every case. About 10 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading.diagnose import average_mismatch, rank_tag, watch_groups
from labkit.grading import impl
from labkit.mesh import shard_rows
from labkit.links.shaper import SlowLink

ROWS = 4  # rows per rank
# float64 tolerance for "equal up to the order of additions": each step rounds at ~1e-16
# relative; DiLoCo's theta - (theta - lr*g) cancels |theta| ~ 1 against lr*g ~ 1e-2, i.e.
# up to ~1e-14 absolute per step, and a few steps stay far below 1e-11.
F64 = dict(rtol=0.0, atol=1e-11)


def sl():
    return impl("slow_links")


class Net(nn.Module):
    """Matrices of several shapes (one 3-D), vectors, and a frozen layer."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # the frozen layer FIRST in parameter order: code that pairs the shared weights with every
        # parameter, frozen ones included, pairs them wrongly (last, zip's truncation would hide it)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 5, bias=False)
        self.cube = nn.Parameter(torch.empty(5, 2, 3))
        self.scale = nn.Parameter(torch.empty(6))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(self.frozen(x) * self.scale))
        h = self.b(h)
        return (h.unsqueeze(-1).unsqueeze(-1) * self.cube).square().mean()


def global_batch(step, world_size):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * world_size, 6, generator=g, dtype=torch.float64)


def mine(x, rank):
    """This rank's rows of the global batch (labkit's one sharding rule)."""
    return shard_rows(x, rank, x.shape[0] // ROWS)


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(got, want, **tol):
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{name}: {m}", **tol)


def dp_reference(steps, world_size, make_opt):
    """One process, whole global batch, plain training: what DP must equal."""
    model = Net()
    opt = make_opt(model)
    for step in range(steps):
        opt.zero_grad()
        model(global_batch(step, world_size)).backward()
        opt.step()
    return state(model)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def same_on_all_ranks(tensors):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(e, everyone[0]) for e in everyone), "ranks disagree"


# --- the cases, run inside the ranks -----------------------------------------------------


def pseudo_gradients_rank_tags(rank, n, members=None):
    """shared - p = 16**rank on every rank: each shared[i].grad must be the group's tags / group size.

    members: a subgroup ([0, 2] of 3 ranks: not the whole world, not [0..k)); rank 1 is outside."""
    members = members or list(range(n))
    group = dist.new_group(members) if len(members) < n else None  # collective: every rank creates it
    if rank not in members:
        return
    model = Net()
    with torch.no_grad():
        for p in trainable(model):
            p.fill_(-rank_tag(rank))
    shared = [torch.zeros_like(p) for p in trainable(model)]
    with watch_groups(group or dist.group.WORLD, f"average_pseudo_gradients (group {members})"):
        try:
            sl().average_pseudo_gradients(model, shared, group=group)
        except RuntimeError as err:
            if "must match the size" not in str(err):
                raise
            raise AssertionError(
                f"average_pseudo_gradients: {err}. shared[i] belongs to the model's i-th TRAINABLE parameter "
                "(requires_grad); this model's frozen layer comes first and has no shared copy: pair shared with "
                "the trainable parameters only") from None
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for i, (name, s) in enumerate(zip(names, shared)):
        assert s.grad is not None, f"average_pseudo_gradients: shared[{i}].grad (for `{name}`) is not set"
        wrong = average_mismatch(s.grad, rank, members, n, len(members))
        assert wrong is None, (f"average_pseudo_gradients: shared[{i}].grad (for `{name}`), with shared - p = "
                               f"16**rank on every rank: {wrong}. Expected the mean over the group {members} of "
                               "shared[i] - p_i: one all-reduce over the group, divided by the group's size")


def pseudo_gradients_mean_of_differences(rank, n):
    model = Net(seed=rank + 1)  # different local weights on each rank
    shared = [p.detach().clone() for p in trainable(Net())]
    with SlowLink(float("inf")) as link:
        sl().average_pseudo_gradients(model, shared)
    for s, p in zip(shared, trainable(model)):
        want = (s - p).detach().clone()
        dist.all_reduce(want)
        torch.testing.assert_close(s.grad, want / n, **F64)
    assert link.by_op == {"all_reduce": 1}, f"expected ONE all-reduce, got {link.by_op}"
    assert link.payload_bytes == sum(p.numel() for p in trainable(model)) * 8


def diloco_run(rank, n, steps, inner_steps, make_inner, **outer):
    model = Net()
    algo = sl().DiLoCo(model, make_inner(model), inner_steps, **outer)
    synced = []
    with SlowLink(float("inf")) as link:
        for step in range(steps):
            model(mine(global_batch(step, n), rank)).backward()
            synced.append(algo.step())
    return model, algo, link, synced


def diloco_H1_equals_dp(make_inner):
    def case(rank, n):
        model, _, _, synced = diloco_run(rank, n, 4, 1, make_inner, outer_lr=1.0, outer_momentum=0.0)
        assert synced == [True] * 4
        assert_same(state(model), dp_reference(4, n, make_inner), **F64)
    return case


def diloco_bytes_fall_by_H(rank, n):
    H, steps = 4, 8
    _, _, link, synced = diloco_run(rank, n, steps, H, lambda m: torch.optim.AdamW(trainable(m), lr=1e-2))
    assert synced == [False, False, False, True] * 2
    model = Net()
    with SlowLink(float("inf")) as dp_link:
        for step in range(steps):
            model(mine(global_batch(step, n), rank)).backward()
            sl().sync_gradients(model)
            model.zero_grad()
    assert link.by_op == {"all_reduce": steps // H}
    assert link.wire_bytes * H == dp_link.wire_bytes, (link.wire_bytes, dp_link.wire_bytes)


def diloco_replicas_equal_after_sync_adamw_nesterov(rank, n):
    model, algo, _, _ = diloco_run(rank, n, 6, 3, lambda m: torch.optim.AdamW(trainable(m), lr=1e-2))
    same_on_all_ranks(trainable(model))
    for p, s in zip(trainable(model), algo.shared):
        assert torch.equal(p, s)
    assert any(st.get("momentum_buffer") is not None for st in algo.outer.state.values())


def diloco_H_zero_raises(rank, n):
    diloco_H1_equals_dp(lambda m: torch.optim.SGD(trainable(m), lr=0.1))(rank, n)  # works first
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="inner_steps"):
            sl().DiLoCo(Net(), torch.optim.SGD(Net().parameters(), lr=0.1), bad)


def powersgd_steps(rank, n, r, steps):
    """Train a few SGD steps with PowerSGD; return (model, compressor, sum of true local grads, sum transmitted)."""
    model = Net()
    comp = sl().PowerSGD(model, r, seed=3)
    opt = torch.optim.SGD(trainable(model), lr=0.05)
    true_sum = [torch.zeros_like(p) for p in trainable(model)]
    sent_sum = [torch.zeros_like(p) for p in trainable(model)]
    applied_sum = [torch.zeros_like(p) for p in trainable(model)]
    for step in range(steps):
        opt.zero_grad()
        model(mine(global_batch(step, n), rank)).backward()
        for acc, p in zip(true_sum, trainable(model)):
            acc += p.grad
        comp.sync_gradients()
        for acc, sent, applied, p in zip(sent_sum, comp.transmitted, applied_sum, trainable(model)):
            acc += sent
            applied += p.grad
        opt.step()
    return model, comp, true_sum, sent_sum, applied_sum


def powersgd_error_feedback_nothing_lost(rank, n):
    for r, steps in ((1, 1), (1, 5), (2, 7)):
        model, comp, true_sum, sent_sum, applied_sum = powersgd_steps(rank, n, r, steps)
        for want, sent, residual in zip(true_sum, sent_sum, comp.residuals):
            torch.testing.assert_close(sent + residual, want, **F64)  # this rank: nothing lost
        assert any(res.abs().max() > 1e-6 for res in comp.residuals), "rank 1 should drop something"
        for applied, want, residual in zip(applied_sum, true_sum, comp.residuals):
            total = want - residual  # what all ranks sent, summed = N x what was applied
            dist.all_reduce(total)
            torch.testing.assert_close(applied * n, total, **F64)
        same_on_all_ranks([p.grad for p in trainable(model)])


def powersgd_full_rank_equals_dp(rank, n):
    model, comp, *_ = powersgd_steps(rank, n, 8, 4)  # 8 >= min(n, m) for every matrix
    assert_same(state(model), dp_reference(4, n, lambda m: torch.optim.SGD(trainable(m), lr=0.05)), **F64)


def powersgd_bytes_match_numbers_sent(rank, n):
    model = Net()
    comp = sl().PowerSGD(model, 1)
    model(mine(global_batch(0, n), rank)).backward()
    with SlowLink(float("inf")) as link:
        comp.sync_gradients()
    sent, full = comp.numbers_sent()
    assert link.payload_bytes == sent * 8 and sent < full
    assert link.by_op == {"all_reduce": 3}  # vectors, P, Q


def powersgd_rank_zero_raises(rank, n):
    powersgd_bytes_match_numbers_sent(rank, n)  # works first
    for bad in (0, -1):
        with pytest.raises(ValueError, match="rank r"):
            sl().PowerSGD(Net(), bad)


def subgroup_only(kind):
    """DiLoCo / PowerSGD given group= ranks [0, 2] of 3 must call every collective on that group (watch_groups
    names one on another group): rank 1 stays out (on 2 ranks, the group is the world). Two steps of each
    (DiLoCo syncs at each with H = 1)."""
    def case(rank, n):
        members = [0, 2] if n == 3 else list(range(n))  # on 2 ranks: the whole world
        group = dist.new_group(members)  # every rank makes it, in the same order
        if rank not in members:
            return
        model = Net()
        with watch_groups(group, f"{kind} (group {members} of {n} ranks)"):
            algo = (sl().DiLoCo(model, torch.optim.SGD(trainable(model), lr=0.1), 1, group=group) if kind == "DiLoCo"
                    else sl().PowerSGD(model, 1, group=group, seed=3))
            for step in range(2):
                model(mine(global_batch(step, len(members)), members.index(rank))).backward()
                algo.step() if kind == "DiLoCo" else algo.sync_gradients()
                model.zero_grad()
    return case


CASES = {
    "diloco_subgroup_0_2_of_3": subgroup_only("DiLoCo"),
    "powersgd_subgroup_0_2_of_3": subgroup_only("PowerSGD"),
    "pseudo_gradients_rank_tags": pseudo_gradients_rank_tags,
    "pseudo_gradients_subgroup_0_2_of_3": lambda rank, n: pseudo_gradients_rank_tags(rank, n, [0, 2] if n == 3 else None),
    "pseudo_gradients_mean_of_differences": pseudo_gradients_mean_of_differences,
    "diloco_H1_inner_sgd_equals_dp": diloco_H1_equals_dp(lambda m: torch.optim.SGD(trainable(m), lr=0.1)),
    "diloco_H1_inner_sgd_momentum_weight_decay_equals_dp": diloco_H1_equals_dp(
        lambda m: torch.optim.SGD(trainable(m), lr=0.1, momentum=0.9, weight_decay=0.01)),
    "diloco_bytes_per_inner_step_fall_by_H": diloco_bytes_fall_by_H,
    "diloco_replicas_equal_after_sync_adamw_nesterov": diloco_replicas_equal_after_sync_adamw_nesterov,
    "diloco_H_zero_raises": diloco_H_zero_raises,
    "powersgd_error_feedback_nothing_lost": powersgd_error_feedback_nothing_lost,
    "powersgd_full_rank_equals_dp": powersgd_full_rank_equals_dp,
    "powersgd_bytes_match_numbers_sent": powersgd_bytes_match_numbers_sent,
    "powersgd_rank_zero_raises": powersgd_rank_zero_raises,
}


def run_all(rank, world_size):
    return run_cases({key: functools.partial(body, rank, world_size) for key, body in CASES.items()})


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def outcomes(request):
    return launch_cases(run_all, request.param, timeout=90)


def check(outcomes, key):
    expect_case(outcomes, key, key)


@pytest.mark.exercise("average_pseudo_gradients")
@pytest.mark.parametrize("key", ["pseudo_gradients_rank_tags", "pseudo_gradients_subgroup_0_2_of_3"])
def test_pseudo_gradients_on_rank_tags_name_what_the_average_holds(outcomes, key):
    check(outcomes, key)


@pytest.mark.exercise("average_pseudo_gradients")
def test_pseudo_gradients_mean_of_differences_one_allreduce(outcomes):
    check(outcomes, "pseudo_gradients_mean_of_differences")


@pytest.mark.exercise("DiLoCo", needs=("average_pseudo_gradients",))
@pytest.mark.parametrize("key", ["diloco_H1_inner_sgd_equals_dp", "diloco_H1_inner_sgd_momentum_weight_decay_equals_dp",
                                 "diloco_bytes_per_inner_step_fall_by_H",
                                 "diloco_replicas_equal_after_sync_adamw_nesterov", "diloco_H_zero_raises",
                                 "diloco_subgroup_0_2_of_3"])
def test_diloco(outcomes, key):
    check(outcomes, key)


@pytest.mark.exercise("PowerSGD")
@pytest.mark.parametrize("key", ["powersgd_error_feedback_nothing_lost", "powersgd_full_rank_equals_dp",
                                 "powersgd_bytes_match_numbers_sent", "powersgd_rank_zero_raises",
                                 "powersgd_subgroup_0_2_of_3"])
def test_powersgd(outcomes, key):
    check(outcomes, key)
