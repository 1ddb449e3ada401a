"""Run a function on N ranks with a process group ready, and never hang silently.

    import labkit
    def hello(rank, world_size):
        return rank * 10
    labkit.launch(hello, 4)          # -> [0, 10, 20, 30]

This module is the public API and its checks. The work happens in three small modules:
- `labkit.launching.forked`: the fork launcher (ranks forked from this process, watched, killed);
- `labkit.launching.cluster`: under torchrun, Slurm (srun) or mpiexec, where the processes exist already;
- `labkit.launching.failures`: what went wrong, told as one `LaunchError` with the root cause first.

The backend rule, the same in both paths: ``backend="auto"`` picks nccl when every rank on
this node can have a GPU of its own (GPUs on the node >= ranks on the node), else gloo.
``backend="nccl"`` without a GPU per rank is refused before anything starts.
"""
from __future__ import annotations

import os
import sys
import warnings

from labkit.launching.failures import (LaunchError, LaunchInterrupted, OversubscriptionWarning,  # noqa: F401 - public
                       RankFailure, StubNotImplemented)
from labkit.launching.forked import ForkLauncher
from labkit.launching.cluster import run_as_scheduled_rank, scheduled_world

BACKENDS = ("auto", "gloo", "nccl")
BEFORE_FORK: list = []  # callables run in the caller just before it asks for the ranks
_warned = False


def launch(fn, world_size, *args, backend="auto", timeout=120.0, idle_timeout=None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    ``backend``: "auto" (nccl when this node has a GPU for each of its ranks, else gloo),
    "gloo" or "nccl". ``timeout``: seconds ``fn`` may run once every rank has started; then
    the ranks still running are reported with their Python stacks, killed, and `LaunchError`
    is raised. Under torchrun/Slurm/mpiexec the same timeout is the process group's, and a
    watchdog prints the stacks and ends a process whose ``fn`` outlives it.
    Ctrl-C (the notebook's stop button) prints the running ranks' stacks, kills them and
    raises `LaunchInterrupted` (a KeyboardInterrupt).
    ``idle_timeout``: with forked gloo ranks, report a hang as soon as every running rank has
    slept (used no CPU) for that many seconds (`labkit.launching.progress`); for work that never
    sleeps on purpose, such as the grading cases. Default: $LABKIT_IDLE_TIMEOUT, else off.
    Raises ValueError for bad arguments, `LaunchError` for any failure
    (`StubNotImplemented` when an exercise stub was the root cause).
    """
    return _launch(fn, world_size, args, kwargs, backend, timeout, idle_timeout)


def _launch(fn, world_size, args, kwargs, backend="auto", timeout=120.0, idle_timeout=None, namespace_owner=None):
    """`launch` with its arguments as they are; ``namespace_owner`` names a dict argument in errors."""
    _check_arguments(fn, world_size, backend, timeout)
    world = scheduled_world()
    if world is not None:
        return run_as_scheduled_rank(world, fn, world_size, args, kwargs, backend, float(timeout),
                                     choose_backend)
    backend = choose_backend(backend, world_size)
    _note_oversubscription(world_size)
    for hook in BEFORE_FORK:  # e.g. labkit.grading reloads the exercises a learner just edited
        hook()
    if idle_timeout is None and os.environ.get("LABKIT_IDLE_TIMEOUT"):
        idle_timeout = float(os.environ["LABKIT_IDLE_TIMEOUT"])
    return ForkLauncher(fn, world_size, args, kwargs, backend, float(timeout), idle_timeout, namespace_owner).run()


def rank_device():
    """The device this rank should use: its own GPU under nccl, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend()):  # "nccl" or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# --------------------------------------------------------------------------- checks

def _check_arguments(fn, world_size, backend, timeout):
    if not callable(fn):
        raise ValueError(f"fn must be a function taking (rank, world_size, ...); got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r} ({type(world_size).__name__})")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")


def _cuda_device_count() -> int:
    # The NVML-based check counts GPUs without initialising CUDA in this process,
    # which would make every later fork unable to use CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(backend: str, ranks_on_node: int) -> str:
    """The one backend rule: nccl when this node has a GPU for each of its ranks, else gloo."""
    gpus = _cuda_device_count()
    if backend == "auto":
        backend = "nccl" if gpus >= ranks_on_node else "gloo"
    if backend == "nccl":
        if gpus < ranks_on_node:
            raise LaunchError(
                f"backend='nccl' needs one GPU per rank: {ranks_on_node} ranks on this node, {gpus} GPU(s) "
                "visible. nccl cannot put two ranks on one GPU. Use backend='gloo' (CPU), fewer ranks, "
                "or a node with more GPUs.")
    return backend


def _note_oversubscription(world_size: int) -> None:
    """Once per process: more ranks than cores is fine, but slower. A short note, not a wall."""
    global _warned
    cores = os.cpu_count() or 1
    if world_size <= cores or _warned:
        return
    _warned = True
    message = (f"{world_size} ranks on {cores} CPU cores take turns (oversubscription): they run, "
               "but slower than on cores of their own. Said once per session.")
    if _in_notebook():  # one plain line, not a pink box with a file path
        with warnings.catch_warnings():  # restores showwarning; the caller's filters still apply
            warnings.showwarning = lambda msg, *args, **kwargs: print(f"labkit note: {msg}")
            warnings.warn(message, OversubscriptionWarning)
    else:
        warnings.warn(message, OversubscriptionWarning, stacklevel=3)


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None
