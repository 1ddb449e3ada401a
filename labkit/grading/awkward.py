"""A model with awkward parameters, trained in a subgroup, for grading the sharded optimizers.

`Awkward` holds, in this order: a block of 42 trainable elements, then a block whose first
parameter is FROZEN (requires_grad=False), then one never used by the loss (its .grad stays
None), then one used by the group's rank 0 only (None on the others), then 24 more. 77
trainable elements, a multiple of neither 2 nor 4. The frozen and the gradient-less
parameters sit in the MIDDLE: leaving a None gradient out of a flat gradient, or writing a
flat vector back into the frozen parameter too, shifts every parameter after it.

`train(...)` runs it on this rank's rows of the group's batches, under
`diagnose.watch_groups(group)`, and proves the result against one process with torch's AdamW
on the group's whole batches: the first differing parameter is named, a frozen parameter that
moved is named first (even when a shape error follows). Used by the grading tests of ZeRO-1,
ZeRO-2 and FSDP (tests/grading/test_zero*.py, test_fsdp.py) with groups [1, 3] and [0, 2] of
4 ranks, whose group ranks differ from their global ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.grading import diagnose

TRAINABLE = 77  # elements that train, in order: layers.0 (42), spare (4), rare (7), out (24)

HINT = ("Likely cause: the flat gradient and the flat parameters no longer line up. Flatten the TRAINABLE "
        "parameters only (requires_grad=True), every one of them, a .grad of None counted as zeros "
        "(grads_or_zeros), and write back into those same parameters; the average is over the ranks of group= only")


class Middle(nn.Module):
    """gain (FROZEN), spare (never used), rare (used when asked), out = Linear(7, 3)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.rand(7) + 0.5, requires_grad=False)
        self.spare = nn.Parameter(torch.randn(4))
        self.rare = nn.Parameter(torch.rand(7) + 0.5)
        self.out = nn.Linear(7, 3)

    def forward(self, h, use_rare):
        h = h * self.gain
        return self.out(h * self.rare if use_rare else h).pow(2).mean()


class Awkward(nn.Module):
    """layers = [Linear(5, 7), Middle()] in float64; forward(x, use_rare) -> the mean squared output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(5, 7), Middle()])
        self.double()

    def forward(self, x, use_rare=True):
        return self.layers[1](torch.tanh(self.layers[0](x)), use_rare)

    def trainable_flat(self) -> torch.Tensor:
        """The trainable parameters, flattened in order (what ZeRO-1 shards)."""
        return torch.cat([p.detach().reshape(-1) for p in self.parameters() if p.requires_grad])


def batches(ranks, steps, rows=3):
    g = torch.Generator().manual_seed(100 + ranks[0])  # each group its own data
    return [torch.randn(rows * len(ranks), 5, generator=g, dtype=torch.float64) for _ in range(steps)]


def uses_rare(index: int, rare_everywhere: bool) -> bool:
    return rare_everywhere or index == 0


def reference(ranks, steps, hyper, rows=3, rare_everywhere=False) -> dict:
    """One process, torch.optim.AdamW, on the group's batches: the loss is the mean of its ranks' losses;
    a .grad of None counts as zeros (weight decay still moves the parameter). {name: parameter}."""
    model = Awkward()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **hyper)
    for x in batches(ranks, steps, rows):
        losses = [model(x[rows * i:rows * (i + 1)], uses_rare(i, rare_everywhere)) for i in range(len(ranks))]
        (sum(losses) / len(ranks)).backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def train(rank, ranks, group, make_optimizer, what: str, hyper: dict, tol: dict, *, steps=2, rows=3,
          rare_everywhere=False, model=None):
    """Train `model` (default: a new Awkward) on this rank's rows of the group's batches; return the optimizer.

    make_optimizer(model) -> an object with step() and zero_grad() (and, for ZeRO-3, full_parameters():
    the parameters are read from it). Everything runs under watch_groups(group, what). Then the frozen
    parameter must be bit for bit unchanged and every parameter equal `reference` within `tol`
    (assert_close's rtol/atol), or AssertionError names the first wrong one and the likely cause.
    rare_everywhere: every rank uses `rare` (ZeRO-3 needs the same parameters used on every rank).
    """
    model = model if model is not None else Awkward()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    me = ranks.index(rank)
    where = f"{what} on global rank {rank} (rank {me} of group {list(ranks)})"
    try:
        with diagnose.watch_groups(group, what):
            opt = make_optimizer(model)
            for x in batches(ranks, steps, rows):
                model(x[rows * me:rows * (me + 1)], uses_rare(me, rare_everywhere)).backward()
                opt.step()
                opt.zero_grad()
            got = opt.full_parameters() if hasattr(opt, "full_parameters") else \
                {n: p.detach() for n, p in model.named_parameters()}
    except NotImplementedError:  # an unwritten stub (a RuntimeError too): graded as not implemented
        raise
    except (RuntimeError, ValueError, IndexError) as error:  # a shape error: first say what went wrong before it
        changed = diagnose.frozen_changes(frozen, model)
        if changed:
            raise AssertionError(f"{where}: {changed} (then {type(error).__name__}: {error})") from error
        raise AssertionError(f"{where}: {type(error).__name__}: {error}. {HINT}") from error
    changed = diagnose.frozen_changes(frozen, got)
    assert changed is None, f"{where}: {changed}"
    diagnose.assert_same_named(got, reference(ranks, steps, hyper, rows, rare_everywhere), "parameter",
                               f"{where}, after {steps} steps against one process with AdamW on the group's "
                               "batches", **tol, hint=HINT)
    return opt
