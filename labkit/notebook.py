"""Notebook helpers: a cell that needs an unwritten exercise says so in one line, and the notebook goes on.

    from labkit.notebook import needs_exercise, not_yet
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


def not_yet(err: BaseException) -> None:
    """Print the stub's one-line message and say that the notebook goes on without it."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    print(f"{first}\n(this cell needs that exercise; the notebook goes on without it)")


@contextmanager
def needs_exercise():
    """Run a block; if an exercise it needs is still a stub, print one line instead of a traceback.

    The exercise files are refreshed first (outside a notebook too): the block runs what is on disk.
    """
    from .grading import refresh_changed

    refresh_changed()
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
    from .failures import LaunchError, StubNotImplemented

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
    from .failures import LaunchError

    shell.set_custom_exc((LaunchError, NotImplementedError), _show_lab_error)


def _refresh_before_cell(shell) -> None:
    """Reload edited lab modules; rebind the notebook's names that hold their old functions/classes."""
    from .grading import current_version, refresh_changed

    changed = refresh_changed()
    if not changed:
        return
    for name, value in list(shell.user_ns.items()):
        if not name.startswith("_") and getattr(value, "__module__", None) in changed:
            shell.user_ns[name] = current_version(value)
    files = ", ".join(f"{m.replace('.', '/')}.py" for m in changed)
    print(f"(labkit: reloaded {files}, edited since the last cell)")


def install_cell_refresh() -> None:
    """In an IPython kernel, run `_refresh_before_cell` before every cell. Idempotent."""
    import sys

    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "_labkit_refresh", None) is not None:
        return
    from .grading import _stamp_new_modules

    shell._labkit_refresh = lambda *_: _refresh_before_cell(shell)
    shell.events.register("pre_run_cell", shell._labkit_refresh)
    # modules a cell imported are stamped as it ends, so an edit before the next cell is seen
    shell.events.register("post_run_cell", lambda *_: _stamp_new_modules())
