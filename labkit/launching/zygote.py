"""The clean process every forked rank is born from (a zygote, as Python's ``forkserver``).

Why: on a GPU node torch refuses to run autograd in a process forked after its parent ran a
backward ("Unable to handle autograd's threading in combination with fork-based
multiprocessing"), and refuses CUDA in a process forked after its parent initialised CUDA. A
notebook kernel, or a script that trained before it launched, has done both. So ranks are never
forked from the caller. The first launch of a process starts one *fresh interpreter*, the zygote
(``python -m labkit.launching.zygote``, never a fork of the caller), which imports torch and
labkit, warms them up without running autograd or touching CUDA, and then waits. Each launch asks
it to fork the ranks: forking a process that has torch imported costs milliseconds, where
``mp.spawn`` pays a fresh interpreter and ``import torch`` per rank, seconds each.

What a rank runs travels by value (`labkit.launching.shipping`); its stdout, stderr and result
pipes are made by the caller and handed over with the request (SCM_RIGHTS), so the caller reads
them as if it had forked the rank itself, and signals the ranks by pid (stacks, kill). The zygote
reports each rank's exit status (the caller is not their parent and cannot wait for them).

Lifetime: one zygote per calling process, started lazily (`get`), or early in a notebook kernel
(`start_soon`) so that its start-up overlaps the learner's reading. It exits when the caller's end
of the socket closes (the caller exited or was killed), killing any rank still running, so no
process outlives the caller. A zygote whose start fails is reported with its own output.

The test suite shares one zygote among its processes instead (`labkit.launching.zygote_sharing`):
each process that connects gets a handler forked from it, which serves that process as its own
zygote would, with the same lifetime.
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from labkit.launching.failures import LaunchError
from labkit.launching.fd_messages import receive, send
from labkit.launching.zygote_sharing import SOCKET_ENV, serve_shared, shared_socket, zygote_env

READY_TIMEOUT = 180.0  # a fresh interpreter importing torch on a loaded 2-core machine
# Modules a rank would otherwise import for itself at every launch; imported once, here.
PRELOAD = ("torch.distributed", "numpy", "labkit.launching.magic", "labkit.launching.rank_main", "cloudpickle")
# ... and these where the caller has imported them (the layers above the core add their own names).
PRELOAD_IF_CALLER_HAS: tuple = ("pytest", "psutil", "nbformat")
# ... and, at each launch, the modules of these packages that the caller has imported since its last
# launch: a rank forked after the zygote imported them inherits them, where it would otherwise import
# them itself (about a second per rank for labkit's layers and torch.distributed's, every launch).
# Never the learner's code (exercises, solutions, notebook helpers): the rank imports those from disk,
# so an edit is seen at the next launch. Never modules that may touch CUDA or start workers on import.
PRELOAD_PACKAGES = ("labkit", "torch", "numpy")
NEVER_PRELOAD = ("labkit.session", "torch._inductor", "torch.testing._internal", "torch.utils.cpp_extension",
                 "torch.utils.benchmark", "torch.cuda")


# --------------------------------------------------------------------------- messages

# --------------------------------------------------------------------------- the zygote itself

def _leave(*_):
    raise SystemExit(0)  # through serve's `finally`: the ranks are killed first


def serve(fd: int, prepared: bool = False) -> None:
    """The zygote's loop: fork ranks on request, report their exits, leave when the caller does."""
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's to handle
    signal.signal(signal.SIGTERM, _leave)
    if not prepared:
        _prepare()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, tuple] = {}  # pid -> (launch id, rank)
    send(sock, ("ready", os.getpid()))
    try:
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [], None if not children else 1.0)
            if wake_r in readable:
                os.read(wake_r, 4096)
            _reap(children, sock)
            if sock in readable:
                try:
                    (kind, request), fds = receive(sock, max_fds=253)
                except (EOFError, OSError):
                    break  # the caller is gone
                if kind == "launch":
                    _import_quietly(request.get("preload", ()))
                    _fork_ranks(request, fds, children, sock, (wake_r, wake_w))
                elif kind == "process":  # a session's engine (labkit.launching.zygote_process)
                    _fork_process(request, fds, children, sock, (wake_r, wake_w))
                elif kind == "stop":
                    break
    finally:
        for pid in children:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        os._exit(0)


def _prepare() -> None:
    """Import and warm up everything a rank needs, without autograd, CUDA or OpenMP's threads."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    prewarm()
    # The caller's names (LABKIT_ZYGOTE_PRELOAD): an import here only saves each rank the time; a
    # failure is the rank's to report, so the zygote depends on none of them.
    _import_quietly(list(PRELOAD) + os.environ.pop("LABKIT_ZYGOTE_PRELOAD", "").split(","))


def _import_quietly(names) -> None:
    """Import what the ranks will need; a failure is the rank's to report, so the zygote depends on none."""
    import importlib

    import torch

    for name in filter(None, names):
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - a rank that needs it will say why
                pass
    assert not torch.cuda.is_initialized(), "the zygote must never initialise CUDA"


def worth_preloading(name: str) -> bool:
    """A module the zygote may import for the ranks: in `PRELOAD_PACKAGES`, not under `NEVER_PRELOAD`."""
    def under(prefixes):
        return any(name == p or name.startswith(p + ".") for p in prefixes)
    return under(PRELOAD_PACKAGES) and not under(NEVER_PRELOAD)


_prewarmed = False


def prewarm():
    """Import, once, in this process what every forked rank would otherwise import for itself.

    The first torch.optim optimizer a process builds imports torch._dynamo (seconds on a
    laptop), and the first ``assert_close`` imports numpy's testing helpers. The zygote does this
    once, so the ranks it forks inherit both for free; the training entry point and the grading
    runner call it too (`labkit.launching.launcher.prewarm`). It runs no autograd and touches no GPU.
    """
    global _prewarmed
    if not _prewarmed:
        import torch
        import torch._dynamo  # noqa: F401

        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
        _prewarmed = True


def _reap(children: dict, sock) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        launch_id, rank = children.pop(pid, (None, None))
        if launch_id is not None:
            try:
                send(sock, ("exit", (launch_id, rank, os.waitstatus_to_exitcode(status))))
            except OSError:
                pass


def _fork_ranks(request: dict, fds: list, children: dict, sock, wake) -> None:
    from labkit.launching.rank_main import rank_main

    pids = []
    for rank in range(request["world_size"]):
        mine = fds[3 * rank:3 * rank + 3]
        pid = os.fork()
        if pid == 0:  # the rank: nothing of the zygote's plumbing stays open in it
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for other in [fd for fd in fds if fd not in mine] + list(wake) + [sock.fileno()]:
                try:
                    os.close(other)
                except OSError:
                    pass
            rank_main(rank, request, *mine)  # never returns
            os._exit(1)
        children[pid] = (request["launch_id"], rank)
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    send(sock, ("forked", (request["launch_id"], pids)))


def _fork_process(request: dict, fds: list, children: dict, sock, wake) -> None:
    from labkit.launching import zygote_process

    _import_quietly([request["module"]])  # once: the later engines inherit it
    pid = os.fork()
    if pid == 0:
        zygote_process.become(request, fds, list(wake) + [sock.fileno()])  # never returns
    children[pid] = (None, None)  # reaped without a report: the caller watches it by pid
    for fd in fds:
        os.close(fd)
    send(sock, ("process", pid))


# --------------------------------------------------------------------------- the caller's handle

class ZygoteError(LaunchError):
    """The zygote could not be started, or died."""


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
        """Ask for ``request['world_size']`` ranks; their pids, in rank order."""
        new = [name for name in list(sys.modules) if name not in self.preloaded and worth_preloading(name)]
        self.preloaded.update(new)
        send(self.sock, ("launch", dict(request, preload=new)), fds)
        while True:
            kind, value = self.next_message(timeout=READY_TIMEOUT)
            if kind == "forked" and value[0] == request["launch_id"]:
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
    if len(sys.argv) > 2:
        serve_shared(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], prepare=_prepare, serve=serve)
    else:
        serve(int(sys.argv[1]))
