"""A one-node Slurm cluster for tests: slurmctld and slurmd on this machine's loopback (written config,
auth/none, ports the OS picked free), started in ``prefix`` (e.g. ``nsenter --net=...`` for a namespace).

Used by tests/test_multihost.py (sbatch in a namespace) and tests/test_session_launchers.py (a session's
engines started by srun inside an allocation). Needs root (slurmd) and slurm-wlm; `why_not` says otherwise.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# MinJobAge=4: `sbatch --wait` polls the job after 2, 8 and 32 s (each wait 4x the last while it is under
# MinJobAge/2, so that a finished job is never purged unseen); the default (300 s) let a 12 s job return
# after 42 s. With 4 it polls every 2 s. sched_min_interval=0: a job is placed as soon as it is submitted
# (the default waits up to 2 s between scheduling passes).
SLURM_CONF = """\
ClusterName=labkit
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=4
SchedulerParameters=sched_min_interval=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
INSTALL = "make browser (as root: apt-get install -y chromium openmpi-bin mpich slurm-wlm)"


def sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def why_not() -> str | None:
    """Why no Slurm cluster can run here, or None."""
    missing = [d for d in ("slurmctld", "slurmd", "sbatch", "sinfo", "srun", "salloc")
               if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"no {', '.join(missing)}: install it with {INSTALL}"
    if os.geteuid() != 0:
        return "a Slurm cluster in a test needs root (slurmd)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_node_slurm(folder: Path, env: dict, prefix=()):
    """Start the daemons (in ``prefix``), wait until the node is idle; yields ``env`` with SLURM_CONF set.

    Skips the test (pytest.skip) when a daemon cannot run here; always stops both daemons at the end.
    """
    import pytest

    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=folder, ctld_port=_free_port(), d_port=_free_port()))
    env = dict(env, SLURM_CONF=str(conf))
    daemons = []
    try:
        for cmd in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", "localhost"]):
            log = open(folder / f"{cmd[0]}.out", "w")
            daemons.append(subprocess.Popen([*prefix, sbin(cmd[0]), *cmd[1:], "-f", str(conf)], env=env, cwd=folder,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run([*prefix, "sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                           timeout=30, env=env).stdout:
            for cmd, proc in zip(("slurmctld", "slurmd"), daemons):
                if proc.poll() is not None:
                    out = (folder / f"{cmd}.out").read_text().strip().splitlines()
                    pytest.skip(f"{cmd} cannot run here: {out[-1] if out else proc.returncode}")
            if time.monotonic() > deadline:
                pytest.fail("the Slurm node did not become idle within 60 s: " + (folder / "slurmd.log").read_text()[-1000:])
            time.sleep(0.5)
        yield env
    finally:
        for proc in daemons:  # SIGTERM: they shut down cleanly; SIGKILL if they do not
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
