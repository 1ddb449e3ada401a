"""pytest plugin (loaded from pyproject.toml): the implementation switch and the grade table.

    pytest --impl=solutions            # test the reference code (what CI does)
    pytest tests/grading --grade       # your code, with a table per exercise at the end

Options:
  --impl exercises|solutions   sets LABKIT_IMPL for the run: tests, launched ranks and
                               notebooks executed by tests/test_notebooks.py all use the same
                               implementation (there, the stubs' runs use exercises/).
  --grade                      print the table: exercise, notebook, status.
  --grade-json PATH            write every grading test's outcome as JSON (used by the
                               test that proves every grading test fails on the stubs).

Grading tests (``tests/grading``) carry ``@pytest.mark.exercise("name", ..., needs=("other",))``:
the exercises the test grades, and those whose code it only uses. Each gets a per-test timeout
(GRADING_TIMEOUT seconds) as a backstop, and its launches report a hang as soon as every rank
sleeps without CPU (``LABKIT_IDLE_TIMEOUT``, see `labkit.launch`).

The grade table blames only the wrong exercise: a failed test whose `needs`, or one of its
several graded exercises, also fails a test of its own is "blocked by" that exercise for the
others, not counted against them (`_rows`). A rank that died is "crashed", not "timed out".
"""
from __future__ import annotations

import json
import os

import pytest

GRADING_TIMEOUT = 90  # seconds per grading test on an idle machine: a backstop; launches report hangs first

NOT_IMPLEMENTED, FAILED, PASSED, TIMED_OUT = "not implemented yet", "failed", "passed", "timed out"
CRASHED, BLOCKED = "crashed", "blocked by"
IDLE_HANG = 3.0  # seconds all ranks of a grading launch may sleep without CPU: then it is a hang


def pytest_addoption(parser):
    group = parser.getgroup("labkit")
    group.addoption("--impl", choices=("exercises", "solutions"), default=None,
                    help="which implementation the grading tests and notebooks use (default: "
                         "$LABKIT_IMPL or 'exercises', your code)")
    group.addoption("--grade", action="store_true", help="print a table of exercises and their status")
    group.addoption("--grade-json", default=None, help="write grading outcomes as JSON to this path")


def pytest_configure(config):
    chosen = config.getoption("--impl")
    if chosen:
        os.environ["LABKIT_IMPL"] = chosen
    os.environ.setdefault("LABKIT_IMPL", "exercises")
    config._labkit_outcomes = {}


def pytest_collection_modifyitems(config, items):
    from labkit.grading.cases import busy_factor

    backstop = GRADING_TIMEOUT * busy_factor()  # slow shared cores get more time, never a false "hang"
    for item in items:
        if item.get_closest_marker("exercise") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(backstop))


def _status(report, excinfo=None) -> str:
    """passed / not implemented / timed out / failed, decided by the exception's TYPE, never its text.

    Only a `NotImplementedError` (an unwritten stub; `StubNotImplemented` is one) means "not
    implemented": a traceback that merely mentions the word (every `LaunchError` shows
    labkit's source) is a failure of written code. A hang is a `LaunchError` whose failures
    are all timeouts, or pytest-timeout's own failure.
    """
    if report.passed:
        return PASSED
    if excinfo is not None:
        error = excinfo.value
        if isinstance(error, NotImplementedError):
            return NOT_IMPLEMENTED
        if type(error).__name__ == "CaseCrashed":
            return CRASHED
        failures = getattr(error, "failures", None)
        if failures and any(getattr(f, "kind", None) == "crash" and "signal" in f.summary for f in failures) \
                and not any(getattr(f, "kind", None) == "timeout" for f in failures):
            return CRASHED
        if failures and all(getattr(f, "kind", None) == "timeout" for f in failures):
            return TIMED_OUT
        if "Timeout" in excinfo.typename or "from pytest-timeout" in str(error)[:200]:
            return TIMED_OUT
    if "Timeout (>" in str(report.longrepr)[-3000:] and excinfo is None:  # pytest-timeout's own report
        return TIMED_OUT
    return FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("exercise")
    if marker is None or (report.when != "call" and not report.failed):
        return
    status = _status(report, call.excinfo)
    if status == TIMED_OUT:
        hint = (f"{item.nodeid} did not finish in time: your implementation may loop forever, or its "
                "ranks wait for each other (a skipped collective, a recv without a matching send).")
        report.longrepr = f"{hint}\n\n{report.longreprtext}"
    outcomes = item.config._labkit_outcomes
    previous = outcomes.get(item.nodeid)
    if previous is None or previous["status"] == PASSED:  # a setup/teardown failure wins
        outcomes[item.nodeid] = {"exercises": list(marker.args), "status": status,
                                 "needs": list(marker.kwargs.get("needs", ()))}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Grading launches: a hang is reported once every rank sleeps without CPU for a few seconds."""
    if item.get_closest_marker("exercise") is None or "LABKIT_IDLE_TIMEOUT" in os.environ:
        yield
        return
    from labkit.grading.cases import busy_factor

    os.environ["LABKIT_IDLE_TIMEOUT"] = str(IDLE_HANG * min(busy_factor(), 2.0))
    try:
        yield
    finally:
        os.environ.pop("LABKIT_IDLE_TIMEOUT", None)


def _blame(outcomes) -> dict:
    """exercise -> the statuses it is charged with; a dependent's failure becomes "blocked by X".

    An exercise "fails on its own" when a test grading it alone (it is the only name in the
    marker) does not pass. A failed test is charged only to those of its graded exercises
    that fail on their own, when any of them, or of its `needs`, does; the others get
    "blocked by ..." for it. When none does, every graded exercise is charged (no way to tell).
    """
    own_failures = {o["exercises"][0] for o in outcomes.values()
                    if len(o["exercises"]) == 1 and not o.get("needs") and o["status"] != PASSED}
    charged: dict[str, list[str]] = {}
    for outcome in outcomes.values():
        graded, status = outcome["exercises"], outcome["status"]
        culprits = [x for x in dict.fromkeys(graded + outcome.get("needs", [])) if x in own_failures]
        for name in graded:
            if status in (PASSED, NOT_IMPLEMENTED) or not culprits or name in culprits:  # a stub names itself
                charged.setdefault(name, []).append(status)
            else:
                charged.setdefault(name, []).append(f"{BLOCKED} {', '.join(c for c in culprits if c != name)}")
    return charged


def _rows(outcomes):
    from labkit.grading.registry import exercises

    known = {e.key: e for e in exercises()}
    by_exercise = _blame(outcomes)
    rows = []
    for name in list(known) + sorted(set(by_exercise) - set(known)):
        statuses = by_exercise.get(name, [])
        notebook = known[name].notebook if name in known else "?"
        blocked = sorted({s[len(BLOCKED) + 1:] for s in statuses if s.startswith(BLOCKED)})
        mine = [s for s in statuses if not s.startswith(BLOCKED)]
        if not statuses:
            status = "no test run"
        elif NOT_IMPLEMENTED in mine:
            status = NOT_IMPLEMENTED
        elif any(s in (TIMED_OUT, CRASHED, FAILED) for s in mine):
            worst = next(s for s in (CRASHED, TIMED_OUT, FAILED) if s in mine)
            status = f"{worst} ({sum(s != PASSED for s in mine)} of {len(statuses)} tests)"
        elif blocked:
            status = f"{BLOCKED} {', '.join(blocked)} ({len(statuses) - len(mine)} of {len(statuses)} tests)"
        else:
            status = f"{PASSED} ({len(statuses)} tests)"
        rows.append((name, notebook, status))
    return rows


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    outcomes = config._labkit_outcomes
    path = config.getoption("--grade-json")
    if path:
        with open(path, "w") as f:
            json.dump(outcomes, f, indent=1)
    if not config.getoption("--grade") or not outcomes:
        return
    rows = [row for row in _rows(outcomes) if row[2] != "no test run"]
    widths = [max(len(r[i]) for r in rows + [("exercise", "notebook", "status")]) for i in range(3)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    write = terminalreporter.write_line
    terminalreporter.section(f"grade ({os.environ.get('LABKIT_IMPL')})")
    write(line(("exercise", "notebook", "status")))
    write(line(tuple("-" * w for w in widths)))
    for row in rows:
        write(line(row))
    done = sum(r[2].startswith(PASSED) for r in rows)
    write(f"\n{done} of {len(rows)} exercises pass. Work on one: edit exercises/<topic>.py, then "
          "`pytest tests/grading/test_<topic>.py`.")
