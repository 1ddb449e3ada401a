"""The local launcher's engines, forked from the lab's zygote instead of started as fresh interpreters.

ipyparallel's local launcher runs ``python -m ipyparallel.engine ...`` once per engine, and each engine
then imports torch (when it joins the process group) and ipyparallel: about 4.5 s of CPU per engine.
This launcher hands the same command, environment, directory and output file to the zygote
(`labkit.launching.zygote_process`), which forks the engine with torch already imported. The zygote has
never run autograd nor touched CUDA, so the engine is as clean as a rank (never a fork of the kernel).

Everything else is ipyparallel's: the engine reads its connection from the environment, its output goes
to the launcher's log file (`Engines._launcher_output`), and the launcher watches and signals it by pid.
The engine dies with the zygote, which leaves when the kernel does (SIGKILL included): the session's
reaper does not need to find it. Where the zygote cannot be used (another engine command, a zygote that
does not start), the engine starts as a fresh interpreter, as before.
"""
from __future__ import annotations

import os

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

ENGINE_MODULE = "ipyparallel.engine"


class ForkedEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the zygote (falls back to ipyparallel's own start)."""

    def start(self):
        from labkit.launching import zygote, zygote_process
        from labkit.launching.zygote import ZygoteError

        args = list(self.args)
        if self.state != "before" or args[1:3] != ["-m", ENGINE_MODULE]:
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        try:
            with open(self.output_file, "ab") as out, open(os.devnull, "rb") as stdin:
                pid = zygote.get().start_process(zygote_process.request(ENGINE_MODULE, args[3:], env, self.work_dir),
                                                 [stdin.fileno(), out.fileno(), out.fileno()])
        except (ZygoteError, OSError):
            return super().start()
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """N engines, each forked by the zygote."""

    launcher_class = ForkedEngineLauncher
