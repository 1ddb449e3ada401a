"""What a GPU node refuses, emulated on a CPU-only machine, so that CI sees it.

On a machine with a GPU, torch's autograd engine starts its device threads at the first backward
and registers an at-fork handler: every process forked afterwards fails at its first backward
with "Unable to handle autograd's threading in combination with fork-based multiprocessing".
Likewise a process forked after CUDA was initialised fails at its first CUDA call ("Cannot
re-initialize CUDA in forked subprocess"). A CPU-only torch does neither, so a launcher that forks
ranks from a process that trained passes every test on a laptop and fails on the GPU node (it
did, 2026-11-26: 142 + 28 failures on an H200).

`refuse_like_a_gpu_node()` makes every process forked from this one from now on behave as it would
on a GPU node: backward raises torch's message, and so does CUDA's initialisation. Call it after a
backward, as the GPU node's torch does. Processes started fresh (the lab's zygote) are unaffected,
exactly as on the node.
"""
from __future__ import annotations

import os

AUTOGRAD_MESSAGE = ("Unable to handle autograd's threading in combination with fork-based multiprocessing. "
                    "See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork")
CUDA_MESSAGE = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
                "you must use the 'spawn' start method")
_installed = False


def refuse_like_a_gpu_node() -> None:
    """From now on, a process forked from this one refuses autograd and CUDA, as on a GPU node."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=_refuse_in_this_child)
        _installed = True


class _RefusingEngine:
    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        raise RuntimeError(AUTOGRAD_MESSAGE)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _refuse_in_this_child() -> None:
    import torch.autograd.variable as variable
    import torch.cuda

    if not isinstance(variable.Variable._execution_engine, _RefusingEngine):
        variable.Variable._execution_engine = _RefusingEngine(variable.Variable._execution_engine)

    def lazy_init():
        raise RuntimeError(CUDA_MESSAGE)

    torch.cuda._lazy_init = lazy_init
