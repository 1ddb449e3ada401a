"""Where a session's engines run, and the address they reach the kernel at.

The controller (ipyparallel) and the session's TCPStore listen in the kernel's process; the engines
connect to them. When every engine runs on this node, that is the loopback address. When the launcher
puts engines on other hosts (`--hosts a:2,b:2` with mpiexec, a PBS host file, Slurm's node list
`SLURM_JOB_NODELIST`, expanded by `scontrol show hostnames` or `expand_nodelist`), it is
this node's address on the route to those hosts (`controller_address`): the one interface they share
with it. Not the address the host name resolves to: on Debian that is a loopback entry (127.0.1.1),
and a cluster node has several interfaces (management ethernet, InfiniBand), of which only some reach
the others. `--ip` overrides the choice on a node where the route is not the way back.

All of it is arithmetic on names and routes, done before any process starts, so bad input (a host that
does not resolve, a loopback --ip with remote hosts) is a ValueError that says what to do.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import subprocess

import psutil

LOOPBACK = "127.0.0.1"


def parse_hosts(text: str, world_size: int) -> list[tuple[str, int]]:
    """'a:2,b:2' (or 'a,b': the ranks split evenly) -> [(host, slots)], the slots summing to ``world_size``."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise ValueError(f"--hosts {text!r} names no host: give them as --hosts node1:2,node2:2")
    hosts = []
    for entry in entries:
        name, _, slots = entry.partition(":")
        if not name or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"--hosts entry {entry!r}: write host or host:ranks (ranks >= 1), e.g. node1:2")
        hosts.append((name, int(slots) if slots else None))
    if all(s is None for _, s in hosts):
        if world_size % len(hosts):
            raise ValueError(f"{world_size} ranks do not split evenly over {len(hosts)} hosts: say how many go "
                             f"where, e.g. --hosts {hosts[0][0]}:{world_size - len(hosts) + 1},...")
        hosts = [(name, world_size // len(hosts)) for name, _ in hosts]
    if any(s is None for _, s in hosts) or sum(s for _, s in hosts) != world_size:
        raise ValueError(f"--hosts {text!r} places {sum(s or 0 for _, s in hosts)} rank(s), not the session's "
                         f"{world_size}: give every host its number of ranks, summing to {world_size}")
    return hosts


def allocation_hosts(launcher: str) -> list[str]:
    """The hosts a scheduler's launcher will use: PBS's host file, Slurm's node list; [] where this node is all
    we know (then the controller listens at loopback)."""
    if launcher == "slurm":
        nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        return slurm_hostnames(nodes) if nodes else []
    path = os.environ.get("PBS_NODEFILE") if launcher == "pbs" else None
    if path and os.path.exists(path):
        with open(path) as f:
            return sorted({line.strip() for line in f if line.strip()})
    return []


def slurm_hostnames(nodes: str) -> list[str]:
    """Slurm's compressed node list as host names: `scontrol show hostnames` (Slurm's own reading) where it
    runs, else `expand_nodelist` (a kernel outside the cluster's software: a container, a login node's venv)."""
    try:
        said = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=10)
        if said.returncode == 0 and said.stdout.split():
            return said.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return expand_nodelist(nodes)


def expand_nodelist(nodes: str) -> list[str]:
    """'node[01-03,07],gpu5' -> node01 node02 node03 node07 gpu5, as `scontrol show hostnames` reads it.

    Commas split hosts only outside brackets; a bracket holds numbers and ranges, a range keeps the width of
    its first number (08-10: node08 node09 node10); several brackets in one name multiply
    (r[1-2]n[1-2]: r1n1 r1n2 r2n1 r2n2); a name given twice is listed twice, as scontrol does.
    """
    names = [name for entry in _split_outside_brackets(nodes, nodes) for name in _expand_entry(entry, nodes)]
    if not names:
        raise ValueError(f"Slurm's node list {nodes!r} names no node: check SLURM_JOB_NODELIST")
    return names


def _split_outside_brackets(text: str, whole: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"Slurm's node list {whole!r} has unbalanced or nested brackets: check SLURM_JOB_NODELIST")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"Slurm's node list {whole!r} has an unclosed '[': check SLURM_JOB_NODELIST")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_entry(entry: str, whole: str) -> list[str]:
    if "[" not in entry:
        return [entry]
    head, _, rest = entry.partition("[")
    inside, _, tail = rest.partition("]")
    numbers = []
    for piece in inside.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"Slurm's node list {whole!r}: [{inside}] holds {piece!r}, not a number or a range "
                             "like 01-04: check SLURM_JOB_NODELIST")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return [head + number + name for number in numbers for name in _expand_entry(tail, whole)]


def resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise ValueError(f"host {host!r} does not resolve to an address here: check its name (it must be a name "
                         f"or an address this node can reach)") from None


def this_node_addresses() -> list[str]:
    """Every IPv4 address of this node's interfaces (loopback included)."""
    return sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET})


def is_this_node(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback or address in this_node_addresses()


def route_source(address: str) -> str:
    """This node's address on the route to ``address`` (a UDP connect sends nothing: it only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as err:
            raise ValueError(f"no route from this node to {address} ({err.strerror}): check the host's name and "
                             "the network between them") from None
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this node's interface that holds ``address`` (lab0, ib0, eth0), or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def controller_address(hosts: list[str], ip: str | None = None) -> str:
    """The address the controller and the store listen at: loopback when every host is this node, else this
    node's address on the route to the other hosts (``ip`` when given, checked)."""
    remote = [h for h in hosts if not is_this_node(resolve(h))]
    if ip is not None:
        if ip not in this_node_addresses():
            raise ValueError(f"--ip {ip} is not an address of this node (it has {', '.join(this_node_addresses())}): "
                             "give one of them, the one the engines' hosts reach")
        if remote and ipaddress.ip_address(ip).is_loopback:
            raise ValueError(f"--ip {ip} is a loopback address, which the engines on {', '.join(remote)} cannot "
                             "reach: give this node's address on their network, or leave --ip out")
        return ip
    if not remote:
        return LOOPBACK
    sources = {h: route_source(resolve(h)) for h in remote}
    if len(set(sources.values())) > 1:
        raise ValueError("the hosts are reached through different addresses of this node ("
                         + ", ".join(f"{h} via {a}" for h, a in sources.items())
                         + "): give --ip with the one every host can reach")
    return next(iter(sources.values()))


def machine_id() -> str:
    """Who shares pids with whom: the host name, the boot and the pid namespace. Two network namespaces of one
    machine (the lab's two-host test) share it, so the kernel can signal their engines by pid; two nodes do not."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(open(path).read().strip() if path.endswith("boot_id") else str(os.stat(path).st_ino))
        except OSError:
            pass
    return "/".join(parts)
