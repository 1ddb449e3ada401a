"""Every notebook runs top to bottom in a fresh kernel, in its quick setting, on the reference
solutions and on the untouched stubs; no cell raises.

- On the solutions: every check in the notebook holds (a cell's `assert` is its test).
- On the untouched stubs: a learner who has written nothing yet sees one line per cell that needs an
  exercise, in the stub's own words ("is not implemented yet"), and no cell raises. Cells that fail on
  purpose (a timeout demo) catch their error and print it, so they pass too.

Both need pristine stubs and the solutions, so they run in the maintainers' mode (`--impl=solutions`,
as `make test` and CI do).

The notebooks run two at a time, each in its own interpreter and kernel (tests/run_notebook.py): a
kernel keeps about one core busy (measured on the stubs: 198 s of CPU in 208 s for six notebooks), so
two share a 2-core machine in well under the time of one after the other. Only the notebooks selected
run (`-k "stubs and 03_"`); the longest start first, so that the last two end together.
"""
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from labkit.grading import REPO_ROOT, current_impl

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RUNNER = Path(__file__).resolve().parent / "run_notebook.py"
AT_ONCE = 2
TIMEOUT = 900  # seconds for one whole notebook, sharing the cores with another (a backstop: the
# runner's per-cell timeout, 600 s, reports a stuck cell first, with the kernel shut down)
ALL_TIMEOUT = 2400  # seconds for every notebook of the module (about 8 minutes idle, both settings)

pytestmark = [
    pytest.mark.skipif(current_impl() != "solutions", reason="needs the solutions and pristine stubs: maintainers' "
                       "mode only (pytest --impl=solutions)"),
    pytest.mark.timeout(ALL_TIMEOUT + 300),  # the first test waits for every selected notebook
]


def _run(job: tuple[str, Path], deadline: float) -> dict:
    impl, path = job
    left = min(TIMEOUT, deadline - time.monotonic())
    if left < 1:
        return {"error": f"not run: the notebooks of this module took more than {ALL_TIMEOUT} s in all"}
    env = dict(os.environ, LABKIT_IMPL=impl, LABKIT_QUICK="1")  # the kernel inherits them
    try:
        out = subprocess.run([sys.executable, str(RUNNER), str(path)], capture_output=True, text=True,
                             timeout=left, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:  # the runner is killed; its kernel sees its parent gone and exits
        return {"error": f"did not finish in {left:.0f} s"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return {"error": f"the runner exited with {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"}
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def runs(request):
    """(impl, path) -> the runner's JSON, for every test of this module that pytest selected."""
    impls = {"test_notebook_runs_to_the_end_on_the_solutions": "solutions",
             "test_notebook_runs_to_the_end_on_untouched_stubs": "exercises"}
    jobs = [(impls[item.originalname], item.callspec.params["path"]) for item in request.session.items
            if item.module is request.module and item.originalname in impls]
    jobs.sort(key=lambda job: -job[1].stat().st_size)
    deadline = time.monotonic() + ALL_TIMEOUT
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(zip(jobs, pool.map(_run, jobs, [deadline] * len(jobs))))


def _failed(path: Path, result: dict, on: str):
    if result.get("error"):
        pytest.fail(f"{path.name} stops {on}:\n{result['error'][-3000:]}", pytrace=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_on_the_solutions(path: Path, runs):
    _failed(path, runs["solutions", path], "on the solutions")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_on_untouched_stubs(path: Path, runs):
    result = runs["exercises", path]
    _failed(path, result, "on the untouched stubs")
    if result["uses_impl"]:
        # it really ran on the stubs, and said so in the stub's own words
        assert result["met_a_stub"], f"{path.name} never met a stub: did it run on exercises/?"
