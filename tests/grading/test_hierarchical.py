"""Grading tests for notebook 03_allreduce, stretch exercise: hierarchical_allreduce.

Run: pytest tests/grading/test_hierarchical.py   (add --impl=solutions for the reference)

Every case compares with torch's own `dist.all_reduce` on the same input, on 1 to 4 ranks and
every node size that divides the world size. The inputs are int64, or float64 holding small
integers, so every partial sum is exact whatever the order of the additions: the results must
be EQUAL (torch.equal), not merely close. One launch per world size runs every case.
About 10 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl

pytestmark = pytest.mark.exercise("hierarchical_allreduce")

WORLD_SIZES = (1, 2, 3, 4)


def node_sizes(world_size):
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


def make_input(rank, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)  # integers: exact sums in float64


def check(fn, mesh, x, **kwargs):
    expected = x.clone()
    dist.all_reduce(expected)
    got = x.clone()
    assert fn(got, mesh=mesh, **kwargs) is got, "must return the tensor it was given (summed in place)"
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, expected), f"differs from dist.all_reduce: {got.flatten()[:8]} vs {expected.flatten()[:8]}"


def cases(rank, world_size, module, node_size, mesh):
    fn = module.hierarchical_allreduce
    out = {}
    out["int64_and_float64"] = lambda: [check(fn, mesh, make_input(rank, shape, dtype, seed=i))
                                        for i, shape in enumerate([(4 * world_size * 3,), (3, 5, 7), (1,)])
                                        for dtype in (torch.int64, torch.float64)]
    out["numel_not_divisible_by_node_size"] = lambda: [
        check(fn, mesh, make_input(rank, (k * node_size + extra,), torch.int64))
        for k in (1, 3) for extra in range(1, max(node_size, 2))]
    out["numel_smaller_than_node_size"] = lambda: [
        check(fn, mesh, make_input(rank, (numel,), torch.float64)) for numel in range(1, node_size)]
    out["empty_tensor"] = lambda: check(fn, mesh, torch.empty(0, 3, dtype=torch.int64))
    out["non_contiguous"] = lambda: check(fn, mesh, make_input(rank, (6, 10), torch.float64).t())

    def inter_node_step_uses_inter_allreduce_on_one_chunk(numel=10):
        seen = []

        def recording(chunk, group=None):
            seen.append((chunk.numel(), dist.get_world_size(group)))
            return dist.all_reduce(chunk, group=group)
        check(fn, mesh, make_input(rank, (numel,), torch.int64), inter_allreduce=recording)
        want = (-(-numel // node_size), world_size // node_size)  # ceil(numel / node_size) over n_nodes ranks
        assert seen == [want], (f"inter_allreduce should be called once, on this rank's chunk of "
                                f"{want[0]} elements over the {want[1]} nodes; calls (numel, group size): {seen}")
    out["inter_node_step_uses_inter_allreduce_on_one_chunk"] = inter_node_step_uses_inter_allreduce_on_one_chunk
    return out


def run_all(rank, world_size):
    module = impl("hierarchical")
    todo = {}
    for node_size in node_sizes(world_size):
        mesh = module.node_mesh(node_size)  # collective: same order on every rank
        for name, body in cases(rank, world_size, module, node_size, mesh).items():
            todo[node_size, name] = body
    if world_size in (3, 4):
        bad = 2 if world_size == 3 else 3

        def node_size_that_does_not_divide_raises():
            mesh = module.node_mesh(1)
            check(module.hierarchical_allreduce, mesh, make_input(rank, (5,), torch.int64))  # works first
            try:
                module.node_mesh(bad)
            except ValueError as e:
                assert "does not divide" in str(e) and str(world_size) in str(e), str(e)
            else:
                raise AssertionError(f"no ValueError for node_size={bad} on {world_size} ranks")
        todo["bad", "node_size_that_does_not_divide_raises"] = node_size_that_does_not_divide_raises
    return run_cases(todo)


def expect_ok(world_size, node_size, case):
    expect_case(launch_cases(run_all, world_size), (node_size, case),
                f"hierarchical_allreduce on {world_size} ranks, node_size={node_size}, case {case}")


ALL = [pytest.param(w, n, id=f"world{w}-node{n}") for w in WORLD_SIZES for n in node_sizes(w)]


@pytest.mark.parametrize("world_size,node_size", ALL)
def test_hierarchical_equals_dist_all_reduce_int64_and_float64(world_size, node_size):
    expect_ok(world_size, node_size, "int64_and_float64")


@pytest.mark.parametrize("world_size,node_size", [(4, 2), (4, 4), (3, 3), (2, 2)])
def test_hierarchical_numel_not_divisible_by_node_size(world_size, node_size):
    expect_ok(world_size, node_size, "numel_not_divisible_by_node_size")


@pytest.mark.parametrize("world_size,node_size", [(4, 4), (3, 3), (4, 2)])
def test_hierarchical_numel_smaller_than_node_size(world_size, node_size):
    expect_ok(world_size, node_size, "numel_smaller_than_node_size")


@pytest.mark.parametrize("world_size,node_size", [(1, 1), (4, 2), (3, 3)])
def test_hierarchical_empty_tensor(world_size, node_size):
    expect_ok(world_size, node_size, "empty_tensor")


@pytest.mark.parametrize("world_size,node_size", [(2, 1), (4, 2)])
def test_hierarchical_non_contiguous(world_size, node_size):
    expect_ok(world_size, node_size, "non_contiguous")


@pytest.mark.parametrize("world_size,node_size", ALL)
def test_hierarchical_inter_node_step_uses_inter_allreduce_on_one_chunk(world_size, node_size):
    expect_ok(world_size, node_size, "inter_node_step_uses_inter_allreduce_on_one_chunk")


@pytest.mark.parametrize("world_size", [3, 4])
def test_hierarchical_node_size_that_does_not_divide_raises(world_size):
    expect_ok(world_size, "bad", "node_size_that_does_not_divide_raises")

