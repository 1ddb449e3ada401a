"""Long subprocess jobs that run beside the rest of the test suite (a notebook in a fresh kernel, the
grading suite on the untouched stubs).

Each is a process of its own that keeps about one core busy, and most of the suite leaves one of the
two cores idle (a test waits on ranks, a timeout, a browser). So the jobs start as soon as collection
ends, one at a time while other tests run, and two at a time once a test waits for a result: the
tests that read results run last (tests/conftest.py orders them). The suite's verdicts must not
depend on the load, as `make test-stress` checks with both cores taken.

A module offers its jobs with `background_jobs(items) -> [(key, argv, env, timeout_s, weight)]` for
the items that pytest selected; a test reads one with `result(key)`. The heaviest jobs start first,
so that the last ones end together. Every process is killed when the session ends.
"""
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field

BESIDE_TESTS, WHEN_WAITED_FOR = 1, 2  # jobs at once while other tests run / while a test waits
# A job's torch computes on one thread: it shares the two cores with the tests (and another job), where a
# second thread only waits at each op's end for a thread the scheduler put aside. Notebook 01 on the
# solutions beside a busy core: 121 s with two threads, 102 s with one (2026-11-27).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Done:
    returncode: int | None  # None: killed at its timeout
    stdout: str
    stderr: str
    seconds: float


@dataclass
class _Job:
    key: object
    argv: list
    env: dict
    timeout: float
    weight: float
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Done | None = None
    process: subprocess.Popen | None = None


class Background:
    def __init__(self, cwd):
        self.cwd = cwd
        self.jobs: dict[object, _Job] = {}
        self.waiting = 0  # tests now blocked in result()
        self.running = 0
        self.closed = False
        self.lock = threading.Condition()
        self.thread = None
        self.helpers = []  # processes the jobs share (tests/kernel_factory.py): .pids(), .close()

    def start(self, specs):
        for key, argv, env, timeout, weight in specs:
            self.jobs[key] = _Job(key, list(argv), dict(env), timeout, weight)
        if self.jobs:
            self.thread = threading.Thread(target=self._schedule, name="background-jobs", daemon=True)
            self.thread.start()

    def _limit(self) -> int:
        return WHEN_WAITED_FOR if self.waiting else BESIDE_TESTS

    def _schedule(self):
        queue = sorted(self.jobs.values(), key=lambda job: -job.weight)
        for job in queue:
            with self.lock:
                self.lock.wait_for(lambda: self.closed or self.running < self._limit())
                if self.closed:
                    return
                self.running += 1
            threading.Thread(target=self._run, args=(job,), name=f"job {job.key}", daemon=True).start()

    def _run(self, job: _Job):
        began = time.monotonic()
        try:
            job.process = subprocess.Popen(job.argv, cwd=self.cwd, env=job.env, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = job.process.communicate(timeout=job.timeout)
                code = job.process.returncode
            except subprocess.TimeoutExpired:  # killed; a notebook kernel sees its parent gone and exits
                job.process.kill()
                out, err = job.process.communicate()
                code = None
            job.outcome = Done(code, out, err, time.monotonic() - began)
            _log(job, began)
        except Exception as error:  # a job that cannot start is reported by the test that reads it
            job.outcome = Done(-1, "", f"could not run {job.argv}: {error!r}", time.monotonic() - began)
        finally:
            with self.lock:
                self.running -= 1
                self.lock.notify_all()
            job.done.set()

    def result(self, key, timeout: float) -> Done:
        """The job's outcome, waiting up to `timeout` seconds; two jobs run at once meanwhile."""
        job = self.jobs.get(key)
        if job is None:
            raise KeyError(f"no background job {key!r}: was it offered by its module's background_jobs()?")
        with self.lock:
            self.waiting += 1
            self.lock.notify_all()
        try:
            if not job.done.wait(timeout):
                return Done(None, "", f"not finished after the test waited {timeout:.0f} s", timeout)
            return job.outcome
        finally:
            with self.lock:
                self.waiting -= 1

    def close(self):
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        for job in self.jobs.values():
            if job.process is not None and job.process.poll() is None:
                job.process.kill()
                job.process.wait()
        for helper in self.helpers:
            helper.close()

    def add_helper(self, helper):
        """A process the jobs share: closed with them, its processes counted as theirs."""
        self.helpers.append(helper)
        return helper


_current: Background | None = None


def _log(job: _Job, began: float):
    """`LABKIT_BACKGROUND_LOG=file`: one JSON line per job (its key, start and end on the wall clock, the end of
    what it wrote on stderr), to see what the suite's time is spent on beside the tests (the suite's time is a
    budget: README), and where a job that passed spent minutes (tests/run_notebook.py names its slow cells)."""
    path = os.environ.get("LABKIT_BACKGROUND_LOG")
    if path:
        import json

        end = time.time()
        with open(path, "a") as f:
            f.write(json.dumps({"key": [str(part) for part in job.key] if isinstance(job.key, tuple) else str(job.key),
                                "start": end - (time.monotonic() - began), "end": end,
                                "stderr": job.outcome.stderr[-2000:] if job.outcome else ""}) + "\n")


def current() -> Background:
    if _current is None:
        raise RuntimeError("background jobs are started by tests/conftest.py: run the tests with pytest")
    return _current


def install(background: Background | None):
    global _current
    _current = background


def living(process) -> bool:
    """Whether a process (a psutil.Process or a pid) still runs and is not a zombie. One that ends between two
    reads of /proc makes psutil raise at the second: that is "not living", not an error (`make test-stress`
    caught that race in test_launch's leftover check: is_running() true, then status() on a pid gone)."""
    import psutil

    try:
        process = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_trees() -> set[int]:
    """The pids of every running job and its descendants (and of the helpers the jobs share): tests that look for processes they left
    behind among this process's children must not count these."""
    import psutil

    pids = set()
    for helper in (_current.helpers if _current is not None else ()):
        pids |= helper.pids()
    for job in (_current.jobs.values() if _current is not None else ()):
        if job.process is not None and job.process.poll() is None:
            try:
                root = psutil.Process(job.process.pid)
                pids |= {root.pid, *(child.pid for child in root.children(recursive=True))}
            except psutil.Error:
                pass
    return pids


def beside_this_process() -> set[int]:
    """`process_trees()`, and the shared zygote's handlers that serve other processes (the jobs' kernels)
    with their ranks and session engines: all that a leftover-process check of this process must skip."""
    import psutil

    from labkit.launching import zygote

    beside = process_trees()
    mine = zygote.current_pid()  # this process's own handler (or zygote): its children are this test's
    try:
        owner = psutil.Process(mine).ppid() if mine else os.getpid()
        if owner != os.getpid():
            for handler in psutil.Process(owner).children():
                if handler.pid != mine:
                    beside |= {handler.pid, *(c.pid for c in handler.children(recursive=True))}
    except psutil.Error:
        pass
    return beside
