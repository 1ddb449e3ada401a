"""Wait for a cell on the ranks, and never silently: a hang, a dead engine or an interrupt is reported.

A collective that waits for a rank that never comes sleeps inside gloo, using no CPU. When every rank
still running the cell has slept for `HANG_WINDOW` seconds (`labkit.launching.progress.IdleWatch`), their
stacks are read (faulthandler, SIGUSR1); if one waits in torch.distributed, that is a hang, reported
with each rank's waiting line (`labkit.launching.stacks`). A rank that sleeps on purpose
(``time.sleep``) is left alone. When a rank has already failed, the window is shorter: its peers wait
for news that will not come. An engine on another machine is read the same way, through its lifeline
(`labkit.session.lifeline`): its CPU time and stack as it reads them there, its death as the end of its
connection.
"""
from __future__ import annotations

import os
import signal
import time

import psutil

from labkit.launching.failures import LaunchError, LaunchInterrupted
from labkit.launching.progress import IdleWatch, cpu_seconds
from labkit.launching.stacks import _waiting_call, hint
from labkit.session.report import where_raised
from labkit.launching.forked import trim_stack

HANG_WINDOW = 3.0  # seconds every running rank sleeps before its stack is read
AFTER_FAILURE_WINDOW = 1.5  # the same, once a peer has failed
INTERRUPT_GRACE = 3.0  # seconds the ranks get to stop after SIGINT


class SessionError(LaunchError):
    """A cell on the session's ranks failed, hung, or an engine died."""


class SessionBroken(SessionError):
    """The session's ranks cannot go on (a hang, a dead engine): it was stopped; %ranks restart."""


class SessionInterrupted(LaunchInterrupted):
    """The cell was interrupted (the notebook's stop button)."""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stacks(pids: dict[int, int], paths: dict[int, str], ranks, lifelines=None) -> dict[int, str]:
    """{rank: its Python stack now}: faulthandler's SIGUSR1 file for an engine on this machine (by pid), the
    engine's own answer through its lifeline for one on another machine."""
    found, offsets = {}, {}
    for rank in [r for r in ranks if r not in pids]:
        said = lifelines.ask(rank, "stack") if lifelines is not None else None
        found[rank] = (_cell_part(said.get("stack", "")) if said else "") or "(no stack: the engine did not answer)"
    ranks = [r for r in ranks if r in pids]
    for rank in ranks:
        offsets[rank] = os.path.getsize(paths[rank]) if os.path.exists(paths[rank]) else 0
        try:
            os.kill(pids[rank], signal.SIGUSR1)
        except (ProcessLookupError, KeyError):  # KeyError: an engine on another machine
            pass
    if ranks:
        time.sleep(0.5)
    for rank in ranks:
        try:
            with open(paths[rank]) as f:
                f.seek(offsets[rank])
                found[rank] = _cell_part(f.read()) or "(no stack: the engine did not answer)"
        except OSError:
            found[rank] = "(no stack: the engine did not answer)"
    return found


def _cell_part(stack: str) -> str:
    """The frames from where the rank waits to the cell; the engine's own frames left out."""
    kept = []
    for line in trim_stack(stack).splitlines():
        if "labkit/session/engine_side.py" in line:
            break
        kept.append(line)
    return "\n".join(kept)


def wait(pending: dict, pids: dict[int, int], paths: dict[int, str], world_size: int, lifelines=None) -> dict:
    """Wait for {rank: AsyncResult}; return {rank: the engine's answer}. Raises SessionBroken / SessionInterrupted.

    ``pids``: the engines on this machine; the others are watched through ``lifelines``
    (`labkit.session.lifeline`): their death, CPU time and stacks."""
    done: dict = {}
    idle = IdleWatch(HANG_WINDOW)

    def sample(rank):  # (CPU seconds, state) of a rank's engine, read here by pid or there by the engine
        if rank in pids:
            return cpu_seconds(pids[rank])
        said = lifelines.ask(rank, "sample") if lifelines is not None else None
        return tuple(said["sample"]) if said and said["sample"] else None
    try:
        while len(done) < len(pending):
            dead = []
            for rank, ar in pending.items():
                if rank not in done and ar.ready():
                    try:
                        done[rank] = ar.get()
                    except Exception:  # ipyparallel's EngineError: the engine died under the task
                        dead.append(rank)
            running = [r for r in pending if r not in done]
            dead += [r for r in pids if r not in dead and not alive(pids[r])]
            if lifelines is not None:
                dead += [r for r in lifelines.gone(range(world_size)) if r not in dead]
            if dead:
                raise SessionBroken(_dead_text(sorted(dead), [r for r in running if r not in dead], world_size))
            if not running:
                break
            failed = [r for r, answer in done.items() if answer["error"]]
            idle.window = AFTER_FAILURE_WINDOW if failed else HANG_WINDOW
            # a hang is judged by the ranks' CPU and stacks: read by pid on this machine (`Session.here`), asked
            # through the lifeline on another
            if (lifelines is not None or all(r in pids for r in running)) and idle.all_asleep(running, sample):
                now = stacks(pids, paths, running, lifelines)
                if failed or any(_waiting_call(s) for s in now.values()):
                    raise SessionBroken(_hang_text(now, running, failed, done, world_size, idle.window))
                idle.reset()  # asleep on purpose (time.sleep): not ours to judge
            pending[running[0]].wait(0.2)
    except KeyboardInterrupt:
        _interrupt(pending, done, pids, paths, world_size, lifelines)
    return done


def _dead_text(dead, running, world_size) -> str:
    others = f" while rank(s) {', '.join(map(str, running))} ran the cell" if running else ""
    return (f"the engine of rank(s) {', '.join(map(str, dead))} of {world_size} died (killed, os._exit, or out "
            f"of memory){others}. The session was stopped; "
            "run `%ranks restart` for a fresh one (every rank's variables are lost).")


def _hang_text(now, running, failed, done, world_size, window) -> str:
    if failed:
        head = (f"hung: rank(s) {', '.join(map(str, running))} of {world_size} wait for rank(s) "
                f"{', '.join(map(str, failed))}, which failed: "
                + next(x for x in reversed(done[failed[0]]["error"].strip().splitlines()) if x.strip()))
    else:
        head = (f"hung: rank(s) {', '.join(map(str, running))} of {world_size} all waited, none using the "
                f"CPU, for {window:.0f} s (nobody left to wake them)")
    parts = [head + "."]
    parts += [f"rank {r} waits {where_raised(now[r], innermost_first=True) or 'at an unknown line'}" for r in running]
    not_running = sorted(set(range(world_size)) - set(running) - set(done))
    if not_running:
        parts.append(f"rank(s) {', '.join(map(str, not_running))} did not run this cell (--targets): a collective "
                     "needs every rank of its group")
    if not failed:
        parts.append(hint(now))
    for r in running:
        shown = now[r].splitlines()[:8]
        parts.append(f"\n=== rank {r}: its Python stack ===\n" + "\n".join(shown))
    parts.append("\nThe ranks were stuck inside torch.distributed, so the session was stopped; run "
                 "`%ranks restart` for a fresh one (every rank's variables are lost).")
    return "\n".join(parts)


def _interrupt(pending, done, pids, paths, world_size, lifelines=None):
    running = [r for r in pending if r not in done]
    before = stacks(pids, paths, running, lifelines)
    for rank in running:
        try:
            if rank in pids:
                os.kill(pids[rank], signal.SIGINT)
            elif lifelines is not None:  # an engine on another machine: it signals itself
                lifelines.ask(rank, "interrupt")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + INTERRUPT_GRACE
    while time.monotonic() < deadline and not all(pending[r].ready() for r in running):
        time.sleep(0.1)
    stuck = [r for r in running if not pending[r].ready()]
    where = "\n".join(f"rank {r} was {where_raised(before[r], innermost_first=True) or 'at an unknown line'}" for r in running)
    if stuck:
        raise SessionBroken(f"interrupted: rank(s) {', '.join(map(str, stuck))} of {world_size} did not stop "
                            f"(waiting inside torch.distributed):\n{where}\nThe session was stopped; run "
                            "`%ranks restart` for a fresh one (every rank's variables are lost).") from None
    raise SessionInterrupted(f"interrupted: rank(s) {', '.join(map(str, running))} of {world_size} stopped.\n"
                             f"{where}\nThe session is still up and every rank keeps its variables.") from None
