"""The forked notebook kernels of the suite's notebook runs (tests/kernel_factory.py) behave as fresh ones.

The notebook tests trust that a forked kernel is what jupyter_client would have started: the runner's
environment and working directory, Interrupt, and nothing left once the kernel manager kills it.
"""
import ast
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


def _value(client, code, expression, timeout=60):
    """The value of `expression` after running `code`, as the kernel's execute reply carries it.

    Read from the reply on the shell channel, not from printed output: ipykernel sends a cell's
    stream output on iopub from its own thread, and under load that can come after the cell's
    'idle' (CI saw a print's output missing once), which says nothing about the kernel.
    """
    reply = client.execute_interactive(code, timeout=timeout, user_expressions={"value": expression})
    content = reply["content"]
    assert content["status"] == "ok", (content.get("ename"), content.get("evalue"))
    value = content["user_expressions"]["value"]
    assert value["status"] == "ok", (value.get("ename"), value.get("evalue"))
    return ast.literal_eval(value["data"]["text/plain"])


def test_a_forked_kernel_has_the_runners_environment_and_directory_is_interrupted_and_leaves_nothing(
        factory, tmp_path, monkeypatch):
    manager, client = _manager(factory, tmp_path, monkeypatch)
    try:
        seen = _value(client, "import os, sys, torch", "(os.environ['LABKIT_PROBE'], os.getcwd(), os.getppid(), "
                      "'torch' in sys.modules, os.getpid(), str(torch.get_num_threads()))")
        probe, cwd, parent, torch_loaded, pid, threads = seen
        text = repr(seen)
        # the runner's thread count, though torch read the factory's at import (on a 1-core machine: 1 anyway)
        assert threads == background.ONE_THREAD["OMP_NUM_THREADS"], text
        # forked by the factory, torch already imported there: the point of it
        assert parent == factory.process.pid and torch_loaded, text
        assert probe == "from the runner" and os.path.samefile(cwd, tmp_path), text
        kernel = psutil.Process(pid)

        # stop_on_error=False: the interrupted cell must not abort the next one. ipykernel aborts a request
        # that reaches it before the abort window after an error closes (a race under load: seen once, "aborted")
        client.execute("import time\nfor _ in range(600): time.sleep(0.1)", stop_on_error=False)
        time.sleep(1.0)
        manager.interrupt_kernel()  # SIGINT to the shim, which forwards it
        reply = client.get_shell_msg(timeout=30)
        assert reply["content"].get("ename") == "KeyboardInterrupt", reply["content"]
        assert _value(client, "answer = 6 * 7", "answer") == 42, "the kernel should go on after an Interrupt"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)  # SIGKILL to the shim's process group: the factory ends the kernel
    deadline = time.monotonic() + 10
    while background.living(kernel) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not background.living(kernel), "the kernel outlived its manager's kill"
