"""One zygote for many processes: what a test run shares, and when a process may use it.

Every process that launches ranks starts its own zygote (`labkit.launching.zygote`): a fresh
interpreter that imports torch and labkit and warms them up, about 4 s of CPU. A learner's kernel
pays that once. The lab's test suite starts about a hundred such processes (notebook kernels, the
train app's scripts, pytest runs inside pytest), so it pays it a hundred times. Here the suite
starts one *shared* zygote (`SharedZygote`, from tests/conftest.py); it listens on a Unix socket
named in the environment, which every child process inherits. For each process that connects it
forks a handler, a copy of itself already warmed up, which then serves that process exactly as
its own zygote would: it forks its ranks and kills them when the process goes (`zygote_server.serve`).
This is Python's ``forkserver`` again, one level up.

A process may use the shared zygote only if the zygote imported exactly what it would have
imported itself: the same interpreter, the same labkit and torch files, and the same environment
(`fingerprint`), except variables read at call time, not at import (`CALL_TIME_ENV`): the
exercise switch, the quick setting, pytest's and Jupyter's own. Any other difference (another
`PYTHONPATH`, `ATEN_CPU_CAPABILITY`, a copy of the repository) and the process starts its own.
`LABKIT_SHARED_ZYGOTE=0` turns sharing off.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

SOCKET_ENV = "LABKIT_ZYGOTE_SOCKET"          # the shared zygote's listening socket
FINGERPRINT_ENV = "LABKIT_ZYGOTE_FINGERPRINT"  # what a process must match to use it
# Read at call time (or never by torch and labkit): a process differing only in these may share.
# Names, and prefixes (ending in "_"); ipykernel sets the pagers and CLICOLOR_FORCE in a kernel.
CALL_TIME_ENV = ("LABKIT_IMPL", "LABKIT_QUICK", "LABKIT_SHARED_ZYGOTE", "LABKIT_ZYGOTE", "LABKIT_ZYGOTE_",
                 "PYTEST_", "JPY_", "PYDEVD_", "MPLBACKEND", "CLICOLOR", "CLICOLOR_", "FORCE_COLOR", "PAGER",
                 "GIT_PAGER", "TERM", "COLUMNS", "LINES", "PWD", "OLDPWD", "SHLVL", "_", "PYTHONUNBUFFERED",
                 "JUPYTER_", "JUPYTERLAB_",  # where Jupyter keeps its settings (the browser test's own)
                 "PYTORCH_NVML_BASED_CUDA_CHECK",  # set by the launcher itself; torch reads it per call
                 "OMP_NUM_THREADS")  # torch reads it at import, but every rank and engine sets its own (one)


def _call_time(key: str) -> bool:
    return any(key == name or (name.endswith("_") and len(name) > 1 and key.startswith(name))
               for name in CALL_TIME_ENV)


def fingerprint(environ=None) -> str:
    """What the zygote's imports depend on: interpreter, labkit's and torch's files, the environment."""
    environ = os.environ if environ is None else environ
    torch_spec = importlib.util.find_spec("torch")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [os.path.realpath(sys.executable), sys.version, package_root,
             torch_spec.origin if torch_spec else "", repr(sys.flags)]
    parts += [f"{key}={value}" for key, value in sorted(environ.items()) if not _call_time(key)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def shared_socket() -> str | None:
    """The shared zygote's socket, if one is announced and this process may use it."""
    path = os.environ.get(SOCKET_ENV)
    if (not path or os.environ.get("LABKIT_SHARED_ZYGOTE") == "0" or os.environ.get("LABKIT_ZYGOTE") == "1"
            or os.environ.get(FINGERPRINT_ENV) != fingerprint()):
        return None
    return path


def serve_shared(owner_fd: int, listener_fd: int, path: str, prepare, serve) -> None:
    """The shared zygote: warm up (`prepare`), then fork a handler running `serve` for each process
    that connects (`zygote_server.serve` and `zygote_server._prepare`, passed in: that module imports this one).

    Its owner made the listening socket, so a process connecting while this one warms up waits in
    the queue. It leaves when its owner's end of `owner_fd` closes, ending every handler (each kills
    its ranks first).
    """
    owner = socket.socket(fileno=owner_fd)
    listener = socket.socket(fileno=listener_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepare()
    handlers: set[int] = set()
    try:
        while True:
            readable, _, _ = select.select([listener, owner], [], [], 1.0)
            while handlers:  # reap the handlers whose process has gone
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                handlers.discard(pid)
            if owner in readable and not owner.recv(1):
                break
            if listener in readable:
                conn, _ = listener.accept()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    owner.close()
                    serve(conn.detach(), prepared=True)  # never returns
                    os._exit(1)
                handlers.add(pid)
                conn.close()
    finally:
        for pid in handlers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        # its folder (socket, log) goes too: an owner killed by SIGKILL cannot remove it
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        os._exit(0)


def zygote_env(caller_has: tuple) -> dict:
    """The environment a zygote process starts with: the caller's, with this labkit first on the path."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above labkit/
    env = dict(os.environ, LABKIT_ZYGOTE="1",
               LABKIT_ZYGOTE_PRELOAD=",".join(m for m in caller_has if m in sys.modules))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in sys.path if p]
                                        + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class SharedZygote:
    """Start the shared zygote and announce it in this process's environment (children inherit it).

    It lives until `close`, or until this process dies (it watches its end of a socket pair). Where
    a compatible one is already announced (a pytest run inside pytest), it is reused, not doubled.
    """

    def __init__(self, caller_has: tuple = ()):
        self.proc = None
        if os.environ.get("LABKIT_SHARED_ZYGOTE") == "0" or shared_socket():
            return
        self.dir = tempfile.mkdtemp(prefix="labkit-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.log = open(os.path.join(self.dir, "log"), "wb")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.owner = mine
        # Bound and listening here, before the zygote has even imported torch: a process that
        # connects early waits in the queue until the zygote is warm, and never finds no socket.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(128)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labkit.launching.zygote", str(theirs.fileno()), str(listener.fileno()), self.path],
            pass_fds=[theirs.fileno(), listener.fileno()], stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=self.log, env=zygote_env(caller_has), close_fds=True, start_new_session=True)
        theirs.close()
        listener.close()
        # the fingerprint before the announcement (the announcing variables are not part of it)
        os.environ[FINGERPRINT_ENV] = fingerprint()
        os.environ[SOCKET_ENV] = self.path

    def close(self) -> None:
        if self.proc is None:
            return
        for name in (SOCKET_ENV, FINGERPRINT_ENV):
            os.environ.pop(name, None)
        self.owner.close()  # the zygote sees it and leaves, ending every handler
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc = None
