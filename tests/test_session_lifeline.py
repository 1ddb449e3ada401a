"""`labkit.session.lifeline`, the kernel's only view of an engine on another machine, with two stand-in engines:
fresh interpreters that hold a lifeline as an engine's `join` does and then sleep in a known function. Without
pids (the kernel uses none of theirs here): the stack comes through the connection, an interrupt reaches the
cell (KeyboardInterrupt) and leaves the engine up, a SIGKILLed engine is seen
gone as its connection ends, and an engine whose kernel side closes exits by itself. About 1 s: the stand-ins
load lifeline.py alone (no torch); what they sample for CPU is a stub (the CPU reading is IdleWatch's, tested
with the launcher).
"""
import os
import signal
import subprocess
import sys
import time

from labkit.grading import REPO_ROOT
from labkit.session.lifeline import Lifelines

STAND_IN = """
import importlib.util, sys, threading, time, types
for name in ("labkit", "labkit.launching", "labkit.launching.progress"):  # lifeline.py alone, without torch
    sys.modules[name] = types.ModuleType(name)
sys.modules["labkit.launching.progress"].cpu_seconds = lambda pid: (0.0, "S")
spec = importlib.util.spec_from_file_location("lifeline", sys.argv[1])
lifeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lifeline)

def wait_here():
    time.sleep(60)  # the stand-in's waiting line

lifeline.hold("127.0.0.1", int(sys.argv[2]), int(sys.argv[3]), threading.get_ident())
try:
    wait_here()
except KeyboardInterrupt:  # the stop button, through the lifeline: the cell stops, the engine stays
    print("INTERRUPTED", flush=True)
    time.sleep(60)
"""


def _until(condition, seconds):
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def test_the_lifeline_carries_the_stack_sees_a_killed_engine_and_ends_the_engine_when_closed():
    lines = Lifelines("127.0.0.1", 2)
    path = str(REPO_ROOT / "labkit" / "session" / "lifeline.py")
    engines = [subprocess.Popen([sys.executable, "-I", "-c", STAND_IN, path, str(lines.port), str(rank)],
                                stdout=subprocess.PIPE) for rank in (0, 1)]
    try:
        lines.accept(timeout=30)
        said = {0: {}, 1: {}}

        def waits_in_wait_here(rank):  # asked until the stand-in is past `hold`, which answers once connected
            said[rank].update(lines.ask(rank, "stack") or {})
            return "in wait_here" in said[rank].get("stack", "")

        # both: an interrupt that came while rank 1 was still in `hold` would not reach wait_here
        assert _until(lambda: waits_in_wait_here(1), 5.0), said
        assert _until(lambda: waits_in_wait_here(0), 5.0), said
        said = said[0]
        assert said["sample"] == [0.0, "S"], said
        assert said["stack"].startswith("Stack (most recent call first):"), said["stack"]
        assert 'line 11 in wait_here' in said["stack"], said["stack"]  # time.sleep(60) in the stand-in
        assert lines.gone([0, 1]) == []
        assert lines.ask(1, "interrupt") is not None  # the stop button, without a pid
        assert engines[1].stdout.readline().strip() == b"INTERRUPTED", "the interrupt did not reach the cell"
        assert lines.gone([0, 1]) == []  # interrupted, not ended
        os.kill(engines[1].pid, signal.SIGKILL)  # its death ends its connection: seen without its pid
        assert _until(lambda: lines.gone([0, 1]) == [1], 2.0), lines.gone([0, 1])
        assert lines.ask(1, "stack") is None  # a gone engine does not answer
        lines.close()  # %ranks stop, or the kernel's death: rank 0's engine ends itself
        assert _until(lambda: engines[0].poll() is not None, 3.0), "the engine outlived its lifeline"
        assert engines[0].returncode == 0
    finally:
        lines.close()
        for engine in engines:
            engine.kill()
            engine.wait(timeout=10)
