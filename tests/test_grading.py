"""The grading harness: stub generation, the implementation switch, and proof that the tests can fail.

`test_every_grading_test_fails_on_the_untouched_stubs` runs the whole grading suite on
`exercises/` in a subprocess: every grading test must fail, and fail as "not implemented",
so that no grading test passes without the learner's code. It needs pristine stubs, so it
runs only in the maintainers' mode (`--impl=solutions`, as `make test` and CI do).
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import background

from labkit.grading import stubgen
from labkit.grading import REPO_ROOT, current_impl, impl
from labkit.grading.registry import exercise_blocks, exercises

SOLUTION = textwrap.dedent('''\
    """A topic."""
    NOTEBOOK = "99_topic"

    def helper(x):
        return x + 1

    def square(x):
        """Return x squared."""
        ### BEGIN SOLUTION
        return x * x
        ### END SOLUTION

    class Counter:
        def __init__(self):
            ### BEGIN SOLUTION
            self.n = 0
            ### END SOLUTION

        def bump(self):
            ### BEGIN SOLUTION
            self.n += 1
            ### END SOLUTION
''')

maintainers_only = pytest.mark.skipif(
    os.environ.get("LABKIT_IMPL") != "solutions",
    reason="maintainers' check (needs untouched exercises/): run with --impl=solutions")


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "solutions" / "topic.py").write_text(SOLUTION)
    return tmp_path


def test_blocks_belong_to_their_top_level_def_or_class():
    assert [name for name, _, _ in exercise_blocks(SOLUTION)] == ["square", "Counter", "Counter"]


@pytest.mark.parametrize("broken", [
    "def f():\n    ### BEGIN SOLUTION\n    pass\n",
    "def f():\n    pass\n    ### END SOLUTION\n",
    "### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n",
], ids=["unclosed_block", "end_without_begin", "block_outside_any_def"])
def test_malformed_markers_are_refused(broken):
    with pytest.raises(ValueError):
        exercise_blocks(broken)


def test_stub_keeps_signatures_and_docstrings_and_raises_with_a_hint(tree):
    stubgen.sync(tree)
    text = (tree / "exercises" / "topic.py").read_text()
    assert 'def square(x):\n    """Return x squared."""\n    raise NotImplementedError(' in text
    assert "return x * x" not in text and "### BEGIN" not in text
    assert "def helper(x):\n    return x + 1" in text
    namespace = {}
    exec(compile(text, "topic.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"exercise square is not implemented yet: edit "
                                                  r"exercises/topic.py, see notebooks/99_topic.ipynb"):
        namespace["square"](3)
    with pytest.raises(NotImplementedError, match="exercise Counter"):
        namespace["Counter"]()


def test_regenerating_never_loses_learner_work(tree):
    stubgen.sync(tree)
    target = tree / "exercises" / "topic.py"
    edited = target.read_text().replace(
        'raise NotImplementedError("exercise square is not implemented yet: edit exercises/topic.py, '
        'see notebooks/99_topic.ipynb")', "return x * x  # mine")
    target.write_text(edited)
    (tree / "solutions" / "topic.py").write_text(SOLUTION.replace("Return x squared.", "Square it."))

    stale, kept, written = stubgen.sync(tree)  # an edited file is kept as it is
    assert kept == [target] and written == [] and target.read_text() == edited

    stale, kept, written = stubgen.sync(tree, force=True)  # --force: backup first
    backups = list((tree / "exercises").glob("topic.py.bak-*"))
    assert written == [target] and len(backups) == 1 and backups[0].read_text() == edited
    assert "Square it." in target.read_text()


def test_untouched_stubs_are_regenerated_without_backup(tree):
    stubgen.sync(tree)
    (tree / "solutions" / "topic.py").write_text(SOLUTION.replace("Return x squared.", "Square it."))
    stale, kept, written = stubgen.sync(tree)
    assert written == [tree / "exercises" / "topic.py"] and kept == []
    assert not list((tree / "exercises").glob("*.bak-*"))


def test_check_mode_reports_without_writing(tree):
    assert stubgen.main(["--check", "--root", str(tree)]) == 1
    assert not (tree / "exercises" / "topic.py").exists()


def test_switch_selects_the_module(monkeypatch):
    monkeypatch.setenv("LABKIT_IMPL", "solutions")
    assert current_impl() == "solutions"
    monkeypatch.setenv("LABKIT_IMPL", "answers")
    with pytest.raises(ValueError, match="LABKIT_IMPL='answers'"):
        current_impl()
    with pytest.raises(ValueError, match="no exercise module"):
        impl("no_such_topic", "solutions")


@maintainers_only
def test_exercises_are_in_sync_with_solutions():
    """If this fails: maintainers run `python -m labkit.grading.stubgen` and commit exercises/."""
    stale, _, _ = stubgen.sync(REPO_ROOT, check=True)
    assert not stale, f"out of date: {[p.name for p in stale]}: run `python -m labkit.grading.stubgen`"


STUB_RUN_TESTS = ("test_every_grading_test_fails_on_the_untouched_stubs",
                  "test_every_exercise_has_grading_tests_and_appears_in_the_table")
STUB_RUN_TIMEOUT = 900


def background_jobs(items) -> list:
    """The grading suite on the untouched stubs, in a pytest of its own, run beside the other tests
    (tests/background.py) when a test that reads it was selected."""
    if os.environ.get("LABKIT_IMPL") != "solutions" or not any(i.originalname in STUB_RUN_TESTS for i in items):
        return []
    report = Path(tempfile.mkdtemp(prefix="labkit-stub-run-")) / "grade.json"
    atexit.register(shutil.rmtree, report.parent, True)
    # --tb=no: the verdicts come from each exception's type (the grade JSON), and formatting 623 tracebacks
    # cost pytest about 48 s of CPU, a third of this run
    argv = [sys.executable, "-m", "pytest", "tests/grading", "--impl=exercises", "--grade", "-q", "--tb=no",
            "-p", "no:cacheprovider", f"--grade-json={report}"]
    # weight: about 90 s of one core, as long as the longest notebook
    return [(("stub run", report), argv, dict(os.environ, LABKIT_IMPL="exercises", **background.ONE_THREAD), STUB_RUN_TIMEOUT, 10**9)]


@pytest.fixture(scope="module")
def stub_run():
    key = next(key for key in background.current().jobs if key[0] == "stub run")
    done = background.current().result(key, STUB_RUN_TIMEOUT + 600)
    report = key[1]
    if done.returncode is None or not report.exists():
        pytest.fail(f"the grading suite on the stubs gave no report (exit {done.returncode}):\n"
                    f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}", pytrace=False)
    return done, json.loads(report.read_text())


@maintainers_only
@pytest.mark.reads_background
@pytest.mark.timeout(STUB_RUN_TIMEOUT + 900)
def test_every_grading_test_fails_on_the_untouched_stubs(stub_run):
    out, outcomes = stub_run
    assert outcomes, f"no grading test ran:\n{out.stdout[-3000:]}"
    wrong = {test: o["status"] for test, o in outcomes.items() if o["status"] != "not implemented yet"}
    assert not wrong, f"grading tests that do not fail as 'not implemented' on the stubs: {wrong}"


@maintainers_only
@pytest.mark.reads_background
@pytest.mark.timeout(STUB_RUN_TIMEOUT + 900)
def test_every_exercise_has_grading_tests_and_appears_in_the_table(stub_run):
    out, outcomes = stub_run
    graded = {name for o in outcomes.values() for name in o["exercises"]}
    missing = [e.key for e in exercises() if e.key not in graded]
    assert not missing, f"exercises without a grading test: {missing}"
    for exercise in exercises():
        assert any(line.split()[:1] == [exercise.key] and "not implemented yet" in line
                   for line in out.stdout.splitlines()), f"{exercise.key} missing from the grade table"


@pytest.mark.parametrize("tb", ["long", "no"])
def test_grade_table_reports_passed_not_implemented_failed_and_timed_out(tmp_path, tb):
    """Every output mode (tracebacks or not, the JSON file) files each test by its exception's type:
    written-but-wrong code in launched ranks is "failed", whatever its traceback mentions; a dead
    rank is "crashed"; a test that fails while an exercise it needs (or grades too) fails its own
    tests is "blocked by" that one, not counted against its other exercises."""
    (tmp_path / "test_fake.py").write_text(textwrap.dedent('''
        import pytest
        import labkit
        import torch.distributed as dist

        def _wrong_in_ranks(rank, world_size):
            # mentions the word, as a learner's message or labkit's source may: still just wrong
            raise AssertionError("replicas differ (NotImplementedError is not the issue here)")

        def _stuck_in_ranks(rank, world_size):
            if rank == 1:
                dist.barrier()

        def _stub_in_ranks(rank, world_size):
            raise NotImplementedError("exercise ex_launch_stub is not implemented yet")

        @pytest.mark.exercise("ex_launch_wrong")
        def test_launch_wrong():
            labkit.launch(_wrong_in_ranks, 2, timeout=30)

        @pytest.mark.exercise("ex_launch_hang")
        def test_launch_hang():
            labkit.launch(_stuck_in_ranks, 2, timeout=2)

        @pytest.mark.exercise("ex_launch_stub")
        def test_launch_stub():
            labkit.launch(_stub_in_ranks, 2, timeout=30)

        @pytest.mark.exercise("ex_pass")
        def test_ok():
            assert 1 + 1 == 2

        @pytest.mark.exercise("ex_stub")
        def test_stub():
            raise NotImplementedError("exercise ex_stub is not implemented yet")

        @pytest.mark.exercise("ex_wrong")
        def test_wrong():
            assert 1 + 1 == 3

        @pytest.mark.exercise("ex_hang")
        @pytest.mark.timeout(1)
        def test_hang():
            while True:
                pass

        def _segfault_in_ranks(rank, world_size):
            import os, signal
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSEGV)
            dist.barrier()

        @pytest.mark.exercise("ex_crash")
        def test_crash():
            labkit.launch(_segfault_in_ranks, 2, timeout=30)

        @pytest.mark.exercise("ex_base")
        def test_base():
            assert False, "the base exercise is wrong"

        @pytest.mark.exercise("ex_dep", needs=("ex_base",))
        def test_dep_fails_because_of_base():
            assert False, "wrong only because ex_base is"

        @pytest.mark.exercise("ex_dep", needs=("ex_base",))
        def test_dep_ok():
            pass

        @pytest.mark.exercise("ex_multi", "ex_base")
        def test_two_graded_one_of_them_wrong_on_its_own():
            assert False
    '''))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "labkit.grading.plugin", "--grade", "-q",
                          f"--tb={tb}", "--grade-json", "grade.json", "-p", "no:cacheprovider", "test_fake.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180).stdout
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("ex_")}
    expected = {"ex_pass": "passed (1 tests)", "ex_stub": "not implemented yet",
                "ex_wrong": "failed (1 of 1 tests)", "ex_hang": "timed out (1 of 1 tests)",
                "ex_launch_wrong": "failed (1 of 1 tests)", "ex_launch_hang": "timed out (1 of 1 tests)",
                "ex_launch_stub": "not implemented yet", "ex_crash": "crashed (1 of 1 tests)",
                "ex_base": "failed (2 of 2 tests)", "ex_dep": "blocked by ex_base (1 of 2 tests)",
                "ex_multi": "blocked by ex_base (1 of 1 tests)"}
    for name, status in expected.items():
        assert status in rows[name], f"--tb={tb}: {rows[name]!r} should say {status!r}"
    outcomes = json.loads((tmp_path / "grade.json").read_text())
    by_name = {o["exercises"][0]: o["status"] for o in outcomes.values()}
    for name, status in expected.items():
        if name in ("ex_dep", "ex_multi"):  # the JSON keeps each test's own outcome, not the blame
            continue
        assert status.startswith(by_name[name]), f"--grade-json: {name} is {by_name[name]!r}, not {status!r}"
    if tb != "no":
        assert "did not finish in time: your implementation may loop forever" in out


def _probe_value(rank, world_size, module):
    return module.value()


def test_an_edited_exercise_is_picked_up_without_a_restart_in_the_kernel_and_in_launched_ranks():
    """impl() returns the file's current code; a launch reloads changed modules before it forks."""
    import labkit

    name = f"_reload_probe_{os.getpid()}"
    path = REPO_ROOT / "exercises" / f"{name}.py"
    try:
        path.write_text("def value():\n    return 1\n")
        module = impl(name, "exercises")
        assert module.value() == 1
        path.write_text("def value():\n    return 2\n")  # same length, same second: no stale .pyc
        assert impl(name, "exercises") is module and module.value() == 2  # reloaded in place
        path.write_text("def value():\n    return 3\n")  # edited again, impl() not called again
        assert labkit.launch(_probe_value, 2, module, timeout=60) == [3, 3]
        assert module.value() == 3  # the kernel's module object was refreshed too
    finally:
        path.unlink(missing_ok=True)
        sys.modules.pop(f"exercises.{name}", None)


def test_every_notebook_cell_runs_the_exercise_files_as_they_are_on_disk(tmp_path):
    """A real kernel. After an edit on disk, the next cell runs the new code through a module bound
    in an earlier cell (impl() or a plain import), a function imported by name, a lab module that
    imported a name from the edited one, and inside needs_exercise(), without impl() or launch."""
    import nbformat
    from run_notebook import NotebookClient  # nbclient's, polling its sockets every second

    tag = f"_cell_probe_{os.getpid()}"
    base, dep = REPO_ROOT / "exercises" / f"{tag}.py", REPO_ROOT / "exercises" / f"{tag}_dep.py"
    write = ("def edit(n):\n"
             f"    open({str(base)!r}, 'w').write(f'def value():\\n    return {{n}}\\n')\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        f"import labkit\nfrom labkit.grading import impl\n{write}"
        f"m = impl('{tag}', 'exercises')\nimport exercises.{tag}_dep as d\nfrom exercises.{tag} import value\n"
        "print('before', m.value(), value(), d.twice())\nedit(2)",
        "print('after', m.value(), value(), d.twice())\nedit(3)\n"
        "with labkit.needs_exercise():\n    print('inside', m.value())",
    )]
    try:
        base.write_text("def value():\n    return 1\n")
        dep.write_text(f"from .{tag} import value\n\ndef twice():\n    return 2 * value()\n")
        client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        for path in (base, dep):
            path.unlink(missing_ok=True)
    text = ["".join(o.get("text", "") + "".join(o.get("traceback", [])) for o in cell.outputs) for cell in nb.cells]
    assert "before 1 1 2" in text[0], text[0]
    assert "after 2 2 4" in text[1] and "reloaded exercises/" in text[1], text[1]
    assert "inside 3" in text[1], text[1]
