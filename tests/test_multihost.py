"""Two hosts on one machine: the cluster launchers really run, across a real network link.

Two Linux network namespaces joined by a veth pair are two hosts: each has its own
interfaces and ports, and they reach each other only at 10.231.0.1 and 10.231.0.2 (a test
subnet that exists inside the namespaces only, on an interface named lab0 on both). On them:
  - torchrun: labkit/jobs/torchrun_multi_node.sh in each namespace, c10d rendezvous on host A
    (notebook 14's composed pp2 x tp2 with one stage per host; the hybrid dp2 x pp2 crosses
    the hosts under mpiexec below, and under torchrun in the fault test);
  - mpiexec: labkit/jobs/pbs_mpiexec.pbs with a PBS-style host file naming both addresses;
    Open MPI reaches host B through an rsh agent that is `ip netns exec` instead of ssh;
  - Slurm: slurmctld and slurmd (a one-node cluster on host A's loopback, written config,
    auth/none), and labkit/jobs/slurm.sbatch submitted with sbatch;
each running `python -m labkit.apps.train` on gloo, whose final weights and losses must
equal the single-process `labkit.training.loop.train` (the comparison of test_train_scripts).
And a fault: a rank on host B is killed mid-run; every process on both hosts must end.
And a session of persistent ranks (`%ranks start 2 --launcher mpiexec --hosts A,B`) driven from a
process in host A's namespace, as a notebook kernel there would: its controller and store listen at host
A's address, its all-reduce crosses the link, and `%ranks stop` leaves nothing on either host.

Needs root and a working `ip netns` (CI runs as root); otherwise skipped with one line.
Every namespace, daemon and process is removed at the end, also when a test fails.
Cost: about 1 minute per launcher on two idle cores (each starts 4 ranks that import torch).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import slurm_cluster
from test_train_scripts import COMMON, REPO, _check, _env, _report, _run, reference  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

JOBS = REPO / "labkit" / "jobs"
ADDRS = ("10.231.0.1", "10.231.0.2")
IFNAME = "lab0"  # the same name on both hosts: one GLOO_SOCKET_IFNAME for all
HYBRID = ["--strategy", "hybrid", "--dp", "2", "--pp", "2", "--microbatches", "2", "--model", "tiny"]
FAULT_DEADLINE = 180  # s from the kill until every process has ended (see the fault test)
INSTALL = slurm_cluster.INSTALL


def _sh(*cmd, check=True, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check, env=env)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "two-host tests need root for `ip netns` (CI runs as root)"
    if shutil.which("ip") is None:
        return "two-host tests need `ip` (apt-get install -y iproute2)"
    probe = f"lkprobe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {(made.stderr.strip().splitlines() or ['?'])[-1]}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def _pids(ns: str) -> list[int]:
    out = _sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all_in(ns: str):
    for pid in _pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _in(ns: str, *cmd) -> list[str]:
    return ["ip", "netns", "exec", ns, *map(str, cmd)]


@pytest.fixture(scope="module")
def hosts():
    """Two namespaces, a and b, joined by a veth pair; removed with all their processes at the end."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = f"lk{os.getpid() % 100000}"
    ns = (f"{tag}a", f"{tag}b")
    try:
        for name in ns:
            _sh("ip", "netns", "add", name)
        _sh("ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for name, end, addr in zip(ns, (f"{tag}va", f"{tag}vb"), ADDRS):
            _sh("ip", "link", "set", end, "netns", name)
            _sh("ip", "-n", name, "link", "set", end, "name", IFNAME)
            _sh("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _sh("ip", "-n", name, "link", "set", IFNAME, "up")
            _sh("ip", "-n", name, "link", "set", "lo", "up")
        yield SimpleNamespace(ns=ns, addrs=ADDRS, tag=tag)
    except subprocess.CalledProcessError as err:
        pytest.fail(f"setting up the namespaces failed: {' '.join(err.cmd)}: {err.stderr.strip()}")
    finally:
        for name in ns:
            _kill_all_in(name)
            _sh("ip", "netns", "del", name, check=False)  # deletes its veth end, and so the pair
        _sh("ip", "link", "del", f"{tag}va", check=False)  # if it never moved into a namespace
        assert not [n for n in ns if n in _sh("ip", "netns", "list").stdout], "a namespace was left behind"


@pytest.fixture
def nothing_left(hosts):
    """After each test: no process may remain in either namespace (then they are killed anyway)."""
    yield
    left = {name: _pids(name) for name in hosts.ns}
    for name in hosts.ns:
        _kill_all_in(name)
    assert not any(left.values()), f"processes left running on the hosts: {left}"


def _torchrun_jobs(hosts, port, job_id, args, **extra):
    jobs = []
    for ns, addr in zip(hosts.ns, hosts.addrs):
        env = _env(HEAD=hosts.addrs[0], NNODES="2", NPROC="2", PORT=str(port), JOB_ID=job_id, MODEL="tiny",
                   PYTHON=sys.executable, TORCHRUN_ARGS=f"--local-addr {addr}", GLOO_SOCKET_IFNAME=IFNAME,
                   **extra)
        jobs.append((_in(ns, "bash", JOBS / "torchrun_multi_node.sh", *args), env))
    return jobs


def _the_report(outputs):
    """Rank 0 prints the JSON report; which host it ran on is the rendezvous' choice."""
    return _report(next((o for o in outputs if any(line.startswith("{") for line in o.splitlines())), outputs[0]))


def test_torchrun_pp_and_tp_across_two_hosts_equals_single_process(hosts, reference, tmp_path, nothing_left):
    """Notebook 14's composed strategy, pp2 x tp2 on 2 ranks per host: the grid puts tp innermost, so each
    host holds one pipeline stage (its tp group stays inside it) and the stage boundary's activations and
    gradients cross the link between the hosts. (Two axes, not three: cp's ring, like tp's group, would stay
    inside a host, and four more ranks cost about 20 s of CPU; test_train_scripts' composed jobs run cp,
    forked and under MPICH's variables.)"""
    saved = tmp_path / "weights.pt"
    args = ["--pp", "2", "--tp", "2", *COMMON, "--save", saved]
    jobs = _torchrun_jobs(hosts, 29504, f"labkit-2d-{hosts.tag}", args, STEPS="3")
    _check(_the_report(_run(jobs)), saved, reference, "composed", 4)


def _open_mpi_rsh_agent(hosts, tmp_path, own_pids=()):
    """Open MPI starts its daemon on a remote host with `<agent> <host> <command>`: ssh on a cluster, here
    `ip netns exec` into that host's namespace (each call logged, to prove host B was used). A host in
    ``own_pids`` also gets its own pid namespace and /proc (`unshare --pid --fork --mount-proc`): its
    processes' pids are not the kernel's, as on a separate machine."""
    flavour = _sh("mpiexec", "--version", check=False).stdout
    if "Open MPI" not in flavour and "OpenRTE" not in flavour:
        pytest.skip("the rsh agent below is written for Open MPI's mpiexec (apt-get install -y openmpi-bin)")
    agent, calls = tmp_path / "netns-rsh", tmp_path / "agent-calls.txt"
    wrap = {addr: "unshare --pid --fork --mount-proc" if addr in own_pids else "" for addr in hosts.addrs}
    cases = "\n".join(f'  {addr}) ns={ns}; wrap="{wrap[addr]}" ;;' for addr, ns in zip(hosts.addrs, hosts.ns))
    agent.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}\n'
                     f'  *) echo "unknown host $host" >&2; exit 1 ;;\nesac\n'
                     f'echo "$host $ns" >> {calls}\nexec ip netns exec "$ns" $wrap sh -c "$*"\n')
    agent.chmod(0o755)
    return agent, calls


def test_mpiexec_across_two_hosts_equals_single_process(hosts, reference, tmp_path, nothing_left):
    if shutil.which("mpiexec") is None:
        pytest.skip(f"no mpiexec: install it with {INSTALL}")
    agent, calls = _open_mpi_rsh_agent(hosts, tmp_path)
    nodefile = tmp_path / "nodefile"  # what PBS writes: one line per process
    nodefile.write_text("".join(f"{addr}\n" * 2 for addr in hosts.addrs))
    saved = tmp_path / "weights.pt"
    env = _env(PBS_NODEFILE=str(nodefile), PPN="2", MASTER_PORT="29501", PYTHON=sys.executable,
               GLOO_SOCKET_IFNAME=IFNAME, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_plm_rsh_agent=str(agent), OMPI_MCA_oob_tcp_if_include=IFNAME,
               OMPI_MCA_btl_tcp_if_include=IFNAME)
    cmd = _in(hosts.ns[0], "bash", JOBS / "pbs_mpiexec.pbs", *HYBRID, *COMMON, "--save", saved)
    (output,) = _run([(cmd, env)])
    assert f"{hosts.addrs[1]} {hosts.ns[1]}" in calls.read_text(), "mpiexec never started anything on host B"
    _check(_report(output), saved, reference, "hybrid", 4)


# The "kernel" of a two-host session: a process in host A's namespace that drives the session as the
# magics do in a notebook (`%ranks ...` is `ranks_line`, a `%%ranks` cell is `run_on_session`).
SESSION_DRIVER = """
import json, os, sys, time
import psutil
from labkit.session.engines import EnginesDidNotStart
from labkit.session.session import ranks_line, run_on_session
from labkit.session.watch import SessionError
import labkit.session.session as sess

a, b, unreachable, namespaces = sys.argv[1], sys.argv[2], sys.argv[3], set(sys.argv[4:])

def left():  # every process in the two namespaces but this one (host B's own pid namespace included)
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and str(os.stat(f"/proc/{p.pid}/ns/net").st_ino) in namespaces \\
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append((p.pid, " ".join(p.cmdline())[:80]))
        except (OSError, psutil.Error):
            pass
    return found

def left_after(seconds=10.0):  # an engine on host B ends itself when its lifeline ends: give it the time
    end = time.monotonic() + seconds
    while left() and time.monotonic() < end:
        time.sleep(0.2)
    return left()

def reported(cell):  # [the session's report, seconds until it came]
    began = time.monotonic()
    try:
        run_on_session("", cell)
    except SessionError as err:
        return [str(err), time.monotonic() - began]
    return ["not reported", time.monotonic() - began]

t0 = time.monotonic()
print("START", ranks_line(f"start 2 --launcher mpiexec --backend gloo --hosts {a},{b} --start-timeout 90"))
run_on_session("", "import os\\nx = torch.tensor([2.0 ** rank], dtype=torch.float64)\\ndist.all_reduce(x)\\n"
                   "print('SUM', int(x.item()), 'NETNS', os.stat('/proc/self/ns/net').st_ino, 'LOCAL', os.environ['LOCAL_RANK'],"
                   " 'PIDNS', os.stat('/proc/self/ns/pid').st_ino)")
print("HOSTS", json.dumps(sess.current.hosts))
print("HERE", json.dumps(sorted(sess.current.here)))  # the ranks whose pids this kernel shares
t1 = time.monotonic()
# a hang across the hosts: each rank waits to receive from the other (rank 1's stack comes through its lifeline).
# Its report stops the session: the lifelines end first, and B's engine must end itself before Engines.stop
# stops mpiexec (whose daemon on B would otherwise end it): watched here, on the way into Engines.stop
from labkit.session.engines import Engines
_stop = Engines.stop

def engines_on_b():  # argv's last: host B's network namespace
    found = []
    for pid, cmd in left():
        try:
            if "ipyparallel" in cmd and os.stat(f"/proc/{pid}/ns/net").st_ino == int(sys.argv[-1]):
                found.append(pid)
        except OSError:
            pass
    return found

watched = []  # seconds spent watching B (not the session's: left out of the hang's seconds)

def stop_after_watching_b(self, pids=()):
    began = end = time.monotonic()
    while engines_on_b() and end < began + 5:
        time.sleep(0.1)
        end = time.monotonic()
    watched.append(end - began)
    print("ENGINE_B_BEFORE_MPIEXEC_STOPPED", json.dumps(engines_on_b()))
    _stop(self, pids)

Engines.stop = stop_after_watching_b
hang, seconds = reported("t = torch.zeros(1)\\ndist.recv(t, src=1 - rank)")
Engines.stop = _stop
print("HANG", json.dumps([hang, seconds - sum(watched)]))
print("LEFT_AFTER_HANG", json.dumps(left_after()))  # the hang stopped the session (Session.stop: `%ranks stop`)
t2 = time.monotonic()
ranks_line("restart")
print("DEAD", json.dumps(reported("import os, signal\\nif rank == 1:\\n    os.kill(os.getpid(), signal.SIGKILL)")))
print("LEFT", json.dumps(left_after()))
t3 = time.monotonic()
began = time.monotonic()
try:
    ranks_line(f"start 2 --launcher mpiexec --backend gloo --hosts {a},{b} --ip {unreachable} --start-timeout 40")
    print("UNREACHABLE STARTED")
except EnginesDidNotStart as err:
    print("REFUSED", json.dumps([str(err), time.monotonic() - began]))
print("LEFT_END", json.dumps(left_after()))
print("SECONDS", json.dumps({"start+cell": t1 - t0, "hang+stop": t2 - t1, "restart+dead+stop": t3 - t2,
                             "unreachable": time.monotonic() - began}))
"""


def test_a_session_spans_two_hosts_reduces_across_them_and_stops_everything(hosts, tmp_path, nothing_left):
    """`%ranks start 2 --launcher mpiexec --hosts A,B` from host A: the engines join one group across the link
    (an all_reduce of 2**rank in float64 is 2**2 - 1 = 3 only if each rank took part once), rank 0 runs in host
    A's network namespace and rank 1 in B's (each rank reads its own namespace), each is local rank 0 on its
    host (its GPU under nccl), the session names both hosts by their addresses.
    Host B is a separate machine to the kernel: its own pid namespace and /proc (the rsh agent's `unshare`), so
    the kernel can neither signal its engine nor read it by pid (`Session.here` holds rank 0 only), and the
    kernel's reaper leaves it alone. Through its lifeline (`labkit.session.lifeline`), still: a hang (each rank
    receiving from the other) is reported within 10 s with each rank's waiting line, rank 1's included; the
    session's stop ends B's engine through its lifeline (seen gone before mpiexec, whose daemon would end it
    too, is stopped) and leaves no process on either host; after `%ranks restart`, the engine on B killed by
    SIGKILL is reported as dead, and nothing is left. Then bad input: the controller at an
    address of A that B has no route to (`--ip`) is named, with what to do, within the start timeout, and its
    engine on B, which never reached the kernel, gives up and leaves nothing (within 10 s).
    One engine per host: the hosts are what is tested, and each engine imports torch (seconds on 2 cores)."""
    if shutil.which("mpiexec") is None:
        pytest.skip(f"no mpiexec: install it with {INSTALL}")
    agent, calls = _open_mpi_rsh_agent(hosts, tmp_path, own_pids=[hosts.addrs[1]])
    unreachable = "10.232.0.1"  # on host A's loopback: a /32 route host B does not have
    _sh("ip", "-n", hosts.ns[0], "addr", "add", f"{unreachable}/32", "dev", "lo")
    inodes = {ns: os.stat(f"/var/run/netns/{ns}").st_ino for ns in hosts.ns}
    env = _env(PYTHON=sys.executable, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_plm_rsh_agent=str(agent), OMPI_MCA_oob_tcp_if_include=IFNAME)  # no GLOO_SOCKET_IFNAME: chosen
    cmd = _in(hosts.ns[0], sys.executable, "-c", SESSION_DRIVER, *hosts.addrs, unreachable, *inodes.values())
    (output,) = _run([(cmd, env)], timeout=240)
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in output.splitlines() if " " in line}
    a, b = hosts.addrs
    assert lines.get("START", "").startswith(f"session up of 2 rank(s), backend gloo, mpiexec launcher, hosts "
                                             f"{a} [rank 0], {b} [rank 1], engine pids"), output[-3000:]
    assert f"{b} {hosts.ns[1]}" in calls.read_text(), "mpiexec never started anything on host B"
    ino_a, ino_b = inodes.values()
    # LOCAL: the rank on its own host, the GPU it would take under nccl: 0 on each host, not the global rank
    assert f"[rank 0] SUM 3 NETNS {ino_a} LOCAL 0" in output and f"[rank 1] SUM 3 NETNS {ino_b} LOCAL 0" in output, \
        output[-3000:]
    pid_ns = {int(m[0]): int(m[1]) for m in re.findall(r"\[rank (\d)\] SUM 3 .* PIDNS (\d+)", output)}
    assert pid_ns[0] == os.stat("/proc/self/ns/pid").st_ino != pid_ns[1], pid_ns  # B: pids of its own
    assert json.loads(lines["HOSTS"]) == {"0": a, "1": b}
    assert json.loads(lines["HERE"]) == [0], lines["HERE"]  # hosts.machine_id: B is another machine
    hang, seconds = json.loads(lines["HANG"])
    assert hang.startswith("hung: rank(s) 0, 1 of 2 all waited"), hang
    for rank in (0, 1):  # each rank's waiting line; rank 1's stack came from B through its lifeline
        assert f"rank {rank} waits at your cell, line 2: dist.recv(t, src=1 - rank)" in hang, hang
    assert seconds < 10, f"the hang was reported after {seconds:.1f} s"
    assert json.loads(lines["ENGINE_B_BEFORE_MPIEXEC_STOPPED"]) == [], "B's engine did not end with its lifeline"
    assert json.loads(lines["LEFT_AFTER_HANG"]) == [], f"left on the hosts after the hang's stop: {lines['LEFT_AFTER_HANG']}"
    dead, seconds = json.loads(lines["DEAD"])
    assert re.match(r"the engine of rank\(s\) (0, )?1 of 2 died", dead), dead
    assert seconds < 10, f"the dead engine was reported after {seconds:.1f} s"
    assert json.loads(lines["LEFT"]) == [], f"processes left on the hosts after the session stopped: {lines['LEFT']}"
    assert "REFUSED" in lines, output[-3000:]
    assert json.loads(lines["LEFT_END"]) == [], f"left on the hosts after the refused start: {lines['LEFT_END']}"
    text, seconds = json.loads(lines["REFUSED"])
    assert "the mpiexec launcher started" in text and "of 2 engine(s)" in text, text
    assert (f"the controller and the session's store listen at {unreachable}" in text
            and f"check that every host reaches {unreachable}" in text and "--ip" in text), text
    assert seconds < 40 + 15, seconds  # within the start timeout (and the stop that follows it)
    print("two-host session, seconds:", lines["SECONDS"], "hang reported:", json.loads(lines["HANG"])[1],
          "dead engine reported:", json.loads(lines["DEAD"])[1])


def test_slurm_one_node_cluster_runs_the_sbatch_script(hosts, reference, tmp_path, nothing_left):
    reason = slurm_cluster.why_not()
    if reason:
        pytest.skip(reason)
    d = tmp_path / "slurm"
    # nsenter joins host A's network only; `ip netns exec` would also remount /sys, hiding the
    # cgroup file systems slurmd needs ("No filesystem mounted on /sys/fs/cgroup").
    netns = ["nsenter", f"--net=/var/run/netns/{hosts.ns[0]}"]
    with slurm_cluster.one_node_slurm(d, _env(PYTHON=sys.executable, MASTER_PORT="29502"), netns) as env:
        saved = tmp_path / "weights.pt"
        cmd = [*netns, "sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
               "--cpus-per-task=1", f"--output={d}/job-%j.out", f"--chdir={REPO}", JOBS / "slurm.sbatch",
               "--model", "tiny", "--strategy", "dp", "--dp", "2", *COMMON, "--save", saved]
        _run([(list(map(str, cmd)), env)])
        (job_out,) = d.glob("job-*.out")
        _check(_report(job_out.read_text()), saved, reference, "dp", 2)


def test_killing_a_rank_on_host_b_ends_every_process_on_both_hosts(hosts, tmp_path, nothing_left):
    import psutil

    args = [*HYBRID, "--steps", "500", "--batch-size", "8", "--seq-len", "32", "--impl", "solutions"]
    logs = [open(tmp_path / f"host-{h}.log", "w+") for h in "ab"]
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
              for (cmd, env), log in zip(_torchrun_jobs(hosts, 29503, f"labkit-fault-{hosts.tag}", args), logs)]
    def text():
        return "".join(Path(log.name).read_text() for log in logs)

    try:
        deadline = time.monotonic() + 240
        while "step    1" not in text():  # mid-run: a step is done, hundreds to go
            if any(a.poll() is not None for a in agents) or time.monotonic() > deadline:
                pytest.fail(f"training never got going:\n{text()[-3000:]}")
            time.sleep(0.5)
        workers = [p for p in psutil.Process(agents[1].pid).children(recursive=True)  # the ranks on host B
                   if "labkit.apps.train" in " ".join(p.cmdline()) and "torch.distributed.run" not in p.cmdline()]
        assert len(workers) == 2, workers
        workers[0].kill()
        killed = time.monotonic()
        # Bound: the peers see the dead rank's closed sockets at once; labkit's exit handler then
        # waits up to 60 s for the ranks that never finish, and torchrun gives SIGTERM'd workers
        # 30 s. Far below the process-group timeout (torch's default for gloo: 30 min).
        for agent in agents:
            agent.wait(timeout=max(1, FAULT_DEADLINE - (time.monotonic() - killed)))
        ended = time.monotonic() - killed
        assert all(a.returncode != 0 for a in agents), [a.returncode for a in agents]
        print(f"both torchruns ended {ended:.0f} s after rank kill (exit codes {[a.returncode for a in agents]})")
        for ns in hosts.ns:  # nothing of the job left on either host
            deadline = time.monotonic() + 10
            while _pids(ns) and time.monotonic() < deadline:
                time.sleep(0.2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"processes still running {FAULT_DEADLINE} s after a rank was killed:\n{text()[-3000:]}")
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for log in logs:
            log.close()
