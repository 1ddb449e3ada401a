"""The forked notebook kernels of the suite's notebook runs (tests/kernel_factory.py) behave as fresh ones.

The notebook tests trust that a forked kernel is what jupyter_client would have started: the runner's
environment and working directory, Interrupt, and nothing left once the kernel manager kills it.
"""
import os
import time

import psutil
import pytest

import background
import kernel_factory


@pytest.fixture(scope="module")
def factory():
    made = kernel_factory.start()
    if made is None:
        pytest.skip("the kernel factory is turned off (LABKIT_FRESH_KERNELS=1) or cannot start here")
    yield made
    made.close()
    assert made.process.poll() is not None, "the factory outlived its close()"


def _manager(factory, tmp_path, monkeypatch):
    from jupyter_client import KernelManager

    for name, value in factory.environment({"LABKIT_PROBE": "from the runner", **background.ONE_THREAD}).items():
        monkeypatch.setenv(name, value)  # the kernel manager takes the kernelspec and env from here
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    client.wait_for_ready(timeout=120)
    return manager, client


def _run(client, code, timeout=60):
    """(stdout text, error name or None) of one cell."""
    said = []
    reply = client.execute_interactive(code, timeout=timeout, output_hook=said.append)
    text = "".join(m["content"].get("text", "") for m in said if m["msg_type"] == "stream")
    return text, reply["content"].get("ename")


def test_a_forked_kernel_has_the_runners_environment_and_directory_is_interrupted_and_leaves_nothing(
        factory, tmp_path, monkeypatch):
    manager, client = _manager(factory, tmp_path, monkeypatch)
    try:
        text, error = _run(client, "import os, sys, torch\nprint(os.environ['LABKIT_PROBE'], os.getcwd(), os.getppid(), "
                                   "'torch' in sys.modules, os.getpid(), torch.get_num_threads(), sep='|')")
        assert error is None, error
        probe, cwd, parent, torch_loaded, pid, threads = text.strip().split("|")
        # the runner's thread count, though torch read the factory's at import (on a 1-core machine: 1 anyway)
        assert threads == background.ONE_THREAD["OMP_NUM_THREADS"], text
        # forked by the factory, torch already imported there: the point of it
        assert int(parent) == factory.process.pid and torch_loaded == "True", text
        assert probe == "from the runner" and os.path.samefile(cwd, tmp_path), text
        kernel = psutil.Process(int(pid))

        client.execute("import time\nfor _ in range(600): time.sleep(0.1)")
        time.sleep(1.0)
        manager.interrupt_kernel()  # SIGINT to the shim, which forwards it
        reply = client.get_shell_msg(timeout=30)
        assert reply["content"].get("ename") == "KeyboardInterrupt", reply["content"]
        text, error = _run(client, "print(6 * 7)")
        assert (text.strip(), error) == ("42", None), "the kernel should go on after an Interrupt"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)  # SIGKILL to the shim's process group: the factory ends the kernel
    deadline = time.monotonic() + 10
    while kernel.is_running() and kernel.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE, "the kernel outlived its manager's kill"
