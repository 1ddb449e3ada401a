"""A long-lived process forked from the zygote, running a module as ``python -m`` would: a session's engine.

A session's local engines (`labkit.session.forked_engines`) used to start as fresh interpreters,
``python -m ipyparallel.engine``, and each then imported torch and ipyparallel: about 4.5 s of CPU per
engine, 8-10 s of waiting for ``%ranks start 2`` on two cores. The zygote (`labkit.launching.zygote`)
has torch imported and has never run autograd or touched CUDA, so a process forked from it is as
clean as a rank (CONTRIBUTING, "How a rank is born"): never a fork of the kernel.

The request carries what ``subprocess.Popen`` would get: the module and its arguments, the whole
environment, the working directory, and stdin/stdout/stderr (descriptors, sent with the request).
The child takes them, names itself (``NAME``, what ``ps`` and psutil's ``name()`` show: its command line
is the zygote's), and dies with the zygote (PR_SET_PDEATHSIG), as ranks do: the zygote leaves when its
caller does, so nothing outlives the kernel, SIGKILL included. The zygote imports the module first
(its preload), once, so that every later process inherits it too.
"""
from __future__ import annotations

import os
import signal
import sys

NAME = "labkit-engine"  # the process name (15 bytes at most: Linux's comm)


def request(module: str, argv: list[str], env: dict, cwd: str) -> dict:
    return {"module": module, "argv": list(argv), "env": dict(env), "cwd": cwd}


def become(request: dict, fds: list[int], close: list[int]) -> None:
    """In the forked child: the request's streams, environment, directory and argv; run the module; exit."""
    code = 1
    try:
        os.setsid()  # its own process group, as Popen(start_new_session=True) would give it
        from labkit.launching.rank_main import _die_with_parent

        _die_with_parent()
        _name(NAME)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the zygote ignores it; an engine is interrupted
        for fd in close:
            try:
                os.close(fd)
            except OSError:
                pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["argv"]]
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:  # noqa: BLE001 - said on its stderr, the launcher's log
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what a normal interpreter exit runs
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _name(name: str) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except Exception:  # noqa: BLE001 - a name is a convenience
            pass
