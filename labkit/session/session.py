"""A session of persistent ranks, and the ``%ranks`` line magic that drives it.

    %ranks start 4 [--backend auto|gloo|nccl] [--launcher local|mpiexec|slurm|pbs] [--start-timeout S]
                   [--hosts a:2,b:2] [--ip ADDRESS]  # mpiexec's engines on several hosts (labkit.session.hosts)
    %%ranks [--targets 0,2] [--tabs]  # a cell on every rank (or some), each keeping its variables;
                                      # --tabs: the output as a tab per rank (ipywidgets)
    %ranks stop | %ranks restart | %ranks
    spans = %ranks timeline [NAME]    # each rank's Timeline (``tl``) merged and drawn (labkit.session.spans)

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
import shutil
import sys
import tempfile

import psutil

from labkit.launching.failures import LaunchError
from labkit.launching.forked import store_path
from labkit.launching.launcher import BACKENDS, choose_backend
from labkit.launching.notebook import BEFORE_CELL
from labkit.session import engine_side, hosts as where, report, watch
from labkit.session.engines import LAUNCHERS, Engines, check_launcher
from labkit.session.lifeline import Lifelines
from labkit.session.spans import session_timeline
from labkit.session.watch import SessionBroken, SessionError

JOIN_TIMEOUT = 60.0  # seconds the engines get to form the process group
USAGE = ("usage: %ranks start N [--backend auto|gloo|nccl] [--launcher local|mpiexec|slurm|pbs] "
         "[--start-timeout S] [--hosts a:2,b:2] [--ip ADDRESS]; %ranks stop; %ranks restart; "
         "spans = %ranks timeline [NAME]; %ranks (status)")


def rendezvous_store(world_size: int, timeout: float):
    """The session's TCPStore, served from this kernel on a port the OS picks, bound before any engine
    joins: every rank joins it as a client (TORCHELASTIC_USE_AGENT_STORE, as torchrun's agent serves
    its ranks). A port picked free and bound later by rank 0 could be taken in between by another
    process (two notebooks at once: EADDRINUSE, seen). TCP, not the forked launches' file
    (labkit.launching.forked.store_path): a session's engines may run on other hosts."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


class Session:
    """N persistent ranks; `run_cell` runs a cell on all (or some) of them."""

    def __init__(self, world_size: int, backend: str = "auto", launcher: str = "local", start_timeout: float = 120.0,
                 hosts: str | None = None, ip: str | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"the number of ranks must be an int >= 1; got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: use one of {BACKENDS}")
        check_launcher(launcher)
        if hosts is not None and launcher != "mpiexec":
            raise ValueError(f"--hosts places the engines with mpiexec: add --launcher mpiexec (--launcher {launcher} "
                             + ("starts them on this node)" if launcher == "local" else "uses the allocation's hosts)"))
        self.host_option, self.ip = hosts, ip
        self.host_slots = where.parse_hosts(hosts, world_size) if hosts is not None else None
        names = [h for h, _ in self.host_slots] if self.host_slots else where.allocation_hosts(launcher)
        self.address = where.controller_address(names, ip)  # where the controller and the store listen
        self.world_size, self.launcher, self.start_timeout = world_size, launcher, start_timeout
        # local: every rank on this node, so nccl with too few GPUs is refused here; the other launchers'
        # engines apply the same rule on their own nodes once they are up (Session.start)
        self.backend = choose_backend(backend, world_size) if launcher == "local" else backend
        self.requested_backend = backend
        self.engines: Engines | None = None
        self.store = None  # the TCPStore this kernel serves to engines on other hosts while the session is up
        self.lifelines = None  # each engine's connection to this kernel (labkit.session.lifeline)
        self.pids: dict[int, int] = {}  # rank -> engine pid (on its own machine: `here` says which this kernel sees)
        self.engine_of: dict[int, int] = {}  # rank -> ipyparallel engine id
        self.hosts: dict[int, str] = {}  # rank -> its engine's host (its address when the session spans hosts)
        self.here: set[int] = set()  # the ranks whose engines share this kernel's pids (same machine)
        self.cells = 0

    @property
    def up(self) -> bool:
        return self.engines is not None

    def start(self) -> "Session":
        # the folder first: the session's reaper removes it, also when the kernel dies without `%ranks stop`
        self.folder = tempfile.mkdtemp(prefix="labkit-session-")
        self.engines = Engines(self.world_size, self.launcher, self.start_timeout, self.host_slots, self.address,
                               self.folder)
        try:
            self.engines.start()
        except BaseException:
            self.engines = None  # Engines.start stopped what it started (its reaper removed the folder)
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
            raise
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
        said = dict(zip(ids, client[ids].apply_sync(engine_side.identify, self.address)))
        if self.launcher == "local":  # a kernel inside an allocation passes its scheduler's variables on: ignored
            for e in ids:
                said[e]["world"] = None
        ranks = {e: (said[e]["world"]["rank"] if said[e]["world"] else i) for i, e in enumerate(ids)}
        if sorted(ranks.values()) != list(range(self.world_size)):  # a launcher started other processes too
            raise SessionError(f"the {self.launcher} launcher gave the engines ranks {sorted(ranks.values())}, "
                               f"not 0..{self.world_size - 1}")
        self.engine_of = {r: e for e, r in ranks.items()}
        spans = self.address != where.LOOPBACK  # several hosts, maybe one machine's network namespaces: by address
        hosts = {r: said[e]["address" if spans else "host"] for e, r in ranks.items()}
        machine = where.machine_id()
        self.here = {r for e, r in ranks.items() if said[e]["machine"] == machine}
        local = {r: sorted(q for q in hosts if hosts[q] == hosts[r]).index(r) for r in hosts}  # by host, else
        for e, r in ranks.items():  # the launcher's own local rank (labkit.launching.cluster's variables)
            if said[e]["world"]:
                local[r] = said[e]["world"]["local_rank"]
        if self.launcher != "local":
            per_node = {r: sum(h == hosts[r] for h in hosts.values()) for r in hosts}
            chosen = {r: client[self.engine_of[r]].apply_async(engine_side.backend_here, self.backend, per_node[r])
                      for r in hosts}
            backends = {r: ar.get(timeout=JOIN_TIMEOUT) for r, ar in chosen.items()}
            if len(set(backends.values())) > 1:
                raise SessionError(f"the nodes chose different backends ({backends}): give --backend gloo or nccl")
            self.backend = backends[0]
        if not spans and len(self.here) == self.world_size:  # one machine: a file, as a launch's ranks meet
            store = ("file", store_path(self.folder))
        else:  # served from this kernel on a port the OS picks (no race with a launch beside it)
            self.store = rendezvous_store(self.world_size, JOIN_TIMEOUT)
            store = ("tcp", self.store.port)
        self.lifelines = Lifelines(self.address, self.world_size)  # each engine's connection, on any machine
        hooks = pickle.dumps(list(BEFORE_CELL))
        kernel = (machine, os.getpid(), psutil.Process().create_time())
        pending = {r: client[self.engine_of[r]].apply_async(
                       engine_side.join, r, self.world_size, local[r], self.backend, self.address, store, JOIN_TIMEOUT,
                       hooks, self.paths[r], kernel, self.lifelines.port)
                   for r in range(self.world_size)}
        self.hosts = hosts
        for rank, ar in pending.items():
            self.pids[rank] = ar.get(timeout=JOIN_TIMEOUT + 10)
        self.lifelines.accept(JOIN_TIMEOUT)

    def stop(self) -> None:
        if self.lifelines is not None:  # first: an engine on another machine exits when its lifeline ends
            self.lifelines.close()
            self.lifelines = None
        if self.engines is not None:
            self.engines.stop([pid for r, pid in self.pids.items() if r in self.here])
        self.engines, self.pids, self.store, self.hosts, self.here = None, {}, None, {}, set()
        if getattr(self, "folder", None):  # the ranks' stack files: nothing reads them once the engines are gone
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def run_cell(self, cell: str, targets: list[int] | None = None, tabs: bool = False) -> None:
        """Run ``cell`` on ``targets`` (default: every rank); print grouped output (``tabs``: a tab per rank, where
        ipywidgets is there); raise SessionError on failure."""
        targets = list(range(self.world_size)) if targets is None else targets
        bad = [t for t in targets if not 0 <= t < self.world_size]
        if bad or not targets:
            raise ValueError(f"--targets {bad or targets}: this session has ranks 0..{self.world_size - 1}")
        gone = [r for r, pid in self.pids.items() if r in self.here and not watch.alive(pid)]
        gone += [r for r in self.lifelines.gone(range(self.world_size)) if r not in gone]
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
            answers = watch.wait(pending, {r: p for r, p in self.pids.items() if r in self.here}, self.paths,
                                 self.world_size, self.lifelines)
        except BaseException as err:
            if isinstance(err, SessionBroken):
                self.stop()
            report.show(pending)
            raise
        failed = {r: a for r, a in answers.items() if a["error"]}
        results = {r: answers[r]["result"] for r in targets}
        if failed or not tabs:
            report.show(pending)
        elif not report.show_tabs(pending, results, targets):
            print("(--tabs needs ipywidgets, which cannot be imported here: the output as text)")
            report.show(pending)
            tabs = False
        if failed:
            raise SessionError(report.failure_text(failed, self.world_size, "the cell"))
        if not tabs:
            report.display_results(results)

    def status(self) -> str:
        if not self.up:
            return "no session: `%ranks start N` starts one"
        spread = ""
        if len(set(self.hosts.values())) > 1:
            spread = ", hosts " + ", ".join(f"{h} {report.ranks_label([r for r in self.hosts if self.hosts[r] == h])}"
                                           for h in sorted(set(self.hosts.values())))
        return (f"a session of {self.world_size} rank(s), backend {self.backend}, {self.launcher} launcher{spread}, "
                f"engine pids {[self.pids[r] for r in sorted(self.pids)]}")


# --------------------------------------------------------------------------- the one session of a kernel

current: Session | None = None

_parser = argparse.ArgumentParser(prog="%ranks", add_help=False)
_parser.add_argument("action", nargs="?", default="status", choices=("start", "stop", "restart", "status"))
_parser.add_argument("world_size", nargs="?", type=int)
_parser.add_argument("--backend", default="auto", choices=BACKENDS)
_parser.add_argument("--launcher", default="local", choices=tuple(LAUNCHERS))
_parser.add_argument("--start-timeout", type=float, default=120.0)
_parser.add_argument("--hosts")
_parser.add_argument("--ip")


_cell_parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
_cell_parser.add_argument("--targets")
_cell_parser.add_argument("--tabs", action="store_true")


def ranks_line(line: str):
    """The ``%ranks`` line magic; returns what it says (``timeline``: the merged spans)."""
    global current
    words = shlex.split(line, comments=True)
    if words[:1] == ["timeline"]:
        if current is None or not current.up or len(words) > 2:
            raise SessionError("usage: `spans = %ranks timeline [NAME]` with a session up: each rank's Timeline "
                               "NAME (default tl), recorded in a %%ranks cell")
        return session_timeline(current, *words[1:])
    try:
        options = _parser.parse_args(shlex.split(line, comments=True))
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
        current = Session(options.world_size, options.backend, options.launcher, options.start_timeout,
                          options.hosts, options.ip).start()
    else:  # restart: the same settings unless new ones are given
        if current is None:
            raise SessionError("no session to restart: `%ranks start N` starts one")
        current.stop()
        n = options.world_size or current.world_size
        current = Session(n, current.requested_backend if options.backend == "auto" else options.backend,
                          current.launcher, options.start_timeout, options.hosts or current.host_option,
                          options.ip or current.ip).start()
    return current.status().replace("a session", "session up", 1)


def run_on_session(line: str, cell: str) -> None:
    """``%%ranks`` with no number: the cell on the session's ranks (``--targets 0,2`` for some)."""
    try:
        options = _cell_parser.parse_args(shlex.split(line, comments=True))
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
