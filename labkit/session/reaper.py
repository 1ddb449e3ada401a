"""Nothing of a session outlives its kernel, even a kernel killed by SIGKILL (the out-of-memory killer, a
`kill -9`, JupyterLab's kernel manager when a shutdown times out).

A killed kernel runs no exit handler, and its children (the controller, the local engines, mpiexec and
what it started) are re-parented and live on. So every session starts one reaper: a fresh, small
interpreter (this file as a script: no torch, no labkit) in its own session, whose stdin is a pipe from the kernel. It reads until end of
file, which comes when the kernel closes its end: at `%ranks stop`, or when the kernel exits or dies, by
any signal (the operating system closes a dead process's descriptors). Then it kills, with SIGKILL, every
process whose environment carries this session's marker (`MARKER`: set by the launchers in the controller's
and the engines' environment, inherited by everything they start, mpiexec's daemons included), until none
is left, removes the session's folder (the ranks' stack files, `Session.folder`: a kernel that dies or shuts
down without `%ranks stop` leaves it otherwise) and ipyparallel's files of the session in the IPython profile
(`leftovers`: the cluster file, the controller's connection files and the logs, which a killed controller never
removes: one file per session in the learner's ~/.ipython, and every cluster file there slows JupyterLab, whose
IPython Parallel panel loads each on every refresh), and exits.

Why not PR_SET_PDEATHSIG: it fires when the parent *thread* ends (in a kernel, whose event loop is
running, ipyparallel's `*_sync` calls run in a helper thread), is Linux only, and reaches direct children
only, not the engines under mpiexec nor its daemons on other hosts.
Why not only the engines' own watch (`engine_side._watch_kernel`): the controller runs no code of ours,
and an engine watches only once it has joined. The reaper finds processes by /proc (psutil), so it covers
this machine, network namespaces included, and only its own pid namespace: an engine on another machine
(or, in the lab's two-host test, in another pid namespace) exits when its lifeline to the kernel ends
(`labkit.session.lifeline`), which a dead kernel's does at once.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
import uuid

MARKER = "LABKIT_SESSION_MARKER"  # the variable; its value is one session's id


def marked(marker: str) -> list:
    """The processes of this machine whose environment has ``MARKER=marker`` (zombies excluded: already dead)."""
    import psutil

    found, machine = [], _pid_namespace("self")
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARKER) == marker and process.status() != psutil.STATUS_ZOMBIE \
                    and _pid_namespace(process.pid) == machine:
                found.append(process)
        except psutil.Error:  # gone, or another user's
            continue
    return found


def _pid_namespace(pid) -> int | None:
    """The process's pid namespace: this machine's engines share the reaper's (`hosts.machine_id`); one in a child
    namespace is another machine's (the two-host test's host B), whose engines end themselves (their lifeline)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def sweep(marker: str, deadline_s: float = 10.0) -> int:
    """SIGKILL every marked process until none is left (a launcher may start one while we kill); how many."""
    killed, end = set(), time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = marked(marker)
        if not found:
            break
        for process in found:
            try:
                process.kill()
                killed.add(process.pid)
            except Exception:
                pass
        time.sleep(0.05)
    return len(killed)


class Reaper:
    """The kernel's side: ``environment`` goes to the launchers; ``stop()`` (or the kernel's death) ends them
    and removes ``folder`` (the session's files), when given, and every file matching a ``leftovers`` pattern."""

    def __init__(self, folder: str | None = None, leftovers: tuple[str, ...] = ()):
        self.marker = uuid.uuid4().hex
        self.environment = {MARKER: self.marker}
        env = {k: v for k, v in os.environ.items() if k != MARKER}
        # this file as a script, isolated (-I): psutil only, not labkit's package (torch, seconds and 200 MB)
        self.process = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), self.marker,
                                         folder or "", *leftovers],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                                        start_new_session=True)  # the stop button's SIGINT is not for it

    def stop(self, timeout: float = 15.0) -> None:
        """End every process of the session now, and wait for the reaper to have done so. Idempotent."""
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(marker: str, folder: str = "", *leftovers: str) -> None:
    try:
        sys.stdin.buffer.read()  # until the kernel's end closes: stopped, exited or killed
    except BaseException:
        pass
    sweep(marker)
    if folder:  # after the sweep: no engine writes a stack into it any more
        shutil.rmtree(folder, ignore_errors=True)
    for pattern in leftovers:
        for path in glob.glob(pattern):
            try:
                os.remove(path)
            except OSError:
                pass


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    main(*sys.argv[1:])
