"""``%%ranks N``: run a notebook cell on N ranks through `labkit.launch`.

    %load_ext labkit
    %%ranks 4 --timeout 30
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    print(t)

The cell sees the notebook's variables (the ranks are forked from the kernel) plus
``rank``, ``world_size``, ``torch`` and ``dist``. Errors and timeouts behave exactly
as in `labkit.launch`. Assignments made in the cell stay in the ranks.
"""
from __future__ import annotations

import argparse
import linecache
import shlex

from labkit.launching.launcher import launch

_parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
_parser.add_argument("world_size", type=int)
_parser.add_argument("--timeout", type=float, default=120.0)
_parser.add_argument("--backend", default="auto")


def _run_cell(rank, world_size, source, filename, namespace):
    import torch
    import torch.distributed as dist

    scope = dict(namespace, rank=rank, world_size=world_size, torch=torch, dist=dist)
    exec(compile(source, filename, "exec"), scope)


def ranks(line: str, cell: str, user_ns: dict | None = None):
    try:
        options = _parser.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError("usage: %%ranks N [--timeout SECONDS] [--backend auto|gloo|nccl]") from None
    filename = f"<%%ranks cell {abs(hash(cell)) % 10**8}>"
    # Registered so that tracebacks from the ranks show the cell's lines.
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    launch(_run_cell, options.world_size, cell, filename, user_ns or {},
           backend=options.backend, timeout=options.timeout)


def load_ipython_extension(ipython):
    def ranks_magic(line, cell):
        ranks(line, cell, ipython.user_ns)

    ipython.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
