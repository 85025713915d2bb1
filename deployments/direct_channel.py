"""A direct TCP channel for the disaggregated topology's per-step proposer call.

Ray Serve stays the control plane (placement, scaling, health, and the `pin` call that picks the
proposer replica a verifier sticks to); the hot path, one call per engine step, goes over a plain
socket to that replica. A Serve handle call costs a few milliseconds of routing, asyncio hops and
Ray task overhead each way (measured here: ~11 ms of a 28 ms call in a slow VM phase), which is a
large share of a step that takes 10-30 ms on a GPU.

What it trusts, next to Ray. Ray's own ports trust whoever can reach them (anyone there can run
code in the cluster), which is why Ray asks for a private network. This channel does not extend
that trust to its port:
- authenticated: a connection first proves, and gets proof back, that both ends hold the
  application's secret (`handshake`: HMAC-SHA256 over a fresh nonce from each side, so a recorded
  exchange cannot be replayed to either side). The secret is made when the app is built and given
  only to the verifier and proposer deployments; a server made without one makes its own, and a
  client cannot be made without one, so the channel never runs unauthenticated.
- no code execution: messages are the fixed binary layout of deployments.wire (no pickle), every
  field checked against what the receiver expects.
- bounded allocation: before the handshake a connection can make the server read 69 bytes, within
  `handshake_timeout_s`; after it, a frame's length prefix is checked against `max_frame_bytes`
  before anything is allocated. At most `max_connections` connections at a time.
A connection that fails any of this is closed and counted (`ChannelServer.num_rejected`); the
others go on. Not done: encryption and per-frame integrity. Traffic (token ids, features,
drafts) is readable on the wire, and an attacker who can intercept and rewrite packets between
the two nodes can take over a connection once it is authenticated. Keep the cluster's network
private (or tunnelled, e.g. WireGuard), as Ray requires anyway. No Ray import here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from typing import Callable

from deployments.wire import (HEADER, CallLimits, FrameTooLarge, ReplyLimits, decode_call,
                              decode_reply, encode_call, encode_drafts, encode_error)
from rayspec.proposers import Draft, ProposeRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 256 << 20  # a prompt's EAGLE-3 features for Llama-3.1-8B: 24 KiB a token
HANDSHAKE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64  # one per verifier replica, plus reconnects whose old socket is closing

_MAGIC = b"RSPC\x01"  # rayspec channel, layout version 1
_NONCE = 32
_MAC = 32  # HMAC-SHA256


class ChannelRefused(ConnectionError):
    """The handshake failed: the other end does not hold the same secret (or is not a channel)."""


class CallTooLarge(ValueError):
    """The call's frame exceeds max_frame_bytes; nothing was sent, the channel is still usable."""


def secret_bytes(secret) -> bytes:
    """bytes, str or pydantic SecretStr -> the key; refuses short ones."""
    if hasattr(secret, "get_secret_value"):
        secret = secret.get_secret_value()
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("the channel secret must be at least 16 bytes")
    return secret


# ---- bytes on a socket ----------------------------------------------------------------------------
def _receive_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """n bytes; with a deadline (time.monotonic) the whole read must end by then."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the handshake took too long")
            sock.settimeout(left)
        read = sock.recv_into(view[got:], n - got)
        if read == 0:
            raise ConnectionError("the channel was closed")
        got += read
    return buf


def receive_frame(sock: socket.socket, max_frame_bytes: int) -> bytearray:
    """One frame's body; its length is checked before the body's buffer exists."""
    (n,) = HEADER.unpack(_receive_exactly(sock, HEADER.size))
    if n > max_frame_bytes:
        raise FrameTooLarge(f"a frame of {n} bytes; at most {max_frame_bytes}")
    return _receive_exactly(sock, n)


# ---- the handshake ----------------------------------------------------------------------------
# server -> client: MAGIC, server nonce
# client -> server: MAGIC, client nonce, HMAC(secret, "client" label, server nonce, client nonce)
# server -> client: HMAC(secret, "server" label, server nonce, client nonce)
# Each side's MAC covers the other side's fresh nonce (no replay) and its own label (a MAC cannot
# be reflected back as the other side's).
_CLIENT, _SERVER = b"rayspec-channel-v1 client", b"rayspec-channel-v1 server"


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def server_handshake(conn: socket.socket, secret: bytes, deadline: float) -> bool:
    server_nonce = secrets.token_bytes(_NONCE)
    conn.sendall(_MAGIC + server_nonce)
    answer = bytes(_receive_exactly(conn, len(_MAGIC) + _NONCE + _MAC, deadline))
    magic, client_nonce, mac = answer[:len(_MAGIC)], answer[len(_MAGIC):-_MAC], answer[-_MAC:]
    if magic != _MAGIC or not hmac.compare_digest(mac, _mac(secret, _CLIENT, server_nonce, client_nonce)):
        return False
    conn.sendall(_mac(secret, _SERVER, server_nonce, client_nonce))
    return True


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Raises ChannelRefused unless the server proves it holds the secret too."""
    hello = bytes(_receive_exactly(sock, len(_MAGIC) + _NONCE))
    if hello[:len(_MAGIC)] != _MAGIC:
        raise ChannelRefused("not a rayspec channel (or another layout version)")
    server_nonce, client_nonce = hello[len(_MAGIC):], secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + client_nonce + _mac(secret, _CLIENT, server_nonce, client_nonce))
    try:
        proof = bytes(_receive_exactly(sock, _MAC))
    except ConnectionError:
        raise ChannelRefused("the proposer closed the channel: it holds another secret") from None
    if not hmac.compare_digest(proof, _mac(secret, _SERVER, server_nonce, client_nonce)):
        raise ChannelRefused("the proposer could not prove it holds the channel secret")


# ---- server -----------------------------------------------------------------------------------
class ChannelServer:
    """Answers `handler(requests, released) -> drafts` for every call on every authenticated
    connection, one thread per connection (one per verifier replica). A handler error goes back
    to the caller, who raises it; the connection stays."""

    def __init__(self, handler: Callable[[list[ProposeRequest], list[str]], list[Draft]], secret=None,
                 host: str = "127.0.0.1", limits: CallLimits = CallLimits(),
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        self._handler = handler
        # no secret given (tests, hand-built servers): one of its own, for whoever builds the client
        self.secret = secret_bytes(secret) if secret is not None else secrets.token_bytes(32)
        self.limits, self.max_frame_bytes, self.handshake_timeout_s = limits, max_frame_bytes, handshake_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._count_lock = threading.Lock()
        self.num_connections = 0  # authenticated
        self.num_rejected = 0  # closed: failed handshake, malformed or oversized frame, too many connections
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="rayspec-channel-accept", daemon=True).start()

    def __repr__(self) -> str:  # never the secret
        return f"ChannelServer({self.address[0]}:{self.address[1]})"

    def _reject(self, peer, reason: str) -> None:
        with self._count_lock:
            self.num_rejected += 1
        logger.warning("direct channel: closed a connection from %s: %s", peer, reason)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()
                self._reject(peer, "too many connections")
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="rayspec-channel", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            refused = self._handshake(conn) or self._answer_calls(conn)
        finally:
            conn.close()
            self._slots.release()
        if refused:  # counted once closed, its slot free again
            self._reject(peer, refused)

    def _handshake(self, conn: socket.socket) -> str | None:
        """None once the caller proved the secret; else why it is refused."""
        conn.settimeout(self.handshake_timeout_s)
        try:
            if not server_handshake(conn, self.secret, time.monotonic() + self.handshake_timeout_s):
                return "wrong secret, or not a rayspec channel"
        except OSError as err:  # timed out, closed, reset
            return f"no handshake ({type(err).__name__})"
        conn.settimeout(None)  # a verifier may be idle for long between calls
        with self._count_lock:
            self.num_connections += 1
        return None

    def _answer_calls(self, conn: socket.socket) -> str | None:
        """Until the caller goes (None) or sends what is refused (why)."""
        while True:
            try:
                body = receive_frame(conn, self.max_frame_bytes)
            except FrameTooLarge as err:
                return str(err)
            except OSError:
                return None  # the caller went away (or gave up on a call: its timeout)
            try:
                requests, released = decode_call(body, self.limits)
            except Exception as err:  # noqa: BLE001 - MalformedFrame, or whatever else a hostile frame provokes
                return f"{type(err).__name__}: {err}"
            try:
                reply = encode_drafts(self._handler(requests, released))
                size = len(reply) - HEADER.size
                if size > self.max_frame_bytes:  # the caller would refuse it: tell it why instead
                    raise CallTooLarge(f"the reply has {size} bytes; at most {self.max_frame_bytes}")
            except Exception as err:  # noqa: BLE001 - the caller's call fails, the channel stays
                logger.exception("channel handler failed")
                reply = encode_error(f"{type(err).__name__}: {err}")
            try:
                conn.sendall(reply)
            except OSError:
                return None

    def close(self) -> None:
        """Stops accepting; open connections end when their callers go."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not, on Linux)
        except OSError:
            pass
        self._sock.close()


# ---- client -----------------------------------------------------------------------------------
class ChannelClient:
    """One authenticated connection to a ChannelServer; `call` blocks for the reply, each read at
    most `timeout_s`. Raises ChannelRefused when the server does not hold the same secret."""

    def __init__(self, address: tuple[str, int], secret, timeout_s: float | None,
                 limits: ReplyLimits = ReplyLimits(), max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        key = secret_bytes(secret)
        self.address = tuple(address)
        self.limits, self.max_frame_bytes = limits, max_frame_bytes
        self._sock = socket.create_connection(self.address, timeout=timeout_s)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(self._sock, key)
        except BaseException:
            self._sock.close()
            raise

    def call(self, requests: list[ProposeRequest], released: list[str]) -> list[Draft]:
        """Raises CallTooLarge (nothing sent), OSError (timeout, connection lost), RuntimeError (the
        handler failed) or MalformedFrame (a reply that breaks the layout or the limits)."""
        frame = encode_call(requests, released)
        if len(frame) - HEADER.size > self.max_frame_bytes:
            raise CallTooLarge(f"the call has {len(frame) - HEADER.size} bytes; at most {self.max_frame_bytes}")
        self._sock.sendall(frame)
        return decode_reply(receive_frame(self._sock, self.max_frame_bytes), self.limits, len(requests))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
