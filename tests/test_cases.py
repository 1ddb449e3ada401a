"""labkit.grading.cases: many grading cases in one launch, and one exercise's mistake costs only its own cases.

Each test builds a tiny grading module of two "exercises" with a deliberate mistake in one.
"""
import time

import pytest
import torch
import torch.distributed as dist

from labkit.grading.cases import CaseTimeout, Outcomes, launch_cases, run_cases

CASE_TIMEOUT = 3  # the cases below take milliseconds when they do not hang


def _good(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


def _run_with_a_hang(rank, world_size):
    def hang_on_odd_ranks():
        if rank % 2:
            dist.recv(torch.zeros(1), src=rank - 1)  # nobody sends: a skipped send

    return run_cases({
        ("good", "before"): lambda: _good(rank, world_size),
        ("bad", "hangs"): hang_on_odd_ranks,
        ("bad", "after_the_hang"): lambda: _good(rank, world_size),
        ("good", "after"): lambda: _good(rank, world_size),
    })


def _run_with_a_wrong_result_on_one_rank(rank, world_size):
    def wrong_on_rank_0():
        _good(rank, world_size)
        assert rank != 0, "rank 0 holds the wrong value"

    return run_cases({
        ("bad", "wrong_on_rank_0"): wrong_on_rank_0,
        ("good", "after"): lambda: _good(rank, world_size),
        ("bad", "fine_later"): lambda: _good(rank, world_size),
    })


def _run_stubs(rank, world_size):
    def stub():
        raise NotImplementedError("exercise bad is not implemented yet")

    return run_cases({(name, i): stub for name in ("a", "b") for i in range(20)})


def test_a_hang_is_named_with_its_stack_within_the_case_timeout_and_costs_only_its_exercise():
    start = time.monotonic()
    outcomes = launch_cases(_run_with_a_hang, 2, case_timeout=CASE_TIMEOUT)
    assert time.monotonic() - start < 60
    assert isinstance(outcomes, Outcomes)
    hung = outcomes.by_case[repr(("bad", "hangs"))]
    assert isinstance(hung, CaseTimeout)
    assert "did not finish within" in str(hung) and "s on rank(s) 1" in str(hung)
    assert "hang_on_odd_ranks" in str(hung) and " in recv" in str(hung)  # where rank 1 waits
    later = outcomes.by_case[repr(("bad", "after_the_hang"))]
    assert isinstance(later, CaseTimeout) and "not run: an earlier case of bad" in str(later)
    for key in (("good", "before"), ("good", "after")):  # the other exercise ran, before and after
        assert outcomes.by_case[repr(key)] == [("ok", ""), ("ok", "")]


def test_a_wrong_result_on_some_ranks_fails_only_its_case_and_the_rest_run_again():
    outcomes = launch_cases(_run_with_a_wrong_result_on_one_rank, 3, case_timeout=CASE_TIMEOUT)
    wrong = outcomes.by_case[repr(("bad", "wrong_on_rank_0"))]
    assert wrong[0][0] == "failed" and "rank 0 holds the wrong value" in wrong[0][1]
    assert [status for status, _ in wrong[1:]] == ["ok", "ok"]
    assert outcomes.by_case[repr(("good", "after"))] == [("ok", "")] * 3
    assert outcomes.by_case[repr(("bad", "fine_later"))] == [("ok", "")] * 3


def test_untouched_stubs_stay_in_one_launch(monkeypatch):
    import sys

    launch_module = sys.modules["labkit.launching.launcher"]
    calls = []
    real = launch_module.launch
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    outcomes = launch_cases(_run_stubs, 2, case_timeout=CASE_TIMEOUT)
    assert len(calls) == 1  # every rank raised NotImplementedError: in step, no relaunch
    assert len(outcomes.by_case) == 40
    assert all(o[0][0] == "not implemented" for o in outcomes.by_case.values())


def test_run_cases_without_the_runner_is_a_plain_loop():
    results = run_cases({"ok": lambda: None, "bad": lambda: 1 / 0,
                         "stub": lambda: (_ for _ in ()).throw(NotImplementedError("x"))})
    assert results["ok"] == ("ok", "")
    assert results["bad"][0] == "failed" and "ZeroDivisionError" in results["bad"][1]
    assert results["stub"] == ("not implemented", "x")


@pytest.fixture(autouse=True)
def _fresh_cache():
    launch_cases.cache_clear()
    yield
    launch_cases.cache_clear()
