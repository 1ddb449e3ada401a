"""Grading tests for notebook 09_zero_fsdp: ZeRO-3 / FSDP by hand (FlatShard, ZeRO3).

Run: pytest tests/grading/test_fsdp.py   (add --impl=solutions for the reference)
All cases of one world size run in one launch (labkit.grading.cases). Models run in float64 because
N ranks sum gradients in another order than one process (see tests/grading/test_zero.py for
why atol=1e-8 is sound after a few AdamW steps); where the arithmetic is the same (gathering
shards, a mean of two numbers) the check is torch.equal. Cases: the tiny transformer (forward,
gradients and K steps equal one process, and equal torch's FSDP2 fully_shard), tied weights,
frozen parameters, a model whose unit sizes (42, 56, 24, 1) do not divide by the world size,
prefetch order read from the Timeline (issue order, not durations), peak gathered memory and
communication volume against their formulas. About 30 s on 2 cores.
"""
import functools

import pytest
import torch
from torch import nn

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl
from labkit.launching.launcher import launch
from labkit.model import build_model
from labkit.measure.timeline import Timeline
from labkit.grading.cases import launch_timeout

TIMEOUT = launch_timeout(40)  # a hang is reported by the launcher, with stacks
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
F64 = dict(atol=1e-8, rtol=0)  # float64 against one process: see tests/grading/test_zero.py


class Chain(nn.Module):
    """Three blocks of 42, 56 and 24 parameters and a root of ONE parameter: nothing divides by 4."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)])
        self.scale = nn.Parameter(torch.full((1,), 1.5))
        self.double()

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x * self.scale).pow(2).mean()


def loss64(model, x, y=None):
    """Chain's loss, or the transformer's mean cross-entropy in float64 (lm_loss casts to float32)."""
    if y is None:
        return model(x)
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _tiny(tied=False, frozen=False):
    model = build_model("tiny", seed=0).double()
    if tied:
        model.output.weight = model.tok_embeddings.weight  # one Parameter in the root unit
    if frozen:
        model.layers[0].attention_norm.weight.requires_grad_(False)
        model.layers[1].attention.wq.weight.requires_grad_(False)
    return model


def _batches(world, steps, chain):
    g = torch.Generator().manual_seed(1)
    if chain:
        return [(torch.randn(3 * world, 5, generator=g, dtype=torch.float64),) for _ in range(steps)]
    return [tuple(torch.randint(0, 4096, (2 * world, 16), generator=g) for _ in range(2)) for _ in range(steps)]


def _train(rank, world, make, steps=3, prefetch=True, fsdp2=False, accumulate=False):
    """ZeRO3 against one process (float64), step by step: loss, then parameters at the end.

    accumulate (Chain only): two forward/backward passes per step, on this rank's first row and
    on its other two (losses weighted 1/3 and 2/3: their sum is the mean over its 3 rows), then
    one finish() and one step: the second pass's gradient shards must ADD to the first's."""
    fsdp = impl("fsdp")
    ours, one = make(), make()
    chain = isinstance(ours, Chain)
    frozen_before = {n: p.detach().clone() for n, p in ours.named_parameters() if not p.requires_grad}
    zero3 = fsdp.ZeRO3(ours, prefetch=prefetch)
    opt = torch.optim.AdamW(zero3.shards(), **HYPER)
    ref = torch.optim.AdamW([p for p in one.parameters() if p.requires_grad], **HYPER)
    rows = 3 if chain else 2
    for step, batch in enumerate(_batches(world, steps, chain)):
        mine = tuple(t[rows * rank:rows * (rank + 1)] for t in batch)
        ref_loss = loss64(one, *batch)
        if accumulate:  # two micro-batches, two backward passes, then one step
            first = loss64(ours, mine[0][:1]) / 3
            first.backward()
            second = loss64(ours, mine[0][1:]) * (2 / 3)
            second.backward()
            loss = first.detach() + second.detach()
        else:
            loss = loss64(ours, *mine)
            loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        torch.testing.assert_close(total / world, ref_loss.detach(), **F64,
                                   msg=lambda m: f"step {step}: the forward's loss differs from one process: {m}")
        ref_loss.backward()
        zero3.sync_gradients()
        if step == 0:  # the gradient shards: this rank's slice of one process's flat gradient, per unit
            for unit in zero3.units + ([zero3.root] if zero3.root else []):
                full = torch.cat([dict(zip(map(id, ours.parameters()), one.parameters()))[id(p)].grad.reshape(-1)
                                  for p in unit.params])
                full = torch.cat([full, full.new_zeros(unit.flat.numel() - full.numel())])
                s = unit.shard.numel()
                got = unit.shard.grad
                want = full[rank * s:(rank + 1) * s]
                if got is not None and not torch.allclose(got, want, **F64) and accumulate:
                    raise AssertionError(f"{unit.name}: after two backward passes the gradient shard is not the sum "
                                         "of both passes' shards: reduce_grads must ADD this rank's reduced shard to "
                                         "shard.grad (set it only when None), and every backward must reduce again")
                torch.testing.assert_close(got, want, **F64,
                                           msg=lambda m: f"{unit.name}: gradient shard differs: {m}")
        for o in (opt, ref):
            o.step()
            o.zero_grad()
    got = zero3.full_parameters()
    for name, q in one.named_parameters():
        torch.testing.assert_close(got[name], q, **F64, msg=lambda m: f"{name} after {steps} steps: {m}")
    for name, before in frozen_before.items():
        assert torch.equal(got[name], before), f"{name} is frozen but changed"
    if fsdp2:
        _equal_fsdp2(rank, world, make, steps, got)
    return zero3


def _equal_fsdp2(rank, world, make, steps, got):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for batch in _batches(world, steps, False):
        loss64(model, *(t[2 * rank:2 * rank + 2] for t in batch)).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach().full_tensor(), **F64,
                                   msg=lambda m: f"{name}: by hand vs FSDP2: {m}")


def _prefetch_order(rank, world, prefetch):
    """Issue order from the Timeline: with prefetch, block i+1's gather starts before block i's F ends."""
    fsdp = impl("fsdp")
    model = Chain()
    tl = Timeline()
    zero3 = fsdp.ZeRO3(model, prefetch=prefetch, timeline=tl)
    model(torch.ones(2, 5, dtype=torch.float64)).backward()
    zero3.sync_gradients()
    spans = tl.spans
    fwd = {s.mb: s for s in spans if s.kind == "F"}
    assert set(fwd) == {0, 1, 2}, f"expected F spans for blocks 0, 1, 2, got {sorted(fwd)}"
    # the forward's gathers: issued before the last block's forward ended (backward's come later)
    gather = {s.mb: s for s in spans if s.kind == "allgather" and s.mb is not None and s.start < fwd[2].end}
    for i in (0, 1):
        early = gather[i + 1].start < fwd[i].end
        assert early == prefetch, (f"block {i + 1}'s all-gather was issued {'during' if early else 'after'} "
                                   f"block {i}'s forward with prefetch={prefetch}")
    # peak gathered bytes: root + one block, or + two neighbouring blocks with prefetch (8 bytes each)
    sizes = [u.flat.numel() * 8 for u in zero3.units]
    root = zero3.root.flat.numel() * 8
    expected = root + (max(a + b for a, b in zip(sizes, sizes[1:])) if prefetch else max(sizes))
    assert zero3.peak_gathered_bytes == expected, f"peak {zero3.peak_gathered_bytes} bytes, formula {expected}"
    # communication: blocks gathered twice (forward, backward), the root once; everything reduced once
    assert zero3.gathered_elements == 2 * sum(sizes) // 8 + root // 8
    assert zero3.reduced_elements == sum(sizes) // 8 + root // 8
    assert all(u.gathered_bytes() == 0 for u in zero3.units + [zero3.root]), "a unit stayed gathered"


def _flat_shard_roundtrip(rank, world):
    fsdp = impl("fsdp")
    model = Chain()
    original = [p.detach().clone() for p in model.layers[0].parameters()]
    unit = fsdp.FlatShard(list(model.layers[0].parameters()))
    s = -(-42 // world)
    assert unit.shard.numel() == s and unit.flat.numel() == s * world, "shard of ceil(42 / N) elements"
    assert unit.gathered_bytes() == 0, "a new FlatShard must end resharded"
    unit.unshard()
    assert all(torch.equal(p, q) for p, q in zip(model.layers[0].parameters(), original)), "gather != original"
    model.layers[0](torch.ones(1, 5, dtype=torch.float64)).sum().mul(rank + 1).backward()
    expected = [p.grad.clone() * (world + 1) / 2 / (rank + 1) for p in model.layers[0].parameters()]
    unit.reduce_grads()
    assert all(p.grad is None for p in model.layers[0].parameters()), "the full gradients must be freed"
    flat = torch.cat([e.reshape(-1) for e in expected] + [torch.zeros(s * world - 42, dtype=torch.float64)])
    torch.testing.assert_close(unit.shard.grad, flat[rank * s:(rank + 1) * s], **F64)
    unit.reshard()
    assert unit.gathered_bytes() == 0


def cases(world):
    out = {
        "flat_shard_gather_reshard_reduce": _flat_shard_roundtrip,
        "sizes_not_divisible_by_world_size": lambda r, n: _train(r, n, Chain, steps=3),
        "no_prefetch_equal_too": lambda r, n: _train(r, n, Chain, steps=2, prefetch=False),
        "two_backward_passes_before_one_step": lambda r, n: _train(r, n, Chain, steps=2, accumulate=True),
        "prefetch_issues_next_gather_during_forward": lambda r, n: _prefetch_order(r, n, True),
        "without_prefetch_gathers_one_at_a_time": lambda r, n: _prefetch_order(r, n, False),
    }
    if world == 2:
        out["tiny_transformer_equals_one_process_and_fsdp2"] = lambda r, n: _train(r, n, _tiny, 2, fsdp2=True)
        out["tied_weights"] = lambda r, n: _train(r, n, functools.partial(_tiny, tied=True), 2)
        out["frozen_parameters"] = lambda r, n: _train(r, n, functools.partial(_tiny, frozen=True), 2)
    return out


def _run_all(rank, world):
    return run_cases({key: functools.partial(body, rank, world) for key, body in cases(world).items()})


@pytest.mark.exercise("FlatShard")
@pytest.mark.parametrize("world", [2, 4])
def test_flat_shard_gather_reshard_reduce(world):
    expect_case(launch_cases(_run_all, world, timeout=TIMEOUT), "flat_shard_gather_reshard_reduce",
                f"FlatShard on {world} ranks")


@pytest.mark.exercise("ZeRO3", needs=("FlatShard",))
@pytest.mark.parametrize("world,case", [(w, c) for w in (2, 4) for c in cases(w)
                                        if c != "flat_shard_gather_reshard_reduce"])
def test_zero3(world, case):
    expect_case(launch_cases(_run_all, world, timeout=TIMEOUT), case, f"{case} on {world} ranks")


def _no_blocks(rank, world):
    impl("fsdp").ZeRO3(Chain())  # a model with blocks works (an unwritten stub raises here)
    try:
        impl("fsdp").ZeRO3(nn.Linear(3, 3))
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.exercise("ZeRO3", needs=("FlatShard",))
def test_zero3_model_without_blocks_raises():
    (message,) = launch(_no_blocks, 1, timeout=TIMEOUT)
    assert message is not None and "no blocks to wrap" in message, message


# --- awkward parameters in a subgroup (labkit.grading.awkward): groups [1, 3] and [0, 2] of 4 ranks ---
# Block 1 holds a frozen parameter, then one never used (its .grad stays None), then the rest: leaving the
# None gradient out of the flat gradient shifts every later one. Group ranks differ from global ranks, so
# a shard taken by global rank, or a collective on the default group, changes the result.
SUBGROUPS = ((1, 3), (0, 2))


def _flat_shard_awkward(rank, ranks, group):
    """FlatShard of block 1's trainable parameters (spare first, never used): shard, gather, reduced gradient."""
    from labkit.grading import awkward, diagnose
    from labkit.parallel.flat import flatten

    fsdp = impl("fsdp")
    model = awkward.Awkward()
    params = [p for p in model.layers[1].parameters() if p.requires_grad]
    names = [n for n, p in model.layers[1].named_parameters() if p.requires_grad]
    original = [p.detach().clone() for p in params]
    n, me = len(ranks), ranks.index(rank)
    s = -(-sum(p.numel() for p in params) // n)
    where = f"FlatShard on global rank {rank} (rank {me} of group {list(ranks)})"
    with diagnose.watch_groups(group, "FlatShard"):
        unit = fsdp.FlatShard(params, group=group, name="block 1")
        wrong = diagnose.shard_mismatch(unit.shard, flatten(original, s * n), me, rank, n, "FlatShard.shard")
        assert wrong is None, f"{wrong} (block 1's trainable parameters {names}, in order, zero-padded)"
        unit.unshard()
        diagnose.assert_same_named(dict(zip(names, (p.detach() for p in params))), dict(zip(names, original)),
                                   "parameter", f"{where}, after unshard()", rtol=0, atol=0,
                                   hint="Likely cause: the all-gather of every rank's shard into flat, in group order")
        x = awkward.batches(ranks, 1)[0][3 * me:3 * (me + 1)]
        model(x, True).backward()  # spare: no gradient on any rank
        unit.reduce_grads()
    # the group's mean gradient: every rank's own, in one process
    ref = awkward.Awkward()
    x = awkward.batches(ranks, 1)[0]
    (sum(ref(x[3 * i:3 * (i + 1)], True) for i in range(n)) / n).backward()
    mean = [q.grad if q.grad is not None else torch.zeros_like(q) for q in ref.layers[1].parameters() if q.requires_grad]
    want = flatten(mean, s * n)[me * s:(me + 1) * s]
    assert unit.shard.grad is not None, f"{where}: reduce_grads() left shard.grad None, expected this rank's shard " \
                                        "of the group's mean gradient"
    diff = diagnose.first_differences({"shard.grad": unit.shard.grad}, {"shard.grad": want}, **F64)
    assert not diff, (f"{where}: reduce_grads() gave {diff[0][1]}, expected elements {me * s}-{(me + 1) * s - 1} of "
                      f"the group's mean flat gradient of {names} ({names[0]} has no gradient on any rank). Likely "
                      "cause: a .grad of None must count as zeros (grads_or_zeros), else every later gradient "
                      "shifts; the mean is over the ranks of group= only")


class _Zero3Step:
    """ZeRO3 + AdamW over its shards, as one optimizer for labkit.grading.awkward.train."""

    def __init__(self, model, group):
        self.zero3 = impl("fsdp").ZeRO3(model, group=group)
        self.opt = torch.optim.AdamW(self.zero3.shards(), **HYPER)

    def step(self):
        self.zero3.sync_gradients()
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()

    def full_parameters(self):
        return self.zero3.full_parameters()


def _zero3_awkward(rank, ranks, group):
    from labkit.grading import awkward

    awkward.train(rank, ranks, group, lambda m: _Zero3Step(m, group), "ZeRO3", HYPER, F64, rare_everywhere=True)


SUBGROUP_CASES = {"flat_shard_awkward_parameters_in_group": _flat_shard_awkward,
                  "zero3_awkward_parameters_in_group": _zero3_awkward}


def _run_subgroup_cases(rank, world):
    groups = {ranks: torch.distributed.new_group(list(ranks)) for ranks in SUBGROUPS}  # collective: every rank
    ranks = next(r for r in SUBGROUPS if rank in r)
    return run_cases({case: functools.partial(body, rank, ranks, groups[ranks]) for case, body in SUBGROUP_CASES.items()})


@pytest.mark.exercise("FlatShard")
def test_flat_shard_gradless_parameter_first_in_a_subgroup_whose_ranks_are_not_global():
    expect_case(launch_cases(_run_subgroup_cases, 4, timeout=TIMEOUT), "flat_shard_awkward_parameters_in_group",
                "FlatShard of a block whose first trainable parameter gets no gradient, group=[1, 3] and "
                "group=[0, 2] on 4 ranks")


@pytest.mark.exercise("ZeRO3", needs=("FlatShard",))
def test_zero3_frozen_and_gradless_parameters_in_a_subgroup_whose_ranks_are_not_global():
    expect_case(launch_cases(_run_subgroup_cases, 4, timeout=TIMEOUT), "zero3_awkward_parameters_in_group",
                "ZeRO3 with a frozen parameter and one never used in a block, group=[1, 3] and group=[0, 2] on 4 ranks")
