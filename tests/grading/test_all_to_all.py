"""Grading tests for notebook 12_experts: all_to_all_single from point-to-point messages.

Run: pytest tests/grading/test_all_to_all.py   (add --impl=solutions for the reference)

Every case runs torch's own `dist.all_to_all_single` (gloo) on the same input and sizes
and compares exactly (an all-to-all only copies). World sizes 1 to 4, equal and uneven
splits, chunks of length zero, rows of several dimensions, a non-contiguous input, and
subgroups of 4 ranks. Sizes that do not add up, or that disagree between peers, must
raise ValueError on EVERY rank instead of hanging. ONE launch per world size runs every
case; each test reads its case's outcome. About 10 s on 2 cores.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from labkit.grading.cases import expect_case, launch_cases, run_cases
from labkit.grading import impl

SUBGROUPS = [(1, 3), (0, 2, 3)]  # on 4 ranks


def split_matrix(n, seed, zeros=False):
    """S[i][j]: rows group rank i sends to group rank j (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 5, (n, n), generator=g)
    if zeros:  # a whole row and a whole column of zeros, plus scattered zeros
        s[0, :] = 0
        s[:, n - 1] = 0
        s[torch.rand(n, n, generator=g) < 0.3] = 0
    return s.tolist()


def make_rows(rank, rows, tail=(3,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn((rows, *tail), generator=g, dtype=dtype)
    return torch.randint(-1000, 1000, (rows, *tail), generator=g, dtype=dtype)


def check(fn, x, out_rows, out_splits, in_splits, group=None):
    expected = x.new_full((out_rows, *x.shape[1:]), 7)
    dist.all_to_all_single(expected, x.contiguous(), out_splits, in_splits, group=group)
    got = x.new_full((out_rows, *x.shape[1:]), -7)
    assert fn(got, x, out_splits, in_splits, group=group) is None, "all_to_all_single returns None (in place)"
    assert torch.equal(got, expected), f"output differs from dist.all_to_all_single:\n{got}\n{expected}"


def uneven(fn, r, n, seed, zeros=False, tail=(3,), dtype=torch.float32):
    s = split_matrix(n, seed, zeros)
    ins, outs = s[r], [s[i][r] for i in range(n)]
    check(fn, make_rows(r, sum(ins), tail, dtype, seed), sum(outs), outs, ins)


def expect_value_error_everywhere(fn, r, n, call, words):
    uneven(fn, r, n, seed=1)  # must work on good input first
    try:
        call()
    except ValueError as e:
        assert any(w in str(e) for w in words), f"the error should say what is wrong: {e}"
    else:
        raise AssertionError("no ValueError on this rank: every rank must raise, not only the one with bad sizes")


def cases(n):
    out = {}
    out["equal_splits_none"] = lambda fn, r, n: check(fn, make_rows(r, 2 * n), 2 * n, None, None)
    out["uneven_splits"] = lambda fn, r, n: [uneven(fn, r, n, seed) for seed in range(3)]
    out["zero_length_splits"] = lambda fn, r, n: [uneven(fn, r, n, seed, zeros=True) for seed in range(3)]
    out["all_splits_zero"] = lambda fn, r, n: check(fn, make_rows(r, 0), 0, [0] * n, [0] * n)
    out["rows_of_several_dimensions_int64"] = lambda fn, r, n: uneven(fn, r, n, 5, tail=(2, 3), dtype=torch.int64)
    out["one_dimensional_float64"] = lambda fn, r, n: uneven(fn, r, n, 6, tail=(), dtype=torch.float64)

    def non_contiguous_input(fn, r, n):
        s = split_matrix(n, 7)
        ins, outs = s[r], [s[i][r] for i in range(n)]
        x = make_rows(r, 4 * sum(ins), (2,))[::4]  # every 4th row: not contiguous
        assert not x.is_contiguous() or x.shape[0] <= 1
        check(fn, x, sum(outs), outs, ins)
    out["non_contiguous_input"] = non_contiguous_input

    def splits_not_adding_up_raise(fn, r, n):
        ins = [1] * n
        x = make_rows(r, n + (1 if r == n - 1 else 0))  # the last rank has one row too many
        expect_value_error_everywhere(fn, r, n, lambda: fn(make_rows(r, n), x, [1] * n, ins), ("add", "rank"))
    out["splits_not_adding_up_raise_on_every_rank"] = splits_not_adding_up_raise

    def splits_disagreeing_with_peer_raise(fn, r, n):
        outs = [1] * n
        outs[0] += 1 if r == n - 1 else 0  # the last rank expects 2 rows from rank 0, which sends 1
        expect_value_error_everywhere(fn, r, n, lambda: fn(make_rows(r, sum(outs)), make_rows(r, n), outs, [1] * n),
                                      ("expects", "rank"))
    if n > 1:
        out["splits_disagreeing_with_peer_raise_on_every_rank"] = splits_disagreeing_with_peer_raise

    def wrong_number_of_splits_raise(fn, r, n):
        ins = [1] * (n + 1) if r == 0 else [1] * n
        expect_value_error_everywhere(fn, r, n, lambda: fn(make_rows(r, n), make_rows(r, len(ins)), [1] * n, ins),
                                      ("size", "rank"))
    out["wrong_number_of_splits_raise_on_every_rank"] = wrong_number_of_splits_raise
    return out


def subgroup_cases(groups):
    """One case per subgroup of 4 ranks: members exchange among themselves, others are untouched."""
    def case(ranks, group):
        def body(fn, r, n):
            m = len(ranks)
            s = split_matrix(m, 11 + m, zeros=True)
            if r in ranks:
                i = ranks.index(r)
                ins, outs = s[i], [s[j][i] for j in range(m)]
                check(fn, make_rows(r, sum(ins)), sum(outs), outs, ins, group=group)
            else:
                out = torch.full((3, 3), 5.0)
                assert fn(out, make_rows(r, 3), None, None, group=group) is None
                assert torch.equal(out, torch.full((3, 3), 5.0)), "a rank outside the group must not change its output"
        return body
    return {f"subgroup_{'_'.join(map(str, ranks))}": case(ranks, group) for ranks, group in groups}


def run_all(rank, world_size):
    fn = impl("all_to_all").all_to_all_single
    groups = []
    if world_size == 4:  # new_group is collective: every rank creates every group
        groups = [(ranks, dist.new_group(list(ranks))) for ranks in SUBGROUPS]
    todo = {name: functools.partial(body, fn, rank, world_size)
            for name, body in {**cases(world_size), **subgroup_cases(groups)}.items()}
    return run_cases(todo)


def expect_ok(case, world_size):
    expect_case(launch_cases(run_all, world_size), case, f"all_to_all_single on {world_size} ranks, case {case}")


ALL_WORLDS = ["equal_splits_none", "uneven_splits", "zero_length_splits", "all_splits_zero",
              "rows_of_several_dimensions_int64", "one_dimensional_float64", "non_contiguous_input",
              "splits_not_adding_up_raise_on_every_rank", "wrong_number_of_splits_raise_on_every_rank"]


@pytest.mark.exercise("all_to_all_single")
@pytest.mark.parametrize("case", ALL_WORLDS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_to_all_single_matches_torch(case, world_size):
    expect_ok(case, world_size)


@pytest.mark.exercise("all_to_all_single")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_single_splits_disagreeing_with_peer_raise_on_every_rank(world_size):
    expect_ok("splits_disagreeing_with_peer_raise_on_every_rank", world_size)


@pytest.mark.exercise("all_to_all_single")
@pytest.mark.parametrize("ranks", ["_".join(map(str, g)) for g in SUBGROUPS])
def test_all_to_all_single_subgroup_of_4_ranks(ranks):
    expect_ok(f"subgroup_{ranks}", 4)
