"""labkit.grading.cases: many grading cases in one launch, and one exercise's mistake costs only its own cases.

Each test builds a tiny grading module of two "exercises" with a deliberate mistake in one.
"""
import re
import time

import pytest
import torch
import torch.distributed as dist

from labkit.grading.cases import CaseCrashed, CaseTimeout, Outcomes, expect_case, launch_cases, run_cases

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
    outcomes = launch_cases(_run_with_a_hang, 2, case_timeout=CASE_TIMEOUT).settle()
    assert time.monotonic() - start < 60
    assert isinstance(outcomes, Outcomes)
    hung = outcomes.by_case[repr(("bad", "hangs"))]
    assert isinstance(hung, CaseTimeout)
    # the launcher saw every rank asleep (or, on a busy machine, the case's watchdog fired first)
    assert re.search(r"(hung: every rank waited without using the CPU|did not finish within \d+ s) "
                     r"on rank\(s\) 1\.", str(hung)), str(hung)
    assert "rank 1 waits at tests/test_cases.py line 26 in hang_on_odd_ranks: dist.recv(" in str(hung)
    assert " in recv" in str(hung) and "hint: rank 1 in recv: a recv whose send is missing" in str(hung)
    later = outcomes.by_case[repr(("bad", "after_the_hang"))]
    assert isinstance(later, CaseTimeout) and "not run: an earlier case of bad" in str(later)
    for key in (("good", "before"), ("good", "after")):  # the other exercise ran, before and after
        assert outcomes.by_case[repr(key)] == [("ok", ""), ("ok", "")]


def test_a_wrong_result_on_some_ranks_fails_only_its_case_and_the_rest_run_again():
    outcomes = launch_cases(_run_with_a_wrong_result_on_one_rank, 3, case_timeout=CASE_TIMEOUT).settle()
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
    outcomes = launch_cases(_run_stubs, 2, case_timeout=CASE_TIMEOUT).settle()
    assert len(calls) == 1  # every rank raised NotImplementedError: in step, no relaunch
    assert len(outcomes.by_case) == 40
    assert all(o[0][0] == "not implemented" for o in outcomes.by_case.values())


def test_run_cases_without_the_runner_is_a_plain_loop():
    results = run_cases({"ok": lambda: None, "bad": lambda: 1 / 0,
                         "stub": lambda: (_ for _ in ()).throw(NotImplementedError("x"))})
    assert results["ok"] == ("ok", "")
    assert results["bad"][0] == "failed" and "ZeroDivisionError" in results["bad"][1]
    assert results["stub"] == ("not implemented", "x")


def _run_fail_then_wait(rank, world_size):
    def wrong_then_collective():
        t = torch.ones(2)
        assert rank != 1, "rank 1 holds the wrong value"
        dist.all_reduce(t)  # rank 0 waits here for rank 1, which has left the case

    def crash_on_rank_1():
        if rank == 1:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGSEGV)
        dist.all_reduce(torch.ones(1))

    return run_cases({
        ("bad", "wrong_then_wait"): wrong_then_collective,
        ("good", "fine"): lambda: _good(rank, world_size),
        ("crash", "segfault"): crash_on_rank_1,
        ("later", "hangs"): lambda: dist.recv(torch.zeros(1), src=1 - rank),  # both receive first
    })


def test_a_rank_waiting_for_a_failed_peer_stops_at_once_and_the_failure_leads_the_report():
    """The peer watch stops rank 0 about a second after rank 1 failed (not after its watchdog); the
    report is rank 1's assertion first, rank 0 in one line, a hint; the case asked for runs first."""
    outcomes = launch_cases(_run_fail_then_wait, 2, case_timeout=60)  # only the peer watch can be quick
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        expect_case(outcomes, ("bad", "wrong_then_wait"), "the case")
    assert time.monotonic() - start < 40  # a fork and a second, even on a busy machine (the watchdog: 60 s+)
    report = str(failure.value)
    assert report.startswith("the case: failed on rank(s) 1\nrank 1: Traceback"), report
    assert "rank 1 holds the wrong value" in report and "labkit/grading/cases.py" not in report
    assert "rank 0: stopped: it waited for rank(s) 1, which had failed, at tests/test_cases.py" in report
    assert "hint: the ranks that stopped waited only because a peer had failed" in report
    assert "a received tensor used before its wait()?" in report
    assert len(report.splitlines()) < 40


def test_a_dead_rank_is_crashed_with_its_signal_never_timed_out_and_a_later_case_runs_first():
    outcomes = launch_cases(_run_fail_then_wait, 2, case_timeout=60)
    with pytest.raises(CaseCrashed, match=r"crashed: rank\(s\) 1 died.\nrank 1: exited with signal SIGSEGV"):
        expect_case(outcomes, ("crash", "segfault"), "segfault")
    assert repr(("bad", "wrong_then_wait")) not in outcomes.by_case  # asked for first, run first: not waited for
    start = time.monotonic()
    with pytest.raises(CaseTimeout, match=r"hung: every rank waited without using the CPU") as hang:
        expect_case(outcomes, ("later", "hangs"), "both receive")
    assert time.monotonic() - start < 40  # the idle watch (3 s x load), not the 60 s watchdog
    assert "hint: ranks 0, 1 in recv: a recv whose send is missing" in str(hang.value)


def _run_irecv_cases(rank, world_size):
    def recv(wait):
        buf = torch.zeros(2)
        if rank == 0:
            dist.isend(torch.ones(2), 1).wait()
        else:
            request = dist.irecv(buf, 0)
            if wait:
                request.wait()
            raise AssertionError("this case fails on rank 1 whatever the buffer holds")

    return run_cases({("recv", "waited"): lambda: recv(True), ("recv", "not_waited"): lambda: recv(False)})


def test_a_received_tensor_used_before_its_wait_is_named_in_the_failure():
    outcomes = launch_cases(_run_irecv_cases, 2, case_timeout=60)
    not_waited = outcomes.outcome(repr(("recv", "not_waited")))[1][1]
    assert "hint: 1 of the 1 irecv requests of this rank were never waited for: a received tensor used " \
           "before its wait()?" in not_waited
    assert "never waited" not in outcomes.outcome(repr(("recv", "waited")))[1][1]


@pytest.fixture(autouse=True)
def _fresh_cache():
    launch_cases.cache_clear()
    yield
    launch_cases.cache_clear()


def test_a_failed_case_gets_the_launchers_hint_for_a_known_error():
    def peer_not_in_group():  # gloo's words when a global rank is passed as group_dst= (planted: no process needed)
        raise RuntimeError("[enforce fail at pair.cc:801] state_ >= CONNECTED. 1 vs 4. Pair is not connected")

    (status, detail), = run_cases({("broadcast", "subgroup"): peer_not_in_group}).values()
    assert status == "failed" and "Pair is not connected" in detail, detail
    assert "hint: a send or receive named a peer that is not in its group" in detail, detail
