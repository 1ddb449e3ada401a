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

Every rank writes what it starts and finishes to a log file; the test process reads those logs,
so outcomes survive a rank that died or hung.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import tempfile
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

CASE_TIMEOUT = 10.0  # seconds one case may take on an idle machine: the lab's cases take milliseconds to a second
AGREE_TIMEOUT = 60.0  # seconds a rank waits for the others' verdict on a case (peers' watchdogs fire first)
OK, NOT_IMPLEMENTED, FAILED = "ok", "not implemented", "failed"


class CaseTimeout(AssertionError):
    """A grading case hung (or was not run because an earlier case of its exercise hung)."""


@dataclass
class _Plan:  # set by launch_cases in the test process, inherited by the forked ranks
    log_dir: str
    skip: set = field(default_factory=set)  # repr(key) of cases already settled
    case_timeout: float = CASE_TIMEOUT


_plan: _Plan | None = None


# --------------------------------------------------------------------------- in the ranks

def run_cases(cases: dict) -> dict:
    """In a rank: run every ``key -> body()`` in order; return {key: (status, detail)}.

    status is "ok", "not implemented" or "failed" (detail: the traceback). Under
    `launch_cases` the ranks also log, agree after each case, and stop together when they
    might be out of step (see the module docstring).
    """
    import torch.distributed as dist

    plan = _plan
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    store = dist.distributed_c10d._get_default_store() if plan and dist.is_initialized() else None
    log = open(os.path.join(plan.log_dir, f"rank{rank}.jsonl"), "a", buffering=1) if plan else None
    stack = open(os.path.join(plan.log_dir, f"stack{rank}.txt"), "w") if plan else None
    if log:
        log.write(json.dumps({"plan": [repr(k) for k in cases]}) + "\n")
    results = {}
    for index, (key, body) in enumerate(cases.items()):
        if plan and repr(key) in plan.skip:
            continue
        if log:
            allowed = plan.case_timeout * busy_factor()
            log.write(json.dumps({"start": repr(key), "allowed": allowed}) + "\n")
            faulthandler.dump_traceback_later(allowed, exit=True, file=stack)
        try:
            body()
            results[key] = (OK, "")
        except NotImplementedError as error:
            results[key] = (NOT_IMPLEMENTED, str(error))
        except Exception:
            results[key] = (FAILED, traceback.format_exc())
        finally:
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
    """Every case's per-rank outcome, by repr(key); a hung case has a `CaseTimeout` instead."""
    world_size: int
    by_case: dict = field(default_factory=dict)  # repr(key) -> list of (status, detail) or CaseTimeout
    error: Exception | None = None  # a launch that failed before any case could say anything


@functools.lru_cache(maxsize=None)
def launch_cases(run_all, world_size: int, timeout: float = 120, case_timeout: float = CASE_TIMEOUT) -> Outcomes:
    """``launch(run_all, world_size)`` until every case has an outcome; cached per (function, world size)."""
    global _plan
    from labkit.launching.failures import LaunchError
    from labkit.launching.launcher import launch

    outcomes = Outcomes(world_size)
    plan_keys: list[str] = []
    for _attempt in range(200):  # each launch settles at least one case, or the loop ends
        with tempfile.TemporaryDirectory(prefix="labkit-cases-") as log_dir:
            _plan = _Plan(log_dir, set(outcomes.by_case), case_timeout)
            launch_error = None
            try:
                launch(run_all, world_size, timeout=timeout)
            except LaunchError as error:
                launch_error = error
            finally:
                _plan = None
            logs = [_read_log(log_dir, r) for r in range(world_size)]
            stacks = [_read_text(os.path.join(log_dir, f"stack{r}.txt")) for r in range(world_size)]
        plan_keys = plan_keys or next((log["plan"] for log in logs if log["plan"]), [])
        settled = _settle(outcomes, logs, stacks, world_size, case_timeout, launch_error)
        if not [k for k in plan_keys if k not in outcomes.by_case]:
            return outcomes
        if not settled:  # nothing new: a launch that fails before the first case, say
            outcomes.error = launch_error or RuntimeError("the ranks stopped without running any case")
            return outcomes
    return outcomes


def _settle(outcomes, logs, stacks, world_size, case_timeout, launch_error) -> bool:
    """Record the cases this launch finished on every rank, and the one that hung, if any."""
    settled = False
    done = [log["done"] for log in logs]
    started = [log["started"] for log in logs]
    for key in dict.fromkeys(k for rank_done in done for k in rank_done):
        if all(key in rank_done for rank_done in done):
            outcomes.by_case[key] = [rank_done[key] for rank_done in done]
            settled = True
    # A case started but not finished on some rank: it hung (its watchdog ended the rank) or crashed.
    unfinished = {started[r][-1] for r in range(world_size) if started[r] and started[r][-1] not in done[r]}
    for key in unfinished - set(outcomes.by_case):
        ranks = [r for r in range(world_size) if started[r] and started[r][-1] == key and key not in done[r]]
        where = "\n".join(f"=== rank {r}: waiting here ===\n{_trim(stacks[r])}" for r in ranks if stacks[r].strip())
        settled = True
        failed_first = [r for r in range(world_size) if done[r].get(key, (OK,))[0] != OK]
        if failed_first:  # some ranks failed, the others then waited for them: the failure is the news
            outcomes.by_case[key] = [done[r].get(key) or (FAILED, f"stuck in this case after rank(s) "
                                     f"{failed_first} failed; where it waited:\n{_trim(stacks[r])}")
                                     for r in range(world_size)]
            continue
        allowed = max((logs[r]["allowed"] or case_timeout) for r in ranks)
        cause = f"did not finish within {allowed:.0f} s" if where else "stopped"
        detail = (f"case {key} {cause} on rank(s) {', '.join(map(str, ranks))}.\n{where}\n"
                  "A rank that waits for a message nobody sends (a skipped collective, a send without a "
                  "matching recv, the wrong peer or group) blocks forever: compare the stacks above.")
        if launch_error is not None and not where:
            detail += f"\n\nThe launch said:\n{launch_error}"
        outcomes.by_case[key] = CaseTimeout(detail)
        exercise = _exercise_of(key)
        plan = next((log["plan"] for log in logs if log["plan"]), [])
        for later in plan:  # the rest of that exercise would only hang again
            if later not in outcomes.by_case and _exercise_of(later) == exercise:
                outcomes.by_case[later] = CaseTimeout(f"not run: an earlier case of {exercise} ({key}) hung")
    return settled


def _exercise_of(key_repr: str) -> str:
    try:
        import ast

        key = ast.literal_eval(key_repr)
    except (ValueError, SyntaxError):
        return key_repr
    return str(key[0]) if isinstance(key, tuple) and key else str(key)


def _read_log(log_dir: str, rank: int) -> dict:
    log = {"plan": [], "started": [], "done": {}, "allowed": None}
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
    return log


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _trim(stack: str) -> str:
    """The hung rank's frames from where it waits up to the case's body: the rest is the runner's."""
    lines = []
    for line in stack.splitlines():
        if "labkit/grading/cases.py" in line:
            break  # run_cases, then the frames the fork inherited from the test process
        if line.strip() and not line.startswith(("Timeout (", "Thread 0x")) and "c10d_logger.py" not in line:
            lines.append(line)
    return "\n".join(lines)


def expect_case(outcomes, key, label: str):
    """Pass, raise NotImplementedError (a stub), or fail with the failing ranks' traces or the hang's stacks."""
    import pytest

    if isinstance(outcomes, Exception):
        raise outcomes
    if isinstance(outcomes, Outcomes):
        outcome = outcomes.by_case.get(repr(key))
        if outcome is None:
            if outcomes.error is not None:
                raise outcomes.error
            pytest.fail(f"{label}: no such case was run", pytrace=False)
        if isinstance(outcome, CaseTimeout):
            raise CaseTimeout(f"{label}: {outcome}")
        per_rank = outcome
    else:  # a plain list of run_cases results, one dict per rank
        per_rank = [ranks_outcomes[key] for ranks_outcomes in outcomes]
    failed = []
    for rank, (status, detail) in enumerate(per_rank):
        if status == NOT_IMPLEMENTED:
            raise NotImplementedError(detail)
        if status != OK:
            failed.append(f"rank {rank}: {detail}")
    if failed:
        pytest.fail(f"{label}:\n" + "\n".join(failed), pytrace=False)
