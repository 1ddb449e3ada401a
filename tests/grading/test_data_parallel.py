"""Grading tests for notebook 04_data_parallel (solutions/data_parallel.py), on 2 and 4 ranks.

The reference is single-process training on the whole global batch: N ranks with
b rows each must end with the same weights as one process with N x b rows.
OddNet carries the awkward cases: a frozen layer, a layer never used (grad None
everywhere), a layer used only when the batch holds token RARE (grad None on the
ranks whose rows lack it) and an output head tied to the embedding.
The subgroup cases (group=) run in ONE 4-rank launch (labkit.grading.cases): two disjoint groups
[1, 3] and [0, 2] whose group ranks differ from their global ranks, each with its own
source and its own data, so that mixing the groups, or ignoring group=, shows.
Mismatches name the first differing parameter and by how much (`labkit.grading.diagnose`).
The whole file: about 12 s of CPU, 30-50 s of wall time on 2 busy shared cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.grading import diagnose
from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.training.checkpoint import load_checkpoint, save_checkpoint
from labkit.grading import impl
from labkit.launching.launcher import launch
from labkit.grading.cases import launch_timeout

V, D, T, RARE = 32, 16, 5, 0
GLOBAL_BATCH = 8
TIMEOUT = launch_timeout(20)  # a hang is reported by the launcher, with stacks, in seconds


def dp():
    return impl("data_parallel")


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_optimizer_imports_done_once():
    """The first optimizer built in a process imports torch._dynamo (seconds): do it here,
    once, so that the forked ranks inherit it instead of each paying for it. The reference
    runs on one thread like the ranks: on 2 busy cores, more threads only wait for each other."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class OddNet(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.hidden = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.unused = nn.Linear(D, D)  # never called: grad None on every rank
        self.rare = nn.Linear(D, D)  # called only when the rows hold token RARE
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two uses
        self.register_buffer("scale", torch.ones(D))
        self.register_buffer("version", torch.tensor(7))  # a 0-dim integer buffer
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.to(torch.float64)  # the proofs compare N ranks with one process: see RTOL below

    def forward(self, x, y):
        h = torch.tanh(self.hidden(self.emb(x) * self.scale))
        h = h + self.frozen(h)
        is_rare = x == RARE
        if is_rare.any():
            h = h + self.rare(h) * is_rare.unsqueeze(-1)
        return F.cross_entropy(self.head(h).reshape(-1, V), y.reshape(-1))


def global_batch(step):
    """Deterministic (x, y) of GLOBAL_BATCH rows; RARE appears in row 0 only (rank 0's shard)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(1, V, (GLOBAL_BATCH, T), generator=g)
    x[0, 1] = RARE
    return x, torch.randint(0, V, (GLOBAL_BATCH, T), generator=g)


# N ranks sum the gradient in another order than one process. In float64 that differs by ~1e-16
# (relative); AdamW turns a gradient difference dg into an update difference of at most
# lr * dg / eps = 1e-2 * 1e-16 / 1e-8 = 1e-10 per step, so after 3 steps the weights agree to
# ~3e-10: RTOL/ATOL = 1e-9 hold on any CPU, and any real mistake is orders of magnitude larger.
# (In float32 the same bound is 1e-2 * 1e-7 / 1e-8 = 0.1: no honest tolerance exists there.)
RTOL = ATOL = 1e-9

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def rows(batch, rank, world_size):
    """This rank's rows; the tests of other exercises use it so they do not need shard_for_rank."""
    b = GLOBAL_BATCH // world_size
    return tuple(t[rank * b:(rank + 1) * b] for t in batch)


def train(model, opt, steps, first_step=0, rank=0, world_size=1, reduce=None, shard=rows):
    """Plain training loop; with `reduce` each rank takes its shard and reduces the grads."""
    for step in range(first_step, first_step + steps):
        x, y = global_batch(step)
        if reduce is not None:
            x, y = shard((x, y), rank, world_size)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        if reduce is not None:
            reduce()
        opt.step()
    return snapshot(model)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(optimizer, steps=3):
    model = OddNet()
    opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    return train(model, opt, steps)


def assert_same_weights(got, want, where="", **tol):
    """Fail naming the first differing weight (in the model's order), by how much, and how many differ."""
    diagnose.assert_same_named(got, want, "weight", where, tol.get("rtol"), tol.get("atol"))


# --- gradient averaging ---------------------------------------------------------------


def _grads_after_one_backward(rank, world_size, custom):
    calls = []

    def naive_allreduce(tensor, group=None):  # a plug-in all-reduce: gather everything, sum
        calls.append(tensor.numel())
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts).sum(0)

    model = OddNet()
    x, y = rows(global_batch(0), rank, world_size)
    model(x, y).backward()
    dp().sync_gradients(model, allreduce_fn=naive_allreduce if custom else None)
    return {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.exercise("data_parallel.sync_gradients")
@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_gradients_frozen_unused_tied_and_param_used_on_some_ranks_only(world_size):
    model = OddNet()
    model(*global_batch(0)).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for rank, (grads, _) in enumerate(launch(_grads_after_one_backward, world_size, False, timeout=TIMEOUT)):
        # frozen and unused: None (no rank had one); rare: rank 0 had one, the others count as zeros
        diagnose.assert_same_named(grads, want, "gradient", f"rank {rank}")


@pytest.mark.exercise("data_parallel.sync_gradients")
def test_sync_gradients_with_plugged_in_allreduce_fn():
    model = OddNet()
    model(*global_batch(0)).backward()
    for grads, calls in launch(_grads_after_one_backward, 2, True, timeout=TIMEOUT):
        assert len(calls) == 1, "all the gradients must go through ONE call of allreduce_fn (one flat buffer)"
        torch.testing.assert_close(grads["emb.weight"], model.emb.weight.grad)
        torch.testing.assert_close(grads["rare.bias"], model.rare.bias.grad)


def _train_flat(rank, world_size, optimizer, steps=3):
    model = OddNet()
    opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    return train(model, opt, steps, rank=rank, world_size=world_size,
                 reduce=lambda: dp().sync_gradients(model), shard=dp().shard_for_rank)


@pytest.mark.exercise("data_parallel.sync_gradients", "shard_for_rank")
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_data_parallel_equals_big_batch_after_k_steps(optimizer, world_size):
    results = launch(_train_flat, world_size, optimizer, timeout=TIMEOUT)
    for rank, got in enumerate(results):  # the replicas stay identical
        assert_same_weights(got, results[0], f"rank {rank} against rank 0", rtol=0, atol=0)
    assert_same_weights(results[0], reference(optimizer), "rank 0 against one process on the whole batch",
                        rtol=RTOL, atol=ATOL)


def _train_llama(rank, world_size, mode):
    """Two SGD steps of the tiny LLaMA: mode "single" (whole batch), "flat" or "bucketed".

    SGD, not Adam: Adam's update hardly depends on the gradient's scale, so it would
    not notice a forgotten division by the world size (the OddNet tests run both)."""
    from labkit.model import build_model
    model = build_model("tiny", seed=0).double()  # float64: see RTOL
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    wrapper = dp().BucketedDataParallel(model, bucket_size_mb=0.5) if mode == "bucketed" else None
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, model.config.vocab_size, (4, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if mode != "single":
            b = len(x) // world_size
            x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        if mode == "flat":
            dp().sync_gradients(model)
        elif mode == "bucketed":
            wrapper.sync_gradients()
        opt.step()
    return snapshot(model), (len(wrapper.buckets) if wrapper else None)


@pytest.mark.exercise("data_parallel.sync_gradients", "BucketedDataParallel")
@pytest.mark.parametrize("mode", ["flat", "bucketed"])
def test_tiny_llama_data_parallel_equals_big_batch(mode):
    want, _ = _train_llama(0, 1, "single")
    for got, n_buckets in launch(_train_llama, 2, mode, timeout=TIMEOUT):
        assert_same_weights(got, want, rtol=RTOL, atol=ATOL)
        if mode == "bucketed":
            assert n_buckets >= 3  # 0.72M float64 parameters in 0.5 MB buckets


# --- bucketed, overlapped all-reduce --------------------------------------------------
# OddNet's trainable parameters (float64) in reverse order, in bytes: rare.bias 128, rare.weight
# 2048, unused.bias 128, unused.weight 2048, hidden.bias 128, hidden.weight 2048, emb.weight 4096.
BUCKETS = {  # name: (bucket_size_mb, expected number of buckets, ranks)
    "one_bucket": (1.0, 1, 2),
    "two_buckets": (6528 / 2**20, 2, 2),  # everything but the embedding, then the embedding
    "four_buckets": (2176 / 2**20, 4, 4),  # rare.*, unused.*, hidden.*, emb: order matters
}


def _train_bucketed(rank, world_size, bucket_size_mb, steps=3):
    model = OddNet()
    opt = OPTIMIZERS["adamw"]([p for p in model.parameters() if p.requires_grad])
    ddp = dp().BucketedDataParallel(model, bucket_size_mb=bucket_size_mb)
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = [[names[id(p)] for p in bucket] for bucket in ddp.buckets]
    return train(ddp, opt, steps, rank=rank, world_size=world_size, reduce=ddp.sync_gradients), buckets


@pytest.mark.exercise("BucketedDataParallel")
@pytest.mark.parametrize("case", list(BUCKETS))
def test_bucketed_equals_big_batch(case):
    bucket_size_mb, n_buckets, world_size = BUCKETS[case]
    results = launch(_train_bucketed, world_size, bucket_size_mb, timeout=TIMEOUT)
    want = reference("adamw")
    for got, buckets in results:
        assert len(buckets) == n_buckets
        # reverse parameter order, the tied weight once, the frozen layer never
        assert sum(buckets, []) == ["rare.bias", "rare.weight", "unused.bias", "unused.weight",
                                    "hidden.bias", "hidden.weight", "emb.weight"]
        assert_same_weights({k.removeprefix("module."): v for k, v in got.items()}, want, rtol=RTOL, atol=ATOL)


def _backward_twice(rank, world_size):
    model = OddNet()
    ddp = dp().BucketedDataParallel(model, bucket_size_mb=1.0)
    x, y = rows(global_batch(0), rank, world_size)
    ddp(x, y).backward()
    try:
        ddp(x, y).backward()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.exercise("BucketedDataParallel")
def test_bucketed_second_backward_before_sync_gradients_raises():
    for message in launch(_backward_twice, 2, timeout=TIMEOUT):
        assert message is not None and "sync_gradients()" in message


# --- broadcast, weight averaging, sharding --------------------------------------------


def _broadcast(rank, world_size):
    model = OddNet(seed=0)
    if rank == 1:
        with torch.no_grad():
            model.hidden.bias[3] += 1e-3  # one replica drifted by one number
    try:
        dp().check_replicas(model)
        error = None
    except dp().ReplicaMismatchError as e:
        error = str(e)
    model = OddNet(seed=rank)  # every replica different, buffers too
    model.scale.fill_(1.0 + rank)
    model.version.fill_(7 + rank)
    dp().broadcast_parameters(model)
    dp().check_replicas(model)  # raises if the broadcast missed anything
    return error, snapshot(model), model.head.weight is model.emb.weight


@pytest.mark.exercise("broadcast_parameters")
@pytest.mark.parametrize("world_size", [2, 4])
def test_broadcast_parameters_when_replicas_start_different_and_check_names_the_parameter(world_size):
    want = snapshot(OddNet(seed=0))
    for error, got, still_tied in launch(_broadcast, world_size, timeout=TIMEOUT):
        assert error is not None and "'hidden.bias'" in error and "[1]" in error, error
        assert still_tied
        for name in want:
            assert torch.equal(got[name], want[name]), name


PLAIN = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1),
         "adam": lambda params: torch.optim.Adam(params, lr=1e-2)}


def _weights_vs_grads(rank, world_size, optimizer):
    x, y = rows(global_batch(0), rank, world_size)
    by_grads, by_weights = OddNet(), OddNet()
    for model in (by_grads, by_weights):
        opt = PLAIN[optimizer]([p for p in model.parameters() if p.requires_grad])
        model(x, y).backward()
        if model is by_grads:
            dp().sync_gradients(model)  # average the gradients, then step
            opt.step()
        else:
            opt.step()  # step on the local gradient, then average the weights
            dp().average_weights(model)
    return snapshot(by_grads), snapshot(by_weights)


@pytest.mark.exercise("average_weights", "data_parallel.sync_gradients")
def test_average_weights_equals_gradient_averaging_for_one_sgd_step():
    for by_grads, by_weights in launch(_weights_vs_grads, 2, "sgd", timeout=TIMEOUT):
        assert_same_weights(by_weights, by_grads)


@pytest.mark.exercise("average_weights", "data_parallel.sync_gradients")
def test_average_weights_differs_from_gradient_averaging_for_adam():
    for by_grads, by_weights in launch(_weights_vs_grads, 2, "adam", timeout=TIMEOUT):
        # Adam's first step is about lr * sign(grad): mean of signs != sign of the mean
        assert (by_weights["emb.weight"] - by_grads["emb.weight"]).abs().max() > 1e-3
        torch.testing.assert_close(by_weights["frozen.weight"], by_grads["frozen.weight"])


@pytest.mark.exercise("shard_for_rank")
def test_shard_for_rank_rows_cover_global_batch_once():
    x, y = global_batch(0)
    for world_size in (1, 2, 4):
        shards = [dp().shard_for_rank((x, y), rank, world_size) for rank in range(world_size)]
        assert all(isinstance(s, tuple) and s[0].shape[0] == GLOBAL_BATCH // world_size for s in shards)
        assert torch.equal(torch.cat([s[0] for s in shards]), x)
        assert torch.equal(torch.cat([s[1] for s in shards]), y)
    assert torch.equal(dp().shard_for_rank(x, 1, 2), x[4:])  # a lone tensor works too


@pytest.mark.exercise("shard_for_rank")
def test_shard_for_rank_bad_input_global_batch_not_splitting_raises_value_error():
    x, y = torch.zeros(6, T), torch.zeros(6, T)
    with pytest.raises(ValueError, match="multiple of 4"):
        dp().shard_for_rank((x, y), 0, 4)
    with pytest.raises(ValueError, match="first dimension"):
        dp().shard_for_rank((x, y[:4]), 0, 2)
    with pytest.raises(ValueError, match="no tensors"):
        dp().shard_for_rank((), 0, 2)
    with pytest.raises(ValueError, match="rank 2"):
        dp().shard_for_rank((x, y), 2, 2)


# --- checkpointing ----------------------------------------------------------------------


def _checkpointed(rank, world_size, path, phase):
    model = OddNet(seed=0 if phase != "resume" else 100 + rank)  # a restart starts from garbage
    opt = OPTIMIZERS["adamw"]([p for p in model.parameters() if p.requires_grad])
    run = dict(rank=rank, world_size=world_size, reduce=lambda: dp().sync_gradients(model))
    if phase == "uninterrupted":
        return train(model, opt, 4, **run)
    if phase == "first_half":
        train(model, opt, 2, **run)
        save_checkpoint(path, model, opt, step=2)
        return None
    step = load_checkpoint(path, model, opt)["step"]
    return step, train(model, opt, 2, first_step=step, **run)


@pytest.mark.exercise("data_parallel.sync_gradients")
def test_checkpoint_resumed_run_matches_uninterrupted_run_exactly(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    want = launch(_checkpointed, 2, path, "uninterrupted", timeout=TIMEOUT)[0]
    launch(_checkpointed, 2, path, "first_half", timeout=TIMEOUT)
    for step, got in launch(_checkpointed, 2, path, "resume", timeout=TIMEOUT):
        assert step == 2
        for name in want:
            assert torch.equal(got[name], want[name]), name


# --- group=: two disjoint subgroups of 4 ranks, one launch ---------------------------------
# Group ranks differ from global ranks (global 3 is rank 1 of [1, 3]), and no source is rank 0.
GROUPS = {(1, 3): dict(src=3, step=1), (0, 2): dict(src=2, step=0)}  # each group its own source and batch
SMALL_BUCKETS = 1088 / 2**20  # four buckets (see BUCKETS)


def _start_different(rank):
    model = OddNet(seed=rank)  # every replica different, buffers too
    model.scale.fill_(1.0 + rank)
    model.version.fill_(7 + rank)
    return model


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def _group_reference_grads(step):
    """One process on the group's whole batch (its data-parallel equivalent)."""
    model = OddNet()
    model(*global_batch(step)).backward()
    return _grads(model)


def _broadcast_in_group(dp_module, rank, ranks, group):
    src = GROUPS[ranks]["src"]
    model = _start_different(rank)
    with diagnose.watch_groups(group, "broadcast_parameters"):
        dp_module.broadcast_parameters(model, src=src, group=group)
    diagnose.assert_same_named(snapshot(model), snapshot(_start_different(src)), "parameter or buffer",
                               f"rank {rank} of group {list(ranks)} after broadcast_parameters(src={src}): "
                               f"it must hold global rank {src}'s values", rtol=0, atol=0)


def _average_in_group(dp_module, rank, ranks, group):
    model = _start_different(rank)
    with diagnose.watch_groups(group, "average_weights"):
        dp_module.average_weights(model, group=group)
    members = [dict(_start_different(q).named_parameters()) for q in ranks]
    want = {n: sum(m[n].detach() for m in members) / len(ranks) for n in members[0]}
    got = {n: p.detach() for n, p in model.named_parameters()}
    diagnose.assert_same_named(got, want, "parameter", f"rank {rank} of group {list(ranks)}: the mean over "
                               f"global ranks {list(ranks)} only")


def _allreduce_in_group(dp_module, rank, ranks, group):
    step = GROUPS[ranks]["step"]
    model = OddNet()
    model(*rows(global_batch(step), ranks.index(rank), len(ranks))).backward()
    with diagnose.watch_groups(group, "sync_gradients"):
        dp_module.sync_gradients(model, group=group)
    diagnose.assert_same_named(_grads(model), _group_reference_grads(step), "gradient",
                               f"rank {rank} of group {list(ranks)}: the group's mean gradient")


def _bucketed_in_group(dp_module, rank, ranks, group):
    step = GROUPS[ranks]["step"]
    model = OddNet()
    with diagnose.watch_groups(group, "BucketedDataParallel"):
        ddp = dp_module.BucketedDataParallel(model, bucket_size_mb=SMALL_BUCKETS, group=group)
        assert ddp.world_size == len(ranks), f"world_size is {ddp.world_size}: the size of group= is {len(ranks)}"
        ddp(*rows(global_batch(step), ranks.index(rank), len(ranks))).backward()
        ddp.sync_gradients()
    diagnose.assert_same_named(_grads(model), _group_reference_grads(step), "gradient",
                               f"rank {rank} of group {list(ranks)}: the group's mean gradient")


GROUP_CASES = {"broadcast_parameters": _broadcast_in_group, "average_weights": _average_in_group,
               "sync_gradients": _allreduce_in_group, "BucketedDataParallel": _bucketed_in_group}


MARKS = {"sync_gradients": "data_parallel.sync_gradients"}  # a name two topics share is marked with its topic


def group_cases(dp_module, rank):
    """{exercise: body()} on this rank; every rank creates both groups (new_group is collective)."""
    groups = {ranks: dist.new_group(list(ranks)) for ranks in GROUPS}
    ranks = next(r for r in GROUPS if rank in r)
    return {name: functools.partial(body, dp_module, rank, ranks, groups[ranks])
            for name, body in GROUP_CASES.items()}


def _run_group_cases(rank, world_size):
    return run_cases(group_cases(dp(), rank))


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.exercise(MARKS.get(name, name))) for name in GROUP_CASES])
def test_group_two_disjoint_subgroups_of_4_ranks_source_not_rank_0(name):
    expect_case(launch_cases(_run_group_cases, 4, timeout=TIMEOUT), name,
                f"{name} with group=[1, 3] (src 3) and group=[0, 2] (src 2) on 4 ranks")
