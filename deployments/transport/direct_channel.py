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
- no code execution: messages are the fixed binary layout of deployments.transport.wire (no pickle), every
  field checked against what the receiver expects.
- bounded allocation: before the handshake a connection can make the server read 69 bytes, within
  `handshake_timeout_s`; after it, a frame's length prefix is checked against `max_frame_bytes`
  before anything is allocated. At most `max_connections` authenticated sessions at a time; a
  connection takes a session's slot only once its handshake succeeded, and of those still in their
  handshake at most `max_pending` are kept (the oldest closed for a newer one), so sockets held
  open unauthenticated cannot take the verifiers' places.
- integrity, no replay: every frame after the handshake carries an HMAC-SHA256 tag under a key of
  its direction, derived from the secret and both nonces (so each connection has keys of its own),
  over a frame counter and the whole frame. The counter is not sent: each side counts the frames it
  sent and received, so a frame that was altered, replayed (from this connection or another), dropped,
  reordered or reflected back fails its tag, and the connection is closed.
- q checked anyway: the verifier does not trust a draft's probabilities (rayspec.sampling.rejection): a q that
  cannot be a distribution is ignored, and a draft longer than asked is cut (rayspec.engine.llm_engine).
- bounded time: a call has one deadline for sending and its whole reply (`timeout_s`, not per read);
  the server gives a frame whose header arrived `frame_timeout_s` for the rest.
A connection that fails any of this is closed and counted (`ChannelServer.num_rejected`); the
others go on. Not done: encryption. Traffic (token ids, features, drafts) is readable on the wire;
an attacker on the path can read it, and cut the connection (the verifier then steps without drafts:
outputs unchanged), but not change what either end receives. A proposer node under an attacker's
control holds the secret and can still bias sampled drafts within the target's distribution (a q
that looks valid but was not what x was drawn from); such an attacker can run code in the Ray
cluster anyway. Keep the cluster's network private (or tunnelled, e.g. WireGuard), as Ray requires.
No Ray import here.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Callable

from deployments.transport.wire import (HEADER, CallLimits, FrameTooLarge, MalformedFrame, ReplyLimits, decode_call,
                              decode_reply, encode_call, encode_drafts, encode_error)
from rayspec.proposers import Draft, ProposeRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 256 << 20  # a prompt's EAGLE-3 features for Llama-3.1-8B: 24 KiB a token
HANDSHAKE_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 60.0  # the rest of a frame once its header came (256 MiB at ~4.5 MB/s)
MAX_CONNECTIONS = 64  # authenticated: one per verifier replica, plus reconnects whose old socket is closing
# connections still in their handshake: past this many the oldest is closed for a new one, so
# unauthenticated sockets held open (nothing sent) cannot lock verifiers out; a real handshake takes
# milliseconds, a flood has to outpace it
MAX_PENDING_HANDSHAKES = 16

_MAGIC = b"RSPC\x02"  # rayspec channel, layout version 2 (1: no frame tags)
_NONCE = 32
_MAC = 32  # HMAC-SHA256


class ChannelRefused(ConnectionError):
    """The handshake failed: the other end does not hold the same secret (or is not a channel)."""


class FrameNotAuthentic(MalformedFrame):
    """A frame whose tag is wrong: altered, replayed, reordered or injected on the way."""


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
                raise socket.timeout("past the deadline")
            sock.settimeout(left)
        read = sock.recv_into(view[got:], n - got)
        if read == 0:
            raise ConnectionError("the channel was closed")
        got += read
    return buf


# ---- the handshake ----------------------------------------------------------------------------
# server -> client: MAGIC, server nonce
# client -> server: MAGIC, client nonce, HMAC(secret, "client" label, server nonce, client nonce)
# server -> client: HMAC(secret, "server" label, server nonce, client nonce)
# Each side's MAC covers the other side's fresh nonce (no replay) and its own label (a MAC cannot
# be reflected back as the other side's).
_CLIENT, _SERVER = b"rayspec-channel-v1 client", b"rayspec-channel-v1 server"


_CLIENT_KEY, _SERVER_KEY = b"rayspec-channel-v2 client frames", b"rayspec-channel-v2 server frames"
_COUNTER = struct.Struct("<Q")


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


class Session:
    """One authenticated connection's frame keys and counters. A frame goes out as the wire's
    frame (length prefix, body) followed by HMAC-SHA256(direction key, counter || frame); the
    counters (frames sent / received so far) are implicit, so nothing can be replayed or reordered."""

    def __init__(self, secret: bytes, server_nonce: bytes, client_nonce: bytes, is_client: bool):
        client_key = _mac(secret, _CLIENT_KEY, server_nonce, client_nonce)  # what the client sends under
        server_key = _mac(secret, _SERVER_KEY, server_nonce, client_nonce)
        self._send_key, self._receive_key = (client_key, server_key) if is_client else (server_key, client_key)
        self.num_sent = self.num_received = 0

    @staticmethod
    def _tag(key: bytes, counter: int, *parts) -> bytes:
        mac = hmac.new(key, _COUNTER.pack(counter), hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def send(self, sock: socket.socket, frame: bytes, deadline: float | None = None) -> None:
        """frame: a whole wire frame (length prefix included); sent with its tag, by `deadline`."""
        tag = self._tag(self._send_key, self.num_sent, frame)
        self.num_sent += 1
        for part in (frame, tag):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("past the deadline")
                sock.settimeout(left)  # sendall: one limit for the whole part
            sock.sendall(part)

    def receive(self, sock: socket.socket, max_frame_bytes: int, deadline: float | None = None,
                frame_timeout_s: float | None = None) -> bytearray:
        """The next frame's body, once its tag checks. With `deadline` the whole frame must come
        by then; with `frame_timeout_s` (and no deadline) the header may take any time (an idle
        caller), the rest that long. Raises FrameTooLarge (from the prefix alone), FrameNotAuthentic,
        OSError (closed, timed out)."""
        header = _receive_exactly(sock, HEADER.size, deadline)
        (n,) = HEADER.unpack(header)
        if n > max_frame_bytes:
            raise FrameTooLarge(f"a frame of {n} bytes; at most {max_frame_bytes}")
        if deadline is None and frame_timeout_s is not None:
            deadline = time.monotonic() + frame_timeout_s
        body = _receive_exactly(sock, n, deadline)
        tag = bytes(_receive_exactly(sock, _MAC, deadline))
        if not hmac.compare_digest(tag, self._tag(self._receive_key, self.num_received, header, body)):
            raise FrameNotAuthentic("a frame whose tag does not check (altered, replayed or reordered)")
        self.num_received += 1
        return body


def server_handshake(conn: socket.socket, secret: bytes, deadline: float) -> Session | None:
    server_nonce = secrets.token_bytes(_NONCE)
    conn.sendall(_MAGIC + server_nonce)
    answer = bytes(_receive_exactly(conn, len(_MAGIC) + _NONCE + _MAC, deadline))
    magic, client_nonce, mac = answer[:len(_MAGIC)], answer[len(_MAGIC):-_MAC], answer[-_MAC:]
    if magic != _MAGIC or not hmac.compare_digest(mac, _mac(secret, _CLIENT, server_nonce, client_nonce)):
        return None
    conn.sendall(_mac(secret, _SERVER, server_nonce, client_nonce))
    return Session(secret, server_nonce, client_nonce, is_client=False)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float | None = None) -> Session:
    """Raises ChannelRefused unless the server proves it holds the secret too."""
    hello = bytes(_receive_exactly(sock, len(_MAGIC) + _NONCE, deadline))
    if hello[:len(_MAGIC)] != _MAGIC:
        raise ChannelRefused("not a rayspec channel (or another layout version)")
    server_nonce, client_nonce = hello[len(_MAGIC):], secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + client_nonce + _mac(secret, _CLIENT, server_nonce, client_nonce))
    try:
        proof = bytes(_receive_exactly(sock, _MAC, deadline))
    except ConnectionError:
        raise ChannelRefused("the proposer closed the channel: it holds another secret") from None
    if not hmac.compare_digest(proof, _mac(secret, _SERVER, server_nonce, client_nonce)):
        raise ChannelRefused("the proposer could not prove it holds the channel secret")
    return Session(secret, server_nonce, client_nonce, is_client=True)


# ---- server -----------------------------------------------------------------------------------
def _shut(conn: socket.socket) -> None:
    """End a connection another thread is blocked on (its read then fails at once)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class ChannelServer:
    """Answers `handler(requests, released) -> drafts` for every call on every authenticated
    connection, one thread per connection (one per verifier replica). A handler error goes back
    to the caller, who raises it; the connection stays."""

    def __init__(self, handler: Callable[[list[ProposeRequest], list[str]], list[Draft]], secret=None,
                 host: str = "127.0.0.1", limits: CallLimits = CallLimits(),
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, frame_timeout_s: float = FRAME_TIMEOUT_S,
                 max_pending: int = MAX_PENDING_HANDSHAKES):
        self._handler = handler
        # no secret given (tests, hand-built servers): one of its own, for whoever builds the client
        self.secret = secret_bytes(secret) if secret is not None else secrets.token_bytes(32)
        self.limits, self.max_frame_bytes, self.handshake_timeout_s = limits, max_frame_bytes, handshake_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)  # authenticated sessions only
        self._pending: collections.deque[socket.socket] = collections.deque()  # in their handshake, oldest first
        self.max_pending = max_pending
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
            with self._count_lock:
                if len(self._pending) >= self.max_pending:  # the oldest unproven one gives way
                    _shut(self._pending.popleft())
                self._pending.append(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="rayspec-channel", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        """Handshake first (a pending place, not a session's slot), then a slot for the session."""
        try:
            session = self._handshake(conn)
        finally:
            with self._count_lock:
                if conn in self._pending:
                    self._pending.remove(conn)
        if isinstance(session, str):
            conn.close()
            self._reject(peer, session)
            return
        if not self._slots.acquire(blocking=False):
            conn.close()
            self._reject(peer, "too many connections")
            return
        try:
            refused = self._answer_calls(conn, session)
        finally:
            conn.close()
            self._slots.release()
        if refused:  # counted once closed, its slot free again
            self._reject(peer, refused)

    def _handshake(self, conn: socket.socket) -> Session | str:
        """The session once the caller proved the secret; else why it is refused."""
        conn.settimeout(self.handshake_timeout_s)
        try:
            session = server_handshake(conn, self.secret, time.monotonic() + self.handshake_timeout_s)
            if session is None:
                return "wrong secret, or not a rayspec channel"
        except OSError as err:  # timed out, closed, reset
            return f"no handshake ({type(err).__name__})"
        conn.settimeout(None)  # a verifier may be idle for long between calls
        with self._count_lock:
            self.num_connections += 1
        return session

    def _answer_calls(self, conn: socket.socket, session: Session) -> str | None:
        """Until the caller goes (None) or sends what is refused (why)."""
        while True:
            try:
                conn.settimeout(None)
                body = session.receive(conn, self.max_frame_bytes, frame_timeout_s=self.frame_timeout_s)
            except MalformedFrame as err:  # too large, or not authentic
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
                session.send(conn, reply, time.monotonic() + self.frame_timeout_s)  # a caller that stops reading is dropped
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
    """One authenticated connection to a ChannelServer; `call` blocks for the reply, at most
    `timeout_s` for the whole call (sending it and reading all of the reply). Raises ChannelRefused
    when the server does not hold the same secret."""

    def __init__(self, address: tuple[str, int], secret, timeout_s: float | None,
                 limits: ReplyLimits = ReplyLimits(), max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        key = secret_bytes(secret)
        self.address = tuple(address)
        self.limits, self.max_frame_bytes, self.timeout_s = limits, max_frame_bytes, timeout_s
        self._sock = socket.create_connection(self.address, timeout=timeout_s)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._session = client_handshake(self._sock, key, self._deadline())
        except BaseException:
            self._sock.close()
            raise

    def _deadline(self) -> float | None:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def call(self, requests: list[ProposeRequest], released: list[str]) -> list[Draft]:
        """Raises CallTooLarge (nothing sent), OSError (the deadline passed, connection lost),
        RuntimeError (the handler failed) or MalformedFrame (a reply that is not authentic, or
        breaks the layout or the limits). After anything but CallTooLarge, close this client."""
        frame = encode_call(requests, released)
        if len(frame) - HEADER.size > self.max_frame_bytes:
            raise CallTooLarge(f"the call has {len(frame) - HEADER.size} bytes; at most {self.max_frame_bytes}")
        deadline = self._deadline()
        self._session.send(self._sock, frame, deadline)
        body = self._session.receive(self._sock, self.max_frame_bytes, deadline)
        return decode_reply(body, self.limits, len(requests))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
