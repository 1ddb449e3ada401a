"""Notebook helpers: a cell that needs an unwritten exercise says so in one line, and the notebook goes on.

    from labkit.launching.notebook import needs_exercise, not_yet
    with needs_exercise():                 # the whole cell's body
        result = impl("zero").ZeroAdamW(...)

    try:                                   # or by hand, when the cell has more to do afterwards
        ...
    except NotImplementedError as err:
        not_yet(err)

In a notebook, importing labkit also makes a failed launch read as its message, not as a
traceback through labkit's own frames (`install_ipython_display`): an unwritten stub is one
line, a failed or hung launch is its report (root cause, stacks), then where the cell called it.
And every cell sees the files on disk (`install_cell_refresh`): before each cell, exercise and
solution modules whose file changed are reloaded in place, so a module bound in the setup cell
(``ra = impl("ring_attention")``) and a function imported from one by name run the new code.

Only an unwritten stub (`NotImplementedError`, which `labkit.StubNotImplemented` also is) is
caught; any other error is a real failure of written code and propagates as usual.
"""
from __future__ import annotations

from contextlib import contextmanager

# The core offers the hooks; the grading switch (labkit.grading) fills them when it is imported:
BEFORE_CELL: list = []  # before each cell and each needs_exercise block: reload edited modules, return their names
AFTER_CELL: list = []  # after each cell: note the lab modules it imported (so that a later edit is seen)


def not_yet(err: BaseException) -> None:
    """Print the stub's one-line message and say that the notebook goes on without it."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    print(f"{first}\n(this cell needs that exercise; the notebook goes on without it)")


@contextmanager
def needs_exercise():
    """Run a block; if an exercise it needs is still a stub, print one line instead of a traceback.

    The exercise files are refreshed first (outside a notebook too): the block runs what is on disk.
    """
    for hook in BEFORE_CELL:
        hook()
    try:
        yield
    except NotImplementedError as err:
        not_yet(err)


def _cell_frames(tb) -> list[str]:
    """'cell line N: code' for the frames of the learner's own cells in a traceback."""
    import traceback

    lines = []
    for frame in traceback.extract_tb(tb):
        name = frame.filename
        if name.startswith("<ipython-input") or "/ipykernel_" in name or name.startswith("<%%ranks"):
            lines.append(f"  in your cell, line {frame.lineno}: {frame.line}")
    return lines


def _show_lab_error(shell, etype, value, tb, tb_offset=None):
    from labkit.launching.failures import LaunchError, StubNotImplemented

    lab_stub = isinstance(value, NotImplementedError) and str(value).startswith("exercise ")
    if not isinstance(value, LaunchError) and not lab_stub:  # not ours: IPython's usual traceback
        stb = shell.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
    elif isinstance(value, StubNotImplemented) or lab_stub:
        stb = [f"{etype.__name__}: {str(value).splitlines()[0]}"] + _cell_frames(tb)[-1:]
    else:
        stb = [f"{etype.__name__}: {value}", *_cell_frames(tb)[-1:]]
    shell._showtraceback(etype, value, stb)


def install_ipython_display() -> None:
    """In an IPython kernel, show labkit's launch errors and stub errors without labkit's frames.

    Does nothing outside IPython, or when the kernel already has a custom exception handler.
    """
    import sys

    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "custom_exceptions", ()) not in ((), None):
        return
    from labkit.launching.failures import LaunchError

    shell.set_custom_exc((LaunchError, NotImplementedError), _show_lab_error)


def _refresh_before_cell(shell) -> None:
    """Run the BEFORE_CELL hooks; rebind the notebook's names that hold a reloaded module's functions/classes."""
    import sys
    from types import FunctionType

    changed = [name for hook in BEFORE_CELL for name in (hook() or [])]
    if not changed:
        return
    for name, value in list(shell.user_ns.items()):
        if name.startswith("_") or not isinstance(value, (type, FunctionType)) or "<" in value.__qualname__:
            continue
        current = sys.modules.get(value.__module__) if value.__module__ in changed else None
        for part in value.__qualname__.split(".") if current is not None else ():
            current = getattr(current, part, None)
        if current is not None:
            shell.user_ns[name] = current
    files = ", ".join(f"{m.replace('.', '/')}.py" for m in changed)
    print(f"(labkit: reloaded {files}, edited since the last cell)")


def install_cell_refresh() -> None:
    """In an IPython kernel, run the BEFORE_CELL hooks before every cell and AFTER_CELL after it. Idempotent."""
    import sys

    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "_labkit_refresh", None) is not None:
        return
    shell._labkit_refresh = lambda *_: _refresh_before_cell(shell)
    shell.events.register("pre_run_cell", shell._labkit_refresh)
    shell.events.register("post_run_cell", lambda *_: [hook() for hook in AFTER_CELL])
