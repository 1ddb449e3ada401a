"""A session of persistent ranks, and the ``%ranks`` line magic that drives it.

    %ranks start 4 [--backend auto|gloo|nccl] [--launcher local|mpiexec|slurm|pbs] [--start-timeout S]
    %%ranks [--targets 0,2] [--tabs]  # a cell on every rank (or some), each keeping its variables;
                                      # --tabs: the output as a tab per rank (ipywidgets)
    %ranks stop | %ranks restart | %ranks

Rank: the launcher's rank (mpiexec, srun), else the engine id; under nccl, each rank uses the GPU of its
local rank (the launcher's local-rank variable, `labkit.launching.cluster`). A cell is one `engine_side.run_cell` per rank, waited
for by `labkit.session.watch`; what the ranks print comes back grouped (`labkit.session.report`).
"""
from __future__ import annotations

import argparse
import linecache
import os
import pickle
import shlex
import socket
import sys
import tempfile

import psutil

from labkit.launching.failures import LaunchError
from labkit.launching.forked import rendezvous_store
from labkit.launching.launcher import BACKENDS, choose_backend
from labkit.launching.notebook import BEFORE_CELL
from labkit.session import engine_side, report, watch
from labkit.session import tabs as rank_tabs
from labkit.session.engines import LAUNCHERS, Engines, check_launcher
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
        check_launcher(launcher)
        self.world_size, self.launcher, self.start_timeout = world_size, launcher, start_timeout
        # local: every rank on this node, so nccl with too few GPUs is refused here; the other launchers'
        # engines apply the same rule on their own nodes once they are up (Session.start)
        self.backend = choose_backend(backend, world_size) if launcher == "local" else backend
        self.requested_backend = backend
        self.engines: Engines | None = None
        self.store = None  # the TCPStore this kernel serves to the engines while the session is up
        self.pids: dict[int, int] = {}  # rank -> engine pid (on this host; see `hosts`)
        self.engine_of: dict[int, int] = {}  # rank -> ipyparallel engine id
        self.hosts: dict[int, str] = {}  # rank -> its engine's host
        self.cells = 0

    @property
    def up(self) -> bool:
        return self.engines is not None

    def start(self) -> "Session":
        self.engines = Engines(self.world_size, self.launcher, self.start_timeout)
        self.engines.start()
        self.folder = tempfile.mkdtemp(prefix="labkit-session-")
        self.paths = {r: os.path.join(self.folder, f"rank{r}.stack") for r in range(self.world_size)}
        try:
            self._join()
        except Exception as err:
            self.stop()
            if getattr(err, "ename", None) == "LaunchError":  # nccl refused on an engine's node: the rule's words
                raise SessionError(f"the engines started, but on their node: {err.evalue}") from None
            if isinstance(err, SessionError):
                raise
            raise SessionError(f"the engines started but did not form the process group ({type(err).__name__}: "
                               f"{str(err)[:500]}). Run `%ranks start` again.") from None
        return self

    def _join(self) -> None:
        """Ranks from the launcher's variables (else engine ids), the backend checked on each node, then the group."""
        client = self.engines.client
        ids = sorted(client.ids)
        said = dict(zip(ids, client[ids].apply_sync(engine_side.identify)))
        if self.launcher == "local":  # a kernel inside an allocation passes its scheduler's variables on: ignored
            for e in ids:
                said[e]["world"] = None
        ranks = {e: (said[e]["world"]["rank"] if said[e]["world"] else i) for i, e in enumerate(ids)}
        if sorted(ranks.values()) != list(range(self.world_size)):  # a launcher started other processes too
            raise SessionError(f"the {self.launcher} launcher gave the engines ranks {sorted(ranks.values())}, "
                               f"not 0..{self.world_size - 1}")
        self.engine_of = {r: e for e, r in ranks.items()}
        hosts = {r: said[e]["host"] for e, r in ranks.items()}
        local = {r: sorted(q for q in hosts if hosts[q] == hosts[r]).index(r) for r in hosts}  # by host, else
        for e, r in ranks.items():  # the launcher's own local rank (labkit.launching.cluster's variables)
            if said[e]["world"]:
                local[r] = said[e]["world"]["local_rank"]
        here = socket.gethostname()
        if self.launcher != "local":
            per_node = {r: sum(h == hosts[r] for h in hosts.values()) for r in hosts}
            chosen = {r: client[self.engine_of[r]].apply_async(engine_side.backend_here, self.backend, per_node[r])
                      for r in hosts}
            backends = {r: ar.get(timeout=JOIN_TIMEOUT) for r, ar in chosen.items()}
            if len(set(backends.values())) > 1:
                raise SessionError(f"the nodes chose different backends ({backends}): give --backend gloo or nccl")
            self.backend = backends[0]
        # the session's store, served from this kernel on a port the OS picks (no race with a launch beside it)
        self.store = rendezvous_store(self.world_size, JOIN_TIMEOUT)
        address = "127.0.0.1" if set(hosts.values()) == {here} else socket.gethostbyname(here)
        port, hooks = self.store.port, pickle.dumps(list(BEFORE_CELL))
        kernel = (here, os.getpid(), psutil.Process().create_time())
        pending = {r: client[self.engine_of[r]].apply_async(
                       engine_side.join, r, self.world_size, local[r], self.backend, address, port, JOIN_TIMEOUT,
                       hooks, self.paths[r], kernel)
                   for r in range(self.world_size)}
        self.hosts = hosts
        for rank, ar in pending.items():
            self.pids[rank] = ar.get(timeout=JOIN_TIMEOUT + 10)

    def stop(self) -> None:
        if self.engines is not None:
            here = socket.gethostname()
            self.engines.stop([pid for r, pid in self.pids.items() if self.hosts.get(r) == here])
        self.engines, self.pids, self.store, self.hosts = None, {}, None, {}

    def run_cell(self, cell: str, targets: list[int] | None = None, tabs: bool = False) -> None:
        """Run ``cell`` on ``targets`` (default: every rank); print grouped output (``tabs``: a tab per rank, where
        ipywidgets is there); raise SessionError on failure."""
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
        pending = {r: client[self.engine_of[r]].apply_async(engine_side.run_cell, cell, filename, context)
                   for r in targets}
        try:
            answers = watch.wait(pending, self.pids, self.paths, self.world_size)
        except BaseException as err:
            if isinstance(err, SessionBroken):
                self.stop()
            _show(pending)
            raise
        failed = {r: a for r, a in answers.items() if a["error"]}
        results = {r: answers[r]["result"] for r in targets}
        if failed or not tabs:
            _show(pending)
        elif not _show_tabs(pending, results, targets):
            print("(--tabs needs ipywidgets, which cannot be imported here: the output as text)")
            _show(pending)
            tabs = False
        if failed:
            raise SessionError(report.failure_text(failed, self.world_size, "the cell"))
        if not tabs:
            _display(results)

    def status(self) -> str:
        if not self.up:
            return "no session: `%ranks start N` starts one"
        return (f"a session of {self.world_size} rank(s), backend {self.backend}, {self.launcher} launcher, "
                f"engine pids {[self.pids[r] for r in sorted(self.pids)]}")


def _printed(pending) -> tuple[dict, dict]:
    """({rank: stdout}, {rank: stderr}) of the cell's ranks."""
    for ar in pending.values():  # the printed output travels apart from the result (iopub): wait for it
        if ar.ready():
            try:
                ar.wait_for_output(timeout=5)
            except Exception:
                pass
    out = {r: ar.stdout for r, ar in pending.items() if ar.ready() or ar.stdout}
    err = {r: ar.stderr for r, ar in pending.items() if ar.ready() or ar.stderr}
    return out, err


def _show_tabs(pending, results, targets) -> bool:
    out, err = _printed(pending)
    if not rank_tabs.show(out, err, results, targets):
        return False
    _show_displays(pending)
    return True


def _show(pending) -> None:
    out, err = _printed(pending)
    for line in report.grouped_lines(out):
        print(line)
    for line in report.grouped_lines(err):
        print(line, file=sys.stderr)
    _show_displays(pending)


def _show_displays(pending) -> None:
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


_cell_parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
_cell_parser.add_argument("--targets")
_cell_parser.add_argument("--tabs", action="store_true")


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
    try:
        options = _cell_parser.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError("usage: %%ranks N [--timeout S] [--backend B] (a cell on N new ranks), or, with a "
                         "session up, %%ranks [--targets 0,2] [--tabs]") from None
    targets = None
    if options.targets is not None:
        try:
            targets = [int(t) for t in options.targets.split(",")]
        except ValueError:
            raise ValueError(f"--targets takes rank numbers separated by commas (--targets 0,2); "
                             f"got {options.targets!r}") from None
    if current is None or not current.up:
        raise SessionError("%%ranks without a number runs the cell on a session, and none is up: "
                           "`%ranks start 4` first, or `%%ranks 4` for one cell on 4 new ranks.")
    current.run_cell(cell, targets, tabs=options.tabs)


def stop_current() -> None:
    if current is not None:
        current.stop()


__all__ = ["Session", "SessionError", "LaunchError", "ranks_line", "run_on_session"]
