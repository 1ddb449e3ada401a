"""labkit.compose.divergence names where a composed step first parts from one process (notebook 14).

Planted mistakes, each installed INSIDE the ranks (a monkeypatch in this process would not reach them):
an activation scaled by tp inside one layer (a forward hook), and norm weights' gradients not summed over
tp (a placement rule). Each must be named at its layer and kind, the first with the factor's hint; a
correct run says equal. Tiny model, float64, 2-4 ranks.
"""
from __future__ import annotations

import pytest
import torch

from labkit import launch
from labkit.compose import divergence
from labkit.compose.dims import ParallelDims
from labkit.compose.model import param_class, parallelize
from labkit.compose.step import ComposedOptimizer
from labkit.grading import impl
from labkit.model import build_model, get_config

CFG = get_config("tiny", d_model=16, n_heads=2, n_layers=2, hidden_dim=32, vocab_size=32, context=16)
B, S = 4, 8


def batch():
    t = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(1))
    return t[:, :-1], t[:, 1:]


def rank_fn(rank, world, dims, plant):
    mesh = dims.build_mesh(world)
    stage = parallelize(build_model(CFG, seed=0).double(), mesh=mesh)
    if plant is not None:
        plant(stage, mesh)  # before the optimizer: it reads the placement table
    opt = ComposedOptimizer(stage, mesh=mesh, zero=dims.zero)
    x, y = batch()
    return divergence.record_first_step(stage, opt, x, y, mesh=mesh, microbatches=dims.microbatches)


def scale_attention(stage, mesh):  # layer 1's attention output times tp: a sum where a mean was due
    if "1" in stage.layers:
        stage.layers["1"].attention.register_forward_hook(lambda m, a, out: out * mesh.size("tp"))


def norm_not_over_tp(stage, mesh):
    mod = impl("placement")
    right = mod.placement

    def wrong(name, *, mesh):
        p = right(name, mesh=mesh)
        if param_class(name) == "sp_replica":
            return type(p)(p.sharded_over, tuple(a for a in p.summed_over if a != "tp"))
        return p
    mod.placement = wrong


@pytest.fixture(scope="module")
def reference():
    yield divergence.reference_first_step(build_model(CFG, seed=0).double(), *batch())


def run(dims, plant=None):
    return launch(rank_fn, dims.world_size, dims, plant, timeout=120)


@pytest.fixture(autouse=True)
def solutions(monkeypatch):
    monkeypatch.setenv("LABKIT_IMPL", "solutions")


def test_a_correct_composed_step_is_equal(reference):
    records = run(ParallelDims(dp=2, tp=2, zero=1, microbatches=2))  # ZeRO: the sums gathered from the shards
    assert divergence.first_divergence(records, reference) is None
    assert divergence.describe(records, reference).startswith("equal to one process at step 1")


def test_an_activation_scaled_by_tp_is_named_at_its_layer_with_the_factor(reference):
    message = divergence.first_divergence(run(ParallelDims(pp=2, tp=2), scale_attention), reference)
    print(message)
    assert message.startswith("first divergence: the activation of layers.1.attention (step 1's forward; tp:")
    assert "2 = the size of tp: a sum where a mean was due" in message


def test_a_norm_gradient_not_summed_over_tp_is_named_in_backward_order(reference):
    message = divergence.first_divergence(run(ParallelDims(tp=2), norm_not_over_tp), reference)
    print(message)
    assert message.startswith("first divergence: "
                              "the gradient of norm (step 1's backward; sp_replica: due summed over tp)")


def mean_over_dp(stage, mesh):  # every gradient divided by dp before the sum: the replicas' mean, not their sum
    def halve(p):
        p.grad.div_(mesh.size("dp"))
    for p in stage.parameters():
        p.register_post_accumulate_grad_hook(halve)


def test_a_mean_over_dp_where_a_sum_was_due_is_named_with_the_inverse_factor(reference):
    message = divergence.first_divergence(run(ParallelDims(dp=2), mean_over_dp), reference)
    print(message)
    assert message.startswith("first divergence: "
                              "the gradient of output (step 1's backward; tp_shard: due summed over dp)")
    assert "1/2 = the size of dp: a mean where a sum was due" in message


def hsdp_sum_across_replicas(stage, mesh):  # hsdp_sync without its division by R: a sum across the replicas
    mod = impl("hsdp")

    def summed(flat_grad, *, shard_group, replica_group):
        import torch.distributed as dist
        from labkit.parallel.sharding import reduce_scatter_mean
        mine = reduce_scatter_mean(flat_grad, group=shard_group)
        dist.all_reduce(mine, group=replica_group)
        return mine
    mod.hsdp_sync = summed


def test_a_wrong_hsdp_sync_fails_the_composed_proof_naming_it(reference):
    """The composed HSDP step runs the learner's hsdp_sync (labkit.compose.step.sync_replicas): one planted in
    the ranks that forgets to divide by R is named at the first gradient, with hsdp_sync and the factor R."""
    dims = ParallelDims(dp=4, dp_replicate=2, zero=1)
    assert divergence.first_divergence(run(dims), reference) is None
    message = divergence.first_divergence(run(dims, hsdp_sum_across_replicas), reference)
    print(message)
    assert message.startswith("first divergence: the gradient of output (step 1's backward; tp_shard: due summed over dp")
    assert "summed by your hsdp_sync (exercises/hsdp.py, notebook 10)" in message
    assert "2 = the size of dp_replicate: a sum where a mean was due" in message
