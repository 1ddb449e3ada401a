"""Grading tests for notebook 02_collectives: broadcast, reduce, all_gather, scatter,
reduce_scatter written with point-to-point messages.

Run: pytest tests/grading/test_collectives.py   (add --impl=solutions for the reference)

Every case runs torch.distributed's own collective on the same inputs and compares:
copies (broadcast, all_gather, scatter) and int64 sums exactly, float sums with
assert_close. Every root is tried (non-zero roots included), on 2, 3 and 4 ranks,
and on subgroups of 4 ranks where src/dst are GLOBAL ranks. ONE launch per world
size runs every case of every function; each test reads its case's outcome.
About 10 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl

FUNCTIONS = ("broadcast", "reduce", "all_gather", "scatter", "reduce_scatter")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
SHAPES = [(5,), (3, 4), (), (0,)]
SUBGROUPS = [(1, 3), (0, 2, 3)]  # on 4 ranks


def make_input(rank, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def same(got, expected, summed=False):
    if summed and got.dtype.is_floating_point:
        torch.testing.assert_close(got, expected)
    else:
        assert got.dtype == expected.dtype and torch.equal(got, expected), f"{got} != {expected}"


# One check per function: run ours and torch's on copies of the same inputs, on this rank.
def check_broadcast(fn, r, members, shape, dtype, root, group=None, seed=0):
    x = make_input(r, shape, dtype, seed)
    expected, got = x.clone(), x.clone()
    dist.broadcast(expected, src=root, group=group)
    assert fn(got, root, group=group) is None
    same(got, expected)


def check_reduce(fn, r, members, shape, dtype, root, group=None, seed=0):
    x = make_input(r, shape, dtype, seed)
    expected, got = x.clone(), x.clone()
    dist.reduce(expected, dst=root, group=group)
    fn(got, root, group=group)
    if r == root:  # torch leaves the other ranks' tensors unspecified
        same(got, expected, summed=True)


def check_all_gather(fn, r, members, shape, dtype, root=None, group=None, seed=0):
    x = make_input(r, shape, dtype, seed)
    expected = [torch.full(shape, -1, dtype=dtype) for _ in members]
    got = [torch.full(shape, -1, dtype=dtype) for _ in members]
    dist.all_gather(expected, x, group=group)
    fn(got, x, group=group)
    for a, b in zip(got, expected):
        same(a, b)


def check_scatter(fn, r, members, shape, dtype, root, group=None, seed=0):
    pieces = [make_input(100 + i, shape, dtype, seed) for i in range(len(members))] if r == root else None
    expected, got = torch.full(shape, -1, dtype=dtype), torch.full(shape, -1, dtype=dtype)
    dist.scatter(expected, [p.clone() for p in pieces] if pieces else None, src=root, group=group)
    fn(got, pieces, root, group=group)
    same(got, expected)


def check_reduce_scatter(fn, r, members, shape, dtype, root=None, group=None, seed=0):
    pieces = [make_input(10 * r + i, shape, dtype, seed) for i in range(len(members))]
    expected, got = torch.full(shape, -1, dtype=dtype), torch.full(shape, -1, dtype=dtype)
    dist.reduce_scatter(expected, [p.clone() for p in pieces], group=group)
    fn(got, pieces, group=group)
    same(got, expected, summed=True)


CHECKS = {"broadcast": check_broadcast, "reduce": check_reduce, "all_gather": check_all_gather,
          "scatter": check_scatter, "reduce_scatter": check_reduce_scatter}
ROOTED = ("broadcast", "reduce", "scatter")


def cases(fn_name, n, groups):
    """{case name: body(fn, rank)} for one function on world size n."""
    check = CHECKS[fn_name]
    roots = range(n) if fn_name in ROOTED else [None]
    everyone = list(range(n))
    out = {}
    for name, dtype in DTYPES.items():
        out[f"matches_torch_{name}"] = lambda fn, r, dtype=dtype: [
            check(fn, r, everyone, shape, dtype, root, seed=i)
            for root in roots for i, shape in enumerate(SHAPES)]
    if fn_name in ROOTED and n > 1:
        out["last_rank_as_root"] = lambda fn, r: check(fn, r, everyone, (7,), torch.int64, n - 1)
    for ranks, group in groups:
        root = ranks[-1] if fn_name in ROOTED else None  # a GLOBAL rank, never 0
        def body(fn, r, ranks=ranks, group=group, root=root):
            if r in ranks:
                check(fn, r, ranks, (6,), torch.float64, root, group=group)
            else:  # not a member: returns at once, touches nothing
                x = make_input(r, (6,), torch.float64)
                args = {"broadcast": (x, root), "reduce": (x, root), "scatter": (x, None, root),
                        "all_gather": ([x.clone()], x), "reduce_scatter": (x, [x.clone()])}[fn_name]
                before = x.clone()
                fn(*args, group=group)
                same(x, before)
        out[f"subgroup_{'_'.join(map(str, ranks))}"] = body

    def different_sizes_across_ranks_raises(fn, r):
        check(fn, r, everyone, (4,), torch.float32, 0 if fn_name in ROOTED else None)  # good input first
        x = torch.zeros(3 + r)
        args = {"broadcast": (x, 0), "reduce": (x, 0), "scatter": (x, [torch.zeros(3)] * n if r == 0 else None, 0),
                "all_gather": ([x.clone() for _ in range(n)], x),
                "reduce_scatter": (x, [x.clone() for _ in range(n)])}[fn_name]
        try:
            fn(*args)
        except ValueError as e:
            assert "differ" in str(e) or "elements" in str(e), str(e)
        else:
            raise AssertionError("no ValueError for tensors of different sizes on different ranks")
    out["different_sizes_across_ranks_raises"] = different_sizes_across_ranks_raises

    if fn_name in ("all_gather", "scatter", "reduce_scatter"):
        def list_of_wrong_length_raises(fn, r):
            check(fn, r, everyone, (4,), torch.float32, 0 if fn_name in ROOTED else None)
            x = torch.zeros(4)
            short = [torch.zeros(4) for _ in range(n - 1)]
            args = {"scatter": (x, short if r == 0 else None, 0), "all_gather": (short, x),
                    "reduce_scatter": (x, short)}[fn_name]
            try:
                fn(*args)
            except ValueError as e:
                assert "one tensor per rank" in str(e) or "bad arguments" in str(e), str(e)
            else:
                raise AssertionError("no ValueError for a list that does not hold one tensor per rank")
        out["list_of_wrong_length_raises"] = list_of_wrong_length_raises
    return out


def run_all(rank, world_size):
    module = impl("collectives")
    groups = []
    if world_size == 4:  # new_group is collective: every rank creates every group
        groups = [(ranks, dist.new_group(list(ranks))) for ranks in SUBGROUPS]
    todo = {}
    for fn_name in FUNCTIONS:
        fn = getattr(module, fn_name)
        for case, body in cases(fn_name, world_size, groups).items():
            todo[fn_name, case] = functools.partial(body, fn, rank)
    return run_cases(todo)


def expect_ok(fn_name, case, world_size):
    expect_case(launch_cases(run_all, world_size), (fn_name, case),
                f"{fn_name} on {world_size} ranks, case {case}")


def each_function(names=FUNCTIONS):
    """Parametrize a test over the functions, each marked with its exercise name."""
    return pytest.mark.parametrize("fn_name", [
        pytest.param(name, marks=pytest.mark.exercise(name), id=name) for name in names])


@each_function()
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collective_matches_torch_every_root_and_shape(fn_name, dtype, world_size):
    expect_ok(fn_name, f"matches_torch_{dtype}", world_size)


@each_function(ROOTED)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collective_non_zero_root_last_rank(fn_name, world_size):
    expect_ok(fn_name, "last_rank_as_root", world_size)


@each_function()
@pytest.mark.parametrize("ranks", ["_".join(map(str, g)) for g in SUBGROUPS])
def test_collective_subgroup_of_4_ranks_global_root(fn_name, ranks):
    expect_ok(fn_name, f"subgroup_{ranks}", 4)


@each_function()
@pytest.mark.parametrize("world_size", [2, 3])
def test_collective_different_sizes_across_ranks_raises(fn_name, world_size):
    expect_ok(fn_name, "different_sizes_across_ranks_raises", world_size)


@each_function(("all_gather", "scatter", "reduce_scatter"))
def test_collective_list_of_wrong_length_raises(fn_name):
    expect_ok(fn_name, "list_of_wrong_length_raises", 3)
