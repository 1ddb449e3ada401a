"""HSDP's given parts (solutions/hsdp.py): the layout check, the closed forms against torch's own
FSDP2 HSDP, and the grading checks of tests/grading/test_hsdp.py shown to catch planted mistakes.
FSDP2's HSDP is also rebuilt from notebook 09's ZeRO3 (over the shard group) and one all-reduce of
the shards' gradients across the replicas: the same parameters (float64) and the same wire bytes,
group by group, step by step.

Mistakes are planted INSIDE the launched ranks (a wrong function handed to the grading case), never
by monkeypatching this process: ranks are forked from the zygote, not from pytest.
The cost model's HSDP term (labkit.scale.traffic.hsdp_traffic) against the same closed forms.
About 35 s on 2 cores (two 4-rank launches; FSDP2 and the tiny LLaMA twice in the first).
"""
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from labkit.grading import impl
from labkit.grading.cases import launch_timeout
from labkit.launching.launcher import launch

TIMEOUT = launch_timeout(60)


# --- bad input: pure arithmetic, before any process --------------------------------------------

@pytest.mark.parametrize("replicate,shard", [(3, 2), (2, 1), (1, 8)])
def test_check_hsdp_refuses_a_product_that_is_not_the_data_parallel_size(replicate, shard):
    with pytest.raises(ValueError) as error:
        impl("hsdp").check_hsdp(4, replicate, shard)
    message = str(error.value)
    assert f"{replicate} x {shard} = {replicate * shard} ranks" in message
    assert "data-parallel size is 4" in message and "choose replicate x shard among 4 x 1, 2 x 2, 1 x 4" in message


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_check_hsdp_refuses_sizes_that_are_not_positive_ints(bad):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        impl("hsdp").check_hsdp(4, bad, 2)


def test_check_hsdp_accepts_every_factorisation():
    for shard in (1, 2, 3, 6):
        assert impl("hsdp").check_hsdp(6, 6 // shard, shard) is None


def test_closed_forms_add_up_to_a_flat_all_reduce():
    """2 (S-1)/S P + 2 (R-1)/(R S) P = 2 (W-1)/W P: HSDP moves a flat all-reduce's bytes, split by level."""
    for replicate, shard in ((2, 2), (4, 8), (3, 1), (1, 5)):
        forms = impl("hsdp").wire_bytes_per_level(840, replicate=replicate, shard=shard)
        w = replicate * shard
        assert forms["shard"] + forms["replica"] == 2 * Fraction(w - 1, w) * 840
        assert forms["replica"] == 2 * Fraction(replicate - 1, replicate) * Fraction(840, shard)


# --- torch's own HSDP (FSDP2 on a 2-D DeviceMesh) against the closed forms and against ZeRO-3 by hand ---

def _zero3_hsdp(rank, world, steps=2):
    """FSDP2's HSDP by hand: notebook 09's ZeRO3 over the shard group, then ONE all-reduce of the shards'
    gradients across the replicas; its parameters and its bytes per level against FSDP2's, in the same rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from labkit.comm.traffic import count_traffic
    from labkit.model import build_model
    from labkit.parallel.flat import allreduce_mean_

    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (2 * world, 17), generator=g) for _ in range(steps)]

    def loss(model, tokens):
        mine = tokens[2 * rank:2 * rank + 2]
        return torch.nn.functional.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())

    mesh = impl("hsdp").hsdp_mesh(2, 2)
    ours = build_model("tiny", seed=0).double()
    zero3 = impl("fsdp").ZeRO3(ours, group=mesh.group("local"))
    opt = torch.optim.AdamW(zero3.shards(), **hyper)
    theirs = build_model("tiny", seed=0).double()
    # FSDP2 pads each parameter's dim 0 to a multiple of S, ZeRO3 each unit's flat vector: the tiny model
    # needs neither, so both move the same P
    assert all(p.shape[0] % 2 == 0 for p in theirs.parameters())
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in theirs.layers:
        fully_shard(block, mesh=device_mesh)
    fully_shard(theirs, mesh=device_mesh)
    their_opt = torch.optim.AdamW(theirs.parameters(), **hyper)
    wires = []
    for tokens in batches:
        with count_traffic(groups={"shard": mesh.group("local"), "replica": mesh.group("node")}) as ours_t:
            loss(ours, tokens).backward()
            zero3.sync_gradients()
            allreduce_mean_([s.grad for s in zero3.shards()], group=mesh.group("node"))
            opt.step()
        with count_traffic(groups={"shard": device_mesh.get_group("dp_shard"),
                                   "replica": device_mesh.get_group("dp_replicate")}) as theirs_t:
            loss(theirs, tokens).backward()
            their_opt.step()
        for o in (opt, their_opt):
            o.zero_grad()
        wires.append([{"shard": t.wire(group="shard"), "replica": t.wire(group="replica"), "all": t.wire()}
                      for t in (ours_t, theirs_t)])
    got = zero3.full_parameters()
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(got[name], p.detach().full_tensor(), atol=1e-8, rtol=0,  # test_zero.py's bound
                                   msg=lambda m: f"{name}: ZeRO3 + replica all-reduce vs FSDP2's HSDP: {m}")
    padded = sum(u.flat.numel() * 8 for u in zero3.units + [zero3.root])
    blocks = sum(u.flat.numel() * 8 for u in zero3.units)
    return wires, impl("hsdp").wire_bytes_per_level(padded, replicate=2, shard=2, gathered_bytes=padded + blocks)


def test_fsdp2_hsdp_moves_the_closed_form_bytes_per_level_as_zero3_by_hand_plus_a_replica_all_reduce():
    for wires, forms in launch(_zero3_hsdp, 4, timeout=TIMEOUT):
        for ours, theirs in wires:
            assert ours == theirs, (ours, theirs)  # every step, every group: the same wire bytes
            assert ours == {**forms, "all": forms["shard"] + forms["replica"]}, (ours, forms)


# --- the grading checks catch planted mistakes -------------------------------------------------

def sync_over_the_shard_group_only(flat, *, shard_group, replica_group):
    """Wrong: forgets the all-reduce across replicas (each node trains on its own mean)."""
    from labkit.parallel.sharding import reduce_scatter_mean
    return reduce_scatter_mean(flat, group=shard_group)


def sync_whole_gradient_across_replicas(flat, *, shard_group, replica_group):
    """Right values, wrong bytes: all-reduces the WHOLE gradient across the network, then scatters."""
    from labkit.parallel.sharding import reduce_scatter_mean
    total = flat.clone()
    dist.all_reduce(total, group=replica_group)
    return reduce_scatter_mean(total.div_(dist.get_world_size(replica_group)), group=shard_group)


def optimizer_gathering_over_the_world(model, sg, rg):
    """Right parameters (replica 0's shards come first), wrong bytes: the all-gather crosses the nodes."""
    from labkit.parallel.flat import write_back
    from labkit.parallel.sharding import all_gather_flat

    class Wrong(impl("hsdp").HSDPOptimizer):
        @torch.no_grad()
        def update_parameters(self):
            self.optimizer.step()
            write_back(all_gather_flat(self.shard.detach()), self.params)

    import test_hsdp as graded
    return Wrong(model.parameters(), torch.optim.AdamW, shard_group=sg, replica_group=rg, **graded.HYPER)


def _planted(rank, world):
    import test_hsdp as graded  # tests/grading/test_hsdp.py, on the ranks' path as in the caller's

    def failure(fn, **kwargs):
        try:
            fn(rank, **kwargs)
        except AssertionError as error:
            return str(error)
        return None

    out = {
        "shard_only": failure(graded._sync_values, layout="2x2", sync=sync_over_the_shard_group_only),
        "whole_values": failure(graded._sync_values, layout="2x2", sync=sync_whole_gradient_across_replicas),
        "whole_bytes": failure(graded._sync_bytes, layout="2x2", sync=sync_whole_gradient_across_replicas),
        "world_gather_values": failure(graded._train, layout="2x2", make=graded.odd_mlp, steps=2,
                                       optimizer=optimizer_gathering_over_the_world),
        "world_gather_bytes": failure(graded._step_bytes, layout="2x2", optimizer=optimizer_gathering_over_the_world),
        "shard_only_trains": failure(graded._train, layout="2x2", make=graded.odd_mlp, steps=2,
                                     optimizer=lambda m, sg, rg: _with_sync(m, sg, rg, sync_over_the_shard_group_only)),
    }
    try:
        impl("hsdp").hsdp_mesh(3, 2)
        out["mesh"] = None
    except ValueError as error:
        out["mesh"] = str(error)
    layer, world = torch.nn.Linear(2, 2), dist.group.WORLD
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    for case, params in (("two_groups", [{"params": [layer.weight]}, {"params": [layer.bias]}]),
                         ("all_frozen", frozen.parameters()),
                         ("mixed_dtypes", [layer.weight, torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])):
        try:
            impl("hsdp").HSDPOptimizer(params, shard_group=world, replica_group=world, lr=1e-3)
            out[case] = None
        except ValueError as error:
            out[case] = str(error)
    return out


def _with_sync(model, sg, rg, sync):
    class Wrong(impl("hsdp").HSDPOptimizer):
        @torch.no_grad()
        def sync_gradients(self):
            from labkit.parallel.flat import flatten, grads_or_zeros
            flat = flatten(grads_or_zeros(self.params), self.shard.numel() * self.n_shards)
            self.shard.grad = sync(flat, shard_group=self.shard_group, replica_group=self.replica_group)
            self.mark_synced()

    import test_hsdp as graded
    return Wrong(model.parameters(), torch.optim.AdamW, shard_group=sg, replica_group=rg, **graded.HYPER)


@pytest.fixture(scope="module")
def planted(request):
    import sys
    from pathlib import Path

    grading = str(Path(__file__).parent / "grading")
    if grading not in sys.path:  # the ranks import tests/grading/test_hsdp.py by name, from the caller's path
        sys.path.insert(0, grading)
    return launch(_planted, 4, timeout=TIMEOUT)


def test_sync_over_the_shard_group_only_is_named(planted):
    for rank, out in enumerate(planted):
        assert "only (missing" in out["shard_only"] and "divided by 2" in out["shard_only"], out["shard_only"]
        assert out["shard_only_trains"] and "first differing parameter" in out["shard_only_trains"]


def test_whole_gradient_across_replicas_has_right_values_but_fails_the_bytes(planted):
    for out in planted:
        assert out["whole_values"] is None  # the values alone cannot see it ...
        assert "closed form" in out["whole_bytes"], out["whole_bytes"]  # ... the bytes per level do


def test_optimizer_gathering_over_the_world_fails_the_bytes(planted):
    for out in planted:
        assert out["world_gather_values"] is None  # right parameters ...
        assert "closed form" in out["world_gather_bytes"], out["world_gather_bytes"]  # ... bytes across nodes


def test_hsdp_mesh_refuses_before_creating_any_group(planted):
    for out in planted:
        assert out["mesh"] and "choose replicate x shard among 4 x 1, 2 x 2, 1 x 4" in out["mesh"]


# --- the cost model's HSDP term (labkit.scale.traffic.hsdp_traffic) ----------------------------

def test_cost_model_hsdp_zero12_form_is_the_one_the_lab_measures():
    """value_bytes=8 (float64), ZeRO-1/2 in the node: the bytes tests/grading/test_hsdp.py counts."""
    from labkit.scale.cluster import load_cluster
    from labkit.scale.traffic import hsdp_traffic

    h100 = load_cluster("h100-sxm")
    for replicate, shard in ((2, 2), (4, 8), (3, 1), (1, 4)):
        params = 840 * shard  # a multiple of S: no padding
        got = hsdp_traffic(params, replicate, shard, h100, zero="zero1", value_bytes=8)
        forms = impl("hsdp").wire_bytes_per_level(8 * params, replicate=replicate, shard=shard)
        assert got["shard"]["bytes"] == pytest.approx(float(forms["shard"]), rel=1e-12)
        assert got["replica"]["bytes"] == pytest.approx(float(forms["replica"]), rel=1e-12)


def test_cost_model_hsdp_zero3_levels_and_bytes():
    from labkit.scale.cluster import load_cluster
    from labkit.scale.collectives import ring_time
    from labkit.scale.traffic import hsdp_traffic

    h100 = load_cluster("h100-sxm")  # 8 GPUs per node
    P, R, S = 8e9, 16, 8
    got = hsdp_traffic(P, R, S, h100)
    # FSDP2 as torchtitan: bf16 parameters gathered twice, fp32 gradients reduce-scattered, in the node;
    # the fp32 gradient shard (1/S) all-reduced across the nodes
    assert got["shard"]["level"] == "node" and got["replica"]["level"] == "network"
    assert got["shard"]["bytes"] == pytest.approx((S - 1) / S * (2 + 2 + 4) * P, rel=1e-12)
    assert got["replica"]["bytes"] == pytest.approx(2 * (R - 1) / R * 4 * P / S, rel=1e-12)
    # R ranks, one per node: NCCL's base latency, then every step a crossing (Cluster.ring_step_latency)
    alpha = (8.4 + 2 * (R - 1) * h100.network_latency_us) * 1e-6 / (2 * (R - 1))
    assert h100.ring_step_latency("all_reduce", R, 1) == pytest.approx(alpha)
    assert got["replica"]["seconds"] == pytest.approx(
        ring_time("all_reduce", 4 * P / S, R, alpha, h100.link("network")[1])[1])
    # a shard group wider than a node (or spread by tp inside it) pays the network
    assert hsdp_traffic(P, R, S, h100, shard_stride=2)["shard"]["level"] == "network"
    # one replica: nothing crosses the replica group; the whole dp group then fits in a node
    one = hsdp_traffic(P, 1, S, h100)
    assert one["replica"]["bytes"] == 0 and one["replica"]["level"] == "node"


def test_cost_model_hsdp_counts_each_micro_batchs_reductions():
    """Several micro-batches without a pipeline (zero_calls.zero3_calls, zero2_calls): ZeRO-3 gathers twice and
    reduce-scatters once per micro-batch, ZeRO-2 reduce-scatters per micro-batch and gathers once; each
    reduce-scatter's shard all-reduced across the replicas (FSDP2's HSDP). The edge case: m = 3, where a
    once-a-step count would be off by 3 in the reductions; inside a pipeline both count once (ZeRO-2 as ZeRO-1)."""
    from labkit.scale.cluster import load_cluster
    from labkit.scale.traffic import hsdp_traffic
    from labkit.scale.zero_calls import zero2_calls, zero3_calls

    h100 = load_cluster("h100-sxm")
    P, R, S, m = 8e9, 16, 8, 3
    z3 = hsdp_traffic(P, R, S, h100, calls=zero3_calls(1, m))
    assert z3["shard"]["bytes"] == pytest.approx((S - 1) / S * (2 * m * 2 + m * 4) * P, rel=1e-12)
    assert z3["replica"]["bytes"] == pytest.approx(m * 2 * (R - 1) / R * 4 * P / S, rel=1e-12)
    z2 = hsdp_traffic(P, R, S, h100, zero="zero2", calls=zero2_calls(1, m))
    assert z2["shard"]["bytes"] == pytest.approx((S - 1) / S * (1 + m) * 2 * P, rel=1e-12)
    assert z2["replica"]["bytes"] == pytest.approx(m * 2 * (R - 1) / R * 2 * P / S, rel=1e-12)
    assert zero3_calls(4, m) == (1, 1) and zero2_calls(4, m) is None
    piped = hsdp_traffic(P, R, S, h100, zero="zero2", calls=zero2_calls(4, m))
    assert piped == hsdp_traffic(P, R, S, h100, zero="zero1")


def test_hsdp_optimizer_refuses_what_it_cannot_shard(planted):
    for out in planted:
        assert "one parameter group, got 2" in out["two_groups"], out["two_groups"]
        assert "no parameter that requires grad" in out["all_frozen"], out["all_frozen"]
        assert "one dtype" in out["mixed_dtypes"], out["mixed_dtypes"]
