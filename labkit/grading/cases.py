"""Many grading cases in one launch, and one learner's mistake costs only its own cases.

Launching ranks costs far more than most checks, so a grading module runs all its cases in one
launch per world size:

    def run_all(rank, world_size):                      # in the ranks
        return run_cases({("ring_allreduce", "empty"): body, ...})
    outcomes = launch_cases(run_all, 4)                 # in the test process, cached
    expect_case(outcomes, ("ring_allreduce", "empty"), "ring_allreduce on 4 ranks, empty tensor")

A case's key is a tuple whose first item names the exercise it grades. What keeps a wrong
exercise from failing the others:

- After each case the ranks agree, through the rendezvous store (not a collective, which a
  learner's bug could complete or corrupt), on how it went. All "ok", or all "not
  implemented" (a stub raises before it communicates): the ranks are in step and go on.
  Anything else (a case that failed on some ranks, or raised mid-exchange) may have left
  messages in flight, so every rank stops, and `launch_cases` launches again for the cases
  not yet run.
- Each case runs under a watchdog (``case_timeout`` seconds, a few for the lab's small
  tensors): a case that hangs has its ranks' Python stacks written and the ranks ended, and is
  reported as hung, named, with the stacks, within seconds. The other cases of the same
  exercise are reported at once as "not run: an earlier case hung"; the rest run again.

- Each case has a peer watch too: when another rank reports the case failed while this rank
  is still in it (waiting for the failed rank, as a rule), this rank writes its stack and
  stops a second later, instead of waiting for its watchdog. And the launch reports a hang as
  soon as every rank has slept without using the CPU for ``IDLE_HANG`` seconds
  (`labkit.launching.progress`): a rank waiting for a message nobody sends does just that.
- Cases are settled lazily: `expect_case` launches until ITS case has an outcome, and puts
  that case first. A test never waits for other tests' hangs, and ``pytest -x`` stops at the
  first verdict.

Every rank writes what it starts and finishes to a log file; the test process reads those logs,
so outcomes survive a rank that died or hung. A rank that died (a signal, gloo's abort) makes
its case `CaseCrashed`, never a hang; the reports name the learner's own line
(`labkit.launching.stacks`).
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import io
import json
import os
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

CASE_TIMEOUT = 10.0  # seconds one case may take on an idle machine: the lab's cases take milliseconds to a second
IDLE_HANG = 3.0  # seconds every rank may sleep without CPU before a launch of cases is called hung
# (x busy_factor, at most 2: a rank starved of CPU is runnable, never asleep, so load matters little)
AGREE_TIMEOUT = 60.0  # seconds a rank waits for the others' verdict on a case (peers' watchdogs fire first)
OK, NOT_IMPLEMENTED, FAILED = "ok", "not implemented", "failed"


class CaseTimeout(AssertionError):
    """A grading case hung (or was not run because an earlier case of its exercise hung)."""


class CaseCrashed(AssertionError):
    """A rank died in a grading case (a signal such as SIGSEGV, gloo's SIGABRT, os._exit)."""


@dataclass
class _Plan:  # made by launch_cases in the test process, sent to the ranks with the launch (`_with_plan`)
    log_dir: str
    skip: set = field(default_factory=set)  # repr(key) of cases already settled
    case_timeout: float = CASE_TIMEOUT
    first: str | None = None  # repr(key) of the case a test waits for: it runs first


_plan: _Plan | None = None


def _with_plan(rank, world_size, run_all, plan):
    """In a rank: install the test process's plan, then run the cases (ranks share no memory with it)."""
    global _plan
    _plan = plan
    return run_all(rank, world_size)


# --------------------------------------------------------------------------- in the ranks

def run_cases(cases: dict, *, watch_recvs: bool = True) -> dict:
    """In a rank: run every ``key -> body()`` in order; return {key: (status, detail)}.

    watch_recvs: watch the cases' irecv requests (a failed case whose rank never waited for one gets
    the hint "a received tensor used before its wait()?"); False for the tests of the communication
    layer itself, which check that no interception is installed outside their own blocks.

    status is "ok", "not implemented" or "failed" (detail: the traceback). Under
    `launch_cases` the ranks also log, agree after each case, and stop together when they
    might be out of step (see the module docstring).
    """
    import torch.distributed as dist

    from labkit.comm.unwaited import WatchedRecvs, watch_irecv
    from labkit.launching.failures import explain
    from labkit.launching.peer_watch import PeerWatch

    plan = _plan
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    store = dist.distributed_c10d._get_default_store() if plan and dist.is_initialized() else None
    log = open(os.path.join(plan.log_dir, f"rank{rank}.jsonl"), "a", buffering=1) if plan else None
    stack = open(os.path.join(plan.log_dir, f"stack{rank}.txt"), "w") if plan else None
    if log:
        log.write(json.dumps({"plan": [repr(k) for k in cases]}) + "\n")
    results = {}
    order = list(cases.items())
    if plan and plan.first is not None:  # the case a test waits for runs first
        order.sort(key=lambda item: repr(item[0]) != plan.first)
    watch = PeerWatch(store, rank, world_size, log, stack) if store is not None else None
    for index, (key, body) in enumerate(order):
        if plan and repr(key) in plan.skip:
            continue
        if log:
            allowed = plan.case_timeout * busy_factor()
            log.write(json.dumps({"start": repr(key), "allowed": allowed}) + "\n")
            faulthandler.dump_traceback_later(allowed, exit=True, file=stack)
        if watch:
            watch.enter(index, key)
        try:
            with (watch_irecv() if watch_recvs else contextlib.nullcontext(WatchedRecvs())) as recvs:
                body()
            results[key] = (OK, "")
        except NotImplementedError as error:
            results[key] = (NOT_IMPLEMENTED, str(error))
        except Exception as error:  # the lab's advice for a known error (labkit.launching.failures.explain), as a launch adds it
            results[key] = (FAILED, "\n".join(filter(None, [traceback.format_exc(), explain(error), recvs.hint()])))
        finally:
            if watch:
                watch.leave()
            if log:
                faulthandler.cancel_dump_traceback_later()
        if log:
            log.write(json.dumps({"done": repr(key), "status": results[key]}) + "\n")
        if store is not None and not _in_step(store, f"labkit/cases/{index}", rank, world_size, results[key][0]):
            break  # every rank saw the same verdicts: they all stop here, together
    return results


def busy_factor() -> float:
    """How much slower than idle this machine runs now: the run queue per core, at least 1.

    A case's watchdog allows ``case_timeout x busy_factor()`` seconds, so that a machine whose
    cores are shared many times over (CI with other jobs, `make test-stress`) gets more time,
    while on an idle machine a hang is still named within ``case_timeout`` seconds.
    """
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


def launch_timeout(seconds: float = 20.0) -> float:
    """A grading launch's timeout: ``seconds`` on an idle machine, more on a busy one.

    Short enough that a learner's hang is reported by the launcher itself (which case, which
    ranks, their stacks) long before pytest's per-test backstop; scaled by `busy_factor` so
    that slow, shared cores never turn a correct run into a "hang".
    """
    return seconds * busy_factor()


def _in_step(store, prefix: str, rank: int, world_size: int, status: str) -> bool:
    store.set(f"{prefix}/{rank}", status)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys, timedelta(seconds=AGREE_TIMEOUT))
    statuses = {store.get(k).decode() for k in keys}
    return statuses in ({OK}, {NOT_IMPLEMENTED})


# --------------------------------------------------------------------------- in the test process

@dataclass
class Outcomes:
    """Every case's per-rank outcome, by repr(key), settled on demand (`outcome`).

    A settled case holds a list of (status, detail) per rank, or a `CaseTimeout` (it hung) or a
    `CaseCrashed` (a rank died) instead.
    """
    world_size: int
    by_case: dict = field(default_factory=dict)  # repr(key) -> list of (status, detail), CaseTimeout or CaseCrashed
    error: Exception | None = None  # a launch that failed before any case could say anything
    run_all: object = None
    timeout: float = 120
    case_timeout: float = CASE_TIMEOUT
    plan: list = field(default_factory=list)  # repr(key) of every case, in the ranks' order

    def outcome(self, key_repr: str):
        """The case's outcome, launching (that case first) until it has one; None if no such case."""
        while key_repr not in self.by_case and self.error is None:
            if self.plan and key_repr not in self.plan:
                return None
            if not self._launch(key_repr):
                break
        return self.by_case.get(key_repr)

    def settle(self) -> "Outcomes":
        """Settle every case (as the tests of one module would, in turn)."""
        while self.error is None and (not self.plan or [k for k in self.plan if k not in self.by_case]):
            if not self._launch(None):
                break
        return self

    def _launch(self, first) -> bool:
        from labkit.launching.failures import LaunchError
        from labkit.launching.launcher import launch

        with tempfile.TemporaryDirectory(prefix="labkit-cases-") as log_dir:
            plan = _Plan(log_dir, set(self.by_case), self.case_timeout, first)
            launch_error = None
            try:  # the ranks' output (a dying rank's whole stack, say) stays out of the report
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    launch(_with_plan, self.world_size, self.run_all, plan, timeout=self.timeout,
                           idle_timeout=IDLE_HANG * min(busy_factor(), 2.0))
            except LaunchError as error:
                launch_error = error
            logs = [_read_log(log_dir, r) for r in range(self.world_size)]
            stacks = [_read_text(os.path.join(log_dir, f"stack{r}.txt")) for r in range(self.world_size)]
        self.plan = self.plan or next((log["plan"] for log in logs if log["plan"]), [])
        if _settle(self, logs, stacks, launch_error):
            return True
        self.error = launch_error or RuntimeError("the ranks stopped without running any case")
        return False


@functools.lru_cache(maxsize=None)
def launch_cases(run_all, world_size: int, timeout: float = 120, case_timeout: float = CASE_TIMEOUT) -> Outcomes:
    """The cases of ``run_all`` on ``world_size`` ranks, cached per (function, world size).

    Nothing is launched yet: `expect_case` (or `Outcomes.outcome`) launches until the case it
    asks for has an outcome, so a test never waits for the cases of other tests.
    """
    return Outcomes(world_size, run_all=run_all, timeout=timeout, case_timeout=case_timeout)


def _rank_failures(launch_error) -> dict:
    return {f.rank: f for f in getattr(launch_error, "failures", None) or []}


def _settle(outcomes, logs, stacks, launch_error) -> bool:
    """Record the cases this launch finished on every rank, and the one that hung or crashed, if any."""
    from labkit.launching.stacks import consequence, crash_text, head, hint, stuck_after, trim, where_waiting

    world_size, settled = outcomes.world_size, False
    done = [log["done"] for log in logs]
    started = [log["started"] for log in logs]
    for key in dict.fromkeys(k for rank_done in done for k in rank_done):
        if all(key in rank_done for rank_done in done):
            outcomes.by_case[key] = [rank_done[key] for rank_done in done]
            settled = True
    died = _rank_failures(launch_error)
    for r in range(world_size):  # the launcher killed a hung launch (all asleep): its stacks are in the error
        if not stacks[r].strip() and r in died and died[r].kind == "timeout":
            stacks[r] = died[r].details
        stacks[r] = trim(stacks[r], 1000)  # the main thread's frames, down to the case's body
    # A case started but not finished on some rank: it hung, crashed, or waited for a failed peer.
    unfinished = {started[r][-1] for r in range(world_size) if started[r] and started[r][-1] not in done[r]}
    for key in unfinished - set(outcomes.by_case):
        ranks = [r for r in range(world_size) if started[r] and started[r][-1] == key and key not in done[r]]
        settled = True
        crashed = [r for r in ranks if r in died and died[r].kind == "crash" and not logs[r]["stopped"]
                   and not stacks[r].strip()]
        failed_first = [r for r in range(world_size) if done[r].get(key, (OK,))[0] != OK]
        if crashed and all(consequence(done[r][key][1]) for r in failed_first):
            outcomes.by_case[key] = CaseCrashed(crash_text(key, crashed, died, stacks))
            continue
        if failed_first:  # some ranks failed, the others then waited for them: the failure is the news
            stuck = {r: stacks[r] for r in range(world_size) if r not in failed_first}
            outcomes.by_case[key] = [done[r].get(key) or (FAILED, stuck_after(failed_first, stacks[r]))
                                     for r in range(world_size)]
            continue
        allowed = max((logs[r]["allowed"] or outcomes.case_timeout) for r in ranks)
        asleep = launch_error is not None and str(launch_error).startswith("hung:")
        cause = ("hung: every rank waited without using the CPU" if asleep else
                 f"did not finish within {allowed:.0f} s") if any(stacks[r].strip() for r in ranks) else "stopped"
        lines = [f"case {key} {cause} on rank(s) {', '.join(map(str, ranks))}."]
        for r in ranks:
            lines.append(f"rank {r} waits {where_waiting(stacks[r]) or '(no stack)'}")
        lines.append(hint({r: stacks[r] for r in ranks}))
        lines.append("\n".join(f"=== rank {r}: its stack ===\n{head(stacks[r], 12)}" for r in ranks if stacks[r].strip()))
        if launch_error is not None and not any(stacks[r].strip() for r in ranks):
            lines.append(f"The launch said:\n{head(str(launch_error), 15)}")
        outcomes.by_case[key] = CaseTimeout("\n".join(lines))
        exercise = _exercise_of(key)
        for later in outcomes.plan:  # the rest of that exercise would only hang again
            if later not in outcomes.by_case and _exercise_of(later) == exercise and isinstance(_key(later), tuple):
                outcomes.by_case[later] = CaseTimeout(f"not run: an earlier case of {exercise} ({key}) hung")
    return settled


def _key(key_repr: str):
    import ast

    try:
        return ast.literal_eval(key_repr)
    except (ValueError, SyntaxError):
        return key_repr


def _exercise_of(key_repr: str) -> str:
    key = _key(key_repr)
    return str(key[0]) if isinstance(key, tuple) and key else str(key)


def _read_log(log_dir: str, rank: int) -> dict:
    log = {"plan": [], "started": [], "done": {}, "allowed": None, "stopped": None}
    for line in _read_text(os.path.join(log_dir, f"rank{rank}.jsonl")).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a dying rank
        if "plan" in entry:
            log["plan"] = entry["plan"]
        elif "start" in entry:
            log["started"].append(entry["start"])
            log["allowed"] = entry.get("allowed", log.get("allowed"))
        elif "done" in entry:
            log["done"][entry["done"]] = tuple(entry["status"])
        elif "stopped" in entry:
            log["stopped"] = entry
    return log


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def expect_case(outcomes, key, label: str):
    """Pass, raise NotImplementedError (a stub), or fail with the failing ranks' traces or the hang's stacks."""
    import pytest

    if isinstance(outcomes, Exception):
        raise outcomes
    if isinstance(outcomes, Outcomes):
        outcome = outcomes.outcome(repr(key))
        if outcome is None:
            if outcomes.error is not None:
                raise outcomes.error
            pytest.fail(f"{label}: no such case was run", pytrace=False)
        if isinstance(outcome, (CaseTimeout, CaseCrashed)):
            raise type(outcome)(f"{label}: {outcome}")
        per_rank = outcome
    else:  # a plain list of run_cases results, one dict per rank
        per_rank = [ranks_outcomes[key] for ranks_outcomes in outcomes]
    for status, detail in per_rank:
        if status == NOT_IMPLEMENTED:
            raise NotImplementedError(detail)
    failed = [(rank, detail) for rank, (status, detail) in enumerate(per_rank) if status != OK]
    if failed:
        from labkit.launching.stacks import failure_text

        pytest.fail(failure_text(label, failed), pytrace=False)
