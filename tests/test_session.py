"""A session of persistent ranks (`labkit.session`, ``%ranks start N``), in a real kernel driven by nbclient.

One kernel runs the whole story (engines cost seconds to start on 2 cores): variables kept across
cells, grouped output, an edit seen in the engines, an exception named at its rank and line, a hang
reported with the waiting line, a killed engine reported and a restart, a second start refused, the
output as a tab per rank (`%%ranks --tabs`, text without ipywidgets), a KeyboardInterrupt raised inside a
rank, a timeline recorded on the ranks and drawn in the kernel (`%ranks timeline`); then the kernel shuts
down and no engine or controller is left. About a minute on 2 busy cores. Apart: a kernel killed by SIGKILL.
"""
import glob
import os
import time

import psutil
import pytest

import background
from checkout import labkit_path_env

from labkit.grading import REPO_ROOT
from labkit.launching.zygote_process import NAME as ENGINE_NAME

pytestmark = pytest.mark.timeout(300)

CELLS = [
    "import labkit, os, time, signal\nimport labkit.session.session as sess\nfrom labkit.grading import impl\n%load_ext labkit\n"
    "%matplotlib inline",
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
    # 20-23: the output as a tab per rank, and as text where ipywidgets cannot be imported
    "%%ranks --tabs\nprint('line of', rank)\nif rank == 1:\n    print('only one')\nrank * 10",
    "import sys\n_widgets = sys.modules.get('ipywidgets')\nsys.modules['ipywidgets'] = None",
    "%%ranks --tabs\nprint('text', rank)",
    "sys.modules['ipywidgets'] = _widgets",
    # 24-28: a KeyboardInterrupt raised inside a rank (not the stop button): alone, then with a peer waiting for it
    "%%ranks\nif rank == 1:\n    raise KeyboardInterrupt\nprint('after', rank)",
    "import psutil\nbefore = list(sess.current.pids.values())",
    "%%ranks\nt = torch.ones(1)\nif rank == 1:\n    raise KeyboardInterrupt('by the rank itself')\ndist.all_reduce(t)",
    "time.sleep(0.5)\nprint('LEFT', [p for p in before if psutil.pid_exists(p) and psutil.Process(p).status() != 'zombie'])",
    "%ranks restart",
    "s = sess.current\nprint('PIDS', *s.pids.values(), s.engines.cluster.controller.pid)\nprint('FOLDER', s.folder)",
    # 30-32: a timeline recorded on the session's ranks, gathered by the kernel and drawn by the launch's function
    "%%ranks\nfrom labkit.measure.timeline import Timeline\ntl = Timeline()\ntl.sync()\nfor i in range(rank + 2):\n"
    "    with tl.span('F', mb=i):\n        pass\nwith tl.span('allreduce'):\n    dist.all_reduce(torch.ones(1))",
    "import labkit.measure.viz as viz\ndrawn, _draw = [], viz.plot_timeline\n"
    "viz.plot_timeline = lambda spans, **kw: drawn.append(list(spans)) or _draw(spans, **kw)\ntry:\n"
    "    spans = %ranks timeline\nfinally:\n    viz.plot_timeline = _draw\n"
    "print('DRAWN', drawn == [spans], spans == sorted(spans, key=lambda s: (s.start, s.rank)))\n"
    "print('PER_RANK', {r: [(s.label, s.start, s.end) for s in spans if s.rank == r] for r in (0, 1)})",
    "%%ranks\nprint(repr([(s.label, s.start, s.end) for s in tl.spans]))",
]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    import nbformat
    from run_notebook import NotebookClient  # nbclient's, polling its sockets every second

    probe = f"_session_probe_{os.getpid()}"
    path = REPO_ROOT / "exercises" / f"{probe}.py"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c.replace("{probe}", probe).replace("{path!r}", repr(str(path))))
                for c in CELLS]
    old = os.environ.get("PYTHONPATH")
    os.environ.update(labkit_path_env())  # the kernel and its engines import this checkout's labkit
    try:
        path.write_text("def value():\n    return 1\n")
        client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}})
        client.execute()  # shuts the kernel down at the end
    finally:
        path.unlink(missing_ok=True)
        os.environ.pop("PYTHONPATH", None) if old is None else os.environ.__setitem__("PYTHONPATH", old)
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


def _widget_state(nb, cell):
    """{model_id: state} of the notebook's widgets, and the model id the cell displayed."""
    states = {k: v["state"] for k, v in nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"].items()}
    shown = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for o in cell.outputs
             if o.output_type == "display_data" and "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    return states, shown


def test_tabs_show_one_tab_per_rank_holding_its_lines_and_text_without_widgets(story):
    nb, texts, errors = story
    assert errors[20] is None, errors[20] and errors[20].traceback
    states, shown = _widget_state(nb, nb.cells[20])
    assert len(shown) == 1 and states[shown[0]]["_model_name"] == "TabModel"
    tab = states[shown[0]]
    assert tab["titles"] == ["rank 0", "rank 1"]
    panes = [states[child.removeprefix("IPY_MODEL_")] for child in tab["children"]]
    lines = ["".join(o["text"] for o in pane["outputs"]) for pane in panes]
    assert lines == ["line of 0\nOut[rank 0]: 0\n", "line of 1\nonly one\nOut[rank 1]: 10\n"], lines
    assert texts[20] == ""  # nothing as text beside the tabs
    assert errors[22] is None and texts[22] == ("(--tabs needs ipywidgets, which cannot be imported here: the output "
                                                "as text)\n[rank 0] text 0\n[rank 1] text 1\n"), texts[22]


def test_a_keyboard_interrupt_inside_a_rank_is_named_at_its_line_and_leaves_no_engine(story):
    _, texts, errors = story
    report = "\n".join(errors[24].traceback)
    assert errors[24].ename == "SessionError", report
    assert "the cell failed on rank(s) 1 of 2: KeyboardInterrupt" in report
    assert "rank 1 raised at your cell, line 2: raise KeyboardInterrupt" in report and texts[24] == "[rank 0] after 0\n"
    report = "\n".join(errors[26].traceback)  # rank 0 waits in all_reduce for rank 1, which will never come
    assert errors[26].ename == "SessionBroken", report
    assert "hung: rank(s) 0 of 2 wait for rank(s) 1, which failed: KeyboardInterrupt: by the rank itself" in report
    assert "rank 0 waits at your cell, line 4: dist.all_reduce(t)" in report
    assert texts[27] == "LEFT []\n"  # the session was stopped: no engine of it left
    assert errors[28] is None


def test_kernel_shutdown_leaves_no_engine_and_no_controller(story):
    _, texts, _ = story
    said = dict(line.split(" ", 1) for line in texts[29].splitlines())
    pids, folder = [int(p) for p in said["PIDS"].split()], said["FOLDER"]
    assert len(pids) == 3 and os.path.basename(folder).startswith("labkit-session-"), texts[29]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (os.path.exists(folder) or any(
            psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)):
        time.sleep(0.2)
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []
    assert not os.path.exists(folder), f"the session's folder {folder} outlived the kernel (no %ranks stop ran)"



def test_a_session_timeline_holds_each_ranks_recorded_spans_drawn_by_the_launchs_function(story):
    """`spans = %ranks timeline`: rank r recorded F0..F(r+1) then an allreduce; the kernel's spans, rank by rank,
    are exactly each rank's own (labels, starts and ends, read back from the rank), merged in start order, and
    the figure is drawn by `labkit.measure.viz.plot_timeline`, the function a launch's spans are drawn with."""
    import ast

    nb, texts, errors = story
    assert errors[30] is None and errors[31] is None and errors[32] is None, [e and e.traceback for e in errors[30:33]]
    lines = dict(line.split(" ", 1) for line in texts[31].splitlines())
    assert lines["DRAWN"] == "True True", texts[31]  # drawn once, by plot_timeline, with the merged spans
    per_rank = ast.literal_eval(lines["PER_RANK"])
    assert [[label for label, *_ in per_rank[r]] for r in (0, 1)] == [["F0", "F1", "allreduce"],
                                                                      ["F0", "F1", "F2", "allreduce"]]
    recorded = {int(line[len("[rank "):line.index("]")]): ast.literal_eval(line[line.index("]") + 2:])
                for line in texts[32].splitlines()}
    assert recorded == per_rank  # exactly what each rank holds, times included
    assert any("image/png" in o.get("data", {}) for o in nb.cells[31].outputs), nb.cells[31].outputs


# --------------------------------------------------------------------------- bad input, each a clear error

def _session_processes():
    # notebooks 00, 02 and 08 start sessions of their own beside this test (their engines are forked by the
    # shared zygote's handlers that serve their kernels)
    beside = background.beside_this_process()
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in beside and background.living(p) and (
                    p.name() == ENGINE_NAME or "ipyparallel" in " ".join(p.cmdline())):
                found.append(p)
        except psutil.Error:  # it ended while we read it
            pass
    return found


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

    with pytest.raises(EnginesDidNotStart, match=r"the local launcher started \d of 2 engine\(s\) in \d+ s \(--start-timeout 0.5 s\)") as info:
        Session(2, "gloo", start_timeout=0.5).start()
    assert "What the launcher printed:" in str(info.value) and "--start-timeout" in str(info.value)
    deadline = time.monotonic() + 10
    while _session_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes() == []


# --------------------------------------------------------------------------- a kernel killed by SIGKILL

def _marked(variable: str, value: str) -> list[int]:
    """Live processes whose environment has variable=value (the test's own marker, not the session's)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(variable) == value and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_a_kernel_killed_by_sigkill_leaves_no_controller_and_no_engine(tmp_path):
    """The kernel SIGKILLs itself (what the out-of-memory killer does): no exit handler runs, yet within seconds
    no process it started is left: controller, engine, the session's reaper; nor the session's folder in /tmp.
    The controller and the reaper are found by a marker in their environment that this test sets in the
    kernel's (every child inherits it); the session's own marker and reaper are what is under test, so the test
    does not use them. The engines, forked by the zygote, carry the zygote's environment: found by the pid and
    start time the kernel saw. About 10 s (one engine)."""
    import nbformat
    from run_notebook import NotebookClient  # nbclient's, polling its sockets every second
    from nbclient.exceptions import DeadKernelError

    variable, marker = "LABKIT_TEST_SIGKILL_MARKER", f"{os.getpid()}-{time.time_ns()}"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        "import os, signal, psutil\nimport labkit.session.session as sess\n%load_ext labkit",
        "%ranks start 1 --backend gloo",
        f"s = sess.current\npids = [s.engines.cluster.controller.pid, s.engines.reaper.process.pid]\n"
        "def env(p):\n    try:\n        return p.environ()\n    except psutil.Error:\n        return {}\n"
        f"marked = {{p.pid for p in psutil.process_iter() if env(p).get({variable!r}) == {marker!r}}}\n"
        "print('ENGINES', *[f'{p}:{psutil.Process(p).create_time()}' for p in s.pids.values()])\n"
        "print('BORN', *{(psutil.Process(p).name(), psutil.Process(p).ppid() == os.getpid()) for p in s.pids.values()})\n"
        "print('PIDS', *pids, all(p in marked for p in pids))\nprint('FOLDER', s.folder)\n"
        "c = s.engines.cluster\nprint('CLUSTER', c.profile_dir, c.cluster_id, os.path.exists(c.cluster_file))",
        "os.kill(os.getpid(), signal.SIGKILL)",
    )]
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", variable)}
    os.environ.update({"PYTHONPATH": str(REPO_ROOT), variable: marker})  # the kernel and all it starts inherit both
    try:
        client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(tmp_path)}})
        with pytest.raises(DeadKernelError):
            client.execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    killed = time.monotonic()
    lines = "".join(o.get("text", "") for o in nb.cells[2].outputs).splitlines()
    said = dict(line.split(" ", 1) for line in lines)
    assert said.get("PIDS", "").split()[-1:] == ["True"] and "FOLDER" in said and "ENGINES" in said, \
        [nb.cells[1].outputs, nb.cells[2].outputs]
    folder = said["FOLDER"]
    profile, cluster_id, written = said["CLUSTER"].split()
    assert written == "True", said["CLUSTER"]  # ipyparallel wrote its cluster file where the check below looks
    # forked by the zygote (labkit.session.forked_engines), never by the kernel
    assert said["BORN"] == f"('{ENGINE_NAME}', False)", said["BORN"]
    # the engines carry the zygote's environment, not the marker: known by pid and start time (a reused pid
    # is another process)
    engines = [(int(pid), float(began)) for pid, began in (word.split(":") for word in said["ENGINES"].split())]
    assert engines, lines

    def left_over():
        alive = []
        for pid, began in engines:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - began) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        return _marked(variable, marker) + alive

    def files_left():  # ipyparallel's files of this cluster in the IPython profile (~/.ipython/profile_default)
        return sorted(glob.glob(os.path.join(profile, "*", f"*{cluster_id}*")))

    deadline = killed + 10
    while (left_over() or os.path.exists(folder) or files_left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = left_over()
    assert left == [], f"left after the kernel was killed: {[(p, psutil.Process(p).cmdline()[:4]) for p in left]}"
    assert not os.path.exists(folder), f"the session's folder {folder} outlived the killed kernel"
    assert files_left() == [], f"ipyparallel's files outlived the killed kernel: {files_left()}"
    print(f"nothing of the session left {time.monotonic() - killed:.1f} s after the kernel's SIGKILL")


def test_a_launcher_log_already_removed_is_not_an_error_in_the_cell():
    """ipyparallel checks that a launcher's log exists, then removes it; two of its callbacks racing leave the second
    a FileNotFoundError, which it logs as an error into the cell. labkit's filter drops that one message, no other."""
    import logging

    from labkit.session.engines import _already_removed

    def kept(message):
        return _already_removed(logging.LogRecord("ipyparallel", logging.ERROR, __file__, 1, message, None, None))

    assert not kept("Failed to remove /root/.ipython/profile_default/log/ipcontroller-1-a-2.log: [Errno 2] No such "
                    "file or directory: '/root/.ipython/profile_default/log/ipcontroller-1-a-2.log'")
    assert kept("Failed to remove /root/.ipython/x.log: [Errno 13] Permission denied: '/root/.ipython/x.log'")
    assert kept("Controller stopped: {'exit_code': 1}")
