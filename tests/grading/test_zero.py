"""Grading tests for notebook 09_zero_fsdp: the ZeRO-1 sharded AdamW.

Run: pytest tests/grading/test_zero.py   (add --impl=solutions for the reference)
Each rank trains on its slice of every global batch with ZeroAdamW while, in the same
process, an unsharded copy trains on the whole batch with torch.optim.AdamW; after K steps
every parameter must be equal on every rank. Parameter counts chosen NOT to divide by the
world size (padding), and smaller than it. About 15 s on 2 cores.
"""
import math

import pytest
import torch
from torch import nn

from labkit import memory
from labkit.grading import impl
from labkit.launch import launch
from labkit.model import build_model
from labkit.cases import launch_timeout

TIMEOUT = launch_timeout(20)  # a hang is reported by the launcher, with stacks, in seconds
STEPS = 4
HYPER = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

# torch imports modules lazily on first use (sympy on the first backward, DTensor on the first
# assert_close, dynamo on the first optimizer): seconds each on 2 busy cores. Pay it once
# here, before the ranks fork, rather than in every rank of every test.
_x = torch.ones(2, requires_grad=True)
(_x * 2).sum().backward()
torch.optim.AdamW([_x]).step()
torch.testing.assert_close(_x.grad, torch.full((2,), 2.0))


def odd_mlp():
    """5->6->3 with biases: 36 + 21 = 57 parameters, 57 % 2 = 57 % 4 = 1."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def three_params():
    """3 parameters: on 4 ranks, rank 3's shard is all padding."""
    torch.manual_seed(0)
    return nn.Linear(2, 1)


def _train_small(rank, world, make):
    zero = impl("zero")
    model, ref = make(), make()
    opt = zero.ZeroAdamW(model.parameters(), **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    n_in = model[0].in_features if isinstance(model, nn.Sequential) else model.in_features
    g = torch.Generator().manual_seed(1)  # same global batches on every rank
    per_rank = 3
    for _ in range(STEPS):
        x = torch.randn(per_rank * world, n_in, generator=g)
        ref(x).pow(2).mean().backward()  # mean over the global batch
        ref_opt.step()
        ref_opt.zero_grad()
        model(x[rank * per_rank:(rank + 1) * per_rank]).pow(2).mean().backward()  # mean over my slice
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name} after {STEPS} steps: {m}")
    numel = sum(p.numel() for p in model.parameters())
    state = opt.optimizer.state[opt.shard]
    return dict(numel=numel, shard=opt.shard.numel(), exp_avg=state["exp_avg"].numel(),
                exp_avg_sq=state["exp_avg_sq"].numel(), state_bytes=opt.state_bytes(),
                ref_state_bytes=impl("zero").optimizer_state_bytes(ref_opt))


@pytest.mark.exercise("ZeroAdamW")
@pytest.mark.parametrize("world", [2, 4])
def test_zero_adamw_equals_adamw_after_k_steps_numel_not_divisible(world):
    for rank, got in enumerate(launch(_train_small, world, odd_mlp, timeout=TIMEOUT)):
        assert got["numel"] == 57
        shard = math.ceil(57 / world)  # 29 or 15: the flat tensor is padded to 58 or 60
        assert got["shard"] == got["exp_avg"] == got["exp_avg_sq"] == shard, f"rank {rank}"
        # the measured state is the fp32 ZeRO-1 formula (8 bytes per shard element) + Adam's step
        step_bytes = got["state_bytes"] - memory.memory_per_rank(57, world, "zero1", "fp32")["optimizer"]
        assert step_bytes in (4, 8), f"rank {rank}: {got['state_bytes']} bytes of state"


@pytest.mark.exercise("ZeroAdamW")
def test_zero_adamw_numel_smaller_than_world_size():
    for got in launch(_train_small, 4, three_params, timeout=TIMEOUT):
        assert got["numel"] == 3 and got["shard"] == 1


def _train_tiny(rank, world):
    zero = impl("zero")
    model, ref = build_model("tiny", seed=0), build_model("tiny", seed=0)
    # lr 1e-3: Adam divides by sqrt(v), so where a gradient is ~0 its rounding (the ranks sum
    # in another order than one process) becomes an O(lr) difference; keep it under atol.
    hyper = dict(HYPER, lr=1e-3)
    opt = zero.ZeroAdamW(model.parameters(), **hyper)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    g = torch.Generator().manual_seed(1)
    b = 2
    for _ in range(2):
        x = torch.randint(0, 4096, (b * world, 16), generator=g)
        y = torch.randint(0, 4096, (b * world, 16), generator=g)
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * b, (rank + 1) * b)
        model(x[mine], y[mine]).backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    return opt.state_bytes(), impl("zero").optimizer_state_bytes(ref_opt)


@pytest.mark.exercise("ZeroAdamW")
def test_zero_adamw_tiny_model_equals_adamw_and_halves_optimizer_state():
    for zero_bytes, full_bytes in launch(_train_tiny, 2, timeout=TIMEOUT):
        n = build_model("tiny").num_params()
        assert full_bytes >= 8 * n
        assert zero_bytes == pytest.approx(full_bytes / 2, rel=1e-3)


def _grad_none(rank, world):
    """A parameter unused by the loss: ZeroAdamW treats its None grad as zeros."""
    zero = impl("zero")
    torch.manual_seed(0)
    used, unused = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))
    ref_used, ref_unused = (nn.Parameter(t.detach().clone()) for t in (used, unused))
    opt = zero.ZeroAdamW([used, unused], **HYPER)
    ref_opt = torch.optim.AdamW([ref_used, ref_unused], **HYPER)
    for _ in range(2):
        (used * (rank + 1)).sum().backward()
        ref_used.grad = torch.full((5,), (world + 1) / 2)  # average of (rank + 1) over the ranks
        ref_unused.grad = torch.zeros(3)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    torch.testing.assert_close(used, ref_used)
    torch.testing.assert_close(unused, ref_unused)
    return True


@pytest.mark.exercise("ZeroAdamW")
def test_zero_adamw_parameter_without_grad_counts_as_zero_and_ranks_average():
    assert launch(_grad_none, 2, timeout=TIMEOUT) == [True, True]


# Not graded: the two collectives are given code (the same in exercises/ and solutions/),
# tested here so that a learner who relies on them relies on something proven.
def _collectives(rank, world):
    zero = impl("zero")
    torch.manual_seed(rank)
    flat = torch.randn(4 * world)
    total = flat.clone()
    torch.distributed.all_reduce(total)
    mine = total.chunk(world)[rank] / world
    torch.testing.assert_close(zero.reduce_scatter_mean(flat), mine)
    torch.testing.assert_close(zero.reduce_scatter_mean(flat, via_allreduce=True), mine)
    torch.testing.assert_close(zero.all_gather_flat(total.chunk(world)[rank]), total)
    return True


def test_reduce_scatter_mean_and_all_gather_equal_torch_all_reduce():
    assert launch(_collectives, 3, timeout=TIMEOUT) == [True] * 3


def _bad_length(rank, world):
    impl("zero").reduce_scatter_mean(torch.ones(3))


def test_reduce_scatter_mean_length_not_divisible_raises():
    with pytest.raises(Exception, match="ValueError.*pad it first"):
        launch(_bad_length, 2, timeout=TIMEOUT)
