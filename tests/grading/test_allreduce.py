"""Grading tests for notebook 03_allreduce: naive_allreduce and ring_allreduce, and the
optional pipelined_ring_allreduce and tree_allreduce (same tests).

Run: pytest tests/grading/test_allreduce.py   (add --impl=solutions for the reference)

Every case is compared with torch's own `dist.all_reduce` on the same inputs:
exactly for int64, with assert_close for floats (the order of the additions
differs). To keep launches few, ONE launch per world size (1, 2, 3, 4) runs
every case of every function; each test below then reads its case's outcome.
The "bitmask" cases feed rank r the value 16**r (`labkit.grading.diagnose.rank_tag`), so a wrong
sum names the first wrong chunk, on which rank, and whose values it holds or misses; they
have their own launch per world size (2, 3, 4), so that they report even when the other
cases hang. About 15 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit.grading import diagnose
from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl

FUNCTIONS = ("ring_allreduce", "naive_allreduce", "pipelined_ring_allreduce", "tree_allreduce")
# The pipelined ring runs with tiny segments (2-4 elements) so that every case crosses
# segment boundaries; the several-MB case uses its default segments.
SMALL_SEGMENTS = 16
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


def make_input(rank, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def check_against_torch(fn, x, group=None):
    """Run fn on a copy of x; compare with dist.all_reduce; check in place + returned."""
    expected = x.clone()
    dist.all_reduce(expected, group=group)
    got = x.clone()
    out = fn(got, group=group)
    assert out is got, "must return the tensor it was given (summed in place)"
    if got.dtype.is_floating_point:
        torch.testing.assert_close(got, expected, msg=lambda m: f"{m}\n{BITMASK_HINT}")
    else:
        assert torch.equal(got, expected), f"int64 sums must be exact.\n{BITMASK_HINT}"


BITMASK_HINT = ("Where it goes wrong: see this function's test_allreduce_bitmask_* result (which chunk, "
                "which rank, whose values are missing).")
RING_HINT = ("To see the step where it goes wrong: ring_moves.draw_ring(ring_moves"
             ".record_moves(4, FUNCTION), 4) draws every message and marks the first wrong one "
             "(from labkit.apps import ring_moves).")


def check_bitmask(fn, r, n, ring, ranks=None, group=None, fn_name="ring_allreduce"):
    """Rank r contributes 16**r (a hexadecimal digit of its own): every element of the result
    must hold each member's digit once. Otherwise fail naming the first wrong place, with
    chunks as the ring cuts the tensor (`chunk_bounds`) for the ring functions."""
    members = list(range(n)) if ranks is None else list(ranks)
    numel = 3 * len(members)  # equal chunks: a wrong chunk index cannot turn into a size mismatch
    x = diagnose.tagged(r, numel)
    before = x.clone()
    out = fn(x, group=group)
    assert out is x, "must return the tensor it was given (summed in place)"
    if r not in members:
        assert torch.equal(x, before), f"rank {r} is not in the group {members} but its tensor changed"
        return
    bounds = impl("allreduce").chunk_bounds(numel, len(members)) if ring else None
    message = diagnose.allreduce_mismatch(x, r, members, n, bounds=bounds)
    if message:
        hint = "\n" + RING_HINT.replace("FUNCTION", repr(fn_name)) if ring and ranks is None else ""
        raise AssertionError(f"{message}\n(rank q contributes 16**q: each hexadecimal digit of an element "
                             f"counts one rank's value){hint}")


def cases(n, fn_name="ring_allreduce"):
    """{case name: body(fn, rank, n)} for world size n."""
    out = {}
    for name, dtype in DTYPES.items():
        out[f"matches_torch_{name}"] = lambda fn, r, n, dtype=dtype: [
            check_against_torch(fn, make_input(r, shape, dtype, seed=i))
            for i, shape in enumerate([(4 * n * 3,), (3, 5, 7), (1,)])]
    out["numel_not_divisible_by_world_size"] = lambda fn, r, n: [
        check_against_torch(fn, make_input(r, (k * n + extra,), torch.float32))
        for k in (1, 5) for extra in range(1, max(n, 2))]
    out["numel_smaller_than_world_size"] = lambda fn, r, n: [
        check_against_torch(fn, make_input(r, (numel,), torch.int64)) for numel in range(1, n)]
    out["empty_tensor"] = lambda fn, r, n: check_against_torch(fn, torch.empty(0, 3))
    out["several_megabytes"] = lambda fn, r, n: check_against_torch(
        getattr(fn, "func", fn), make_input(r, (3 * 2**20 // 4 + 1,), torch.float32))
    out["non_contiguous"] = lambda fn, r, n: check_against_torch(fn, make_input(r, (6, 10), torch.float64).t())

    def non_contiguous_view_of_bigger_tensor(fn, r, n):
        base = make_input(r, (8, 9), torch.int64)
        view = base[1:7, ::2]  # writes must land in base, and only there
        before = base.clone()
        expected = view.clone()
        dist.all_reduce(expected)
        assert fn(view) is view
        assert torch.equal(view, expected)
        mask = torch.ones_like(base, dtype=torch.bool)
        mask[1:7, ::2] = False
        assert torch.equal(base[mask], before[mask]), "elements outside the view changed"
    out["non_contiguous_view_of_bigger_tensor"] = non_contiguous_view_of_bigger_tensor

    def different_sizes_across_ranks_raises(fn, r, n):
        check_against_torch(fn, make_input(r, (5,), torch.float32))  # must work on good input first
        try:
            fn(torch.ones(4 + r))
        except ValueError as e:
            assert "differ" in str(e), str(e)
        else:
            raise AssertionError("no ValueError for tensors of different sizes on different ranks")
    out["different_sizes_across_ranks_raises"] = different_sizes_across_ranks_raises

    def device_the_backend_cannot_use_raises(fn, r, n):
        check_against_torch(fn, make_input(r, (5,), torch.float32))
        try:
            fn(torch.ones(4, device="meta") if r == n - 1 else torch.ones(4))
        except ValueError as e:
            assert "device" in str(e), str(e)
        else:
            raise AssertionError("no ValueError for a tensor on a device gloo cannot use")
    out["device_the_backend_cannot_use_raises"] = device_the_backend_cannot_use_raises
    return out


def subgroup_cases(groups, fn_name="ring_allreduce"):
    """Cases on subgroups (world size 4): members sum among themselves, others are untouched.

    One case per group, so that a failure inside one group cannot leave the other
    group's members waiting for a rank that gave up.
    """
    def case(ranks, group):
        def body(fn, r, n):
            x = make_input(r, (11,), torch.int64, seed=len(ranks))
            if r in ranks:
                check_against_torch(fn, x, group=group)
            else:
                y = x.clone()
                assert fn(y, group=group) is y
                assert torch.equal(y, x), "a rank outside the group must not change its tensor"
        return body
    return {f"subgroup_{'_'.join(map(str, ranks))}": case(ranks, group) for ranks, group in groups}


def bitmask_cases(groups, fn_name):
    """The bitmask cases: the whole world, then each subgroup. They call no collective besides the
    function under test, so a wrong sum on some ranks cannot put the ranks out of step: they run
    in a launch of their own (`run_bitmask`), which a hang or desync in another case cannot spoil."""
    ring = "ring" in fn_name
    out = {"bitmask": lambda fn, r, n: check_bitmask(fn, r, n, ring, fn_name=fn_name)}
    for ranks, group in groups:
        out[f"bitmask_subgroup_{'_'.join(map(str, ranks))}"] = functools.partial(
            lambda fn, r, n, ranks, group: check_bitmask(fn, r, n, ring, ranks, group, fn_name),
            ranks=ranks, group=group)
    return out


def _run(rank, world_size, bitmask):
    module = impl("allreduce")
    groups = []
    if world_size == 4:  # new_group is collective: every rank creates every group
        groups = [(ranks, dist.new_group(list(ranks))) for ranks in [(1, 3), (0, 2, 3)]]
    todo = {}
    for fn_name in FUNCTIONS:
        fn = getattr(module, fn_name)
        if fn_name == "pipelined_ring_allreduce":
            fn = functools.partial(fn, segment_bytes=SMALL_SEGMENTS)
        chosen = bitmask_cases(groups, fn_name) if bitmask else {**cases(world_size, fn_name),
                                                                  **subgroup_cases(groups, fn_name)}
        for case, body in chosen.items():
            todo[fn_name, case] = functools.partial(body, fn, rank, world_size)
    return run_cases(todo)


def run_all(rank, world_size):
    return _run(rank, world_size, bitmask=False)


def run_bitmask(rank, world_size):
    return _run(rank, world_size, bitmask=True)


def expect_ok(fn_name, case, world_size):
    runner = run_bitmask if case.startswith("bitmask") else run_all
    expect_case(launch_cases(runner, world_size), (fn_name, case),
                f"{fn_name} on {world_size} ranks, case {case}")


def each_function(test):
    """Parametrize a test over every function, each marked with its exercise name."""
    return pytest.mark.parametrize("fn_name", [
        pytest.param(name, marks=pytest.mark.exercise(name), id=name) for name in FUNCTIONS])(test)


@each_function
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_matches_torch(fn_name, dtype, world_size):
    expect_ok(fn_name, f"matches_torch_{dtype}", world_size)


@each_function
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_bitmask_names_first_wrong_chunk_and_missing_ranks(fn_name, world_size):
    expect_ok(fn_name, "bitmask", world_size)


@each_function
@pytest.mark.parametrize("ranks", ["1_3", "0_2_3"])
def test_allreduce_bitmask_subgroup_of_4_ranks_sums_members_only(fn_name, ranks):
    expect_ok(fn_name, f"bitmask_subgroup_{ranks}", 4)


@each_function
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_allreduce_world_size_1(fn_name, dtype):
    expect_ok(fn_name, f"matches_torch_{dtype}", 1)


@each_function
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_numel_not_divisible_by_world_size(fn_name, world_size):
    expect_ok(fn_name, "numel_not_divisible_by_world_size", world_size)


@each_function
@pytest.mark.parametrize("world_size", [3, 4])
def test_allreduce_numel_smaller_than_world_size(fn_name, world_size):
    expect_ok(fn_name, "numel_smaller_than_world_size", world_size)


@each_function
@pytest.mark.parametrize("world_size", [1, 3])
def test_allreduce_empty_tensor(fn_name, world_size):
    expect_ok(fn_name, "empty_tensor", world_size)


@each_function
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allreduce_several_megabytes(fn_name, world_size):
    expect_ok(fn_name, "several_megabytes", world_size)


@each_function
@pytest.mark.parametrize("world_size", [1, 3])
def test_allreduce_non_contiguous(fn_name, world_size):
    expect_ok(fn_name, "non_contiguous", world_size)


@each_function
@pytest.mark.parametrize("world_size", [2, 4])
def test_allreduce_non_contiguous_view_of_bigger_tensor(fn_name, world_size):
    expect_ok(fn_name, "non_contiguous_view_of_bigger_tensor", world_size)


@each_function
@pytest.mark.parametrize("ranks", ["1_3", "0_2_3"])
def test_allreduce_subgroup_of_4_ranks(fn_name, ranks):
    expect_ok(fn_name, f"subgroup_{ranks}", 4)


@each_function
@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_different_sizes_across_ranks_raises(fn_name, world_size):
    expect_ok(fn_name, "different_sizes_across_ranks_raises", world_size)


@each_function
def test_allreduce_device_the_backend_cannot_use_raises(fn_name):
    expect_ok(fn_name, "device_the_backend_cannot_use_raises", 3)
