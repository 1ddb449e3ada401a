"""A session's engines started by the cluster launchers (`%ranks start N --launcher mpiexec|slurm`), in a real
kernel driven by nbclient: Open MPI's mpiexec, MPICH's (where installed), and Slurm's srun inside an allocation
of a one-node Slurm cluster (tests/slurm_cluster.py). Each session keeps a variable across cells, its ranks
form one process group (an all_reduce of 2**rank over N ranks is 2**N - 1, the closed form, and only if every
rank took part exactly once), each rank is the launcher's own rank (its variable, read in the engine), and
`%ranks stop` leaves no engine. Bad input is refused before any process starts; a launcher that exits is
named with what it printed, at once rather than at the start timeout.

Cost: each session starts 2 engines that import torch: about 10 s each on two idle cores, 25 s busy.
"""
import os
import re
import shutil
import subprocess
import time

import psutil
import pytest

import slurm_cluster
from checkout import labkit_path_env
from labkit.grading import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

N = 2
ROOT_OK = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # Open MPI refuses root without


def _session_cells(name, start, rank_variable):
    """Start, a variable set in one cell, all-reduced in the next, the launcher's rank read; stop."""
    return [
        (name, "start", start),
        (name, "set", "%%ranks\nx = torch.tensor([2.0 ** rank], dtype=torch.float64)"),
        (name, "reduce", f"%%ranks\ndist.all_reduce(x)\nimport os\nprint(int(x.item()), os.environ[{rank_variable!r}] == str(rank))"),
        (name, "pids", "print('PIDS', *sess.current.pids.values())"),
        (name, "stop", "%ranks stop"),
    ]


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    import nbformat
    from run_notebook import NotebookClient  # nbclient's, polling its sockets every second

    if shutil.which("mpiexec") is None:
        pytest.skip(f"no mpiexec: install it with {slurm_cluster.INSTALL}")
    tmp = tmp_path_factory.mktemp("launchers")
    cells = [("setup", "", "import labkit, os\nimport labkit.session.session as sess\n%load_ext labkit\n"
                            f"os.environ.update({ROOT_OK!r})")]
    cells += _session_cells("openmpi", f"%ranks start {N} --launcher mpiexec --backend gloo", "OMPI_COMM_WORLD_RANK")
    if os.path.exists("/usr/bin/mpiexec.mpich"):  # MPICH first on PATH, as `module load mpich` would put it
        wrapper = tmp / "mpich" / "mpiexec"
        wrapper.parent.mkdir()
        wrapper.write_text('#!/bin/sh\nexec /usr/bin/mpiexec.mpich "$@"\n')  # hydra finds its proxy beside itself
        wrapper.chmod(0o755)
        cells += [("mpich", "path", f"os.environ['PATH'] = {str(wrapper.parent)!r} + ':' + os.environ['PATH']")]
        cells += _session_cells("mpich", f"%ranks start {N} --launcher mpiexec --backend gloo", "PMI_RANK")
    with slurm_cluster.one_node_slurm(tmp / "slurm", dict(os.environ)) if not slurm_cluster.why_not() \
            else _no_slurm() as slurm_env:
        if slurm_env is not None:
            alloc = subprocess.run(["salloc", "--no-shell", f"-n{N}", "-J", "labkit-session"], env=slurm_env,
                                   capture_output=True, text=True, timeout=60)
            job = re.search(r"Granted job allocation (\d+)", alloc.stderr + alloc.stdout)
            assert job, f"salloc gave no allocation: {alloc.stderr}"
            # SLURM_JOB_NODELIST as salloc's shell would set it: the session reads the allocation's nodes
            # (scontrol show hostnames) and, all of them being this node, listens at loopback
            cells += [("slurm", "alloc", f"os.environ.update(SLURM_CONF={slurm_env['SLURM_CONF']!r}, "
                                         f"SLURM_JOB_ID={job.group(1)!r}, SLURM_JOB_NODELIST='localhost')\n"
                                         "print('NODES', *sess.where.allocation_hosts('slurm'))")]
            cells += _session_cells("slurm", f"%ranks start {N} --launcher slurm --backend gloo", "SLURM_PROCID")
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(source) for _, _, source in cells]
        old = os.environ.get("PYTHONPATH")
        os.environ.update(labkit_path_env())  # the kernel and its engines import this checkout's labkit
        try:
            client = NotebookClient(nb, timeout=180, kernel_name="python3", allow_errors=True,
                                    resources={"metadata": {"path": str(tmp)}})
            client.execute()  # shuts the kernel down at the end
        finally:
            os.environ.pop("PYTHONPATH", None) if old is None else os.environ.__setitem__("PYTHONPATH", old)
            if slurm_env is not None:
                subprocess.run(["scancel", job.group(1)], env=slurm_env, capture_output=True, timeout=30)
    out = {}
    for (name, step, _), cell in zip(cells, nb.cells):
        error = next((o for o in cell.outputs if o.output_type == "error"), None)
        out[name, step] = ("".join(o.get("text", "") for o in cell.outputs), error)
    return out


class _no_slurm:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check_session(story, name, launcher):
    if (name, "start") not in story:
        pytest.skip({"mpich": "no MPICH (apt-get install -y mpich)"}.get(name) or slurm_cluster.why_not()
                    or f"no {name} here")
    for step in ("start", "set", "reduce", "pids", "stop"):
        text, error = story[name, step]
        assert error is None, f"{name} {step}: {error.ename}: {error.evalue}\n" + "\n".join(error.traceback)[-3000:]
    assert story[name, "start"][0].startswith(f"session up of {N} rank(s), backend gloo, {launcher} launcher")
    # x = 2**rank on each rank, kept from the cell before; the sum over N ranks is 2**N - 1 (each rank once)
    assert story[name, "reduce"][0] == f"[ranks 0-{N - 1}] {2 ** N - 1} True\n", story[name, "reduce"][0]
    pids = [int(p) for p in story[name, "pids"][0].split()[1:]]
    assert len(pids) == N
    deadline = time.monotonic() + 10
    alive = lambda: [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]  # noqa: E731
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive() == [], f"engines left after %ranks stop: {alive()}"


def test_a_session_under_open_mpi_mpiexec_keeps_variables_and_forms_one_group(story):
    _check_session(story, "openmpi", "mpiexec")


def test_a_session_under_mpich_mpiexec_keeps_variables_and_forms_one_group(story):
    _check_session(story, "mpich", "mpiexec")


def test_a_session_under_srun_in_an_allocation_keeps_variables_and_forms_one_group(story):
    _check_session(story, "slurm", "slurm")
    assert story["slurm", "alloc"][0] == "NODES localhost\n"  # the allocation's node list, read by the session


# --------------------------------------------------------------------------- bad input, each a clear error

def test_a_cluster_launcher_outside_its_allocation_or_path_is_refused_before_any_process(monkeypatch, tmp_path):
    from labkit.session.session import Session

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("PBS_JOBID", raising=False)
    with pytest.raises(ValueError, match=r"--launcher slurm starts the engines inside your allocation, and this "
                                         r"kernel is in none \(no SLURM_JOB_ID\): get one first \(salloc -n N"):
        Session(2, "gloo", "slurm")
    with pytest.raises(ValueError, match=r"--launcher pbs .* \(no PBS_JOBID\): get one first \(qsub -I"):
        Session(2, "gloo", "pbs")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(ValueError, match=r"--launcher mpiexec starts the engines with `mpiexec`, which is not on PATH"):
        Session(2, "gloo", "mpiexec")


def test_a_launcher_that_exits_is_named_with_what_it_printed_at_once(monkeypatch, tmp_path):
    from labkit.session.engines import EnginesDidNotStart
    from labkit.session.session import Session

    fake = tmp_path / "mpiexec"
    fake.write_text('#!/bin/sh\necho "fake mpiexec: not enough slots for $2 processes" >&2\nexit 3\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    began = time.monotonic()
    with pytest.raises(EnginesDidNotStart) as info:
        Session(2, "gloo", "mpiexec", start_timeout=120).start()
    text = str(info.value)
    assert "the mpiexec launcher started 0 of 2 engine(s)" in text
    assert "`mpiexec` exited with code 3 before every engine was up" in text
    assert "fake mpiexec: not enough slots for 2 processes" in text
    assert time.monotonic() - began < 60  # not the 120 s start timeout


def test_hosts_and_ip_that_cannot_work_are_refused_before_any_process(monkeypatch, tmp_path):
    """`--hosts` and `--ip` (engines on several hosts) checked as arithmetic on names and addresses; no process
    starts (192.0.2.0/24 is TEST-NET-1: never this node's)."""
    from labkit.session.hosts import LOOPBACK, controller_address, parse_hosts
    from labkit.session.session import Session

    fake = tmp_path / "mpiexec"  # only on PATH: nothing may run it
    fake.write_text("#!/bin/sh\nexit 99\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(ValueError, match=r"--hosts places the engines with mpiexec: add --launcher mpiexec"):
        Session(4, "gloo", "local", hosts="a:2,b:2")
    with pytest.raises(ValueError, match=r"--hosts 'a:2,b:1' places 3 rank\(s\), not the session's 4: give every host"):
        Session(4, "gloo", "mpiexec", hosts="a:2,b:1")
    with pytest.raises(ValueError, match=r"4 ranks do not split evenly over 3 hosts: say how many go where"):
        parse_hosts("a,b,c", 4)
    with pytest.raises(ValueError, match=r"--hosts entry 'a:x': write host or host:ranks"):
        parse_hosts("a:x,b", 4)
    assert parse_hosts("a,b", 4) == [("a", 2), ("b", 2)]
    with pytest.raises(ValueError, match=r"--ip 127.0.0.1 is a loopback address, which the engines on 192.0.2.1 "
                                         r"cannot reach: give this node's address on their network"):
        Session(2, "gloo", "mpiexec", hosts="127.0.0.1:1,192.0.2.1:1", ip="127.0.0.1")
    with pytest.raises(ValueError, match=r"--ip 192.0.2.55 is not an address of this node \(it has .*127.0.0.1"):
        Session(2, "gloo", "mpiexec", hosts="127.0.0.1:1,192.0.2.1:1", ip="192.0.2.55")
    assert controller_address(["localhost", "127.0.0.1"]) == LOOPBACK  # every host is this node: loopback, as before
