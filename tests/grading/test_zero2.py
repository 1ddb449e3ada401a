"""Grading tests for notebook 09_zero_fsdp: ZeRO-2 (Zero2Optimizer), gradients sharded in backward.

Run: pytest tests/grading/test_zero2.py   (add --impl=solutions for the reference)
All cases of one world size run in one launch (labkit.grading.cases). Each rank trains on its slice of
every global batch; in the same process an unsharded copy trains on the whole batch (float64:
the sums are ordered differently, see tests/grading/test_zero.py for why atol=1e-8 is sound)
and, on 2 ranks, a plain-DP copy that must agree bit for bit (a sum of two numbers has one
result whatever the order; the element-wise update is the same code). Models: parameter
counts that do not divide by the world size, tied weights, frozen parameters, tiny buckets
(one per parameter) and one bucket for everything. About 20 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl
from labkit.launching.launcher import launch
from labkit.model import build_model
from labkit.grading.cases import launch_timeout

TIMEOUT = launch_timeout(30)  # a hang is reported by the launcher, with stacks
STEPS = 3
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
F64 = dict(atol=1e-8, rtol=0)  # float64 against one process: see tests/grading/test_zero.py


class Odd(nn.Module):
    """5 -> 7 -> 3 with biases (42 + 24 = 66 params, not a multiple of 4), a tied pair, a frozen one."""

    def __init__(self, tied=False, frozen=False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)
        self.c = nn.Linear(3, 3, bias=False)
        self.d = nn.Linear(3, 3, bias=False)
        if tied:
            self.d.weight = self.c.weight  # one Parameter, used twice
        if frozen:
            self.a.bias.requires_grad_(False)
        self.double()

    def forward(self, x):
        return self.d(torch.tanh(self.c(self.b(torch.tanh(self.a(x))))))


def _train(rank, world, make, bucket_mb, steps=STEPS, schedule=None):
    """Zero2Optimizer vs one process (float64) and, on 2 ranks, vs DP bit for bit.

    schedule: a function of the step count; every optimizer is then driven by LambdaLR(opt, schedule).
    """
    zero2 = impl("zero2")
    ours, one, dp = make(), make(), make()
    opt = zero2.Zero2Optimizer(ours, torch.optim.AdamW, bucket_size_mb=bucket_mb, **HYPER)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **HYPER) for m in (one, dp)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in [opt] + opts] if schedule else []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(3 * world, 5, generator=g, dtype=torch.float64)
        mine = x[3 * rank:3 * (rank + 1)]
        one(x).pow(2).mean().backward()
        for m in (ours, dp):
            m(mine).pow(2).mean().backward()
        for p in dp.parameters():
            if p.requires_grad:
                dist.all_reduce(p.grad)
                p.grad /= world
        for o in [opt] + opts:
            o.step()
            o.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    if schedule:  # the schedule reached the inner optimizer: what the shards were stepped with
        assert opt.param_groups[0]["lr"] == HYPER["lr"] * schedule(steps)
        assert opt.optimizer.param_groups[0]["lr"] == HYPER["lr"] * schedule(steps - 1)
    for (name, p), q, r in zip(ours.named_parameters(), one.parameters(), dp.parameters()):
        torch.testing.assert_close(p, q, **F64, msg=lambda m: f"{name} after {steps} steps vs one process: {m}")
        if world == 2:
            assert torch.equal(p, r), f"{name}: ZeRO-2 differs from DP + AdamW on 2 ranks"
        assert p.grad is None, f"{name}: zero_grad() must leave no full gradient"
    return opt


def loss64(model, x, y):
    """The mean cross-entropy in the logits' dtype (labkit's lm_loss casts to float32)."""
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _tiny(rank, world):
    """The tiny transformer, float64: equal to one process; the gradient shards are 1/N."""
    zero2 = impl("zero2")
    ours, one = build_model("tiny", seed=0).double(), build_model("tiny", seed=0).double()
    opt = zero2.Zero2Optimizer(ours, torch.optim.AdamW, bucket_size_mb=0.25, **HYPER)
    ref = torch.optim.AdamW(one.parameters(), **HYPER)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = (torch.randint(0, 4096, (2 * world, 16), generator=g) for _ in range(2))
        loss64(one, x, y).backward()
        loss64(ours, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
        for o in (opt, ref):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), one.parameters()):
        torch.testing.assert_close(p, q, **F64, msg=lambda m: f"{name}: {m}")
    n = sum(p.numel() for p in ours.parameters())
    assert sum(s.numel() for s in opt.shards) <= -(-n // world) + len(opt.buckets), "shards are not 1/N"
    assert opt.peak_grad_bytes < 8 * n, "the full gradient was materialised"


def cases(world):
    out = {
        "not_divisible_one_bucket_per_parameter": lambda r, n: _train(r, n, Odd, 1e-6),
        "one_bucket_for_everything": lambda r, n: _train(r, n, Odd, 100.0),
        "tied_weights": lambda r, n: _train(r, n, functools.partial(Odd, tied=True), 1e-4),
        "frozen_parameter_untouched": lambda r, n: _frozen(r, n),
        "lr_scheduler_lambda_lr_drives_it": lambda r, n: _train(r, n, Odd, 1e-4, schedule=lambda s: 0.5 ** s),
        "step_with_closure_returns_its_loss": lambda r, n: _closure(r, n),
        "parameter_without_grad_counts_as_zero": lambda r, n: _unused(r, n),
    }
    if world == 2:
        out["tiny_transformer"] = _tiny
    return out


def _frozen(rank, world):
    opt = _train(rank, world, functools.partial(Odd, frozen=True), 1e-4)  # the frozen bias stays as built
    assert all(p.requires_grad for b in opt.buckets for p in b), "a frozen parameter was put in a bucket"


def _same_data_pair(seed):
    """(ZeRO-2 model, its optimizer, reference model, AdamW, x): every rank gets the same x."""
    ours, ref = Odd(), Odd()
    opt = impl("zero2").Zero2Optimizer(ours, torch.optim.AdamW, bucket_size_mb=1e-4, **HYPER)
    x = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return ours, opt, ref, torch.optim.AdamW(ref.parameters(), **HYPER), x


def _assert_same(ours, ref):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        # every rank has the same data: the mean of N equal gradients; float64, see F64
        torch.testing.assert_close(p, q, **F64, msg=lambda m: f"{name}: {m}")


def _closure(rank, world):
    """step(closure) returns the closure's loss, as torch's optimizers do; the step is the one of backward()+step()."""
    ours, opt, ref, ref_opt, x = _same_data_pair(4)

    def closure():
        opt.zero_grad()
        loss = ours(x).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    expected = ref(x).pow(2).mean()  # the same weights and data before the step: the same bits
    expected.backward()
    ref_opt.step()
    assert torch.is_tensor(loss) and torch.equal(loss.detach(), expected.detach()), \
        f"step(closure) returned {loss!r}, not the closure's loss {expected.item()}"
    _assert_same(ours, ref)


def _unused(rank, world):
    """d is skipped by the loss on every rank: its grad is None, counted as zeros (weight decay moves it)."""
    model, opt, ref, ref_opt, x = _same_data_pair(3)
    for m in (model, ref):
        m.c(m.b(m.a(x))).sum().backward()
    ref.d.weight.grad = torch.zeros_like(ref.d.weight)
    for o in (opt, ref_opt):
        o.step()
    _assert_same(model, ref)


def _run_all(rank, world):
    return run_cases({key: functools.partial(body, rank, world) for key, body in cases(world).items()})


@pytest.mark.exercise("Zero2Optimizer")
@pytest.mark.parametrize("world,case", [(w, c) for w in (2, 4) for c in cases(w)])
def test_zero2(world, case):
    expect_case(launch_cases(_run_all, world, timeout=TIMEOUT), case, f"{case} on {world} ranks")


def _bad_bucket(rank, world, size):
    try:  # an unwritten stub's NotImplementedError goes through: the test reports "not implemented"
        impl("zero2").Zero2Optimizer(Odd(), bucket_size_mb=size)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.exercise("Zero2Optimizer")
@pytest.mark.parametrize("size", [0, -1.0])
def test_zero2_bucket_size_not_positive_raises(size):
    (message,) = launch(_bad_bucket, 1, size, timeout=TIMEOUT)
    assert message is not None, f"bucket_size_mb={size} must raise ValueError"
    assert "bucket_size_mb must be positive" in message, message


# --- awkward parameters in a subgroup (labkit.grading.awkward): groups [1, 3] and [0, 2] of 4 ranks ---
# A frozen parameter, one never used and one used by the group's rank 0 only, all in the middle; group
# ranks differ from global ranks, so a shard taken by global rank, or a collective on the default group,
# changes the result (watch_groups names the collective before it runs).
SUBGROUPS = ((1, 3), (0, 2))


def _zero2_awkward(rank, ranks, group, bucket_mb):
    from labkit.grading import awkward, diagnose
    from labkit.parallel.flat import bucket_parameters, flatten, trainable

    zero2 = impl("zero2")
    model = awkward.Awkward()
    with diagnose.watch_groups(group, "Zero2Optimizer"):
        opt = zero2.Zero2Optimizer(model, torch.optim.AdamW, bucket_size_mb=bucket_mb, group=group, **HYPER)
    n, me = len(ranks), ranks.index(rank)
    for i, bucket in enumerate(bucket_parameters(trainable(model), bucket_mb)):
        numel = sum(p.numel() for p in bucket)
        flat = flatten([p.detach() for p in bucket], -(-numel // n) * n)
        wrong = diagnose.shard_mismatch(opt.shards[i], flat, me, rank, n, f"Zero2Optimizer.shards[{i}]")
        assert wrong is None, f"{wrong} (bucket {i}: its trainable parameters in reverse order, zero-padded)"
    opt.remove_hooks()
    awkward.train(rank, ranks, group,
                  lambda m: zero2.Zero2Optimizer(m, torch.optim.AdamW, bucket_size_mb=bucket_mb, group=group, **HYPER),
                  "Zero2Optimizer", HYPER, F64)


SUBGROUP_CASES = {"awkward_parameters_in_group_one_bucket": 100.0,
                  "awkward_parameters_in_group_bucket_per_parameter": 1e-6}


def _run_subgroup_cases(rank, world):
    groups = {ranks: dist.new_group(list(ranks)) for ranks in SUBGROUPS}  # collective: every rank, same order
    ranks = next(r for r in SUBGROUPS if rank in r)
    return run_cases({case: functools.partial(_zero2_awkward, rank, ranks, groups[ranks], mb)
                      for case, mb in SUBGROUP_CASES.items()})


@pytest.mark.exercise("Zero2Optimizer")
@pytest.mark.parametrize("case", list(SUBGROUP_CASES))
def test_zero2_frozen_and_gradless_parameters_in_a_subgroup_whose_ranks_are_not_global(case):
    expect_case(launch_cases(_run_subgroup_cases, 4, timeout=TIMEOUT), case,
                f"{case}: Zero2Optimizer with a frozen parameter, one never used and one used on one rank only, "
                "group=[1, 3] and group=[0, 2] on 4 ranks")
