"""A notebook kernel's stand-in: asks tests/kernel_factory.py to fork the kernel, and stands where it would.

The kernelspec's argv (``python tests/kernel_shim.py -f <connection file>``). Standard library only, so
that it starts in milliseconds. It hands the factory its argv (as ``python -m ipykernel_launcher``), its
environment, its working directory and its stdin/stdout/stderr; forwards the signals a kernel manager
sends (SIGINT is JupyterLab's Interrupt) to the kernel; and exits with the kernel's exit code. Without a
factory (none in the environment, gone, or not up within a minute) it becomes a fresh kernel itself.
"""
import json
import os
import signal
import socket
import sys
import time

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
WAIT_FOR_FACTORY = 60.0  # it imports torch first: seconds on a busy machine


def fresh_kernel():
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *sys.argv[1:]])


def connect(path: str, factory_pid: int):
    """A connection to the factory, or None if it is gone or not serving within WAIT_FOR_FACTORY."""
    deadline = time.monotonic() + WAIT_FOR_FACTORY
    while time.monotonic() < deadline:
        try:
            os.kill(factory_pid, 0)
        except OSError:
            return None
        if os.path.exists(path):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except OSError:
                sock.close()
                return None
        time.sleep(0.05)
    return None


def main():
    where = os.environ.get("LABKIT_TEST_KERNEL_FACTORY", "")
    path, _, pid = where.rpartition(":")
    sock = connect(path, int(pid)) if path and pid.isdigit() else None
    if sock is None:
        fresh_kernel()
    env = dict(os.environ)
    env.pop("LABKIT_TEST_KERNEL_FACTORY", None)  # the kernel's own kernels are fresh ones
    body = json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", *sys.argv[1:]], "env": env,
                       "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(sock, [f"{len(body):08d}".encode()], [0, 1, 2])
        sock.sendall(body)
        reader = sock.makefile("rb")
        kernel = json.loads(reader.readline())["pid"]
    except (OSError, ValueError, KeyError):
        fresh_kernel()

    def forward(signum, _frame):
        try:
            os.kill(kernel, signum)
        except OSError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            line = reader.readline()
            break
        except InterruptedError:
            continue
    try:
        code = json.loads(line)["exit"]
    except (ValueError, KeyError):
        code = 1  # the factory is gone, and the kernel with it
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
