"""Warm notebook kernels for the suite's notebook runs: forked from one process that imported torch once.

Each of tests/test_notebooks.py's 32 runs starts a fresh kernel, and every fresh kernel imports torch,
matplotlib and ipykernel before its first cell does anything: about 4.5 s of one core each, 150 s of
the suite's CPU. Here one *factory* process imports them once and forks a kernel per request.

    the runner's KernelManager --starts--> shim (tests/kernel_shim.py: a kernelspec "python3" whose argv
                                                  is this shim, found first through JUPYTER_PATH)
    shim --asks, over a unix socket, with its stdin/stdout/stderr--> factory --forks--> the kernel

The kernel runs `python -m ipykernel_launcher -f <connection file>` exactly as jupyter_client would start
it: the shim's argv, environment (LABKIT_IMPL, LABKIT_QUICK, ...) and working directory, its own session
(process group), the shim's standard streams. Its parent is the factory, so the shim stands in for it:
  - a signal the kernel manager sends the shim (SIGINT: Interrupt; SIGTERM) is forwarded to the kernel;
  - the shim exits with the kernel's exit code, which the factory reports;
  - a shim that dies (the manager's SIGKILL) closes its socket, and the factory kills the kernel's
    process group, as the manager's `killpg` of a kernel it started itself would;
  - the factory's own end (the suite's end) kills every kernel it forked; a kernel also exits if the
    factory dies, by ipykernel's parent poller (JPY_PARENT_PID).

Why forking is sound here: the factory only imports (no autograd, no OpenMP thread pool, no CUDA, no
thread at all), as labkit's zygote does before it forks ranks (CONTRIBUTING, "How a rank is born").
Everything that reads the environment after import (ATEN_CPU_CAPABILITY at the first op, labkit,
LABKIT_IMPL) reads the kernel's own. matplotlib reads MPLBACKEND at import, so the factory sets the
inline backend, as ipykernel does before a kernel's code runs. The factory inherits the suite's
environment, as the runners and their kernels do.

Only the notebook runs use it (tests that kill or inspect a kernel start real ones). Any failure of
the factory falls back to a fresh kernel: the shim execs ipykernel itself. `LABKIT_FRESH_KERNELS=1`
turns the factory off.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOCKET_ENV = "LABKIT_TEST_KERNEL_FACTORY"  # "<socket path>:<factory pid>", read by the shim
PRELOAD = ("torch", "torch.distributed", "matplotlib", "matplotlib.pyplot", "ipykernel.kernelapp",
           "ipykernel.ipkernel", "IPython.core.interactiveshell")
INLINE = "module://matplotlib_inline.backend_inline"
SHIM = Path(__file__).resolve().parent / "kernel_shim.py"


# --------------------------------------------------------------------------- the factory process

def _leave(*_):
    raise SystemExit(0)


def serve(path: str) -> None:
    os.environ.setdefault("MPLBACKEND", INLINE)
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the shim sees the path only once it is served
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the suite's Ctrl-C is the suite's; it then ends us
    kernels: dict[int, socket.socket] = {}  # kernel pid -> its shim's connection
    try:
        while True:
            readable, _, _ = select.select([listener, wake_r, *kernels.values()], [], [], 5.0)
            if wake_r in readable:
                os.read(wake_r, 4096)
            if listener in readable:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _become_kernel(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                kernels[pid] = conn
            for pid, conn in list(kernels.items()):
                if conn in readable and not conn.recv(64):  # the shim is gone: its kernel goes too
                    _kill_group(pid)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = kernels.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                    except OSError:
                        pass
                    conn.close()
    finally:
        for pid in kernels:
            _kill_group(pid)
        os._exit(0)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _receive(conn: socket.socket):
    """(request, [stdin, stdout, stderr]): 8 bytes of length with the three descriptors, then the JSON."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    if len(head) != 8 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError("a request is 8 bytes of length and three descriptors")
    size, body = int(head.decode()), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("the request ended early")
        body += chunk
    return json.loads(body), fds


def _become_kernel(request: dict, fds: list[int]) -> None:
    """In the forked child: take the shim's streams, environment, directory and argv; run ipykernel."""
    code = 1
    try:
        os.setsid()  # its own process group, as jupyter_client starts a kernel (start_new_session)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _close_above(2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # torch read it at import, in the factory
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        # ipykernel exits when the factory is gone (its parent poller); its default was read from
        # JPY_PARENT_PID when the factory imported it, so it is given on the command line
        os.environ["JPY_PARENT_PID"] = str(os.getppid())
        sys.argv = [*request["argv"], f"--IPKernelApp.parent_handle={os.getppid()}"]
        import runpy

        runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what an interpreter's normal exit runs (labkit stops its sessions there)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _close_above(highest: int) -> None:
    """Close every descriptor above ``highest`` (the factory's sockets and pipes are not the kernel's)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = range(highest + 1, 1024)
    for fd in fds:
        if fd > highest:
            try:
                os.close(fd)
            except OSError:
                pass


# --------------------------------------------------------------------------- the suite's side

class KernelFactory:
    """Starts the factory (it warms up while the suite goes on) and says how to reach it."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="labkit-kernels-"))
        self.socket = self.folder / "factory.sock"
        spec = self.folder / "kernels" / "python3"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, str(SHIM), "-f", "{connection_file}"],
            "display_name": "Python 3 (ipykernel, forked by tests/kernel_factory.py)",
            "language": "python", "interrupt_mode": "signal", "metadata": {"debugger": True}}))
        self.process = subprocess.Popen([sys.executable, __file__, str(self.socket)], env=dict(os.environ),
                                        stdin=subprocess.DEVNULL, start_new_session=True)

    def environment(self, env: dict) -> dict:
        """``env`` for a process whose kernels ("python3") should come from the factory."""
        paths = [str(self.folder)] + [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p]
        return dict(env, JUPYTER_PATH=os.pathsep.join(paths), **{SOCKET_ENV: f"{self.socket}:{self.process.pid}"})

    def pids(self) -> set[int]:
        """The factory and every kernel it forked, with their descendants."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return {root.pid, *(child.pid for child in root.children(recursive=True))}
        except psutil.Error:
            return set()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def start() -> KernelFactory | None:
    """A factory, or None where it is turned off (LABKIT_FRESH_KERNELS=1) or cannot start."""
    if os.environ.get("LABKIT_FRESH_KERNELS") == "1" or not hasattr(socket, "recv_fds"):
        return None
    try:
        return KernelFactory()
    except OSError:
        return None


if __name__ == "__main__":
    serve(sys.argv[1])
