"""Every notebook runs top to bottom in a new kernel, in its quick setting, on the reference
solutions and on the untouched stubs; no cell raises.

- On the solutions: every check in the notebook holds (a cell's `assert` is its test).
- On the untouched stubs: a learner who has written nothing yet sees one line per cell that needs an
  exercise, in the stub's own words ("is not implemented yet"), and no cell raises. Cells that fail on
  purpose (a timeout demo) catch their error and print it, so they pass too.

Both need pristine stubs and the solutions, so they run in the maintainers' mode (`--impl=solutions`,
as `make test` and CI do).

Each notebook runs in its own runner and kernel (tests/run_notebook.py), started by
tests/background.py as soon as collection ends: one at a time beside the other tests, two at a time
once these tests (ordered last) wait for them. A kernel keeps about one core busy (measured on the
stubs: 198 s of CPU in 208 s for six notebooks), and most other tests leave one of the two cores idle.
Only the notebooks selected run (`-k "stubs and 03_"`); the longest start first. The kernels are
forked from one process that imported torch, matplotlib and ipykernel once (tests/kernel_factory.py:
about 4.5 s of CPU saved per kernel; `LABKIT_FRESH_KERNELS=1` starts fresh ones instead).
"""
import json
import os
import sys
from pathlib import Path

import pytest

import background
import kernel_factory
from labkit.grading import REPO_ROOT, current_impl

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RUNNER = Path(__file__).resolve().parent / "run_notebook.py"
IMPLS = {"test_notebook_runs_to_the_end_on_the_solutions": "solutions",
         "test_notebook_runs_to_the_end_on_untouched_stubs": "exercises"}
TIMEOUT = 900  # seconds for one whole notebook, sharing the cores with another (a backstop: the
# runner's per-cell timeout, 600 s, reports a stuck cell first, with the kernel shut down)
ALL_TIMEOUT = 2400  # seconds a test waits for its notebook, queued behind the others (all of them take
# about 11 minutes idle, two at a time, both settings)

pytestmark = [
    pytest.mark.skipif(current_impl() != "solutions", reason="needs the solutions and pristine stubs: maintainers' "
                       "mode only (pytest --impl=solutions)"),
    pytest.mark.timeout(ALL_TIMEOUT + 300),  # the first test waits for every selected notebook
]


def background_jobs(items) -> list:
    """One job per notebook and setting that pytest selected (tests/background.py runs them beside the
    other tests); the longest notebooks first."""
    jobs = []
    if current_impl() != "solutions" or not any(IMPLS.get(item.originalname) for item in items):
        return jobs  # skipped: maintainers' mode only
    # the kernels are forked from one process that imported torch once (tests/kernel_factory.py)
    factory = kernel_factory.start()
    if factory is not None:
        background.current().add_helper(factory)
    for item in items:
        impl = IMPLS.get(item.originalname)
        if impl:
            path = item.callspec.params["path"]
            env = dict(os.environ, LABKIT_IMPL=impl, LABKIT_QUICK="1", **background.ONE_THREAD)  # the kernel inherits them
            env = factory.environment(env) if factory is not None else env
            jobs.append(((impl, path), [sys.executable, str(RUNNER), str(path)], env, TIMEOUT, path.stat().st_size))
    return jobs


def _result(impl: str, path: Path) -> dict:
    done = background.current().result((impl, path), ALL_TIMEOUT)
    if done.returncode is None:  # the runner was killed; its kernel sees its parent gone and exits
        return {"error": f"did not finish in {TIMEOUT} s ({done.stderr[-500:]})"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"the runner exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"}
    return json.loads(lines[-1])


def _failed(path: Path, result: dict, on: str):
    if result.get("error"):
        pytest.fail(f"{path.name} stops {on}:\n{result['error'][-3000:]}", pytrace=False)


@pytest.mark.reads_background
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_on_the_solutions(path: Path):
    _failed(path, _result("solutions", path), "on the solutions")


@pytest.mark.reads_background
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_on_untouched_stubs(path: Path):
    result = _result("exercises", path)
    _failed(path, result, "on the untouched stubs")
    if result["uses_impl"]:
        # it really ran on the stubs, and said so in the stub's own words
        assert result["met_a_stub"], f"{path.name} never met a stub: did it run on exercises/?"
