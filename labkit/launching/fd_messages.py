"""Length-prefixed pickled messages over a Unix socket, with file descriptors riding along (SCM_RIGHTS).

The zygote and its caller talk this way (labkit/launching/zygote_server.py and zygote.py): a launch
request carries the ranks' stdout, stderr and result pipes, made by the caller, so that the caller
reads them as if it had forked the ranks itself.
"""
from __future__ import annotations

import pickle
import socket
import struct


def send(sock: socket.socket, message, fds=()) -> None:
    data = pickle.dumps(message)
    header = struct.pack("!Q", len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
        sock.sendall(data)
    else:
        sock.sendall(header + data)


def _recv_exactly(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("the other end closed the socket")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket, max_fds: int = 0):
    """One message, and the file descriptors that came with it."""
    fds = []
    if max_fds:
        header, fds, _, _ = socket.recv_fds(sock, 8, max_fds)
        if not header:
            raise EOFError("the other end closed the socket")
        if len(header) < 8:
            header += _recv_exactly(sock, 8 - len(header))
    else:
        header = _recv_exactly(sock, 8)
    (size,) = struct.unpack("!Q", header)
    return pickle.loads(_recv_exactly(sock, size)), fds
