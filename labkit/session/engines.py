"""The engines of a session: an ipyparallel cluster (one controller, N engines), started and stopped.

The engines are fresh interpreters that the launcher starts (``python -m ipyparallel.engine``), never
forks of the kernel: on a GPU node torch refuses autograd and CUDA in a process forked after its parent
used them (see CONTRIBUTING's "How a rank is born"). They are ordinary IPython kernels, so each keeps
its own namespace between cells. Each engine exits when the kernel that started it is gone
(`labkit.session.engine_side`), and ipyparallel stops the cluster when the kernel exits normally.
"""
from __future__ import annotations

import os
import signal
import time

LAUNCHERS = {"local": "local", "mpiexec": "mpi", "slurm": "slurm", "pbs": "pbs"}  # ours -> ipyparallel's


class EnginesDidNotStart(RuntimeError):
    """The engines did not come up in time; the message names the launcher and what it printed."""


class Engines:
    """N engines and their controller; ``client`` talks to them, ``pids`` are the local engines' pids."""

    def __init__(self, n: int, launcher: str = "local", start_timeout: float = 60.0):
        if launcher not in LAUNCHERS:
            raise ValueError(f"unknown launcher {launcher!r}: use one of {tuple(LAUNCHERS)}")
        self.n, self.launcher, self.start_timeout = n, launcher, start_timeout
        self.cluster = self.client = None

    def start(self) -> None:
        import ipyparallel as ipp

        self.cluster = ipp.Cluster(n=self.n, engine_launcher_class=LAUNCHERS[self.launcher], log_level=40,
                                   shutdown_atexit=True)
        began = time.monotonic()
        try:
            self.cluster.start_cluster_sync()
            self.client = self.cluster.connect_client_sync()
            left = max(1.0, self.start_timeout - (time.monotonic() - began))
            self.client.wait_for_engines(self.n, timeout=left, interactive=False)
        except (TimeoutError, Exception) as err:
            said = self._launcher_output()
            up = len(self.client.ids) if self.client is not None else 0
            self.stop()
            raise EnginesDidNotStart(
                f"the {self.launcher} launcher started {up} of {self.n} engine(s) in {self.start_timeout:g} s "
                f"({type(err).__name__}: {err}).\nWhat the launcher printed:\n{said or '(nothing)'}\n"
                "What to do: on a busy machine, start again with a longer --start-timeout; with mpiexec, "
                "Slurm or PBS, run inside an allocation that has room for the engines.") from None

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
        """The engines' pids as their launchers know them (local launcher), in engine-id order is not known."""
        pids = []
        for engine_set in (self.cluster.engines.values() if self.cluster else ()):
            pids += [launcher.pid for launcher in getattr(engine_set, "launchers", {}).values()]
        return pids

    def stop(self) -> None:
        """Stop the engines and the controller; kill what does not stop. Idempotent."""
        if self.cluster is None:
            return
        # Killed first: an engine holds nothing worth saving once its session stops, and the polite
        # stop (SIGTERM, then SIGKILL after 5 s) waits out every engine whose process group or a
        # collective it is stuck in keeps it from exiting: 7-9 s per `%ranks stop`, measured.
        for pid in self.local_pids():
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
        self.cluster = self.client = None
