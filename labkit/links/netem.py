"""A real slow link: `tc qdisc ... netem` on a veth pair between two network namespaces (needs root).

    from labkit.links import netem
    ok, why = netem.probe()                       # can this machine do it? and if not, why not
    with netem.NetemLink(rate_mbit=80, delay_ms=5) as link:     # in the parent, before launch
        labkit.launch(fn, 2, link)                # fn: group = netem.shaped_group(link, rank)

Layout: namespaces `lab13a` and `lab13b`, joined by the veth pair `lab13a0` <-> `lab13b0`,
addresses 10.232.0.1/24 and 10.232.0.2/24 (a private test subnet that exists only inside the
namespaces), and on each end `netem delay <d>ms rate <r>mbit`, so every packet between them
waits and the pair carries at most the rate. Set-up and tear-down run `ip` and `tc`; the
tear-down always runs (also after a failed set-up) and deleting a namespace removes its end
of the veth pair, so nothing is left behind.

Inside a launched rank, `shaped_group(link, rank)` moves the calling thread into its namespace
(network namespaces are per thread: call it before the rank creates threads that open sockets)
and creates a gloo process group whose connections go over the veth. The default group's
store connection, opened before, stays in the host namespace and keeps working.

Without root, `ip`, network namespaces or the `sch_netem` kernel module, `probe()` says which
is missing, and the lab uses the in-process shaper (`labkit.links.shaper`) instead.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

NAMESPACES = ("lab13a", "lab13b")
DEVICES = ("lab13a0", "lab13b0")
ADDRESSES = ("10.232.0.1", "10.232.0.2")
CLONE_NEWNET = 0x40000000


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)


def _check(*cmd: str) -> None:
    out = _run(*cmd)
    if out.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")


def teardown() -> None:
    """Delete the lab's namespaces (and with them the veth pair and qdiscs), if present. Never raises."""
    if shutil.which("ip") is None:
        return
    for ns in NAMESPACES + ("lab13probe",):
        _run("ip", "netns", "del", ns)


def probe() -> tuple[bool, str]:
    """(True, how) when a netem link can be built here, else (False, what is missing)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "no Linux network namespaces"
    if os.geteuid() != 0:
        return False, "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (iproute2)"
    try:
        _check("ip", "netns", "add", "lab13probe")
        _check("ip", "-n", "lab13probe", "link", "set", "lo", "up")
        _check("tc", "-n", "lab13probe", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        return True, "root, network namespaces and tc netem work"
    except RuntimeError as err:
        reason = str(err)
        if "qdisc kind is unknown" in reason:
            reason = "the kernel has no netem qdisc (module sch_netem not loaded or not built)"
        return False, reason
    finally:
        _run("ip", "netns", "del", "lab13probe")


def probe_plumbing() -> tuple[bool, str]:
    """(True, ...) when namespaces and veth pairs can be built here (root and `ip`), netem or not."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None:
        return False, "needs Linux, root and `ip` (iproute2)"
    out = _run("ip", "netns", "add", "lab13probe")
    _run("ip", "netns", "del", "lab13probe")
    return (out.returncode == 0), (out.stderr.strip() or "network namespaces work")


class NetemLink:
    """Context manager: the two namespaces, the veth pair and netem on both ends; torn down on exit.

    ``NetemLink(rate_mbit=80, delay_ms=5, shape=True)``: rate in Mbit/s (> 0), one-way delay in ms
    (>= 0). ``shape=False`` builds the namespaces and the veth pair without netem (a fast link: the
    tests use it to check the plumbing where the kernel has no netem).
    Raises RuntimeError (after tearing down what was built) when a command fails.
    """

    def __init__(self, rate_mbit: float = 80, delay_ms: float = 5, shape: bool = True):
        if not rate_mbit > 0 or not delay_ms >= 0:
            raise ValueError(f"need rate_mbit > 0 and delay_ms >= 0; got {rate_mbit!r}, {delay_ms!r}")
        self.rate_mbit, self.delay_ms, self.shape = rate_mbit, delay_ms, shape

    def __enter__(self) -> "NetemLink":
        teardown()  # a stale link from a killed run
        try:
            for ns in NAMESPACES:
                _check("ip", "netns", "add", ns)
            _check("ip", "link", "add", DEVICES[0], "type", "veth", "peer", "name", DEVICES[1])
            for ns, dev, addr in zip(NAMESPACES, DEVICES, ADDRESSES):
                _check("ip", "link", "set", dev, "netns", ns)
                _check("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _check("ip", "-n", ns, "link", "set", dev, "up")
                _check("ip", "-n", ns, "link", "set", "lo", "up")
                if self.shape:
                    _check("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem",
                           "delay", f"{self.delay_ms}ms", "rate", f"{self.rate_mbit}mbit")
        except BaseException:
            teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        teardown()

    @property
    def bandwidth(self) -> float:
        """Bytes/s."""
        return self.rate_mbit * 1e6 / 8


def enter_namespace(name: str) -> None:
    """Move the calling thread into network namespace `name` (setns(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def shaped_group(link: NetemLink, rank: int):
    """In launched rank 0 or 1 (of 2): a gloo group whose traffic crosses the netem link. Collective."""
    import torch.distributed as dist

    if dist.get_world_size() != 2 or rank not in (0, 1):
        raise ValueError("the netem link joins exactly two ranks: launch 2 ranks")
    enter_namespace(NAMESPACES[rank])
    os.environ["GLOO_SOCKET_IFNAME"] = DEVICES[rank]
    return dist.new_group([0, 1], backend="gloo")
