"""What runs inside each engine of a session (an ipyparallel engine: forked by the
zygote or a fresh interpreter, never a fork of the kernel).

`join` is called once, on every engine at the same time: the engine becomes rank ``rank`` of one
torch.distributed group (gloo; under nccl, gloo for CPU tensors beside nccl on GPU ``rank``), answers
SIGUSR1 with its stack (faulthandler, to a file the kernel reads) and exits by itself when the kernel
that started it is gone. `run_cell` runs one cell in the engine's own namespace, so each rank keeps
its variables; before it, the kernel's `BEFORE_CELL` hooks run here too (the grading switch's reload
rule: an edited exercise file is seen), and the cell's last expression comes back formatted, as
IPython would show it. A failure comes back as data: the rank's traceback with the cell's own lines.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import signal
import sys
import threading
import time
import traceback

_state: dict = {}  # this engine's rank, world size, hooks


def identify(controller: str = "127.0.0.1") -> dict:
    """Who this engine is: its pid, host, its address on the route to the ``controller`` (the host as the network
    sees it: two nodes, or two network namespaces of one machine, differ there), its machine (who shares pids
    with it), and its place as its launcher set it (None for the local launcher)."""
    import socket

    from labkit.launching.cluster import scheduled_world
    from labkit.session.hosts import machine_id, route_source

    return {"pid": os.getpid(), "host": socket.gethostname(), "address": route_source(controller),
            "machine": machine_id(), "world": scheduled_world()}


def backend_here(requested: str, ranks_on_node: int) -> str:
    """The lab's one backend rule (`choose_backend`), on this engine's node: nccl needs a GPU per rank here."""
    from labkit.launching.launcher import choose_backend

    return choose_backend(requested, ranks_on_node)


def join(rank: int, world_size: int, local_rank: int, backend: str, address: str, store: tuple, timeout: float,
         hooks: bytes, stack_path: str, kernel: tuple, lifeline_port: int | None = None) -> int:
    """Join the session's process group as ``rank`` (under nccl, on GPU ``local_rank``); return this engine's pid.

    ``hooks``: the kernel's BEFORE_CELL hooks, pickled by reference: unpickling them imports their
    module here (the grading switch), which is how the engine gets the same reload rule.
    ``store``: where the ranks meet: ("file", path) when they all run on the kernel's machine, else ("tcp", port),
    the TCPStore the kernel serves at ``address``.
    ``kernel``: (machine, pid, start time) of the kernel that started the session.
    ``lifeline_port``: the kernel's `labkit.session.lifeline` listens there, at ``address``: this engine connects,
    answers through it, and exits when it ends.
    """
    import pickle

    import ipaddress

    from labkit.session.hosts import interface_of, route_source

    if not ipaddress.ip_address(address).is_loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        # engines on several hosts. gloo's own choice is the interface of the host name, which may be loopback or
        # a network the other hosts do not share: take the one this engine reaches the kernel through (lab0, ib0)
        ifname = interface_of(route_source(address))
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if store[0] == "tcp":
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(store[1]),
                          TORCHELASTIC_USE_AGENT_STORE="True")  # the kernel serves the store (Session.start)
    _watch_kernel(*kernel)
    if lifeline_port is not None:
        from labkit.session.lifeline import hold

        hold(address, lifeline_port, rank, threading.get_ident())  # this thread runs the cells too
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    import torch

    torch.set_num_threads(1)
    from labkit.launching.rank_main import init_process_group

    init_process_group(backend, rank, world_size, local_rank, timeout, store[1] if store[0] == "file" else None)
    pickle.loads(hooks)  # imports the hooks' module, which registers them in labkit.launching.notebook
    _state.update(rank=rank, world_size=world_size, stack_file=stack_file)
    return os.getpid()


def _watch_kernel(machine: str, pid: int, started: float) -> None:
    """Exit when the kernel is gone (killed, crashed): no engine outlives the notebook that started it.

    Watched by pid and start time (a reused pid is another process), which works whoever the engine's
    parent is: the kernel (local), mpiexec, or srun's slurmstepd.
    """
    import psutil

    from labkit.session.hosts import machine_id

    if machine_id() != machine:
        return  # another machine: the kernel's pid means nothing here (the controller's heartbeat ends us)

    def gone() -> bool:
        try:
            return abs(psutil.Process(pid).create_time() - started) > 0.01
        except psutil.NoSuchProcess:
            return True

    def watch():
        while not gone():
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="labkit-kernel-watch", daemon=True).start()


def run_cell(source: str, filename: str, context: dict) -> dict:
    """Run a cell in this engine's namespace; {"rank", "result": mimebundle or None, "error": text or None}."""
    from IPython import get_ipython

    shell = get_ipython()
    os.environ.update(context["env"])  # the kernel's environment and path as they are now (LABKIT_IMPL...)
    sys.path[:] = context["path"]
    if os.getcwd() != context["cwd"]:
        os.chdir(context["cwd"])
    rank = _state["rank"]
    import torch
    import torch.distributed as dist

    namespace = shell.user_ns
    namespace.setdefault("torch", torch)
    namespace.setdefault("dist", dist)
    namespace.update(rank=rank, world_size=_state["world_size"])
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        from labkit.launching.notebook import AFTER_CELL, BEFORE_CELL

        for hook in BEFORE_CELL:  # e.g. the grading switch's refresh_changed: edits are seen
            changed = hook() or []
            if changed and rank == 0:
                print(f"(labkit: reloaded {', '.join(m.replace('.', '/') + '.py' for m in changed)} "
                      "in the ranks, edited since the last cell)")
        value = _exec_with_last_expression(source, filename, namespace)
        for hook in AFTER_CELL:  # note the lab modules the cell imported, so that a later edit is seen
            hook()
    except BaseException as err:  # KeyboardInterrupt too: the engine stays, the kernel reports
        return {"rank": rank, "result": None, "error": _cell_traceback(err), "kind": type(err).__name__}
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    result = None
    if value is not None:
        data, _metadata = shell.display_formatter.format(value)
        result = data
    return {"rank": rank, "result": result, "error": None, "kind": None}


def _exec_with_last_expression(source: str, filename: str, namespace: dict):
    """exec the cell; evaluate a final expression and return its value (None when there is none)."""
    import ast

    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), namespace)
    return value


def _cell_traceback(err: BaseException) -> str:
    """The traceback from the cell's first frame on (the engine's own frames left out)."""
    frames = traceback.extract_tb(err.__traceback__)
    keep = next((i for i, f in enumerate(frames) if f.filename.startswith("<%%ranks")), 0)
    lines = ["Traceback (most recent call last):\n"] + traceback.format_list(frames[keep:])
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines)
