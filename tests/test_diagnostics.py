"""The grading messages say WHERE a wrong result goes wrong, and the group= cases catch what they
must: each proven here with a deliberately wrong implementation (a mutant) written below, run
through the grading module's own cases. Not grading tests: no learner code runs here.

labkit.grading.diagnose on hand-made tensors first (no process), then one 4-rank launch per mutant
family (about 40 s of wall time on 2 busy cores).
"""
import importlib.util
import os
import sys
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from labkit.grading import diagnose
from labkit.grading import impl
from labkit.launching.launcher import LaunchError, launch

GRADING = Path(__file__).resolve().parent / "grading"
TIMEOUT = 60


def grading_module(topic):
    """tests/grading/test_<topic>.py as a module (its case bodies, not its tests)."""
    name = f"_grading_{topic}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GRADING / f"test_{topic}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def with_mutant(topic, **replacements):
    """In a rank: the reference module of `topic`, with some functions replaced by mutants."""
    os.environ["LABKIT_IMPL"] = "solutions"
    module = impl(topic, "solutions")
    for name, value in replacements.items():
        setattr(module, name, value)
    return module


# --- labkit.grading.diagnose, by hand ---------------------------------------------------------------


def test_rank_tags_decode_to_ranks_and_counts():
    assert [diagnose.rank_tag(r) for r in range(3)] == [1, 16, 256]
    assert diagnose.decode(1 + 16 + 16 + 4096, 4) == {0: 1, 1: 2, 3: 1}
    assert diagnose.decode(-1, 4) is None and diagnose.decode(1 << 16, 4) is None


def test_allreduce_mismatch_names_chunk_rank_and_missing_ranks():
    x = torch.full((12,), 1 + 16 + 256 + 4096, dtype=torch.int64)
    assert diagnose.allreduce_mismatch(x, 1, range(4), 4, bounds=[0, 3, 6, 9, 12]) is None
    x[6:9] = 16 + 256
    assert diagnose.allreduce_mismatch(x, 1, range(4), 4, bounds=[0, 3, 6, 9, 12]) == (
        "after the all-reduce, chunk 2 (elements 6-8) on rank 1 holds the sum of ranks {1, 2} only (missing {0, 3})")
    x[7] = 1 + 1 + 16 + 256  # rank 0 counted twice, rank 3 missing
    assert diagnose.allreduce_mismatch(x, 1, range(4), 4, bounds=[0, 3, 6, 9, 12]) == (
        "after the all-reduce, element 6 of chunk 2 (elements 6-8) on rank 1 holds the sum of ranks {1, 2} only "
        "(missing {0, 3}); 2 more wrong elements on this rank")
    assert diagnose.describe(1 + 1 + 16 + 256, range(4), 4) == (
        "the sum of ranks {0, 1, 2} (rank 0 counted 2 times; missing {3})")
    assert diagnose.allreduce_mismatch(torch.tensor([17, 0]), 3, [0, 1], 4) == (
        "after the all-reduce, element 1 on rank 3 holds 0: no rank's value at all")


def test_assert_same_named_names_the_first_differing_tensor_and_by_how_much():
    want = {"a": torch.zeros(3), "b": torch.zeros(2, 2), "c": None, "d": torch.ones(1)}
    got = {"a": torch.zeros(3), "b": torch.tensor([[0.0, 0.0], [0.5, 0.0]]), "c": torch.ones(1), "d": torch.ones(1)}
    with pytest.raises(AssertionError) as info:
        diagnose.assert_same_named(got, want, "gradient", "rank 1")
    assert str(info.value) == ("rank 1: first differing gradient: 'b': max abs diff 0.5 at index (1, 0) (got 0.5, "
                               "expected 0; largest expected magnitude 0); 2 of 4 differ (b, c)")
    diagnose.assert_same_named(got, {**got}, "gradient")


def test_shard_mismatch_names_the_piece_a_shard_holds_and_frozen_changes_the_parameter_that_moved():
    flat = torch.arange(8.0)  # 2 pieces of 4
    assert diagnose.shard_mismatch(flat[4:], flat, 1, 3, 2) is None
    assert diagnose.shard_mismatch(flat[4:], flat, 0, 1, 2, "shards[0]") == (
        "shards[0] on global rank 1 (rank 0 of its group of 2) holds piece 1, expected elements 0-3 of the flat, "
        "padded vector (piece 0 of 2): its piece is the one of its GLOBAL rank: take the rank in the group, "
        "dist.get_rank(group), not dist.get_rank()")
    assert diagnose.shard_mismatch(flat[8:], flat, 1, 3, 2).startswith(
        "the shard on global rank 3 (rank 1 of its group of 2) holds nothing, expected elements 4-7")
    assert "holds no piece of the flat vector" in diagnose.shard_mismatch(flat[:4] + 1, flat, 0, 0, 2)
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(False)
    before = {"bias": model.bias.detach().clone()}
    assert diagnose.frozen_changes(before, model) is None
    with torch.no_grad():
        model.bias.add_(0.5)
    assert diagnose.frozen_changes(before, model).startswith(
        "frozen parameter 'bias' (requires_grad=False) changed: max abs diff 0.5, expected 0 (unchanged): "
        "an optimizer must leave frozen parameters untouched")


# --- ring all-reduce: the bitmask case names the first wrong chunk --------------------------


def _ring_one_allgather_step_short(tensor, group=None):
    """A learner's off-by-one: the all-gather stops one step early (range(n - 2))."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    bounds = impl("allreduce", "solutions").chunk_bounds(flat.numel(), n)
    chunk = lambda i: flat[bounds[i % n]:bounds[i % n + 1]]  # noqa: E731
    incoming = torch.empty(bounds[1], dtype=flat.dtype)
    for s in range(n - 1):
        mine = chunk(r - s - 1)
        impl("allreduce", "solutions").send_recv(chunk(r - s), (r + 1) % n, incoming[:mine.numel()], (r - 1) % n)
        mine += incoming[:mine.numel()]
    for s in range(n - 2):  # BUG: range(n - 1)
        impl("allreduce", "solutions").send_recv(chunk(r + 1 - s), (r + 1) % n, chunk(r - s), (r - 1) % n)
    return tensor


def _ring_wrong_chunk_index(tensor, group=None):
    """A wrong chunk index: reduce-scatter adds the incoming chunk into chunk r-s (the one just sent)."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    bounds = impl("allreduce", "solutions").chunk_bounds(flat.numel(), n)
    chunk = lambda i: flat[bounds[i % n]:bounds[i % n + 1]]  # noqa: E731
    incoming = torch.empty(bounds[1], dtype=flat.dtype)
    for s in range(n - 1):
        impl("allreduce", "solutions").send_recv(chunk(r - s), (r + 1) % n, incoming, (r - 1) % n)
        chunk(r - s).add_(incoming)  # BUG: chunk(r - s - 1)
    for s in range(n - 1):
        impl("allreduce", "solutions").send_recv(chunk(r + 1 - s), (r + 1) % n, chunk(r - s), (r - 1) % n)
    return tensor


def _bitmask_with(rank, world_size, mutant):
    from labkit.grading.cases import run_cases

    grading = grading_module("allreduce")
    os.environ["LABKIT_IMPL"] = "solutions"
    return run_cases({"bitmask": lambda: grading.check_bitmask(mutant, rank, world_size, ring=True)})["bitmask"]


@pytest.mark.parametrize("mutant,first", [
    # rank 0's chunk 2 never got rank 1's value: the missing all-gather step would have brought it
    (_ring_one_allgather_step_short,
     "after the all-reduce, chunk 2 (elements 6-8) on rank 0 holds the sum of ranks {0, 2, 3} only (missing {1})"),
    # rank 3 never adds into its chunk 0 (r+1), yet sends it as complete in the all-gather
    (_ring_wrong_chunk_index,
     "after the all-reduce, chunk 0 (elements 0-2) on rank 0 holds the sum of ranks {3} only (missing {0, 1, 2})"),
], ids=["allgather_one_step_short", "wrong_chunk_index"])
def test_bitmask_case_names_the_first_wrong_chunk_of_a_wrong_ring(mutant, first):
    outcomes = launch(_bitmask_with, 4, mutant, timeout=TIMEOUT)
    assert all(status == "failed" for status, _ in outcomes), outcomes
    assert first in outcomes[0][1], outcomes[0][1]
    assert "draw_ring" in outcomes[0][1]  # and where to see the step it goes wrong


def test_bitmask_case_passes_the_reference():
    outcomes = launch(_bitmask_with, 3, impl("allreduce", "solutions").ring_allreduce, timeout=TIMEOUT)
    assert outcomes == [("ok", "")] * 3


# --- data parallel, group=: mutants written here, run through the grading module's cases --------


def _broadcast_ignores_group(model, src=0, group=None):
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=src)  # BUG: no group=group


def _broadcast_from_group_rank_0(model, src=0, group=None):
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, group_src=0, group=group)  # BUG: src ignored


def _average_ignores_group(model, group=None):
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p)  # BUG: over every rank
            p /= dist.get_world_size()


def _allreduce_gradients_ignores_group(model, group=None, allreduce_fn=None):
    impl("data_parallel", "solutions").sync_gradients(model, group=None, allreduce_fn=allreduce_fn)  # BUG: group dropped


def _bucketed_ignores_group(model, bucket_size_mb=25.0, group=None):
    return impl("data_parallel", "solutions").BucketedDataParallel(model, bucket_size_mb, group=None)  # BUG: group dropped


MUTANTS = {"broadcast_ignores_group": _broadcast_ignores_group,
           "broadcast_from_group_rank_0": _broadcast_from_group_rank_0,
           "average_ignores_group": _average_ignores_group,
           "allreduce_gradients_ignores_group": _allreduce_gradients_ignores_group,
           "bucketed_ignores_group": _bucketed_ignores_group}


def _dp_group_cases_with(rank, world_size, exercise, mutant_name):
    from labkit.grading.cases import run_cases

    mutated = SimpleNamespace(**vars(with_mutant("data_parallel")))  # the reference keeps its functions
    setattr(mutated, exercise, MUTANTS[mutant_name])
    cases = grading_module("data_parallel").group_cases(mutated, rank)
    return run_cases({exercise: cases[exercise]})[exercise]


@pytest.mark.parametrize("exercise,mutant,message", [
    ("broadcast_parameters", "broadcast_ignores_group",
     "called dist.broadcast on the default group (ranks [0, 1, 2, 3])"),
    ("broadcast_parameters", "broadcast_from_group_rank_0",
     "it must hold global rank 2's values: first differing parameter or buffer: 'scale'"),
    ("average_weights", "average_ignores_group", "called dist.all_reduce on the default group"),
    ("sync_gradients", "allreduce_gradients_ignores_group", "called dist.all_reduce on the default group"),
    ("BucketedDataParallel", "bucketed_ignores_group", "called dist.broadcast on the default group"),  # its DDP-like broadcast
])
def test_dp_group_cases_catch_a_mutant(exercise, mutant, message):
    outcomes = launch(_dp_group_cases_with, 4, exercise, mutant, timeout=TIMEOUT)
    assert all(status == "failed" for status, _ in outcomes), outcomes
    assert any(message in detail for _, detail in outcomes), outcomes[0][1]


def test_dp_group_cases_pass_the_reference():
    def run(rank, world_size):
        from labkit.grading.cases import run_cases
        return run_cases(grading_module("data_parallel").group_cases(with_mutant("data_parallel"), rank))
    for outcomes in launch(run, 4, timeout=TIMEOUT):
        assert all(status == "ok" for status, _ in outcomes.values()), outcomes


# --- tensor parallel, group=: a column-parallel layer that shards over the default group -------


def _tp_with_mutant(rank, world_size):
    tp = with_mutant("tensor_parallel")
    original = tp.ColumnParallelLinear

    class IgnoresGroup(original):
        def __init__(self, linear, *, group=None, gather_output=False):
            super().__init__(linear, group=None, gather_output=gather_output)  # BUG: group dropped
    tp.ColumnParallelLinear = IgnoresGroup
    try:
        return grading_module("tensor_parallel")._run_group_cases(rank, world_size)
    finally:
        tp.ColumnParallelLinear = original


def test_tp_group_case_catches_a_layer_ignoring_group():
    for outcomes in launch(_tp_with_mutant, 4, timeout=TIMEOUT):
        status, detail = outcomes["ColumnParallelLinear"]
        assert status == "failed" and "weight has shape (6, 6), expected (12, 6)" in detail, detail
        assert outcomes["RowParallelLinear"] == ("ok", "")


# --- hybrid: a step that feeds every replica the whole batch ------------------------------------


def _hybrid_with_whole_batch(rank, world_size, dp, pp, m):
    # the bug: every replica trains on the WHOLE global batch (replica_rows returns every row).
    # The averaged gradient and the averaged loss are the same: it passes "equals one process".
    with_mutant("hybrid", replica_rows=lambda x, *, mesh: x)
    return grading_module("hybrid")._hybrid_rank(rank, world_size, dp, pp, m)


def test_hybrid_rows_check_catches_every_replica_training_on_the_whole_batch():
    grading = grading_module("hybrid")
    dp, pp, m = 2, 2, 2
    results = launch(_hybrid_with_whole_batch, dp * pp, dp, pp, m, timeout=TIMEOUT)
    grading._check_against_reference(results, grading._reference(dp, m), pp)  # the old tests pass it...
    with pytest.raises(AssertionError) as info:  # ... the rows check does not
        grading.check_replica_rows(results, dp, pp, m)
    assert str(info.value).startswith("step 0: replica 0's first stage (rank 0) received inputs for micro-batch 0: "
                                      "global rows [0, 1], expected rows [0]"), str(info.value)


def test_average_mismatch_names_missing_ranks_outsiders_divisor_and_sign():
    import torch

    from labkit.grading.diagnose import average_mismatch, rank_tag

    tags = lambda ranks, by: torch.full((3,), sum(rank_tag(r) for r in ranks) / by, dtype=torch.float64)  # noqa: E731
    assert average_mismatch(tags([0, 2], 4), 0, [0, 2], 4, 4) is None
    assert "the sum of ranks {0, 1, 2, 3} (ranks {1, 3} are not in the group), divided by 4" in \
        average_mismatch(tags([0, 1, 2, 3], 4), 0, [0, 2], 4, 4)
    assert "the right sum divided by 2, instead of divided by 4" in average_mismatch(tags([0, 2], 2), 0, [0, 2], 4, 4)
    assert "the sum of ranks {0} only (missing {1}), not divided" in average_mismatch(tags([0], 1), 0, [0, 1], 2, 2)
    assert "opposite sign" in average_mismatch(-tags([0, 1], 2), 0, [0, 1], 2, 2)
