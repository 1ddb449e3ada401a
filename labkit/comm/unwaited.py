"""Catch a received tensor used before its ``wait()``: irecv requests that nobody waited for.

``dist.irecv`` returns at once; the data lands in the buffer later, when the request is
waited for (or whenever gloo gets to it). Code that reads the buffer without ``wait()`` gets
stale values, or NaN, some of the time: the grading case fails with a wall of numbers and
nothing points at the cause. `watch_irecv` is a hook of the one interception point
(`labkit.comm.intercept`) for the duration of a case: it hands back each ``irecv`` request in
a thin proxy that notes ``wait()`` (and a True ``is_completed()``), and `WatchedRecvs.hint`
says how many were never waited for.
"""
from __future__ import annotations

from contextlib import contextmanager

from labkit.comm.intercept import Hook, intercept


class _Request:
    """A ``Work`` from ``dist.irecv`` that remembers whether it was waited for."""

    def __init__(self, work):
        self._work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        done = self._work.is_completed()
        self.waited = self.waited or done
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


class WatchedRecvs(list):
    def hint(self) -> str:
        missed = [r for r in self if not r.waited]
        if not missed:
            return ""
        return (f"hint: {len(missed)} of the {len(self)} irecv requests of this rank were never waited for: "
                "a received tensor used before its wait()? (irecv returns at once; the data arrives later)")


class _IrecvWatch(Hook):
    def __init__(self, watched: WatchedRecvs):
        self.watched = watched

    def after(self, call, result):
        if call.op != "irecv" or result is None:  # None: this rank is not in the group
            return None
        self.watched.append(_Request(result))
        return self.watched[-1]


@contextmanager
def watch_irecv():
    """Within the block, ``torch.distributed.irecv`` requests are watched; yields their list."""
    watched = WatchedRecvs()
    with intercept(_IrecvWatch(watched)):
        yield watched
