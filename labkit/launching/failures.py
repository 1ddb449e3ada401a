"""What went wrong in a launch, told so that a learner can act on it.

The launchers (`labkit.launching.forked`, `labkit.launching.cluster`) collect one `RankFailure` per rank that
raised, crashed, hung or was interrupted; `launch_error` turns them into one `LaunchError`:
the root cause first, in full; ranks that only failed *because* another rank had died
(gloo's "Connection closed by peer" and the like) collapsed to one line each; the full
texts kept in ``error.failures``.
"""
from __future__ import annotations

import re
import signal
from dataclasses import dataclass


class LaunchError(RuntimeError):
    """A launch failed: a rank raised, crashed or hung. ``failures`` holds the details."""

    def __init__(self, message: str, failures: list | None = None):
        super().__init__(message)
        self.failures = failures or []


class StubNotImplemented(LaunchError, NotImplementedError):
    """The root cause was an exercise stub that is not implemented yet."""


class LaunchInterrupted(LaunchError, KeyboardInterrupt):
    """The launch was interrupted (Ctrl-C, the notebook's stop button); the ranks were killed.

    It is a KeyboardInterrupt, so ``except Exception`` does not swallow it and a script stops.
    """


class OversubscriptionWarning(RuntimeWarning):
    """More ranks than CPU cores: they will take turns, timings will suffer."""


@dataclass
class RankFailure:
    rank: int
    kind: str  # "exception", "crash", "timeout" or "interrupted"
    summary: str  # one line
    details: str  # traceback, exit status or stack
    when: float
    not_implemented: bool = False


# A rank whose peer died fails inside gloo with one of these: a consequence, not a cause.
CONSEQUENCE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                       "remote process exited", "Socket Timeout", "recvValue", "Connection refused")

# gloo aborts the whole process (SIGABRT) on some mistakes; its own line says what happened.
GLOO_ABORTS = {
    "doesn't match expected size": "the ranks called a collective with tensors of different sizes "
                                   "(or called different collectives): compare what each rank passes",
    "Is there a distributed collective mismatch": "the ranks called different collectives, or the same "
                                                  "one with different arguments",
    "op.preamble.length <= op.nbytes": "a recv buffer is smaller than what its peer sent: make the "
                                       "sizes match on both sides",
}


# Python's own words for a call with too many positional arguments: in the lab, most often a group or a
# mesh passed by position to a function that takes the topology by keyword only (CONTRIBUTING's Conventions).
# gloo's words for a point-to-point call to a rank it has no connection to in that group: most often a global
# rank passed as group_dst=/group_src= (ranks inside the group), or the reverse.
_NO_PAIR = "Pair is not connected"
_TOO_MANY_POSITIONAL = re.compile(r"^(\S+)\(\) takes (\d+) positional arguments? but (\d+) (?:were|was) given")


def explain(error: BaseException) -> str:
    """A line of advice for an error whose cause the lab knows, else ''. Added below the traceback, so it
    adds no frame to it (the reports read the traceback for the learner's own line)."""
    found = _TOO_MANY_POSITIONAL.match(str(error)) if isinstance(error, TypeError) else None
    if found:
        return (f"hint: {found.group(1)}() was given {found.group(3)} positional arguments and takes "
                f"{found.group(2)}. The lab's functions take the topology by keyword only: if one of them "
                "is a group, groups or a mesh, name it (group=..., groups=..., mesh=...).")
    if isinstance(error, RuntimeError) and _NO_PAIR in str(error):
        return ("hint: a send or receive named a peer that is not in its group, or the wrong rank of it: "
                "dist.send/recv's dst=/src= (and a peer given by position) are GLOBAL ranks; group_dst=/group_src= "
                "are ranks INSIDE group=. A mesh's prev_rank/next_rank are global: pass them as dst=/src=.")
    return ""


def is_consequence(failure: RankFailure) -> bool:
    return failure.kind == "exception" and any(m in failure.details for m in CONSEQUENCE_MARKERS)


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def describe_exit(code) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def crash_failure(rank: int, exitcode, last_output: list[str], when: float) -> RankFailure:
    """A rank that exited without returning; gloo's own abort message, if any, becomes the summary."""
    status = describe_exit(exitcode)
    # faulthandler printed the dying rank's stack; the frames of the learner's code are what matter
    where = [line.strip() for line in last_output if 'File "' in line
             and not any(skip in line for skip in ("site-packages", "/multiprocessing/", "/labkit/", "/lib/python"))]
    where_text = ("\nwhere it was:\n  " + "\n  ".join(where)) if where else ""
    for line in reversed(last_output):
        for marker, meaning in GLOO_ABORTS.items():
            if marker in line:
                said = line.strip().split("] ", 1)[-1]
                return RankFailure(rank, "crash", f"gloo aborted ({status}): {said.strip()}",
                                   f"rank {rank} was aborted by gloo ({status}): {meaning}.\n"
                                   f"gloo said: {line.strip()}{where_text}", when)
    return RankFailure(rank, "crash", f"exited with {status} without returning",
                       f"rank {rank} exited with {status} before returning a result (os._exit, a "
                       "segmentation fault, or killed by the system, e.g. out of memory)." + where_text, when)


def ranks_text(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def launch_error(failures: list[RankFailure], world_size: int, stopped: list[int]) -> LaunchError:
    """One error for the whole launch: the root cause in full, the consequences in one line each."""
    # The root cause is the earliest failure that is not just a peer noticing that another died.
    failures = sorted(failures, key=lambda f: (is_consequence(f), f.when))
    root = failures[0]
    if root.not_implemented:
        ranks = [f.rank for f in failures if f.not_implemented]
        message = f"{root.summary.split(': ', 1)[-1]}  (raised on rank(s) {ranks_text(ranks)})"
        return StubNotImplemented(message, failures)
    others = failures[1:]
    head = f"rank {root.rank} of {world_size} failed: {root.summary}"
    if others:
        head += f"; then rank(s) {ranks_text([f.rank for f in others])} failed too"
    if stopped:
        head += f"; rank(s) {ranks_text(stopped)} were stopped by the launcher"
    parts = [head + ".", f"\n=== rank {root.rank}: ROOT CAUSE ===\n{root.details.rstrip()}"]
    followers = [f for f in others if is_consequence(f)]
    for failure in others:
        if not is_consequence(failure):
            parts.append(f"\n=== rank {failure.rank}: failed after the root cause ===\n{failure.details.rstrip()}")
    if followers:
        parts.append("")
        for failure in followers:
            parts.append(f"rank {failure.rank}: failed only because a peer had died ({failure.summary[:100]})")
        parts.append("(their full tracebacks are in error.failures)")
    return LaunchError("\n".join(parts), failures)
