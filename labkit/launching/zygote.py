"""The caller's side of the zygote, the clean process every forked rank is born from (as Python's ``forkserver``).

Why: on a GPU node torch refuses autograd in a process forked after its parent ran a backward, and
CUDA in one forked after its parent initialised CUDA; a notebook kernel, or a script that trained
before it launched, has done both. So ranks are never forked from the caller but from a zygote: a
*fresh interpreter* (``python -m labkit.launching.zygote``, never a fork of the caller) that has
imported torch and labkit and forks ranks in milliseconds. What runs in that process, and why it
stays clean, is `labkit.launching.zygote_server`; this module is its caller's handle (`Zygote`) and
the process's entry point (``__main__`` below hands over to `zygote_server.main`).

What a rank runs travels by value (`labkit.launching.shipping`); its stdout, stderr and result
pipes are made by the caller and handed over with the request (SCM_RIGHTS), so the caller reads
them as if it had forked the rank itself, and signals the ranks by pid (stacks, kill). The zygote
reports each rank's exit status (the caller is not their parent and cannot wait for them).

Lifetime: one zygote per calling process, started lazily (`get`), or early in a notebook kernel
(`start_soon`) so that its start-up overlaps the learner's reading. It exits when the caller's end
of the socket closes (the caller exited or was killed), killing any rank still running, so no
process outlives the caller. A zygote whose start fails is reported with its own output.

The test suite shares one zygote among its processes instead (`labkit.launching.zygote_sharing`):
a process that may share connects to it and gets a handler forked from it, which serves that
process as its own zygote would, with the same lifetime.
"""
from __future__ import annotations

import atexit
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

from labkit.launching import zygote_server
from labkit.launching.failures import LaunchError
from labkit.launching.fd_messages import receive, send
from labkit.launching.zygote_sharing import SOCKET_ENV, shared_socket, zygote_env

READY_TIMEOUT = 180.0  # a fresh interpreter importing torch on a loaded 2-core machine
# Modules the zygote imports at its start where the caller has imported them (LABKIT_ZYGOTE_PRELOAD;
# the layers above the core add their own names). What it always imports: `zygote_server.PRELOAD`.
PRELOAD_IF_CALLER_HAS: tuple = ("pytest", "psutil", "nbformat")


class ZygoteError(LaunchError):
    """The zygote could not be started, or died."""


class ForkInterrupted(KeyboardInterrupt):
    """A Ctrl-C that came while the zygote was forking the ranks: `Zygote.fork` waited for their pids (`pids`), so
    that the caller can stop them; without them, ranks started in that window would run on."""

    def __init__(self, pids: list[int]):
        super().__init__()
        self.pids = pids


class Zygote:
    """The caller's handle on its zygote: start it, ask it to fork ranks, hear about their exits."""

    def __init__(self):
        self.ready = False
        self.log = tempfile.TemporaryFile(prefix="labkit-zygote-")
        self.proc = None
        shared = shared_socket()
        if shared:  # a handler of the shared zygote (zygote_sharing); its pid comes with "ready"
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(shared)
                self.pid = None
            except OSError:  # gone or never came up: this process starts its own
                self.sock.close()
                shared = None
        if not shared:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock = mine
            # The caller's path, this labkit first: the zygote imports the same code as its caller.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "labkit.launching.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                env=zygote_env(PRELOAD_IF_CALLER_HAS), close_fds=True, start_new_session=True)
            theirs.close()
            self.pid = self.proc.pid
        self.exits: list = []  # exit reports that arrived while waiting for something else
        self.preloaded: set = set()  # module names already sent to be imported there

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        if self.ready:
            return
        readable, _, _ = select.select([self.sock], [], [], timeout)
        try:
            if not readable:
                raise EOFError(f"it did not answer within {timeout:g} s")
            (kind, pid), _ = receive(self.sock)
            if kind != "ready":
                raise EOFError(f"it said {kind!r} instead of 'ready'")
            self.pid = pid
        except (EOFError, OSError) as error:
            self.close()
            raise ZygoteError(f"the process that forks the ranks (labkit.launching.zygote) did not start: "
                              f"{error}.\n{self.output()}") from None
        self.ready = True

    def output(self) -> str:
        if self.proc is None:  # a shared zygote's handler writes to the shared zygote's log, beside its socket
            try:
                with open(os.path.join(os.path.dirname(os.environ.get(SOCKET_ENV, "")), "log"), "rb") as log:
                    text = log.read().decode(errors="replace").strip()
            except OSError:
                text = ""
            return f"The shared zygote's output:\n{text[-3000:]}" if text else "It printed nothing."
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip()
        return f"Its output:\n{text[-3000:]}" if text else "It printed nothing."

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is None or _running(self.pid)  # a shared zygote's handler (not our child)

    def fork(self, request: dict, fds: list) -> list[int]:
        """Ask for ``request['world_size']`` ranks; their pids, in rank order. A Ctrl-C once the request is sent
        waits for the pids and raises `ForkInterrupted` with them (the ranks exist by then)."""
        new = [name for name in list(sys.modules)
               if name not in self.preloaded and zygote_server.worth_preloading(name)]
        self.preloaded.update(new)
        send(self.sock, ("launch", dict(request, preload=new)), fds)
        interrupted = False
        while True:
            try:
                kind, value = self.next_message(timeout=READY_TIMEOUT)
            except KeyboardInterrupt:
                interrupted = True  # the zygote answers within milliseconds: hear it, then stop what it forked
                continue
            if kind == "forked" and value[0] == request["launch_id"]:
                if interrupted:
                    raise ForkInterrupted(value[1])
                return value[1]
            if kind == "exit":
                self.exits.append(value)

    def start_process(self, request: dict, fds: list) -> int:
        """Fork a long-lived process (`labkit.launching.zygote_process.request`); its pid."""
        send(self.sock, ("process", request), fds)
        while True:
            kind, value = self.next_message(timeout=READY_TIMEOUT)
            if kind == "process":
                return value
            if kind == "exit":
                self.exits.append(value)

    def next_message(self, timeout: float | None = None):
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            raise ZygoteError(f"the process that forks the ranks did not answer within {timeout:g} s")
        try:
            message, _ = receive(self.sock)
        except (EOFError, OSError):
            raise ZygoteError(f"the process that forks the ranks (pid {self.pid}) died. "
                              f"{self.output()}") from None
        return message

    def fileno(self) -> int:  # so that multiprocessing.connection.wait can watch it
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
            self.log.close()
        finally:
            if self.proc is None:  # a handler: it leaves on the socket's close; wait for that
                deadline = time.monotonic() + 5
                while self.pid is not None and _running(self.pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
                return
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_zygote: Zygote | None = None
_owner_pid: int | None = None
_lock = threading.Lock()


def get() -> Zygote:
    """This process's zygote, started (or restarted, if it died) and ready."""
    global _zygote
    with _lock:
        if _zygote is not None and (_owner_pid != os.getpid() or not _zygote.alive()):
            _zygote = None  # inherited through a fork, or dead: start a new one
        if _zygote is None:
            _start()
        zygote = _zygote
    zygote.wait_ready()
    return zygote


def start_soon() -> None:
    """Start this process's zygote now, without waiting for it (a notebook kernel's first import)."""
    if os.environ.get("LABKIT_ZYGOTE") == "1":
        return
    with _lock:
        if _zygote is None:
            _start()


def _start() -> None:
    global _zygote, _owner_pid
    _zygote, _owner_pid = Zygote(), os.getpid()
    atexit.register(stop)  # close it cleanly at exit; a killed caller's zygote leaves on its own


def current_pid() -> int | None:
    """The pid of this process's zygote, if one runs (tests tell it apart from leftover ranks)."""
    return _zygote.pid if _zygote is not None and _owner_pid == os.getpid() and _zygote.alive() else None


def stop() -> None:
    """Stop this process's zygote (a new one starts at the next launch)."""
    global _zygote
    with _lock:
        if _zygote is not None and _owner_pid == os.getpid():
            _zygote.close()
        _zygote = None


if __name__ == "__main__":
    zygote_server.main(sys.argv)
