"""What runs inside the zygote, the clean process every forked rank is born from (`labkit.launching.zygote`).

Why: on a GPU node torch refuses to run autograd in a process forked after its parent ran a
backward ("Unable to handle autograd's threading in combination with fork-based
multiprocessing"), and refuses CUDA in a process forked after its parent initialised CUDA. A
notebook kernel, or a script that trained before it launched, has done both. So ranks are never
forked from the caller, but from the zygote: a *fresh interpreter* (``python -m
labkit.launching.zygote``, never a fork of the caller) that runs `main` here. It imports torch and
labkit, warms them up without running autograd or touching CUDA (`_prepare`), and then waits
(`serve`). Each launch asks it to fork the ranks: forking a process that has torch imported costs
milliseconds, where ``mp.spawn`` pays a fresh interpreter and ``import torch`` per rank, seconds each.

A launch request arrives with the ranks' stdout, stderr and result pipes (SCM_RIGHTS), made by the
caller; each forked rank keeps its own three and closes the rest of the zygote's plumbing, then
runs `labkit.launching.rank_main`. The zygote reports each rank's exit status (the caller is not
their parent and cannot wait for them), and forks a session's engines on request
(`labkit.launching.zygote_process`). It leaves when the caller's end of the socket closes (the
caller exited or was killed), or on SIGTERM, killing any rank still running, so no process
outlives the caller.

The test suite shares one zygote among its processes instead (`labkit.launching.zygote_sharing`):
each process that connects gets a handler forked from it, which runs `serve` for that process as
its own zygote would, with the same lifetime.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import sys

from labkit.launching.fd_messages import receive, send
from labkit.launching.zygote_sharing import serve_shared

# Modules a rank would otherwise import for itself at every launch; imported once, here.
PRELOAD = ("torch.distributed", "numpy", "labkit.launching.magic", "labkit.launching.rank_main", "cloudpickle")
# ... and, at each launch, the modules of these packages that the caller has imported since its last
# launch: a rank forked after the zygote imported them inherits them, where it would otherwise import
# them itself (about a second per rank for labkit's layers and torch.distributed's, every launch).
# Never the learner's code (exercises, solutions, notebook helpers): the rank imports those from disk,
# so an edit is seen at the next launch. Never modules that may touch CUDA or start workers on import.
PRELOAD_PACKAGES = ("labkit", "torch", "numpy")
NEVER_PRELOAD = ("labkit.session", "torch._inductor", "torch.testing._internal", "torch.utils.cpp_extension",
                 "torch.utils.benchmark", "torch.cuda")


def main(argv: list[str]) -> None:
    """``python -m labkit.launching.zygote <fd>``: serve one caller on the socket `fd`. With a listening
    socket's fd and its path after it, be the test suite's shared zygote (`zygote_sharing.serve_shared`)."""
    if len(argv) > 2:
        serve_shared(int(argv[1]), int(argv[2]), argv[3], prepare=_prepare, serve=serve)
    else:
        serve(int(argv[1]))


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
    once, so the ranks it forks inherit both for free. It runs no autograd and touches no GPU.
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
