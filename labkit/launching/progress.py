"""Is anyone still working? A hang seen as "no rank used the CPU for a while", in seconds.

A rank that waits for a message nobody sends sleeps inside gloo: it uses no CPU time at all.
When every rank still running has slept like that for ``window`` seconds together, nobody
can wake them up any more, whatever the launch's timeout says. `IdleWatch` samples the
ranks' CPU time (user + system, all threads) and run state from ``/proc``; the fork launcher
uses it, when asked (`labkit.launch(..., idle_timeout=...)`), to report a hang after a few
seconds instead of after the whole timeout.

Why it is opt-in: a rank may sleep on purpose (`time.sleep`, a shaped link's delay, a
`SyntheticStage`) for longer than a grading case ever does. The grading runner turns it on,
where a case takes milliseconds. A rank that is merely starved of CPU on a busy machine is
"R" (runnable), never idle, and one reading a file is "D"; a busy loop uses CPU: all are left
to the timeout. Only "S" (sleeping, waiting for an event) with no CPU time counts.
"""
from __future__ import annotations

import os
import time

IDLE_CPU_FRACTION = 0.02  # below 2% of one core over the window counts as asleep


def cpu_seconds(pid: int) -> tuple[float, str] | None:
    """(user + system CPU seconds, run state letter) of a process, None if unreadable (not Linux, gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, fields[0]


class IdleWatch:
    """Tell when every watched process has been asleep (no CPU, not runnable) for ``window`` seconds."""

    def __init__(self, window: float):
        self.window = window
        self.since: dict[int, tuple[float, float]] = {}  # pid -> (time asleep since, CPU seconds then)

    def all_asleep(self, pids, sample=cpu_seconds) -> bool:
        """Sample now; True when each of ``pids`` has slept for the whole window (and there are some).

        ``sample(key) -> (CPU seconds, state) | None``: read from /proc by pid unless given (a session asks an
        engine on another machine for its own reading, keyed by rank: `labkit.session.lifeline`)."""
        now, asleep = time.monotonic(), bool(pids)
        for pid in pids:
            sample_now = sample(pid)
            if sample_now is None:
                return False  # no /proc, or no answer: never claim a hang
            cpu, state = sample_now
            start = self.since.get(pid)
            working = state != "S" or start is None or cpu - start[1] > IDLE_CPU_FRACTION * max(now - start[0], 0.5)
            if working:
                self.since[pid] = (now, cpu)
                asleep = False
            elif now - start[0] < self.window:
                asleep = False
        return asleep

    def reset(self) -> None:
        self.since.clear()
