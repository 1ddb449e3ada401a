"""labkit.launch: results, environment, and every way a launch can go wrong.

Each fault test checks two things: the error says what happened (which rank, root
cause, stacks), and no process the launch started is left behind.
"""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import background
import labkit
from labkit.launching.launcher import LaunchError, OversubscriptionWarning, StubNotImplemented

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children():
    from labkit.launching import zygote  # the process ranks are born from lives as long as this one

    beside = background.beside_this_process()  # the notebooks beside this test, their handlers and ranks
    mine = zygote.current_pid()
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid != mine and p.pid not in beside and background.living(p)]


@pytest.fixture(autouse=True)
def no_process_left_behind():
    before = {p.pid for p in _children()}
    yield
    # a few seconds' grace: a process ends asynchronously (a shared zygote's handler leaves when it sees
    # its client's socket close, a moment after the client exited)
    deadline = time.monotonic() + 5
    while (left := [p for p in _children() if p.pid not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


# --------------------------------------------------------------------------- what a launch gives

def _env_and_sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {k: os.environ[k] for k in keys} | {"sum": t.item(), "backend": dist.get_backend()}


def test_results_come_back_in_rank_order_with_env_set():
    results = labkit.launch(_env_and_sum, 3, timeout=30)
    assert [r["RANK"] for r in results] == ["0", "1", "2"]
    assert {r["WORLD_SIZE"] for r in results} == {"3"}
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "2"]
    assert {r["sum"] for r in results} == {6.0}  # 1 + 2 + 3, through the real process group
    assert {r["backend"] for r in results} == {"gloo"}  # no GPU here: auto picks gloo
    assert {r["LOCAL_WORLD_SIZE"] for r in results} == {"3"}


def _with_args(rank, world_size, a, b=0):
    return (rank, world_size, a, b)


def test_args_and_kwargs_are_passed():
    assert labkit.launch(_with_args, 2, "x", b=5, timeout=30) == [(0, 2, "x", 5), (1, 2, "x", 5)]


def test_world_size_one_works():
    assert labkit.launch(_with_args, 1, 7, timeout=30) == [(0, 1, 7, 0)]


def _rank(rank, world_size):
    return rank


def _sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_launches_in_a_row_each_meet_in_a_store_of_their_own_and_leave_no_file(tmp_path, monkeypatch):
    """The ranks meet in a FileStore in the launch's own folder (labkit.launching.forked.store_path):
    no port to collide on, no DNS lookup (a TCPStore's cost 5 s on 4 of 100 connections in this project's sandbox),
    and the folder goes with the launch. A store shared between launches would hand a later launch
    the earlier one's keys: its ranks would start their all-reduce with peers that are gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # only this test's launches make folders here
    for world_size in (2, 3, 2, 4, 2, 3, 2, 2, 3, 2):
        assert labkit.launch(_sum, world_size, timeout=30) == [world_size * (world_size + 1) / 2] * world_size
    assert not list(tmp_path.iterdir()), f"launch folders left behind: {sorted(p.name for p in tmp_path.iterdir())}"


def _hello(rank, world_size):
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)


def test_rank_output_is_prefixed(capsys):
    labkit.launch(_hello, 2, timeout=30)
    out, err = capsys.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 1] warning from 1" in err


def test_group_is_destroyed_and_parent_untouched():
    labkit.launch(_rank, 2, timeout=30)
    assert not dist.is_initialized()  # the parent never joins the group


def _recv_then_note_the_error(rank, world_size, folder):
    try:
        dist.recv(torch.zeros(1), src=1 - rank)  # both receive first: a hang
    except Exception as error:
        with open(os.path.join(folder, f"rank{rank}"), "w") as f:
            f.write(f"saw its peer go: {error}")
        raise


def test_a_hung_launch_stops_every_rank_before_it_kills_any(tmp_path, monkeypatch):
    """A rank killed first closes its connections; a peer still running would see a failed recv and
    report that as its own failure (a grading case then reads "remote worker crashing" where it hung).
    Here the launcher is slowed between two signals, as a loaded machine may preempt it: no rank may
    live to see a peer's end."""
    real_killpg = os.killpg

    def preempted_killpg(pid, sig):
        real_killpg(pid, sig)
        time.sleep(0.5)

    monkeypatch.setattr(os, "killpg", preempted_killpg)
    with pytest.raises(LaunchError, match="hung"):
        labkit.launch(_recv_then_note_the_error, 2, str(tmp_path), timeout=30, idle_timeout=1.0)
    noted = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert not noted, f"ranks that ran on after a peer was killed: {noted}"


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("world_size", [0, -1, 2.0, "2", True])
def test_bad_world_size_is_a_value_error(world_size):
    with pytest.raises(ValueError, match="world_size"):
        labkit.launch(_rank, world_size)


def test_fn_not_callable_is_a_value_error():
    with pytest.raises(ValueError, match="fn must be a function"):
        labkit.launch("not a function", 2)


@pytest.mark.parametrize("timeout", [0, -3, "10"])
def test_bad_timeout_is_a_value_error(timeout):
    with pytest.raises(ValueError, match="timeout"):
        labkit.launch(_rank, 2, timeout=timeout)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        labkit.launch(_rank, 2, backend="mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without GPUs")
def test_nccl_without_gpus_fails_before_spawning():
    before = time.monotonic()
    with pytest.raises(LaunchError, match="nccl.*one GPU per rank"):
        labkit.launch(_rank, 2, backend="nccl")
    assert time.monotonic() - before < 10  # refused at once: no rank was started, nothing waited


def test_more_ranks_than_cores_warns_once_per_process_but_runs():
    import warnings

    launch_module = sys.modules["labkit.launching.launcher"]

    n = (os.cpu_count() or 1) + 1
    launch_module._warned = False  # the note comes once per process (kernel)
    with pytest.warns(OversubscriptionWarning, match="oversubscription"):
        assert len(labkit.launch(_rank, n, timeout=60)) == n
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second launch says nothing more
        assert len(labkit.launch(_rank, n, timeout=60)) == n


# --------------------------------------------------------------------------- a rank fails

def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # the others wait for rank 1, which never comes


def test_exception_on_one_rank_stops_all_and_names_the_root_cause():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        labkit.launch(_raise_on_rank_1, 3, timeout=600)
    # far below the timeout: the waiting ranks were stopped, not waited for (a margin for busy cores)
    assert time.monotonic() - start < 90, "the other ranks must be stopped, not waited for"
    message = str(info.value)
    assert message.startswith("rank 1 of 3 failed: ValueError: rank one is unhappy")
    assert "=== rank 1: ROOT CAUSE ===" in message
    assert "_raise_on_rank_1" in message  # the learner's frame is in the traceback
    assert info.value.failures[0].rank == 1


def _stub(rank, world_size):
    raise NotImplementedError("exercise foo is not implemented yet: edit exercises/x.py, see notebooks/00_setup.ipynb")


def test_unimplemented_stub_is_one_line_not_a_wall_of_tracebacks():
    with pytest.raises(StubNotImplemented) as info:
        labkit.launch(_stub, 2, timeout=30)
    assert isinstance(info.value, NotImplementedError)  # pytest.raises(NotImplementedError) works too
    message = str(info.value)
    assert message.startswith("exercise foo is not implemented yet")
    assert "\n" not in message and "Traceback" not in message


def _exit_on_rank_0(rank, world_size):
    if rank == 0:
        os._exit(7)
    dist.barrier()


def test_os_exit_on_one_rank_is_reported_as_a_crash():
    with pytest.raises(LaunchError) as info:
        labkit.launch(_exit_on_rank_0, 2, timeout=30)
    assert "rank 0 of 2 failed: exited with exit code 7 without returning" in str(info.value)


def _segfault_on_rank_1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


def test_signal_death_names_the_signal():
    with pytest.raises(LaunchError, match="rank 1 of 2 failed: exited with signal SIGSEGV"):
        labkit.launch(_segfault_on_rank_1, 2, timeout=30)


def _mismatched_sizes(rank, world_size):
    t = torch.zeros(4 if rank == 0 else 6)
    dist.all_reduce(t)  # gloo aborts the process (SIGABRT) when the sizes differ
    dist.all_reduce(t)


def test_collective_size_mismatch_is_named_in_the_summary_not_called_a_crash():
    with pytest.raises(LaunchError) as info:
        labkit.launch(_mismatched_sizes, 2, timeout=30)
    head = str(info.value).splitlines()[0]
    assert "gloo aborted (signal SIGABRT)" in head
    assert "Received data size doesn't match expected size" in head
    assert "os._exit, a segmentation fault" not in str(info.value)
    assert "_mismatched_sizes" in str(info.value)  # where it was: the learner's frame


def test_ranks_that_failed_only_because_a_peer_died_are_one_line_each():
    from labkit.launching.failures import RankFailure, launch_error

    peer_died = "Traceback ...\nRuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
    failures = [
        RankFailure(2, "exception", "RuntimeError: Connection closed by peer", peer_died, when=1.0),
        RankFailure(1, "exception", "ValueError: bad", "Traceback ...\nValueError: bad", when=2.0),
        RankFailure(3, "exception", "RuntimeError: Connection closed by peer", peer_died, when=3.0),
    ]
    error = launch_error(failures, 4, stopped=[0])
    message = str(error)
    assert message.startswith("rank 1 of 4 failed: ValueError: bad")  # earlier, but only a consequence
    assert "=== rank 1: ROOT CAUSE ===" in message
    assert message.count("Connection closed by peer") == 2  # one short line per follower, no traceback
    assert "rank 2: failed only because a peer had died" in message
    assert "rank 3: failed only because a peer had died" in message
    assert peer_died not in message and len(error.failures) == 3  # full texts kept on the error


def _unpicklable(rank, world_size):
    return lambda: None


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(LaunchError, match="cannot be sent back to the launcher"):
        labkit.launch(_unpicklable, 2, timeout=30)


# --------------------------------------------------------------------------- ranks hang

def _skip_collective(rank, world_size):
    if rank != 0:
        dist.barrier()  # rank 0 never joins


def _deadlock(rank, world_size):
    buf = torch.zeros(4)
    dist.recv(buf, src=1 - rank)  # both receive first: nobody sends
    dist.send(buf, dst=1 - rank)


def _spin(rank, world_size):
    while True:
        pass


@pytest.mark.parametrize("fn, stuck, where", [
    (_skip_collective, "1, 2", "barrier"),
    (_deadlock, "0, 1", "recv"),
    (_spin, "0, 1", "_spin"),
], ids=["skipped_collective", "send_recv_deadlock", "infinite_loop"])
def test_hang_is_reported_with_stacks_and_killed(fn, stuck, where):
    # The timeout counts from the moment every rank has started, so a slow start on a busy
    # machine cannot make a rank that returns at once (rank 0 of the skipped collective) look stuck.
    world_size = 3 if fn is _skip_collective else 2
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        labkit.launch(fn, world_size, timeout=3)
    elapsed = time.monotonic() - start
    assert elapsed >= 3
    assert elapsed < 60, "reported within start-up plus the timeout, even on a busy machine"
    message = str(info.value)
    assert message.startswith(f"timed out after 3 s: rank(s) {stuck} of {world_size} were still running")
    assert f"in {where}" in message  # the stack shows where each rank is blocked
    assert all(f.kind == "timeout" for f in info.value.failures)


# --------------------------------------------------------------------------- interrupt

def _sleeper_script(tmp_path) -> str:
    """A script's start: `sleeper` writes its rank's pid to tmp_path/pids<rank>, then sleeps."""
    return textwrap.dedent(f"""
        import os, time, labkit
        def sleeper(rank, world_size):
            with open({str(tmp_path / "pids")!r} + str(rank), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
    """)


# a script's end: launch two sleepers and print what the interrupt raised
LAUNCH_UNTIL_INTERRUPTED = textwrap.dedent("""
    try:
        labkit.launch(sleeper, 2, timeout=600)
    except KeyboardInterrupt as error:
        print("MESSAGE", str(error))
        print("interrupted cleanly", type(error).__name__)
""")


def assert_both_ranks_stopped_with_their_stacks(out: str, rank_pids: list[int]) -> None:
    assert "interrupted cleanly LaunchInterrupted" in out, out
    message = out.split("MESSAGE ", 1)[1]
    # each rank's Python stack, showing where it was, then one line saying what happened
    assert "=== rank 0: interrupted here ===" in message and "=== rank 1: interrupted here ===" in message
    assert "in sleeper" in message
    assert "launch interrupted: rank(s) 0, 1 of 2 were still running and have been stopped" in message
    assert "multiprocessing" not in message and "selectors" not in message
    time.sleep(0.2)
    assert not [pid for pid in rank_pids if background.living(pid)]


def test_keyboard_interrupt_kills_every_rank(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(_sleeper_script(tmp_path) + LAUNCH_UNTIL_INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # forking two ranks can take long on a loaded machine
        # the file exists as soon as a rank opens it: wait until its pid is written (a busy machine
        # can interleave the two)
        while not all((tmp_path / f"pids{r}").exists() and (tmp_path / f"pids{r}").read_text()
                      for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        rank_pids = [int((tmp_path / f"pids{r}").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert_both_ranks_stopped_with_their_stacks(out, rank_pids)


def test_keyboard_interrupt_while_the_ranks_are_forked_stops_them(tmp_path):
    """The window between the zygote forking the ranks and the caller hearing their pids: a Ctrl-C there (seen in
    `make test-stress`, when the test above signalled as soon as the ranks had written their pids) raised a plain
    KeyboardInterrupt and left the ranks running. The Ctrl-C is planted in that window: the caller's first wait for
    the zygote's answer raises it, once both ranks run. It must stop both ranks, with their stacks."""
    script = tmp_path / "interrupt_in_fork.py"
    script.write_text(_sleeper_script(tmp_path) + f"PIDS = {str(tmp_path / 'pids')!r}\n" + textwrap.dedent("""
        from labkit.launching import zygote
        real_fork, real_next, state = zygote.Zygote.fork, zygote.Zygote.next_message, {"in": False, "done": False}
        def fork(self, request, fds):
            state["in"] = True
            try:
                return real_fork(self, request, fds)
            finally:
                state["in"] = False
        def next_message(self, timeout=None):
            if state["in"] and not state["done"]:
                state["done"] = True
                pids, deadline = [PIDS + str(r) for r in range(2)], time.monotonic() + 60
                while not all(os.path.exists(f) and open(f).read() for f in pids) and time.monotonic() < deadline:
                    time.sleep(0.05)  # until both ranks run: they are forked, their pids not yet heard
                raise KeyboardInterrupt
            return real_next(self, timeout)
        zygote.Zygote.fork, zygote.Zygote.next_message = fork, next_message
    """) + LAUNCH_UNTIL_INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert_both_ranks_stopped_with_their_stacks(out, [int((tmp_path / f"pids{r}").read_text()) for r in range(2)])


# --------------------------------------------------------------------------- under torchrun

def test_under_torchrun_the_process_is_its_rank(tmp_path):
    script = tmp_path / "under_torchrun.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, labkit
        def work(rank, world_size):
            t = torch.tensor([rank + 1.0]); dist.all_reduce(t)
            return (rank, world_size, os.getpid(), t.item())
        results = labkit.launch(work, 2, timeout=60)
        try:
            labkit.launch(work, 3)
            mismatch = "no error"
        except labkit.LaunchError as e:
            mismatch = str(e)[:60]
        if int(os.environ["RANK"]) == 0:  # one printer: torchrun interleaves the ranks' output
            print("RESULTS", results, os.getpid(), flush=True)
            print("MISMATCH", mismatch, flush=True)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULTS"))
    results, parent_pid = eval(line[len("RESULTS "):].rsplit(" ", 1)[0]), int(line.rsplit(" ", 1)[1])
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert [r[3] for r in results] == [3.0, 3.0]
    assert results[0][2] == parent_pid  # rank 0 ran in torchrun's process, nothing was forked
    assert "MISMATCH launch(fn, 3) asks for 3 ranks, but torchrun st" in out.stdout


def test_under_torchrun_the_timeout_dumps_stacks_and_ends_every_process(tmp_path):
    script = tmp_path / "hang_under_torchrun.py"
    script.write_text(textwrap.dedent("""
        import torch.distributed as dist, labkit
        def hang(rank, world_size):
            if rank == 1:
                dist.barrier()  # rank 0 never joins
            else:
                import time; time.sleep(600)
        labkit.launch(hang, 2, timeout=5)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    start = time.monotonic()
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode != 0
    assert time.monotonic() - start < 200, "the watchdog, not pytest, ended the run"
    assert "in hang" in out.stderr  # the watchdog printed where each rank was


# --------------------------------------------------------------------------- from a notebook

def test_function_defined_in_a_notebook_cell_and_the_ranks_magic(tmp_path):
    """A real kernel: a cell-defined function runs on the ranks (no pickling), %%ranks works,
    rank output lands in the cell's output, and no process outlives the kernel."""
    import nbformat
    from run_notebook import NotebookClient  # nbclient's, polling its sockets every second

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "import labkit, torch, torch.distributed as dist\n"
        "def cell_fn(rank, world_size, scale):\n"
        "    t = torch.tensor([rank * scale]); dist.all_reduce(t)\n"
        "    print('inside', rank)\n"
        "    return t.item()\n"
        "print(labkit.launch(cell_fn, 2, 3.0, timeout=60))",
        "%load_ext labkit",
        "%%ranks 2 --timeout 60\nprint('magic', rank, world_size, scale_from_notebook)",
        "def stub(rank, world_size):\n"
        "    raise NotImplementedError('exercise foo is not implemented yet: edit exercises/x.py, see notebooks/00_setup.ipynb')\n"
        "labkit.launch(stub, 2, timeout=60)",
        "labkit.launch(cell_fn, 2, 'not a number', timeout=60)",
    )]
    nb.cells.insert(1, nbformat.v4.new_code_cell("scale_from_notebook = 42"))
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = lambda cell: "".join(o.get("text", "") for o in cell.outputs)  # noqa: E731
    assert "[3.0, 3.0]" in text(nb.cells[0])
    assert "[rank 0] inside 0" in text(nb.cells[0]) and "[rank 1] inside 1" in text(nb.cells[0])
    assert "[rank 1] magic 1 2 42" in text(nb.cells[3])
    assert not any(o.output_type == "error" for cell in nb.cells[:4] for o in cell.outputs)
    # an unwritten stub reads as one line (and where the cell called it), not labkit's frames
    (stub_error,) = [o for o in nb.cells[4].outputs if o.output_type == "error"]
    assert stub_error.ename == "StubNotImplemented"
    assert stub_error.traceback[0].startswith("StubNotImplemented: exercise foo is not implemented yet")
    assert len(stub_error.traceback) <= 2 and "forked.py" not in "".join(stub_error.traceback)
    # a real failure reads as the launch's report: the root cause and the learner's frame
    (failure,) = [o for o in nb.cells[5].outputs if o.output_type == "error"]
    report = "\n".join(failure.traceback)
    assert failure.ename == "LaunchError" and "ROOT CAUSE" in report and "cell_fn" in report
    assert "labkit/launching/forked.py" not in report


def _asleep_or_busy(rank, world_size, what):
    import time as _time

    if what == "busy":  # two seconds of CPU on every rank: never "asleep"
        end = _time.process_time() + 2.0
        while _time.process_time() < end:
            pass
        return rank
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # a recv whose send is missing; rank 1 waits in the barrier
    dist.barrier()


def test_idle_timeout_names_a_hang_when_every_rank_sleeps_and_leaves_working_ranks_alone():
    import time as _time

    assert labkit.launch(_asleep_or_busy, 2, "busy", timeout=120, idle_timeout=1.0) == [0, 1]
    start = _time.monotonic()
    with pytest.raises(LaunchError, match=r"hung: rank\(s\) 0, 1 of 2 all waited, none using the CPU, for 2 s") as err:
        labkit.launch(_asleep_or_busy, 2, "hang", timeout=120, idle_timeout=2.0)
    assert _time.monotonic() - start < 60  # the idle watch, far before the 120 s timeout
    assert "in recv" in str(err.value) and "in barrier" in str(err.value)


def test_a_killed_caller_leaves_neither_its_zygote_nor_its_ranks(tmp_path):
    """SIGKILL to the caller mid-launch: the zygote sees its socket close, kills the ranks and exits."""
    script = tmp_path / "killed.py"
    script.write_text(_sleeper_script(tmp_path) + textwrap.dedent("""
        from labkit.launching import zygote
        zygote.get()
        print("ZYGOTE", zygote.current_pid(), flush=True)
        labkit.launch(sleeper, 2, timeout=600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        zygote_pid = int(proc.stdout.readline().split()[1])
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pids{r}").exists() and (tmp_path / f"pids{r}").read_text()
                      for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        rank_pids = [int((tmp_path / f"pids{r}").read_text()) for r in range(2)]
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 20
    alive = lambda: [p for p in [zygote_pid] + rank_pids if background.living(p)]  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), f"left behind after the caller was killed: {alive()}"


# --------------------------------------------------------------------------- what a rank inherits

def _which_are_imported(rank, world_size, names):
    import sys

    return {name: name in sys.modules for name in names}


def test_a_rank_inherits_the_callers_labkit_modules_but_imports_the_learners_code_itself(tmp_path, monkeypatch):
    """The zygote imports the caller's labkit/torch modules before forking (a second per rank saved at
    every launch), never a module of the learner's: an edit to it must be seen at the next launch."""
    import importlib

    import torch.utils.benchmark  # noqa: F401 (never preloaded: it may start workers)

    import labkit.compose.divergence  # noqa: F401 (the caller has it: the rank must start with it)

    (tmp_path / "learner_code_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    learner = importlib.import_module("learner_code_probe")
    names = ["labkit.compose.divergence", "learner_code_probe", "torch.utils.benchmark"]
    first = labkit.launch(_which_are_imported, 2, names)[0]
    assert first == {"labkit.compose.divergence": True, "learner_code_probe": False,
                     "torch.utils.benchmark": False}, first
    (tmp_path / "learner_code_probe.py").write_text("VALUE = 2\n")

    def edited(rank, world_size):
        import learner_code_probe

        return learner_code_probe.VALUE

    assert learner.VALUE == 1 and labkit.launch(edited, 2) == [2, 2]


def _group_by_position(rank, world_size):
    from labkit.parallel.sharding import all_gather_flat

    all_gather_flat(torch.ones(2), None)  # the group passed by position: the topology is keyword-only


def test_a_group_passed_by_position_gets_a_hint_below_the_traceback():
    with pytest.raises(LaunchError) as info:
        labkit.launch(_group_by_position, 2)
    text = str(info.value)
    assert "takes 1 positional argument but 2 were given" in text, text
    assert "hint: all_gather_flat() was given 2 positional arguments and takes 1" in text, text
    assert "name it (group=..., groups=..., mesh=...)" in text, text


def _global_peer_as_group_rank(rank, world_size):
    group = dist.new_group([1, 3])
    if rank == 1:
        dist.send(torch.ones(1), group_dst=3, group=group)  # 3 is a GLOBAL rank: its group rank is 1
    elif rank == 3:
        dist.recv(torch.ones(1), group_src=1, group=group)


def test_a_global_rank_passed_as_group_dst_gets_a_hint_below_the_traceback():
    with pytest.raises(LaunchError) as info:
        labkit.launch(_global_peer_as_group_rank, 4, timeout=30)
    text = str(info.value)
    assert "Pair is not connected" in text, text
    assert "hint: a send or receive named a peer that is not in its group" in text, text
    assert "group_dst=/group_src= are ranks INSIDE group=" in text, text


def test_a_process_that_ends_between_two_reads_is_not_living():
    """`make test-stress` caught it in this module's leftover check: is_running() true, then status() on a pid gone by
    then raised NoSuchProcess. background.living reads that as "not living". Planted: the old predicate
    (is_running() and status() != zombie) raises on the same process."""
    class Vanishing(psutil.Process):
        def is_running(self):
            return True

        def status(self):
            raise psutil.NoSuchProcess(self.pid)

    vanishing = Vanishing(os.getpid())
    assert background.living(vanishing) is False
    with pytest.raises(psutil.NoSuchProcess):
        vanishing.is_running() and vanishing.status() != psutil.STATUS_ZOMBIE  # noqa: B015 (the old predicate)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=30)
    assert background.living(ended.pid) is False and background.living(os.getpid()) is True
