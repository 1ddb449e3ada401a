"""The fork launcher: N ranks forked from the zygote, watched from here until they return, fail or hang.

In the order things happen (`labkit.launch` has checked the arguments and chosen the backend):

1. The function, its arguments and the notebook objects they use are packed
   (`labkit.launching.shipping`); what cannot travel is named before any process starts.
2. This process names the ranks' rendezvous store (a file: `store_path`), makes each rank's result,
   stdout and stderr pipes, and asks the zygote (`labkit.launching.zygote`: a clean process that
   never ran autograd or touched CUDA) to fork one child per rank with those pipes. What each rank
   then does is `labkit.launching.rank_main`.
3. This process waits for results, exits (the zygote reports them) and the deadline. The
   ``timeout`` counts from the moment every rank has started (so a slow start on a busy machine
   never counts as a hang); start-up itself gets ``timeout + STARTUP_GRACE`` seconds. On the first
   failure it gives the other ranks a moment to report, then kills the rest and raises
   (`labkit.launching.failures`). On the deadline, or on Ctrl-C, it asks the running ranks for
   their Python stacks (faulthandler on SIGUSR1), kills everything and raises.
"""
from __future__ import annotations

import itertools
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time

from labkit.launching import shipping, zygote
from labkit.launching.progress import IdleWatch
from labkit.launching.rank_main import flush_std_streams, to_cpu  # noqa: F401 - used by the cluster path
from labkit.launching.stacks import hint, where_waiting
from labkit.launching.failures import (LaunchError, LaunchInterrupted, RankFailure, crash_failure, launch_error,
                       ranks_text)

GRACE_AFTER_FAILURE = 1.5  # seconds the other ranks get to report their own failure
STARTUP_GRACE = 60.0  # extra seconds start-up (fork + rendezvous) may take on a busy machine
_launch_ids = itertools.count()


def store_path(folder: str) -> str:
    """Where the launch's ranks meet: a torch FileStore in the launch's own folder, not a TCPStore.

    All ranks of a forked launch share this host, so a file does what a TCP store would, without
    a port (nothing to collide with another launch) and without a name lookup. torch's TCPStore
    formats each connection's address with getnameinfo, which asks DNS for the name of
    ::ffff:127.0.0.1 (/etc/hosts lists 127.0.0.1 only); where the resolver drops the query, that
    connection waits the resolver's 5 s: 4 of 100 connections in this project's sandbox (2026-11-27).
    The folder is removed when the launch ends, whatever its ranks did."""
    return os.path.join(folder, "store")


# --------------------------------------------------------------------------- the parent

class ForkLauncher:
    def __init__(self, fn, world_size, args, kwargs, backend, timeout, idle_timeout=None, namespace_owner=None):
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.backend, self.timeout, self.namespace_owner = backend, timeout, namespace_owner
        # every running rank asleep this long (gloo only: see labkit.launching.progress) = a hang
        self.idle = IdleWatch(idle_timeout) if idle_timeout and backend == "gloo" else None
        self.results: dict[int, object] = {}
        self.started: set[int] = set()
        self.all_started_at: float | None = None
        self.failures: list[RankFailure] = []
        self.pids: list[int] = []
        self.exit_codes: dict[int, int] = {}  # rank -> exit code, as the zygote reported it
        self.readers: list[threading.Thread] = []
        self.tail: dict[int, list[str]] = {r: [] for r in range(world_size)}

    def run(self) -> list:
        payload = shipping.pack(self.fn, self.args, self.kwargs, self.namespace_owner)  # names what cannot travel
        self.zygote = zygote.get()
        self.launch_id = next(_launch_ids)
        # gloo's own timeout comes well after the launcher's deadline (start-up included).
        pg_timeout = 2 * self.timeout + STARTUP_GRACE + 60
        with tempfile.TemporaryDirectory(prefix="labkit-launch-") as tmp:
            stack_paths = [os.path.join(tmp, f"stack-{r}.txt") for r in range(self.world_size)]
            self.stack_paths = stack_paths
            request = dict(launch_id=self.launch_id, world_size=self.world_size, backend=self.backend,
                           store_path=store_path(tmp), pg_timeout=pg_timeout, stack_paths=stack_paths,
                           env=dict(os.environ), path=list(sys.path), cwd=os.getcwd(), payload=payload,
                           sources=shipping.cell_sources())
            result_readers, theirs = [], []
            try:
                flush_std_streams()
                for rank in range(self.world_size):
                    result_r, result_w = os.pipe()
                    out_r, out_w = os.pipe()
                    err_r, err_w = os.pipe()
                    theirs += [result_w, out_w, err_w]
                    result_readers.append(multiprocessing.connection.Connection(result_r, writable=False))
                    self._forward(out_r, rank, "stdout")
                    self._forward(err_r, rank, "stderr")
                try:
                    try:
                        self.pids = self.zygote.fork(request, theirs)
                    finally:
                        for fd in theirs:
                            os.close(fd)
                        theirs = []
                    self._wait(result_readers)
                except KeyboardInterrupt as interrupt:
                    if isinstance(interrupt, LaunchError):
                        raise
                    if isinstance(interrupt, zygote.ForkInterrupted):  # Ctrl-C while the ranks were being forked
                        self.pids = interrupt.pids
                    if not self.pids:  # before the request reached the zygote: no rank to stop
                        raise
                    self._interrupted()
            finally:
                for fd in theirs:  # the request never reached the zygote
                    os.close(fd)
                self._kill_all()
                for reader in self.readers:
                    reader.join(timeout=2)
                for conn in result_readers:
                    conn.close()
        return [self.results[r] for r in range(self.world_size)]

    # -- waiting

    def _exits(self, timeout: float | None = 0.0) -> list[int]:
        """Ranks of this launch whose exit the zygote reported (waiting up to ``timeout`` for the first)."""
        ranks = []
        backlog, self.zygote.exits = self.zygote.exits, []
        for launch_id, rank, code in backlog:
            if launch_id == self.launch_id:
                self.exit_codes[rank] = code
                ranks.append(rank)
        if ranks:
            return ranks
        if timeout is None or multiprocessing.connection.wait([self.zygote], timeout=timeout):
            kind, value = self.zygote.next_message()
            if kind == "exit" and value[0] == self.launch_id:
                self.exit_codes[value[1]] = value[2]
                ranks.append(value[1])
        return ranks

    def _wait(self, conns):
        launched = time.monotonic()
        stop_at = None
        pending = {conn: rank for rank, conn in enumerate(conns)}
        alive = set(range(self.world_size))
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
            ready = multiprocessing.connection.wait(list(pending) + [self.zygote],
                                                    timeout=max(0.0, wait_until - now))
            for item in ready:
                if item in pending:
                    rank = pending[item]
                    if self._receive(item, rank) != "started":
                        pending.pop(item)
            exited = self._exits() if self.zygote in ready or self.zygote.exits else []
            for rank in exited:
                alive.discard(rank)
                conn = next((c for c, r in pending.items() if r == rank), None)
                if conn is not None:  # read what it sent before dying, if anything
                    pending.pop(conn)
                    while conn.poll() and self._receive(conn, rank) == "started":
                        pass
                if rank not in self.results and rank not in {f.rank for f in self.failures}:
                    for pump in self.readers[2 * rank:2 * rank + 2]:
                        pump.join(timeout=2)  # its last lines (gloo's abort message) first
                    self.failures.append(crash_failure(rank, self.exit_codes[rank], self.tail[rank], time.time()))
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
        return self.idle.all_asleep([self.pids[rank] for rank in pending.values()])

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
                os.kill(self.pids[rank], signal.SIGUSR1)
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
        """Kill every rank of this launch (and what it started), then hear each one's exit: none is left.

        All are stopped (SIGSTOP) before any is killed: a rank killed first closes its connections, and a
        peer still running would see that as a failed recv and report it as its own failure (seen once in
        `make test-stress`: a hung case recorded as rank 1's "remote worker crashing")."""
        alive = [pid for rank, pid in enumerate(self.pids) if rank not in self.exit_codes]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in alive:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        give_up = time.monotonic() + 10
        while len(self.exit_codes) < len(self.pids) and time.monotonic() < give_up:
            try:
                self._exits(timeout=max(0.0, give_up - time.monotonic()))
            except zygote.ZygoteError:
                break  # the zygote died: it took its ranks with it (PR_SET_PDEATHSIG)


NOISE_FRAMES = ("labkit/launching/forked.py", "labkit/launching/launcher.py", "labkit/launching/cluster.py",
                "labkit/launching/rank_main.py", "labkit/launching/shipping.py", "labkit/launching/zygote.py",
                "labkit/launching/zygote_server.py",
                "/cloudpickle/", "multiprocessing/",
                "/IPython/", "/ipykernel/", "/tornado/", "/asyncio/", "/traitlets/", "/zmq/", "runpy.py",
                "/_pytest/", "/pluggy/", "/pytest/", "/jupyter_client/", "/jupyter_core/", "/nbclient/",
                "/labkit/launching/magic.py", "<frozen runpy>", "c10d_logger.py")


def trim_stack(text: str) -> str:
    # faulthandler lists every frame down to the process's start; the launcher's, the kernel's
    # and pytest's frames are noise to a learner looking for where their rank waits.
    lines = [line for line in text.splitlines() if not any(noise in line for noise in NOISE_FRAMES)
             and not line.startswith(("Current thread 0x", "Thread 0x"))]
    return "\n".join(lines).strip("\n")
