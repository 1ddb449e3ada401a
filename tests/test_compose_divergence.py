"""labkit.compose.divergence names where a composed step first parts from one process (notebook 14).

Planted mistakes, each installed INSIDE the ranks (a monkeypatch in this process would not reach them):
an activation scaled by tp inside one layer (a forward hook), norm weights' gradients not summed over
tp (a placement rule), a mean over dp where a sum was due, an hsdp_sync without its division by R, a
loss that alone differs (the cross-entropy's forward), each micro-batch's loss scaled by 1/m. Each must be
named at its layer and kind, with the factor's hint where there is one; a correct run says equal. Two more
are refused before they can part: a local_batch of the wrong rows, and a vocabulary block of another tp
rank (`parallelize`'s slice check). Tiny model, float64, 2-4 ranks.
"""
from __future__ import annotations

import pytest
import torch

from labkit import LaunchError, launch
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
                              "the gradient of norm (step 1's backward; sp_replica: due summed over tp; its output's "
                              "gradient comes from SP's gather_sequence backward, a reduce-scatter over tp)")


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


def loss_off(stage, mesh):  # the cross-entropy's value off by a constant, its gradient right: only the loss differs
    mod = impl("vocab_parallel")
    right = mod.vocab_parallel_cross_entropy
    mod.vocab_parallel_cross_entropy = lambda *a, **k: right(*a, **k) + 0.25


def test_a_loss_that_alone_differs_is_named_after_the_activations(reference):
    message = divergence.first_divergence(run(ParallelDims(tp=2), loss_off), reference)
    print(message)
    assert message.startswith("first divergence: the loss of step 1 (every activation equal;")


def scale_by_microbatches(stage, mesh):  # the executor's default 1/m where train_step's loss_scale=1 was due
    mod = impl("pipeline")
    right = mod.run_schedule
    mod.run_schedule = lambda *a, **k: right(*a, **{**k, "loss_scale": 1.0 / 2})


def test_a_loss_scaled_by_the_microbatch_count_gets_that_hint(reference):
    message = divergence.first_divergence(run(ParallelDims(pp=2, microbatches=2), scale_by_microbatches), reference)
    print(message)
    assert message.startswith("first divergence: the loss of step 1")
    assert "got = 0.5 x expected, 1/2 = the micro-batch count: each micro-batch's loss scaled by 1/micro-batches" in message


def whole_sequence(stage, mesh):  # the batch rows, but every position on every cp rank (cp forgotten)
    from labkit.parallel.sharding import shard_rows
    mod = impl("placement")

    def wrong(tokens, targets, *, mesh):
        mine = lambda t: shard_rows(t, mesh.index("batch"), mesh.size("batch"))  # noqa: E731
        return (mine(tokens) if mesh.is_first("pp") else None), (mine(targets) if mesh.is_last("pp") else None)
    mod.local_batch = wrong


def test_a_local_batch_of_the_wrong_shape_is_refused_naming_local_batch():
    with pytest.raises(LaunchError, match=r"local_batch \(your exercises/placement.py\) returned x = shape \(2, 8\) "
                                          r"on rank \d .* and s / cp = 8 / 2 = 4 positions"):
        run(ParallelDims(dp=2, cp=2), whole_sequence)


def another_block(rank, world):  # every tp rank keeps the first block of the vocabulary
    from torch import nn
    vp = impl("vocab_parallel")
    init = vp.VocabParallelEmbedding.__init__

    def wrong(self, embedding, *, group=None):
        init(self, embedding, group=group)
        self.weight = nn.Parameter(embedding.weight[:self.end - self.start].detach().clone())
    vp.VocabParallelEmbedding.__init__ = wrong
    mesh = ParallelDims(tp=2).build_mesh(world)
    try:
        parallelize(build_model(CFG, seed=0).double(), mesh=mesh)
    except ValueError as e:
        return str(e)
    return None


def test_a_vocabulary_block_of_another_tp_rank_is_refused_when_the_stage_is_built():
    messages = launch(another_block, 2, timeout=120)
    assert messages[0] is None  # tp rank 0's block is block 0
    assert messages[1].startswith("VocabParallelEmbedding (exercises/vocab_parallel.py) built tok_embeddings.weight "
                                  "on rank 1 (tp rank 1 of 2) with block 0 (tp rank 0's); due: block 1"), messages[1]
