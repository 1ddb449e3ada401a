"""The test suite's shared zygote (labkit/launching/zygote_sharing.py): one warm process forks a
handler per client process, and each handler serves its client as the client's own zygote would.

Edge cases: a client whose import-time environment differs (here ATEN_CPU_CAPABILITY) must not
share, since the shared zygote's torch was imported under another setting; a client's handler
leaves with its client; closing the shared zygote ends it and its handlers. (A client killed
mid-launch: tests/test_launch.py's killed-caller test runs through a handler whenever pytest runs
with the shared zygote, as `make test` does.)
"""
import os
import subprocess
import sys
import time

import pytest

from labkit.launching import zygote
from labkit.launching.zygote_sharing import FINGERPRINT_ENV, SOCKET_ENV, SharedZygote

CLIENT = """
import json, os, labkit
from labkit.launching import zygote
sums = labkit.launch(lambda rank, world_size: rank * 10 + world_size, 2)
z = zygote._zygote
with open(f"/proc/{z.pid}/stat") as stat:
    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
print(json.dumps({"sums": sums, "own": z.proc is not None, "zygote": z.pid, "zygote_parent": parent,
                  "me": os.getpid()}))
"""


def _client(**env):
    import json

    out = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_a_client_gets_a_handler_of_the_shared_zygote_unless_its_environment_differs(monkeypatch):
    monkeypatch.delenv(SOCKET_ENV, raising=False)  # a shared zygote of this test's own, not the run's
    monkeypatch.delenv(FINGERPRINT_ENV, raising=False)
    shared = SharedZygote(zygote.PRELOAD_IF_CALLER_HAS)
    try:
        assert shared.proc is not None and os.environ[SOCKET_ENV] == shared.path
        same = _client()
        assert same["sums"] == [2, 12], same
        assert not same["own"] and same["zygote_parent"] == shared.proc.pid, \
            f"the client started its own zygote instead of a handler of the shared one: {same}"
        deadline = time.monotonic() + 10  # its handler left with it
        while zygote._running(same["zygote"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not zygote._running(same["zygote"]), "a handler outlived its client"

        # torch imported under another setting than this run's (which may itself be "default")
        capability = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
        other = _client(ATEN_CPU_CAPABILITY=capability)
        assert other["sums"] == [2, 12], other
        assert other["own"] and other["zygote_parent"] == other["me"], \
            f"a client with ATEN_CPU_CAPABILITY={capability} used the shared zygote: {other}"
    finally:
        master = shared.proc
        shared.close()
    assert master.poll() is not None and SOCKET_ENV not in os.environ


@pytest.mark.parametrize("where, starts", [("a notebook kernel", True), ("a %ranks session's engine", False),
                                           ("a plain script", False)])
def test_import_labkit_starts_a_zygote_in_a_kernel_only(monkeypatch, where, starts):
    """An engine of a `%ranks` session runs an IPython shell too, but it is a rank: it never launches,
    and a zygote per engine cost each session start seconds of CPU."""
    import types

    import IPython

    import labkit

    kernel_module = "ipyparallel.engine.kernel" if "engine" in where else "ipykernel.ipkernel"
    kernel = type("Kernel", (), {"__module__": kernel_module})()
    shell = None if where == "a plain script" else types.SimpleNamespace(kernel=kernel)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.delenv("IPP_CONNECTION_INFO", raising=False)
    calls = []
    monkeypatch.setattr(zygote, "start_soon", lambda: calls.append(1))
    labkit._start_zygote_in_a_notebook()
    assert bool(calls) == starts, f"in {where}: start_soon called {len(calls)} time(s)"
