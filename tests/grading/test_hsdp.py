"""Grading tests for notebook 10_scaling_out: HSDP by hand (hsdp_sync, HSDPOptimizer).

Run: pytest tests/grading/test_hsdp.py   (add --impl=solutions for the reference)
Every case runs on 4 ranks in one launch (labkit.grading.cases), on the mesh
``Mesh(4, node=R, local=S)`` for (R, S) = (2, 2), (1, 4), (4, 1), and with the two groups swapped
(shard group {0, 2} / {1, 3}: group ranks are not global ranks, and not rank // R).

How "equal" is proved:
- hsdp_sync on rank tags (rank r adds 16**r, float64: every partial sum and the divisions by 2 and 4
  are exact) must give piece i of the mean over all 4 ranks EXACTLY; a mean over the wrong ranks is
  named by labkit.grading.diagnose ("the sum of ranks {0, 1} only (missing {2, 3})").
- HSDPOptimizer against one process (AdamW on the whole batch) and against torch's FSDP2
  ``fully_shard`` on ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))``:
  float64, atol=1e-8, the bound derived in tests/grading/test_zero.py (N ranks add the gradients in
  another order; AdamW amplifies a rounding dg by at most lr/eps per step).
- bytes: `labkit.comm.traffic.count_traffic` per group, EQUAL (Fractions) to the closed forms of
  solutions/hsdp.py (`wire_bytes_per_level`), and no byte on any other group.
About 30 s on 2 cores (the tiny LLaMA three times: by hand, one process, FSDP2).
"""
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit.comm.traffic import count_traffic
from labkit.grading import impl
from labkit.grading.cases import expect_case, launch_cases, launch_timeout, run_cases
from labkit.model import build_model

TIMEOUT = launch_timeout(60)  # a hang is reported by the launcher, with stacks
WORLD = 4
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
F64 = dict(atol=1e-8, rtol=0)  # float64 against one process: see tests/grading/test_zero.py
LAYOUTS = {"2x2": (2, 2, False), "1x4": (1, 4, False), "4x1": (4, 1, False), "2x2_swapped": (2, 2, True)}


def groups(replicate, shard, swapped):
    """(mesh, shard_group, replica_group): the mesh's local level shards, its node level replicates.

    swapped: shard over the node level ({0, 2}, {1, 3}) instead, so that a group rank is never the
    global rank (nor rank % S): code that takes its piece by global rank fails."""
    mesh = impl("hsdp").hsdp_mesh(replicate, shard)
    local, node = mesh.group("local"), mesh.group("node")
    return (mesh, node, local) if swapped else (mesh, local, node)


def _where(rank, shard_group, replica_group):
    return (f"on global rank {rank} (shard group {dist.get_process_group_ranks(shard_group)}, "
            f"replica group {dist.get_process_group_ranks(replica_group)})")


# --- hsdp_sync ------------------------------------------------------------------------------

def _sync_values(rank, layout, sync=None):
    """Rank tags: the result must be piece i (its shard-group rank) of the mean over all 4 ranks."""
    from labkit.grading import diagnose

    sync = sync or impl("hsdp").hsdp_sync
    replicate, shard, swapped = LAYOUTS[layout]
    _, sg, rg = groups(replicate, shard, swapped)
    where = _where(rank, sg, rg)
    numel = 3 * shard  # s = 3 elements per shard
    got = sync(diagnose.tagged(rank, numel).double(), shard_group=sg, replica_group=rg)
    assert torch.is_tensor(got) and got.shape == (3,), \
        f"hsdp_sync {where} returned {getattr(got, 'shape', got)}: expected this rank's shard, 3 of {numel} elements"
    wrong = diagnose.average_mismatch(got, rank, range(WORLD), WORLD, WORLD)
    assert wrong is None, (f"hsdp_sync {where}: {wrong}; expected the mean over all {WORLD} ranks. Likely cause: "
                           "reduce-scatter the mean over shard_group, then all-reduce the piece over replica_group "
                           "and divide by its size")
    # which piece: the same vector 0, 1, 2, ... on every rank, so the mean is that vector
    flat = torch.arange(numel, dtype=torch.float64)
    got = sync(flat.clone(), shard_group=sg, replica_group=rg)
    wrong = diagnose.shard_mismatch(got, flat, dist.get_rank(sg), rank, shard, "hsdp_sync's result")
    assert wrong is None, wrong


def _sync_bytes(rank, layout, sync=None):
    """Wire bytes per group EQUAL to the closed form; nothing on any other group."""
    hsdp = impl("hsdp")
    sync = sync or hsdp.hsdp_sync
    replicate, shard, swapped = LAYOUTS[layout]
    _, sg, rg = groups(replicate, shard, swapped)
    numel = 5 * shard
    flat = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with count_traffic(groups={"shard": sg, "replica": rg}) as traffic:
        sync(flat, shard_group=sg, replica_group=rg)
    forms = hsdp.wire_bytes_per_level(numel * 8, replicate=replicate, shard=shard, gathered_bytes=0)
    got = {"shard": traffic.wire(group="shard"), "replica": traffic.wire(group="replica")}
    other = traffic.wire() - sum(got.values())
    assert got == forms and other == 0, (
        f"hsdp_sync {_where(rank, sg, rg)} of {numel * 8} bytes put {dict((k, float(v)) for k, v in got.items())} "
        f"bytes on the wire of the shard and replica groups and {float(other)} elsewhere ({traffic.by_group()}); "
        f"the closed form is {dict((k, float(v)) for k, v in forms.items())}: a reduce-scatter of the whole "
        "gradient inside the shard group ((S-1)/S x P), an all-reduce of ONE piece across the replicas "
        "(2 (R-1)/R x P/S), no other collective")


# --- HSDPOptimizer ----------------------------------------------------------------------------

def odd_mlp():
    """5->6->3 with biases: 57 parameters, not a multiple of 2 or 4 (padding)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def tiny():
    return build_model("tiny", seed=0).double()


def loss64(model, x, y=None):
    if y is None:
        return model(x).pow(2).mean()
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())  # float64, unlike lm_loss


def batches(steps, llm):
    g = torch.Generator().manual_seed(1)
    if llm:
        return [tuple(torch.randint(0, 4096, (2 * WORLD, 16), generator=g) for _ in range(2)) for _ in range(steps)]
    return [(torch.randn(3 * WORLD, 5, generator=g, dtype=torch.float64),) for _ in range(steps)]


def make_optimizer(model, sg, rg):
    return impl("hsdp").HSDPOptimizer(model.parameters(), torch.optim.AdamW, shard_group=sg, replica_group=rg,
                                      **HYPER)


def _train(rank, layout, make, steps, *, fsdp2=False, optimizer=None):
    """HSDPOptimizer against one process, step by step (loss, then every parameter after K steps)."""
    from labkit.grading import diagnose

    replicate, shard, swapped = LAYOUTS[layout]
    _, sg, rg = groups(replicate, shard, swapped)
    ours, one = make(), make()
    opt = (optimizer or make_optimizer)(ours, sg, rg)
    ref = torch.optim.AdamW(one.parameters(), **HYPER)
    llm = not isinstance(ours, nn.Sequential)
    rows = 2 if llm else 3
    for batch in batches(steps, llm):
        loss64(ours, *(t[rows * rank:rows * (rank + 1)] for t in batch)).backward()
        loss64(one, *batch).backward()
        for o in (opt, ref):
            o.step()
            o.zero_grad()
    want = {n: p.detach() for n, p in one.named_parameters()}
    got = {n: p.detach() for n, p in ours.named_parameters()}
    diagnose.assert_same_named(got, want, "parameter", f"HSDPOptimizer {_where(rank, sg, rg)}, after {steps} "
                               "steps, against one process on the global batch", **F64,
                               hint="Likely cause: the gradient mean over the wrong ranks (hsdp_sync), or the "
                               "updated shards gathered over the wrong group (the SHARD group)")
    if fsdp2:
        _equal_fsdp2(rank, replicate, shard, make, steps, got)


def _equal_fsdp2(rank, replicate, shard, make, steps, got):
    """torch's own HSDP: FSDP2 fully_shard per block and at the root, on a 2-D DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make()
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for batch in batches(steps, True):
        loss64(model, *(t[2 * rank:2 * rank + 2] for t in batch)).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.detach().full_tensor(), **F64,
                                   msg=lambda m: f"{name}: HSDPOptimizer vs FSDP2's HSDP on a 2-D DeviceMesh: {m}")


def _step_bytes(rank, layout, optimizer=None):
    """One step's wire bytes per group EQUAL to wire_bytes_per_level of the padded parameters."""
    hsdp = impl("hsdp")
    replicate, shard, swapped = LAYOUTS[layout]
    _, sg, rg = groups(replicate, shard, swapped)
    model = odd_mlp()
    opt = (optimizer or make_optimizer)(model, sg, rg)
    (x,) = batches(1, False)[0]
    loss64(model, x[3 * rank:3 * rank + 3]).backward()
    with count_traffic(groups={"shard": sg, "replica": rg}) as traffic:
        opt.step()
    padded = -(-57 // shard) * shard * 8  # 57 float64 parameters, zero-padded to a multiple of S
    forms = hsdp.wire_bytes_per_level(padded, replicate=replicate, shard=shard)
    got = {"shard": traffic.wire(group="shard"), "replica": traffic.wire(group="replica")}
    other = traffic.wire() - sum(got.values())
    assert got == forms and other == 0, (
        f"HSDPOptimizer.step() {_where(rank, sg, rg)} put {dict((k, float(v)) for k, v in got.items())} bytes on "
        f"the shard and replica groups' wire and {float(other)} elsewhere ({traffic.by_group()}); the closed form "
        f"for P = {padded} bytes is {dict((k, float(v)) for k, v in forms.items())}: reduce-scatter and all-gather "
        "inside the shard group, one all-reduce of a 1/S piece across the replicas")


def _awkward(rank, layout):
    """labkit.grading.awkward's model (a frozen, a never-used and a rank-0-only parameter in the middle) under HSDP:
    a None gradient counts as zeros on every rank, so that every rank's flat gradient lines up element for element."""
    from labkit.grading import awkward, diagnose

    replicate, shard, swapped = LAYOUTS[layout]
    _, sg, rg = groups(replicate, shard, swapped)
    ranks, model = list(range(WORLD)), awkward.Awkward()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    where = f"HSDPOptimizer {_where(rank, sg, rg)}, the awkward model"
    opt = make_optimizer(model, sg, rg)
    for x in awkward.batches(ranks, 2):
        model(x[3 * rank:3 * (rank + 1)], awkward.uses_rare(rank, False)).backward()  # `rare`: rank 0 only
        opt.step()
        opt.zero_grad()
    changed = diagnose.frozen_changes(frozen, model)
    assert changed is None, f"{where}: {changed}"
    diagnose.assert_same_named({n: p.detach() for n, p in model.named_parameters()}, awkward.reference(ranks, 2, HYPER),
                               "parameter", f"{where}, after 2 steps against one process with AdamW", **F64,
                               hint=awkward.HINT)


def cases():
    out = {}
    out["optimizer_awkward_2x2_swapped"] = functools.partial(_awkward, layout="2x2_swapped")
    for layout in LAYOUTS:
        out[f"sync_{layout}"] = functools.partial(_sync_values, layout=layout)
        out[f"sync_bytes_{layout}"] = functools.partial(_sync_bytes, layout=layout)
        out[f"optimizer_{layout}"] = functools.partial(_train, layout=layout, make=odd_mlp, steps=4)
        out[f"optimizer_bytes_{layout}"] = functools.partial(_step_bytes, layout=layout)
    out["optimizer_tiny_llama_2x2_equals_one_process_and_fsdp2"] = functools.partial(
        _train, layout="2x2", make=tiny, steps=3, fsdp2=True)
    return out


def _run_all(rank, world):
    return run_cases({key: functools.partial(body, rank) for key, body in cases().items()})


@pytest.mark.exercise("hsdp_sync")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hsdp_sync_gives_this_ranks_piece_of_the_mean_over_every_rank(layout):
    expect_case(launch_cases(_run_all, WORLD, timeout=TIMEOUT), f"sync_{layout}",
                f"hsdp_sync on {WORLD} ranks, replicate x shard = {layout}")


@pytest.mark.exercise("hsdp_sync")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hsdp_sync_bytes_per_level_equal_the_closed_form(layout):
    expect_case(launch_cases(_run_all, WORLD, timeout=TIMEOUT), f"sync_bytes_{layout}",
                f"hsdp_sync's bytes per group on {WORLD} ranks, replicate x shard = {layout}")


@pytest.mark.exercise("HSDPOptimizer", needs=("hsdp_sync",))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hsdp_optimizer_equals_one_process_parameters_not_divisible_by_shards(layout):
    expect_case(launch_cases(_run_all, WORLD, timeout=TIMEOUT), f"optimizer_{layout}",
                f"HSDPOptimizer, 4 AdamW steps of a 57-parameter MLP, replicate x shard = {layout}")


@pytest.mark.exercise("HSDPOptimizer", needs=("hsdp_sync",))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hsdp_optimizer_step_bytes_per_level_equal_the_closed_form(layout):
    expect_case(launch_cases(_run_all, WORLD, timeout=TIMEOUT), f"optimizer_bytes_{layout}",
                f"HSDPOptimizer.step()'s bytes per group, replicate x shard = {layout}")


@pytest.mark.exercise("HSDPOptimizer", needs=("hsdp_sync",))
def test_hsdp_optimizer_frozen_unused_and_one_rank_only_parameters_groups_not_global():
    expect_case(launch_cases(_run_all, WORLD, timeout=TIMEOUT), "optimizer_awkward_2x2_swapped",
                "HSDPOptimizer on a model with a frozen, a never-used and a rank-0-only parameter, 2 x 2 swapped groups")


@pytest.mark.exercise("HSDPOptimizer", needs=("hsdp_sync",))
def test_hsdp_optimizer_tiny_llama_equals_one_process_and_fsdp2_on_a_2d_device_mesh():
    expect_case(launch_cases(_run_all, WORLD, timeout=TIMEOUT), "optimizer_tiny_llama_2x2_equals_one_process_and_fsdp2",
                "HSDPOptimizer on the tiny LLaMA, 2 replicas x 2 shards, 3 steps, against one process and FSDP2")
