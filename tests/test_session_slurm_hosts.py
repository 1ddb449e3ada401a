"""`%ranks start N --launcher slurm` in an allocation that spans nodes: the controller and the session's store
must listen where the other nodes reach them, so the session reads the allocation's nodes from Slurm's node
list (`SLURM_JOB_NODELIST`), expanded by `scontrol show hostnames` where it runs, else by
`labkit.session.hosts.expand_nodelist`. Pure arithmetic on names and routes: no process but scontrol.
"""
import os
import shutil
import subprocess

import pytest

import slurm_cluster
from labkit.session import hosts
from labkit.session.hosts import LOOPBACK, expand_nodelist

# (the node list, what Slurm reads it as, the edge case it covers)
CASES = [
    ("node01", ["node01"], "one name, no brackets"),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"],
     "a range and a single number in one bracket, a comma outside brackets, a plain name after"),
    ("node[08-10]", ["node08", "node09", "node10"], "zero padding kept across a change of digit count"),
    ("n[8-10]", ["n8", "n9", "n10"], "no padding: widths grow as the numbers do"),
    ("n[09-11]", ["n09", "n10", "n11"], "the first number's width (2) pads every number"),
    ("n[007-009]", ["n007", "n008", "n009"], "three-digit padding"),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"], "two brackets in one name multiply, the last fastest"),
    ("n[1,1]", ["n1", "n1"], "a name given twice is listed twice, as scontrol does"),
    ("n[1-2],m[3]", ["n1", "n2", "m3"], "a one-number bracket"),
]


@pytest.mark.parametrize("nodes,expected,case", CASES, ids=[c[0] for c in CASES])
def test_the_pure_python_expansion_reads_each_form_as_slurm_does(nodes, expected, case):
    assert expand_nodelist(nodes) == expected, case


def test_the_expansion_equals_scontrols_own_where_scontrol_runs(tmp_path, monkeypatch):
    """The reference is Slurm itself: `scontrol show hostnames` with a written config (it contacts no daemon)."""
    if shutil.which("scontrol") is None:
        pytest.skip(f"no scontrol: install it with {slurm_cluster.INSTALL}")
    conf = tmp_path / "slurm.conf"
    conf.write_text(slurm_cluster.SLURM_CONF.format(d=tmp_path, ctld_port=1, d_port=2))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    every = ",".join(nodes for nodes, _, _ in CASES)
    said = subprocess.run(["scontrol", "show", "hostnames", every], capture_output=True, text=True, timeout=30)
    assert said.returncode == 0, said.stderr
    assert expand_nodelist(every) == said.stdout.split()
    assert hosts.slurm_hostnames(every) == said.stdout.split()  # the session's reading: scontrol's own


@pytest.mark.parametrize("nodes,words", [
    ("node[01-03", "has an unclosed '\\['"),  # a truncated variable
    ("n]", "unbalanced or nested brackets"),
    ("n[[1]]", "unbalanced or nested brackets"),
    ("node[a-b]", "holds 'a-b', not a number or a range like 01-04"),
    ("n[3-1]", "holds '3-1', not a number or a range"),  # a range that runs backwards
    (",", "names no node"),
])
def test_a_node_list_that_cannot_be_read_is_a_clear_error(nodes, words):
    with pytest.raises(ValueError, match=rf"Slurm's node list .*{words}.*check SLURM_JOB_NODELIST"):
        expand_nodelist(nodes)


def test_without_scontrol_the_session_falls_back_to_the_pure_python_expansion(tmp_path, monkeypatch):
    broken = tmp_path / "scontrol"  # a scontrol that cannot read its config, as on a login node's container
    broken.write_text("#!/bin/sh\necho 'scontrol: fatal: Could not establish a configuration source' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hosts.slurm_hostnames("node[01-02],gpu5") == ["node01", "node02", "gpu5"]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no scontrol at all
    assert hosts.slurm_hostnames("node[01-02],gpu5") == ["node01", "node02", "gpu5"]


def test_the_session_listens_where_the_allocations_other_nodes_reach_it(tmp_path, monkeypatch):
    """An allocation of this node (node01) and two others (node[02-03], on 10.9.0.0/24): the controller and the
    store listen at this node's address on the route to them, not at loopback; an allocation of this node only
    keeps loopback (the one-node srun test). Names and routes are faked: the session reads only them."""
    from labkit.session.session import Session

    fake_srun = tmp_path / "srun"  # only on PATH: nothing may run it
    fake_srun.write_text("#!/bin/sh\nexit 99\n")
    fake_srun.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))  # and no scontrol: the pure-Python expansion
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    addresses = {"node01": "127.0.1.1", "node02": "10.9.0.2", "node03": "10.9.0.3"}
    routes = []
    monkeypatch.setattr(hosts, "resolve", lambda name: addresses[name])
    monkeypatch.setattr(hosts, "route_source", lambda address: routes.append(address) or "10.9.0.1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-03]")
    assert Session(6, "gloo", "slurm").address == "10.9.0.1"
    assert routes == ["10.9.0.2", "10.9.0.3"]  # the route to every other node was asked, not to this one
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node01")
    assert Session(2, "gloo", "slurm").address == LOOPBACK
    monkeypatch.delenv("SLURM_JOB_NODELIST")  # a kernel that knows only the job's id: this node, as before
    assert Session(2, "gloo", "slurm").address == LOOPBACK
    # the nodes reached through two different addresses of this node: which one is the user's to say
    monkeypatch.setattr(hosts, "route_source", lambda address: {"10.9.0.2": "10.9.0.1", "10.9.0.3": "10.8.0.1"}[address])
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-03]")
    with pytest.raises(ValueError, match=r"reached through different addresses of this node \(node02 via 10.9.0.1, "
                                         r"node03 via 10.8.0.1\): give --ip"):
        Session(6, "gloo", "slurm")
