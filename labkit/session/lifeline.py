"""One TCP connection from each engine to the kernel: how the kernel watches engines it cannot see by pid.

An engine on another machine (another node; in the lab's two-host test, another pid namespace) has pids
that mean nothing to the kernel, and no file the kernel can read. What the session promises for it
goes through this connection instead, which the engine opens when it joins (to the session's address,
the one every host already reaches for the controller and the store):
  - its stack, on request ("stack"): a thread in the engine formats the cell thread's frames as
    faulthandler does, with the process's CPU time and run state (`labkit.launching.progress.cpu_seconds`,
    read on its own machine), so `labkit.session.watch` judges a hang on host B as it does here;
  - its death: the operating system closes a dead process's connection, so the kernel reads end of
    file at once (no heartbeat to wait out, and no false alarm while a cell holds the GIL in a long op);
  - its end: when the kernel closes its side (`%ranks stop`) or dies, the engine's thread reads end of
    file and exits the process: `%ranks stop` leaves nothing on a host the kernel's reaper cannot see;
  - an interrupt ("interrupt": the notebook's stop button): the engine signals itself SIGINT, as the kernel
    does by pid to the engines on its own machine.

Why not the session's TCPStore, which every rank already reaches: a store has keys, not connections, so a
dead engine would be seen only by a missed heartbeat, and an engine would learn of a dead kernel the same
way. Why not faulthandler: it writes to a file descriptor from a signal handler, and no signal crosses
machines. The thread needs the GIL to answer; a rank waiting in torch.distributed releases it.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time

ACCEPT_TIMEOUT = 60.0  # seconds the engines get to connect, as for joining the group
ANSWER_TIMEOUT = 2.0  # seconds an engine gets to answer a request


class Lifelines:
    """The kernel's side: a listening socket, then one connection per rank."""

    def __init__(self, address: str, world_size: int):
        self.server = socket.create_server((address, 0), backlog=world_size + 8)
        self.port = self.server.getsockname()[1]
        self.world_size = world_size
        self.lines: dict[int, socket.socket] = {}
        self.ended: set[int] = set()  # ranks whose connection reached end of file: the engine is gone
        self.asked = 0

    def accept(self, timeout: float = ACCEPT_TIMEOUT) -> None:
        """Every rank's connection (each says its rank first)."""
        self.server.settimeout(timeout)
        while len(self.lines) < self.world_size:
            connection, _ = self.server.accept()
            connection.settimeout(timeout)
            rank = int(_read_line(connection))
            connection.settimeout(None)
            self.lines[rank] = connection

    def gone(self, ranks) -> list[int]:
        """The ranks among ``ranks`` whose engine is gone (its connection ended), without waiting."""
        watched = [self.lines[r] for r in ranks if r in self.lines and r not in self.ended]
        readable, _, _ = select.select(watched, [], [], 0) if watched else ([], [], [])
        for rank in ranks:
            line = self.lines.get(rank)
            if line in readable:
                try:
                    if line.recv(1, socket.MSG_PEEK) == b"":
                        self.ended.add(rank)
                except OSError:
                    self.ended.add(rank)
        return [r for r in ranks if r in self.ended]

    def ask(self, rank: int, what: str) -> dict | None:
        """The engine's answer to ``what`` ("stack", "sample", "interrupt"), or None if it is gone or does not
        answer."""
        line = self.lines.get(rank)
        if line is None or rank in self.ended:
            return None
        self.asked += 1  # numbered: an answer that came too late for an earlier request is skipped, not taken
        deadline = time.monotonic() + ANSWER_TIMEOUT
        try:
            line.settimeout(ANSWER_TIMEOUT)
            line.sendall(f"{what} {self.asked}\n".encode())
            while True:
                line.settimeout(max(0.01, deadline - time.monotonic()))
                text = _read_line(line)
                if not text:
                    self.ended.add(rank)
                    return None
                said = json.loads(text)
                if said.get("n") == self.asked:
                    return said
        except OSError:  # socket.timeout included: busy in a long op holding the GIL
            return None
        finally:
            line.settimeout(None)

    def close(self) -> None:
        """End every connection: each engine exits when it reads the end. Idempotent."""
        for line in self.lines.values():
            try:
                line.close()
            except OSError:
                pass
        self.lines = {}
        self.server.close()


def _read_line(connection: socket.socket) -> str:
    """One line, "" at end of file (byte by byte: the answers are short, and nothing is read past them)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            return ""
        data += byte
    return data.decode().strip()


# --------------------------------------------------------------------------- the engine's side

def hold(address: str, port: int, rank: int, cell_thread: int) -> None:
    """Connect to the kernel and answer it from a thread; exit this process when the kernel's side ends."""
    connection = socket.create_connection((address, port), timeout=ACCEPT_TIMEOUT)
    connection.settimeout(None)
    connection.sendall(f"{rank}\n".encode())

    def answer():
        from labkit.launching.progress import cpu_seconds

        while True:
            try:
                request = _read_line(connection)
            except OSError:
                request = ""
            if not request:  # the kernel stopped the session, or is gone: so is this engine
                os._exit(0)
            what, _, number = request.partition(" ")
            said = {"n": int(number or 0), "sample": cpu_seconds(os.getpid())}
            if what == "stack":
                said["stack"] = stack_of(cell_thread)
            elif what == "interrupt":  # as SIGINT by pid does on the kernel's machine: KeyboardInterrupt in the cell
                os.kill(os.getpid(), signal.SIGINT)
            try:
                connection.sendall(json.dumps(said).encode() + b"\n")
            except OSError:  # the kernel's side is gone
                os._exit(0)

    threading.Thread(target=answer, name="labkit-lifeline", daemon=True).start()


def stack_of(thread_id: int) -> str:
    """The thread's Python stack in faulthandler's words (innermost first), which `labkit.session.watch` reads."""
    frame = sys._current_frames().get(thread_id)
    lines = ["Stack (most recent call first):"]
    while frame is not None:
        lines.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}')
        frame = frame.f_back
    return "\n".join(lines) + "\n"
