"""The engines of a session: an ipyparallel cluster (one controller, N engines), started and stopped.

The engines are never forks of the kernel: on a GPU node torch refuses autograd and CUDA in a process
forked after its parent used them (see CONTRIBUTING's "How a rank is born"). The local launcher's are
forked by the lab's zygote, which never did either (`labkit.session.forked_engines`); the other launchers
start fresh interpreters (``python -m ipyparallel.engine``). They are ordinary IPython kernels, so each keeps
its own namespace between cells. Each engine exits when the kernel that started it is gone
(`labkit.session.engine_side`), and ipyparallel stops the cluster when the kernel exits normally.

Launchers (``--launcher``): ``local`` asks the zygote for each engine (ipyparallel's LocalEngineSetLauncher,
forking instead of starting an interpreter); ``mpiexec`` (Open MPI or MPICH, whichever ``mpiexec`` is first on PATH), ``slurm``
(``srun``, inside an allocation: salloc, or a batch job that runs JupyterLab) and ``pbs`` (``mpiexec``
inside the PBS job: PALS on Cray systems) start all N engines with one command, ipyparallel's
MPIEngineSetLauncher with that command. The engines then learn their rank and local rank from the
launcher's variables (`labkit.launching.cluster`, the same rules as a launch under a scheduler).
With mpiexec, ``hosts`` puts them on several hosts (Open MPI's ``--host a:2,b:2``, MPICH's ``-hosts``);
the controller then listens at ``address``, this node's address that those hosts reach
(`labkit.session.hosts`). Every process the cluster starts carries the session's marker in its
environment, and a `labkit.session.reaper` ends them all when the kernel is gone, SIGKILL included.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from labkit.session.hosts import LOOPBACK
from labkit.session.reaper import Reaper

# ours -> the command that starts N engines (None: ipyparallel's local launcher, one child per engine)
LAUNCHERS = {"local": None, "mpiexec": "mpiexec", "slurm": "srun", "pbs": "mpiexec"}
# the variable that says we are inside the scheduler's allocation, and how to get one
ALLOCATION = {"slurm": ("SLURM_JOB_ID", "salloc -n N (or an sbatch job that runs JupyterLab)"),
              "pbs": ("PBS_JOBID", "qsub -I (or a PBS job that runs JupyterLab)")}


def _already_removed(record) -> bool:
    """Drops ipyparallel's "Failed to remove <a launcher's log>: ... No such file or directory" (a logging filter).
    It checks that the file exists, then removes it; when the stop and the process's exit both do that, the second
    finds it gone and logs an error into the learner's cell (seen once, under load). The file is gone, as meant."""
    message = record.getMessage()
    return not (message.startswith("Failed to remove ") and "No such file or directory" in message)


# The hub counts an engine as up only after its first heartbeat, and pings every 3 s by default: 4 of the
# 5.6 s an idle machine took to register 2 engines. Every 0.5 s instead (registered in 1.6 s), and 20
# missed pings (10 s, not 30) before the hub gives an engine up: its heart answers from a zmq thread that
# needs no GIL, so a busy engine still answers.
HEARTBEAT = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=20"]


class EnginesDidNotStart(RuntimeError):
    """The engines did not come up in time; the message names the launcher and what it printed."""


def check_launcher(launcher: str) -> None:
    """Before any process starts: a known launcher, its command on PATH, inside an allocation where one is needed."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: use one of {tuple(LAUNCHERS)}")
    command = LAUNCHERS[launcher]
    if command and shutil.which(command) is None:
        raise ValueError(f"--launcher {launcher} starts the engines with `{command}`, which is not on PATH here: "
                         f"load the MPI or Slurm module first, or use --launcher local")
    if launcher in ALLOCATION and ALLOCATION[launcher][0] not in os.environ:
        variable, how = ALLOCATION[launcher]
        raise ValueError(f"--launcher {launcher} starts the engines inside your allocation, and this kernel is "
                         f"in none (no {variable}): get one first ({how}), or use --launcher local")


def _engine_set_class(command: str):
    """ipyparallel's MPIEngineSetLauncher with ``command`` (mpiexec, srun) and without ``--mpi``.

    ``--mpi`` would make each engine import mpi4py; the engines need no MPI, only the launcher's variables.
    """
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher
    from traitlets import List

    class CommandEngineSetLauncher(MPIEngineSetLauncher):
        mpi_cmd = List([command], config=True, help="the command that starts the engines")

        @property
        def program(self):
            return self.engine_cmd

    CommandEngineSetLauncher.__name__ = f"{command.capitalize()}EngineSetLauncher"
    return CommandEngineSetLauncher


def host_arguments(hosts: list[tuple[str, int]]) -> list[str]:
    """mpiexec's own flag for 'this many ranks on each host': Open MPI's --host, MPICH (Hydra)'s -hosts."""
    spec = ",".join(f"{name}:{slots}" for name, slots in hosts)
    try:
        said = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=10)
        flavour = said.stdout + said.stderr
    except (OSError, subprocess.TimeoutExpired):
        flavour = ""
    if "Open MPI" in flavour or "OpenRTE" in flavour:
        return ["--host", spec]
    if "HYDRA" in flavour.upper():
        return ["-hosts", spec]
    raise ValueError("--hosts knows Open MPI's and MPICH's mpiexec, and the `mpiexec` on PATH is neither "
                     f"({(flavour.strip().splitlines() or ['no --version'])[0]}): give the hosts to your mpiexec "
                     "another way (its host file variable), without --hosts")


def ipyparallel_files(profile_dir: str, cluster_id: str) -> tuple[str, ...]:
    """Glob patterns of what ipyparallel writes for one cluster into the IPython profile: the cluster file and the
    controller's connection files (security/), the controller's and engines' logs and the controller's engine
    state file (log/). The reaper removes them (labkit.session.reaper)."""
    security, log = os.path.join(profile_dir, "security"), os.path.join(profile_dir, "log")
    return (os.path.join(security, f"cluster-{cluster_id}.json"),
            os.path.join(security, f"ipcontroller-{cluster_id}-*.json"), os.path.join(log, f"*{cluster_id}*"))


class Engines:
    """N engines and their controller; ``client`` talks to them."""

    def __init__(self, n: int, launcher: str = "local", start_timeout: float = 60.0,
                 hosts: list[tuple[str, int]] | None = None, address: str = LOOPBACK, folder: str | None = None):
        check_launcher(launcher)
        self.folder = folder  # the session's files: the reaper removes them with the processes
        self.n, self.launcher, self.start_timeout = n, launcher, start_timeout
        self.mpi_args = host_arguments(hosts) if hosts else []
        self.address = address  # where the controller listens (labkit.session.hosts.controller_address)
        self.cluster = self.client = self.reaper = None

    def start(self) -> None:
        import ipyparallel as ipp

        command = LAUNCHERS[self.launcher]
        if command is None:  # forked by the zygote, torch already imported there (labkit.session.forked_engines)
            from labkit.session.forked_engines import ForkedEngineSetLauncher as engine_class
        else:
            engine_class = _engine_set_class(command)
        self.cluster = ipp.Cluster(n=self.n, engine_launcher_class=engine_class, log_level=40, shutdown_atexit=True,
                                   controller_ip=self.address, controller_args=HEARTBEAT)
        self.cluster.log.addFilter(_already_removed)
        self.reaper = Reaper(self.folder, leftovers=ipyparallel_files(self.cluster.profile_dir, self.cluster.cluster_id))
        began = time.monotonic()
        try:
            self.cluster.start_controller_sync(environment=dict(self.reaper.environment))
            # no sleep between them (start_cluster's `delay`): start_engines waits for the controller's connection
            # info and hands it to the engines in their environment (send_engines_connection_env)
            engine_options = {"mpi_args": self.mpi_args} if self.mpi_args else {}
            self.cluster.start_engines_sync(environment=dict(self.reaper.environment), **engine_options)
            self.client = self.cluster.connect_client_sync()
            while True:  # in short waits: a launcher that exits (mpiexec refused, srun outside the job) fails now
                left = self.start_timeout - (time.monotonic() - began)
                try:
                    self.client.wait_for_engines(self.n, timeout=max(0.1, min(1.0, left)), interactive=False)
                    break
                except TimeoutError:
                    exited = self._exited()
                    if exited or left <= 0:
                        raise TimeoutError(exited or f"{self.n - len(self.client.ids)} engine(s) not up") from None
        except (TimeoutError, Exception) as err:
            err = self._exited() or err  # ipyparallel may say only "Engine set stopped": name the command
            said = self._launcher_output()
            up = len(self.client.ids) if self.client is not None else 0
            self.stop()
            raise EnginesDidNotStart(
                f"the {self.launcher} launcher started {up} of {self.n} engine(s) in {time.monotonic() - began:.0f} s "
                f"(--start-timeout {self.start_timeout:g} s) "
                f"({err}).\nWhat the launcher printed:\n{said or '(nothing)'}\n" + self._what_to_do()) from None

    def _what_to_do(self) -> str:
        if self.address == LOOPBACK:
            return ("What to do: on a busy machine, start again with a longer --start-timeout; with mpiexec, "
                    "Slurm or PBS, run inside an allocation that has room for the engines; the controller "
                    f"listens at {LOOPBACK}, on this node only: engines on other hosts need --hosts (mpiexec) "
                    "or a PBS host file, so that it listens where they reach it.")
        return (f"What to do: the controller and the session's store listen at {self.address}, this node's address "
                "on the route to the engines' hosts, and an engine that cannot reach it gives up after 5 s: check "
                f"that every host reaches {self.address} (ping, a firewall between the nodes), or give --ip with "
                "another address of this node that they reach; on a busy machine, a longer --start-timeout.")

    def _exited(self) -> str | None:
        """'`mpiexec` exited with code 3 before every engine was up', or None while the launchers run."""
        import psutil

        for engine_set in self.cluster.engines.values():
            for launcher in [engine_set, *getattr(engine_set, "launchers", {}).values()]:
                process = getattr(launcher, "process", None)  # psutil.Process of what the launcher started
                if process is None:
                    continue
                try:
                    code = process.wait(timeout=0)  # ipyparallel notes the exit only when its loop runs
                except psutil.TimeoutExpired:
                    continue
                return f"`{launcher.args[0]}` exited with code {'?' if code is None else code} before every engine was up"
        return None

    def _launcher_output(self) -> str:
        parts = []
        launchers = [self.cluster.controller] if self.cluster and self.cluster.controller else []
        for engine_set in (self.cluster.engines.values() if self.cluster else ()):
            launchers.append(engine_set)
            launchers += list(getattr(engine_set, "launchers", {}).values())
        for launcher in launchers:
            try:
                text = launcher.get_output()
            except Exception:
                continue
            if text and text.strip():
                lines = text.strip().splitlines()
                parts.append(f"--- {type(launcher).__name__} ---\n" + "\n".join(lines[-15:]))
        return "\n".join(parts)

    def local_pids(self) -> list[int]:
        """The local launcher's engine pids (the other launchers' engines are known by `stop`'s ``pids``)."""
        pids = []
        for engine_set in (self.cluster.engines.values() if self.cluster else ()):
            pids += [launcher.pid for launcher in getattr(engine_set, "launchers", {}).values()]
        return pids

    def stop(self, pids=()) -> None:
        """Stop the engines and the controller; kill what does not stop. Idempotent.

        ``pids``: the engines' own pids on this host, as they said when they joined (under mpiexec or srun
        the launcher knows only its own pid).
        """
        if self.cluster is None:
            return
        # Killed first: an engine holds nothing worth saving once its session stops, and the polite
        # stop (SIGTERM, then SIGKILL after 5 s) waits out every engine whose process group or a
        # collective it is stuck in keeps it from exiting: 7-9 s per `%ranks stop`, measured.
        for pid in set(self.local_pids()) | set(pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            if self.client is not None:
                self.client.close()
            self.cluster.stop_cluster_sync()
        except Exception:
            pass
        if self.reaper is not None:  # whatever is left of the session (mpiexec's daemons on another namespace)
            self.reaper.stop()
        self.cluster = self.client = self.reaper = None

