"""A direct TCP channel for the disaggregated topology's per-step proposer call.

Ray Serve stays the control plane (placement, scaling, health, and the `pin` call that picks the
proposer replica a verifier sticks to); the hot path, one call per engine step, goes over a plain
socket to that replica. A Serve handle call costs a few milliseconds of routing, asyncio hops and
Ray task overhead each way (measured here: ~11 ms of a 28 ms call in a slow VM phase), which is a
large share of a step that takes 10-30 ms on a GPU. The socket costs a pickle and a round trip.

Messages are length-prefixed pickles (torch CPU tensors inside, as Ray itself would send them).
Like Ray's own ports, the server (bound to the node's address, an ephemeral port) trusts whoever
can reach it: keep the cluster on a private network, as Ray requires anyway. No Ray import here.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")  # payload length


def send_message(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        read = sock.recv_into(view[got:], n - got)
        if read == 0:
            raise ConnectionError("the channel was closed")
        got += read
    return bytes(buf)


def receive_message(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return pickle.loads(_receive_exactly(sock, n))


class ChannelServer:
    """Answers `handler(*args)` for every message on every connection, one thread per connection
    (one per verifier replica). A handler error goes back to the caller, who raises it."""

    def __init__(self, handler: Callable[..., Any], host: str = "127.0.0.1"):
        self._handler = handler
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="rayspec-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="rayspec-channel", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    args = receive_message(conn)
                except (OSError, EOFError, pickle.UnpicklingError):
                    return  # the caller went away (or gave up on a call: its timeout)
                try:
                    reply = ("ok", self._handler(*args))
                except Exception as err:  # noqa: BLE001 - the caller's call fails, the channel stays
                    logger.exception("channel handler failed")
                    reply = ("error", f"{type(err).__name__}: {err}")
                try:
                    send_message(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        """Stops accepting; open connections end when their callers go."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not, on Linux)
        except OSError:
            pass
        self._sock.close()


class ChannelClient:
    """One connection to a ChannelServer; `call` blocks for the reply, at most `timeout_s`."""

    def __init__(self, address: tuple[str, int], timeout_s: float | None):
        self.address = tuple(address)
        self._sock = socket.create_connection(self.address, timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, *args) -> Any:
        """Raises OSError (timeout, connection lost) or RuntimeError (the handler failed)."""
        send_message(self._sock, args)
        status, value = receive_message(self._sock)
        if status != "ok":
            raise RuntimeError(f"proposer call failed: {value}")
        return value

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
