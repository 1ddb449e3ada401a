"""The fork launcher: N ranks forked from this process, watched until they return, fail or hang.

In the order things happen (`labkit.launch` has checked the arguments and chosen the backend):

1. The parent picks a free TCP port for rank 0's rendezvous store and *forks* one child per
   rank. Forking (not spawning) is what lets a function defined in a notebook cell run in the
   children without pickling, and it costs milliseconds instead of the seconds a fresh
   interpreter needs to import torch.
2. Each child makes itself a process-group leader (so the parent can kill it and anything it
   started in one call), asks the kernel to kill it if the parent dies, sends its stdout and
   stderr through pipes that the parent prints with a ``[rank k]`` prefix, initialises
   ``torch.distributed``, tells the parent it has started, and calls ``fn``. The return value
   (or the traceback) goes back through a pipe.
3. The parent waits for results, exits and the deadline. The ``timeout`` counts from the moment
   every rank has started (so a slow start on a busy machine never counts as a hang); start-up
   itself gets ``timeout + STARTUP_GRACE`` seconds. On the first failure it gives the other
   ranks a moment to report, then kills the rest and raises (`labkit.launching.failures`). On the
   deadline, or on Ctrl-C, it asks the running ranks for their Python stacks (faulthandler on
   SIGUSR1), kills everything and raises.

Ranks run torch with one intra-op thread: GNU OpenMP, which the CPU build of torch uses, hangs
in a forked child whose parent has already used its thread pool. One thread per rank is also
what torchrun sets (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

from labkit.launching.progress import IdleWatch
from labkit.launching.stacks import hint, where_waiting
from labkit.launching.failures import (LaunchError, LaunchInterrupted, RankFailure, crash_failure, launch_error,
                       one_line, ranks_text)

GRACE_AFTER_FAILURE = 1.5  # seconds the other ranks get to report their own failure
STARTUP_GRACE = 60.0  # extra seconds start-up (fork + rendezvous) may take on a busy machine


def flush_std_streams() -> None:
    """Flush this process's stdout and stderr (before a fork, and before a child exits)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def to_cpu(value):
    """Move tensors to the CPU so that unpickling in the parent never initialises CUDA."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        converted = [to_cpu(v) for v in value]
        return type(value)(converted) if not hasattr(value, "_fields") else type(value)(*converted)
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    return value


def free_port() -> int:
    # A port no socket is bound to right now. (Serving the store from the parent instead
    # would remove the small window before rank 0 binds it, but a store thread in the
    # parent at fork time made ranks hang in init_process_group now and then.)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the child

def _child_main(rank, world_size, fn, args, kwargs, backend, port, pg_timeout,
                result_w, out_w, err_w, stack_path, parent_pid):
    os.setsid()  # own process group: the parent kills it and its children in one call
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before we could ask
        os._exit(1)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="replace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="replace")
    faulthandler.enable(file=sys.stderr)  # a crash's Python stack goes through the pipe too
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    ok = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # see the module docstring: libgomp and fork
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        result_w.send_bytes(pickle.dumps(("started", None)))
        result = fn(rank, world_size, *args, **kwargs)
        try:
            payload = pickle.dumps(("ok", to_cpu(result)))
        except Exception as error:
            raise TypeError(f"the return value of rank {rank} cannot be sent back to the launcher "
                            f"({error}); return plain data or CPU tensors") from None
        result_w.send_bytes(payload)
        ok = True
        # Leave together: a rank that exits while a peer is still connecting to it (gloo sets up
        # its connections pair by pair) makes that peer fail. A barrier would do, but it could
        # complete a collective that a learner's rank skipped; the store keys cannot. Rank 0
        # hosts the store, so it is also the last to leave.
        store = dist.distributed_c10d._get_default_store()
        store.set(f"labkit/done/{rank}", "1")
        store.wait([f"labkit/done/{r}" for r in range(world_size)])
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
        if not ok:
            tb = error.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next  # the learner's frames only, not the launcher's
            details = "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))
            failure = RankFailure(rank, "exception", one_line(error), details,
                                  time.time(), isinstance(error, NotImplementedError))
            try:
                result_w.send_bytes(pickle.dumps(("error", failure)))
            except Exception:
                pass
    finally:
        flush_std_streams()
    os._exit(0 if ok else 1)  # skip atexit handlers inherited from the parent (a Jupyter kernel's, say)


def _die_with_parent():
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


# --------------------------------------------------------------------------- the parent

class ForkLauncher:
    def __init__(self, fn, world_size, args, kwargs, backend, timeout, idle_timeout=None):
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.backend, self.timeout = backend, timeout
        # every running rank asleep this long (gloo only: see labkit.launching.progress) = a hang
        self.idle = IdleWatch(idle_timeout) if idle_timeout and backend == "gloo" else None
        self.results: dict[int, object] = {}
        self.started: set[int] = set()
        self.all_started_at: float | None = None
        self.failures: list[RankFailure] = []
        self.procs: list[mp.Process] = []
        self.readers: list[threading.Thread] = []
        self.tail: dict[int, list[str]] = {r: [] for r in range(world_size)}

    def run(self) -> list:
        ctx = mp.get_context("fork")
        port = free_port()
        # gloo's own timeout comes well after the launcher's deadline (start-up included).
        pg_timeout = 2 * self.timeout + STARTUP_GRACE + 60
        with tempfile.TemporaryDirectory(prefix="labkit-launch-") as tmp:
            self.stack_paths = [os.path.join(tmp, f"stack-{r}.txt") for r in range(self.world_size)]
            result_readers = []
            try:
                flush_std_streams()
                for rank in range(self.world_size):
                    result_r, result_w = ctx.Pipe(duplex=False)
                    out_r, out_w = os.pipe()
                    err_r, err_w = os.pipe()
                    proc = ctx.Process(
                        target=_child_main, name=f"labkit-rank-{rank}",
                        args=(rank, self.world_size, self.fn, self.args, self.kwargs, self.backend, port,
                              pg_timeout, result_w, out_w, err_w, self.stack_paths[rank], os.getpid()))
                    proc.start()
                    result_w.close()
                    os.close(out_w)
                    os.close(err_w)
                    self.procs.append(proc)
                    result_readers.append(result_r)
                    self._forward(out_r, rank, "stdout")
                    self._forward(err_r, rank, "stderr")
                try:
                    self._wait(result_readers)
                except KeyboardInterrupt as interrupt:
                    if isinstance(interrupt, LaunchError):
                        raise
                    self._interrupted()
            finally:
                self._kill_all()
                for reader in self.readers:
                    reader.join(timeout=2)
                for conn in result_readers:
                    conn.close()
        return [self.results[r] for r in range(self.world_size)]

    # -- waiting

    def _wait(self, conns):
        launched = time.monotonic()
        stop_at = None
        pending = {conn: rank for rank, conn in enumerate(conns)}
        alive = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while pending or alive:
            now = time.monotonic()
            if stop_at is not None and now >= stop_at:
                break
            deadline = self._deadline(launched)
            if now >= deadline:
                if not pending:  # every rank returned; one is slow to exit: the cleanup kills it
                    break
                self._timeout(list(pending.values()))
            if self._all_asleep(pending, stop_at):
                self._timeout(list(pending.values()), asleep=True)
            wait_until = min(deadline, stop_at or deadline, now + 0.25 if self.idle else deadline)
            ready = mp.connection.wait(list(pending) + list(alive), timeout=max(0.0, wait_until - now))
            for item in ready:
                if item in pending:
                    rank = pending[item]
                    if self._receive(item, rank) != "started":
                        pending.pop(item)
                elif item in alive:
                    rank = alive.pop(item)
                    proc = self.procs[rank]
                    proc.join(timeout=1)
                    conn = next((c for c, r in pending.items() if r == rank), None)
                    if conn is not None:  # read what it sent before dying, if anything
                        pending.pop(conn)
                        while conn.poll() and self._receive(conn, rank) == "started":
                            pass
                    if rank not in self.results and rank not in {f.rank for f in self.failures}:
                        for pump in self.readers[2 * rank:2 * rank + 2]:
                            pump.join(timeout=2)  # its last lines (gloo's abort message) first
                        self.failures.append(crash_failure(rank, proc.exitcode, self.tail[rank], time.time()))
            if self.failures and stop_at is None:
                stop_at = time.monotonic() + GRACE_AFTER_FAILURE
        if self.failures:
            failed = {f.rank for f in self.failures}
            stopped = [r for r in range(self.world_size) if r not in self.results and r not in failed]
            raise launch_error(self.failures, self.world_size, stopped)

    def _deadline(self, launched: float) -> float:
        if len(self.started) < self.world_size:
            return launched + self.timeout + STARTUP_GRACE
        return self.all_started_at + self.timeout

    def _receive(self, conn, rank):
        try:
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None  # it died before reporting: its exit is handled with its sentinel
        if status == "started":
            self.started.add(rank)
            if len(self.started) == self.world_size:
                self.all_started_at = time.monotonic()
        elif status == "ok":
            self.results[rank] = value
        else:
            self.failures.append(value)
        return status

    def _running(self) -> list[int]:
        failed = {f.rank for f in self.failures}
        return [r for r in range(self.world_size) if r not in self.results and r not in failed]

    def _all_asleep(self, pending, stop_at) -> bool:
        if self.idle is None or stop_at is not None or len(self.started) < self.world_size or not pending:
            return False
        return self.idle.all_asleep([self.procs[rank].pid for rank in pending.values()])

    def _timeout(self, running, asleep=False):
        stuck = sorted(running)
        stacks = self._stacks(stuck)
        finished = sorted(set(range(self.world_size)) - set(stuck))
        not_started = sorted(set(stuck) - self.started)
        if asleep:
            head = (f"hung: rank(s) {ranks_text(stuck)} of {self.world_size} all waited, none using the CPU, "
                    f"for {self.idle.window:.0f} s (nobody left to wake them)")
        elif not_started:
            head = (f"timed out: rank(s) {ranks_text(not_started)} of {self.world_size} had not finished "
                    f"starting (init_process_group) after {self.timeout + STARTUP_GRACE:g} s")
        else:
            head = (f"timed out after {self.timeout:g} s: rank(s) {ranks_text(stuck)} of {self.world_size} "
                    "were still running")
        if finished:
            head += f" (rank(s) {ranks_text(finished)} had already returned)"
        parts = [head + "."] + [f"rank {r} waits {where_waiting(stacks[r])}" for r in stuck if where_waiting(stacks[r])]
        if stacks and not not_started:
            parts.append(hint(stacks))
        first_with = {}  # a stack shown once: ranks that wait in the same place say so in one line
        for rank in stuck:
            if stacks[rank] in first_with:
                parts.append(f"=== rank {rank}: the same stack as rank {first_with[stacks[rank]]} ===")
                continue
            first_with[stacks[rank]] = rank
            shown = stacks[rank].splitlines()
            shown = shown[:10] + ([f"  ... ({len(shown) - 10} outer frames left out)"] if len(shown) > 10 else [])
            parts.append(f"\n=== rank {rank}: still running; its Python stack ===\n" + "\n".join(shown))
            if self.tail[rank]:
                parts.append(f"--- last output of rank {rank} ---\n" + "".join(self.tail[rank][-5:]))
        parts.append("\nA rank that skips a collective, a send without a matching recv, or two ranks that "
                     "both wait to receive first block forever. Compare the stacks above: which call is "
                     "each rank waiting in? Raise timeout= if the work is just slow.")
        failures = [RankFailure(r, "timeout", "still running at the deadline", stacks[r], time.time())
                    for r in stuck]
        self._kill_all()
        raise LaunchError("\n".join(parts), failures)

    def _interrupted(self):
        running = self._running()
        stacks = self._stacks(running)
        self._kill_all()
        parts = [f"=== rank {r}: interrupted here ===\n{stacks[r]}" for r in running]
        parts.append(f"launch interrupted: rank(s) {ranks_text(running) or 'none'} of {self.world_size} "
                     "were still running and have been stopped (their stacks are above).")
        failures = [RankFailure(r, "interrupted", "interrupted", stacks[r], time.time()) for r in running]
        raise LaunchInterrupted("\n".join(parts), failures) from None

    def _stacks(self, ranks) -> dict[int, str]:
        for rank in ranks:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        stacks = {}
        for rank in ranks:
            try:
                with open(self.stack_paths[rank]) as f:
                    stacks[rank] = trim_stack(f.read()) or "(no stack: the rank did not answer)"
            except OSError:
                stacks[rank] = "(no stack: the rank did not answer)"
        return stacks

    # -- output and cleanup

    def _forward(self, fd, rank, stream_name):
        def pump():
            with open(fd, "rb", buffering=0, closefd=True) as pipe:
                buffer = b""
                while True:
                    chunk = pipe.read(65536)
                    if not chunk:
                        break
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        self._emit(rank, stream_name, line.decode(errors="replace") + "\n")
                if buffer:
                    self._emit(rank, stream_name, buffer.decode(errors="replace") + "\n")

        thread = threading.Thread(target=pump, daemon=True, name=f"labkit-rank-{rank}-{stream_name}")
        thread.start()
        self.readers.append(thread)

    def _emit(self, rank, stream_name, text):
        self.tail[rank] = (self.tail[rank] + [text])[-200:]  # enough for a crash's whole stack
        if self.failures:  # ranks dying after a failure print noise; their tracebacks are in the error
            return
        stream = sys.stdout if stream_name == "stdout" else sys.stderr
        try:
            stream.write(f"[rank {rank}] {text}")
            stream.flush()
        except Exception:
            pass

    def _kill_all(self):
        for proc in self.procs:
            if proc.pid is None:
                continue
            for kill in (os.killpg, os.kill):
                try:
                    kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=5)


NOISE_FRAMES = ("labkit/launching/forked.py", "labkit/launching/launcher.py", "labkit/launching/cluster.py", "multiprocessing/",
                "/IPython/", "/ipykernel/", "/tornado/", "/asyncio/", "/traitlets/", "/zmq/", "runpy.py",
                "/_pytest/", "/pluggy/", "/pytest/", "/jupyter_client/", "/jupyter_core/", "/nbclient/",
                "/labkit/launching/magic.py", "<frozen runpy>", "c10d_logger.py")


def trim_stack(text: str) -> str:
    # faulthandler lists every frame down to the process's start; the launcher's, the kernel's
    # and pytest's frames are noise to a learner looking for where their rank waits.
    lines = [line for line in text.splitlines() if not any(noise in line for noise in NOISE_FRAMES)
             and not line.startswith(("Current thread 0x", "Thread 0x"))]
    return "\n".join(lines).strip("\n")
