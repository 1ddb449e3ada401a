"""``%%ranks N``: run a notebook cell on N ranks through `labkit.launch`.

    %load_ext labkit
    %%ranks 4 --timeout 30
    t = torch.ones(2) * rank
    dist.all_reduce(t)
    print(t)

The cell sees the notebook's variables plus ``rank``, ``world_size``, ``torch`` and ``dist``:
the variables the cell names are copied to the ranks by value (`labkit.launching.shipping`; the
ranks are fresh processes, see `labkit.launching.zygote`), and one that cannot travel is named
before any rank starts. Errors and timeouts behave exactly as in `labkit.launch`. Assignments made
in the cell stay in the ranks.

Without a number, ``%%ranks [--targets 0,2]`` runs the cell on a session's persistent ranks, started
with ``%ranks start 4`` (`labkit.session`): each rank keeps its variables from cell to cell.
"""
from __future__ import annotations

import argparse
import linecache
import shlex

import types

from labkit.launching.launcher import _launch

_parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
_parser.add_argument("world_size", type=int)
_parser.add_argument("--timeout", type=float, default=120.0)
_parser.add_argument("--backend", default="auto")


def _run_cell(rank, world_size, source, filename, namespace):
    import torch
    import torch.distributed as dist

    scope = dict(namespace, rank=rank, world_size=world_size, torch=torch, dist=dist)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show the cell
    exec(compile(source, filename, "exec"), scope)


def names_used(code: types.CodeType) -> set[str]:
    """Every name the code (and the functions, classes and comprehensions inside it) may look up."""
    names = set(code.co_names) | set(code.co_varnames) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_used(const)
    return names


def ranks(line: str, cell: str, user_ns: dict | None = None):
    try:
        options = _parser.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError("usage: %%ranks N [--timeout SECONDS] [--backend auto|gloo|nccl]") from None
    filename = f"<%%ranks cell {abs(hash(cell)) % 10**8}>"
    # Registered so that tracebacks from the ranks show the cell's lines.
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    try:
        used = names_used(compile(cell, filename, "exec"))
    except SyntaxError:
        used = set()  # the ranks report it, at the cell's line
    namespace = {name: value for name, value in (user_ns or {}).items()
                 if name in used and not name.startswith("__")}
    _launch(_run_cell, options.world_size, (cell, filename, namespace), {},
            backend=options.backend, timeout=options.timeout, namespace_owner="the %%ranks cell")


def load_ipython_extension(ipython):
    def ranks_magic(line, cell):
        if not line.split()[:1] or not line.split()[0].isdigit():  # no N: the cell runs on the session's ranks
            from labkit.session.session import run_on_session

            return run_on_session(line, cell)
        ranks(line, cell, ipython.user_ns)

    def ranks_line_magic(line):  # %ranks start N | stop | restart: a session of persistent ranks
        from labkit.session.session import ranks_line

        said = ranks_line(line)
        if not isinstance(said, str):
            return said  # %ranks timeline: the spans, for `spans = %ranks timeline`
        print(said)

    ipython.register_magic_function(ranks_magic, magic_kind="cell", magic_name="ranks")
    ipython.register_magic_function(ranks_line_magic, magic_kind="line", magic_name="ranks")
