"""A session of persistent ranks, and the ``%ranks`` line magic that drives it.

    %ranks start 4 [--backend auto|gloo|nccl] [--launcher local] [--start-timeout S]
    %%ranks [--targets 0,2]      # a cell on every rank (or some), each keeping its variables
    %ranks stop | %ranks restart | %ranks

Rank = engine id; under nccl, rank r uses GPU r. A cell is one `engine_side.run_cell` per rank, waited
for by `labkit.session.watch`; what the ranks print comes back grouped (`labkit.session.report`).
"""
from __future__ import annotations

import argparse
import linecache
import os
import pickle
import shlex
import sys
import tempfile

from labkit.launching.failures import LaunchError
from labkit.launching.forked import rendezvous_store
from labkit.launching.launcher import BACKENDS, choose_backend
from labkit.launching.notebook import BEFORE_CELL
from labkit.session import engine_side, report, watch
from labkit.session.engines import LAUNCHERS, Engines
from labkit.session.watch import SessionBroken, SessionError

JOIN_TIMEOUT = 60.0  # seconds the engines get to form the process group
USAGE = ("usage: %ranks start N [--backend auto|gloo|nccl] [--launcher local|mpiexec|slurm|pbs] "
         "[--start-timeout S]; %ranks stop; %ranks restart; %ranks (status)")


class Session:
    """N persistent ranks; `run_cell` runs a cell on all (or some) of them."""

    def __init__(self, world_size: int, backend: str = "auto", launcher: str = "local", start_timeout: float = 120.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"the number of ranks must be an int >= 1; got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
        if launcher != "local":  # the engines' pids (stacks, hangs, deaths) and the address are local ones
            raise ValueError(f"--launcher {launcher}: only the local launcher is built so far; on a cluster, "
                             "use labkit.launch under srun/mpiexec/torchrun (README, On a GPU node and on a cluster)")
        self.world_size, self.launcher, self.start_timeout = world_size, launcher, start_timeout
        self.backend = choose_backend(backend, world_size)  # nccl with too few GPUs: refused here
        self.requested_backend = backend
        self.engines: Engines | None = None
        self.store = None  # the TCPStore this kernel serves to the engines while the session is up
        self.pids: dict[int, int] = {}
        self.cells = 0

    @property
    def up(self) -> bool:
        return self.engines is not None

    def start(self) -> "Session":
        self.engines = Engines(self.world_size, self.launcher, self.start_timeout)
        self.engines.start()
        self.folder = tempfile.mkdtemp(prefix="labkit-session-")
        self.paths = {r: os.path.join(self.folder, f"rank{r}.stack") for r in range(self.world_size)}
        client = self.engines.client
        # the session's store, served from this kernel on a port the OS picks (no race with a launch beside it)
        self.store = rendezvous_store(self.world_size, JOIN_TIMEOUT)
        port, hooks = self.store.port, pickle.dumps(list(BEFORE_CELL))
        pending = {r: client[r].apply_async(engine_side.join, r, self.world_size, self.backend, "127.0.0.1",
                                             port, JOIN_TIMEOUT, hooks, self.paths[r], os.getpid())
                   for r in range(self.world_size)}
        try:
            for rank, ar in pending.items():
                self.pids[rank] = ar.get(timeout=JOIN_TIMEOUT + 10)
        except Exception as err:
            self.stop()
            raise SessionError(f"the engines started but did not form the process group ({type(err).__name__}: "
                               f"{str(err)[:500]}). Run `%ranks start` again.") from None
        return self

    def stop(self) -> None:
        if self.engines is not None:
            self.engines.stop()
        self.engines, self.pids, self.store = None, {}, None

    def run_cell(self, cell: str, targets: list[int] | None = None) -> None:
        """Run ``cell`` on ``targets`` (default: every rank); print grouped output; raise SessionError on failure."""
        targets = list(range(self.world_size)) if targets is None else targets
        bad = [t for t in targets if not 0 <= t < self.world_size]
        if bad or not targets:
            raise ValueError(f"--targets {bad or targets}: this session has ranks 0..{self.world_size - 1}")
        gone = [r for r, pid in self.pids.items() if not watch.alive(pid)]
        if gone:
            self.stop()
            raise SessionBroken(f"the engine of rank(s) {', '.join(map(str, gone))} is gone (killed?). The session "
                                "was stopped; run `%ranks restart` for a fresh one (variables are lost).")
        self.cells += 1
        filename = f"<%%ranks session cell {self.cells}>"
        linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)  # stacks show the cell
        context = {"env": dict(os.environ), "path": list(sys.path), "cwd": os.getcwd()}
        client = self.engines.client
        pending = {r: client[r].apply_async(engine_side.run_cell, cell, filename, context) for r in targets}
        try:
            answers = watch.wait(pending, self.pids, self.paths, self.world_size)
        except SessionBroken:
            self.stop()
            raise
        finally:
            _show(pending)
        failed = {r: a for r, a in answers.items() if a["error"]}
        if failed:
            raise SessionError(report.failure_text(failed, self.world_size, "the cell"))
        _display({r: answers[r]["result"] for r in targets})

    def status(self) -> str:
        if not self.up:
            return "no session: `%ranks start N` starts one"
        return (f"a session of {self.world_size} rank(s), backend {self.backend}, {self.launcher} launcher, "
                f"engine pids {[self.pids[r] for r in sorted(self.pids)]}")


def _show(pending) -> None:
    for ar in pending.values():  # the printed output travels apart from the result (iopub): wait for it
        if ar.ready():
            try:
                ar.wait_for_output(timeout=5)
            except Exception:
                pass
    out = {r: ar.stdout for r, ar in pending.items() if ar.ready() or ar.stdout}
    err = {r: ar.stderr for r, ar in pending.items() if ar.ready() or ar.stderr}
    for line in report.grouped_lines(out):
        print(line)
    for line in report.grouped_lines(err):
        print(line, file=sys.stderr)
    for rank, ar in sorted(pending.items()):
        for output in getattr(ar, "outputs", None) or []:  # display() calls: figures, widgets' fallbacks
            _publish(output.get("data", {}), f"{report.ranks_label([rank])}")


def _display(results) -> None:
    for ranks, bundle in report.grouped_results(results):
        _publish(bundle, f"Out{report.ranks_label(ranks)}")


def _publish(bundle: dict, label: str) -> None:
    if set(bundle) <= {"text/plain"}:
        print(f"{label}: {bundle.get('text/plain', '')}")
        return
    print(f"{label}:")
    try:
        from IPython.display import publish_display_data

        publish_display_data(bundle)
    except Exception:
        print(bundle.get("text/plain", ""))


# --------------------------------------------------------------------------- the one session of a kernel

current: Session | None = None

_parser = argparse.ArgumentParser(prog="%ranks", add_help=False)
_parser.add_argument("action", nargs="?", default="status", choices=("start", "stop", "restart", "status"))
_parser.add_argument("world_size", nargs="?", type=int)
_parser.add_argument("--backend", default="auto", choices=BACKENDS)
_parser.add_argument("--launcher", default="local", choices=tuple(LAUNCHERS))
_parser.add_argument("--start-timeout", type=float, default=120.0)


def ranks_line(line: str) -> str:
    """The ``%ranks`` line magic; returns what it says."""
    global current
    try:
        options = _parser.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(USAGE) from None
    if options.action == "status":
        return current.status() if current else "no session: `%ranks start N` starts one"
    if options.action == "stop":
        if current is None or not current.up:
            return "no session to stop"
        current.stop()
        return "session stopped"
    if options.action == "start":
        if current is not None and current.up:
            raise SessionError(f"a session is already up ({current.status()}). `%ranks stop` first, or "
                               "`%ranks restart` for fresh ranks.")
        if options.world_size is None:
            raise ValueError("%ranks start needs the number of ranks: `%ranks start 4`")
        current = Session(options.world_size, options.backend, options.launcher, options.start_timeout).start()
    else:  # restart: the same settings unless new ones are given
        if current is None:
            raise SessionError("no session to restart: `%ranks start N` starts one")
        current.stop()
        n = options.world_size or current.world_size
        current = Session(n, current.requested_backend if options.backend == "auto" else options.backend,
                          current.launcher, options.start_timeout).start()
    return current.status().replace("a session", "session up", 1)


def run_on_session(line: str, cell: str) -> None:
    """``%%ranks`` with no number: the cell on the session's ranks (``--targets 0,2`` for some)."""
    options = shlex.split(line)
    targets = None
    if options[:1] == ["--targets"] and len(options) == 2:
        try:
            targets = [int(t) for t in options[1].split(",")]
        except ValueError:
            raise ValueError(f"--targets takes rank numbers separated by commas (--targets 0,2); got {options[1]!r}") from None
    elif options:
        raise ValueError("usage: %%ranks N [--timeout S] [--backend B] (a cell on N new ranks), or, with a "
                         "session up, %%ranks [--targets 0,2]")
    if current is None or not current.up:
        raise SessionError("%%ranks without a number runs the cell on a session, and none is up: "
                           "`%ranks start 4` first, or `%%ranks 4` for one cell on 4 new ranks.")
    current.run_cell(cell, targets)


def stop_current() -> None:
    if current is not None:
        current.stop()


__all__ = ["Session", "SessionError", "LaunchError", "ranks_line", "run_on_session"]
