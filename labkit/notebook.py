"""Notebook helpers: a cell that needs an unwritten exercise says so in one line, and the notebook goes on.

    from labkit.notebook import needs_exercise, not_yet
    with needs_exercise():                 # the whole cell's body
        result = impl("zero").ZeroAdamW(...)

    try:                                   # or by hand, when the cell has more to do afterwards
        ...
    except NotImplementedError as err:
        not_yet(err)

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
    """Run a block; if an exercise it needs is still a stub, print one line instead of a traceback."""
    try:
        yield
    except NotImplementedError as err:
        not_yet(err)
