"""A session of persistent ranks (`labkit.session`, ``%ranks start N``), in a real kernel driven by nbclient.

One kernel runs the whole story (engines cost seconds to start on 2 cores): variables kept across
cells, grouped output, an edit seen in the engines, an exception named at its rank and line, a hang
reported with the waiting line, a killed engine reported and a restart, a second start refused; then
the kernel shuts down and no engine or controller is left. About a minute on 2 busy cores.
"""
import os
import time

import psutil
import pytest

from labkit.grading import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

CELLS = [
    "import labkit, os, time, signal\nimport labkit.session.session as sess\nfrom labkit.grading import impl\n%load_ext labkit",
    "%ranks start 2 --backend gloo",
    "%%ranks\nt = torch.ones(2) * (rank + 1)\nsq = rank ** 2\nprint('hello from the session')",
    "%%ranks\ndist.all_reduce(t)\nprint(sq, t.tolist())\nsq + 100",
    "%%ranks\nfrom labkit.grading import impl\nm = impl('{probe}', 'exercises')\nm.value() + rank",
    "open({path!r}, 'w').write('def value():\\n    return 5\\n')",
    "%%ranks\nm.value() + rank",
    "%%ranks\nx = 1\ny = x / (rank - 1)",
    "%%ranks --targets 1\nsq",
    "%%ranks\nif rank == 0:\n    dist.all_reduce(t)",
    "%ranks restart",
    "%%ranks\nprint('fresh', 'sq' in dir())",
    "os.kill(sess.current.pids[1], signal.SIGKILL)\ntime.sleep(1.0)",
    "%%ranks\nprint('never')",
    "%ranks restart",
    "%%ranks\nprint('back', rank)",
    "%ranks start 2",
    "import threading\nthreading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # the stop button",
    "%%ranks\nimport time\nkept = rank\ntime.sleep(120)",
    "%%ranks\nprint('still up', kept)",
    "s = sess.current\nprint('PIDS', *s.pids.values(), s.engines.cluster.controller.pid)",
]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    import nbformat
    from nbclient import NotebookClient

    probe = f"_session_probe_{os.getpid()}"
    path = REPO_ROOT / "exercises" / f"{probe}.py"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.replace("{probe}", probe).replace("{path!r}", repr(str(path))))
                for c in CELLS]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO_ROOT)  # the kernel and its engines import this checkout's labkit
    try:
        path.write_text("def value():\n    return 1\n")
        client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}})
        client.execute()  # shuts the kernel down at the end
    finally:
        path.unlink(missing_ok=True)
        os.environ.pop("PYTHONPATH") if old is None else os.environ.__setitem__("PYTHONPATH", old)
    texts = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
    errors = [next((o for o in cell.outputs if o.output_type == "error"), None) for cell in nb.cells]
    return nb, texts, errors


def _seconds(cell) -> float:
    from datetime import datetime

    timing = cell.metadata["execution"]
    start, end = (datetime.fromisoformat(timing[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "shell.execute_reply"))
    return (end - start).total_seconds()


def test_each_rank_keeps_its_variables_and_output_is_grouped_by_rank(story):
    _, texts, errors = story
    assert errors[:4] == [None] * 4, [e and e.traceback for e in errors[:4]]
    assert texts[1].startswith("session up of 2 rank(s), backend gloo, local launcher")
    assert texts[2] == "[ranks 0-1] hello from the session\n"
    assert texts[3] == "[rank 0] 0 [3.0, 3.0]\n[rank 1] 1 [3.0, 3.0]\nOut[rank 0]: 100\nOut[rank 1]: 101\n"
    assert texts[8] == "Out[rank 1]: 1\n"  # --targets; the variables outlived the failed cell before it


def test_an_edited_exercise_file_is_seen_inside_the_engines(story):
    _, texts, errors = story
    assert texts[4] == "Out[rank 0]: 1\nOut[rank 1]: 2\n"
    assert errors[6] is None and texts[6].endswith("Out[rank 0]: 5\nOut[rank 1]: 6\n"), texts[6]
    assert "reloaded exercises/_session_probe_" in texts[6]


def test_an_exception_names_the_rank_and_the_learners_line(story):
    _, _, errors = story
    error = errors[7]
    assert error.ename == "SessionError"
    report = "\n".join(error.traceback)
    assert "the cell failed on rank(s) 1 of 2: ZeroDivisionError: division by zero" in report
    assert "rank 1 raised at your cell, line 2: y = x / (rank - 1)" in report


def test_a_hang_is_reported_within_seconds_with_the_waiting_line_and_restart_works(story):
    nb, texts, errors = story
    error = errors[9]
    report = "\n".join(error.traceback)
    assert error.ename == "SessionBroken", report
    assert "hung: rank(s) 0 of 2" in report and "rank 0 waits at your cell, line 2: dist.all_reduce(t)" in report
    assert _seconds(nb.cells[9]) < 15, _seconds(nb.cells[9])
    assert errors[10] is None and texts[11] == "[ranks 0-1] fresh False\n"


def test_a_killed_engine_is_reported_and_the_session_restarts(story):
    _, texts, errors = story
    report = "\n".join(errors[13].traceback)
    assert errors[13].ename == "SessionBroken" and "the engine of rank(s) 1" in report and "%ranks restart" in report
    assert errors[14] is None and texts[15] == "[rank 0] back 0\n[rank 1] back 1\n"


def test_a_second_start_is_refused(story):
    _, _, errors = story
    assert errors[16].ename == "SessionError"
    assert "a session is already up (a session of 2 rank(s)" in errors[16].traceback[0]


def test_the_stop_button_interrupts_the_ranks_and_the_session_stays_up(story):
    nb, texts, errors = story
    report = "\n".join(errors[18].traceback)
    assert errors[18].ename == "SessionInterrupted", report
    assert "rank 0 was at your cell, line 3: time.sleep(120)" in report and "still up" in report
    assert _seconds(nb.cells[18]) < 15
    assert errors[19] is None and texts[19] == "[rank 0] still up 0\n[rank 1] still up 1\n"


def test_kernel_shutdown_leaves_no_engine_and_no_controller(story):
    _, texts, _ = story
    pids = [int(p) for p in texts[20].split()[1:]]
    assert len(pids) == 3
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        time.sleep(0.2)
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []



# --------------------------------------------------------------------------- bad input, each a clear error

def _session_processes():
    return [p for p in psutil.Process().children(recursive=True) if "ipyparallel" in " ".join(p.cmdline())]


def test_a_cell_with_no_session_and_no_number_says_what_to_do():
    from labkit.session.session import SessionError, run_on_session

    with pytest.raises(SessionError, match=r"none is up: `%ranks start 4` first, or `%%ranks 4` for one cell"):
        run_on_session("", "print(rank)")


def test_nccl_with_more_ranks_than_gpus_is_refused_before_any_engine_starts():
    from labkit.launching.failures import LaunchError
    from labkit.session.session import ranks_line

    with pytest.raises(LaunchError, match=r"backend='nccl' needs one GPU per rank: \d+ ranks on this node, \d+ GPU"):
        ranks_line("start 64 --backend nccl")  # more than any node has GPUs
    assert _session_processes() == []


def test_engines_that_do_not_come_up_in_time_name_the_launcher_and_leave_nothing():
    from labkit.session.engines import EnginesDidNotStart
    from labkit.session.session import Session

    with pytest.raises(EnginesDidNotStart, match=r"the local launcher started \d of 2 engine\(s\) in 0.5 s") as info:
        Session(2, "gloo", start_timeout=0.5).start()
    assert "What the launcher printed:" in str(info.value) and "--start-timeout" in str(info.value)
    deadline = time.monotonic() + 10
    while _session_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes() == []
