"""The verifier <-> proposer direct channel (deployments.transport.direct_channel, deployments.transport.wire) against
what an attacker who can reach its port might send: no pickle is ever loaded, a connection that
does not prove the application's secret or sends a malformed or oversized frame is closed and
counted, and the server keeps answering everyone else.

Timeouts are generous where a call should succeed (a loaded 2-core VM may stall for seconds);
the one call meant to time out waits on a threading.Event that is only set afterwards.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from deployments.transport.direct_channel import (CallTooLarge, ChannelClient, ChannelRefused, ChannelServer,
                                        client_handshake)
from deployments.transport.wire import (HEADER, CallLimits, MalformedFrame, ReplyLimits, decode_call, decode_reply,
                              encode_call, encode_drafts, encode_error)
from rayspec.proposers import Draft, ProposeRequest

SECRET = b"s" * 32
WIDTH, VOCAB = 12, 50  # the features' width the proposer expects; the target's vocabulary
LIMITS = CallLimits(feature_width=WIDTH, max_requests=8, max_seq_tokens=64, max_draft_tokens=16)
OK_S = 30.0  # a call that should succeed may take this long on a loaded machine


def _requests() -> list[ProposeRequest]:
    g = torch.Generator().manual_seed(0)
    return [
        ProposeRequest("verifier-a-0", [1, 2, 3, 4, 5], 4, 0.0, 0, 1.0, None,
                       torch.randn(4, WIDTH, generator=g), 0, tree=True),
        ProposeRequest("verifier-a-1", list(range(40)), 3, 0.7, 20, 0.9, 2**70 + 3,  # a seed past 64 bits
                       torch.randn(2, WIDTH, generator=g).to(torch.bfloat16), 37),
        ProposeRequest("verifier-a-ü", [7], 0, 1.5, -1, 0.5, -12),  # no features at all
        ProposeRequest("verifier-a-3", [9, 9], 2, features=torch.empty(0, WIDTH)),  # an empty block
    ]


def _drafts() -> list[Draft]:
    probs = torch.softmax(torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)), -1)
    return [Draft([5, 6, 7, 8], parents=[-1, 0, 0, 2]),  # a tree
            Draft([1, 2, 3], probs=probs, pre_drafted=True),  # a sampled chain, a speculation-cache hit
            Draft([], pre_drafted=False),  # drafted on the call by an asynchronous proposer
            Draft([], resend_features_from=17)]


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
        else:
            assert x == y and type(x) is type(y), name


def _echo(requests, released):
    """A handler that answers what the tests check: one draft per request, from its own fields."""
    return [Draft([r.num_tokens], parents=[-1]) for r in requests]


@pytest.fixture
def server():
    s = ChannelServer(_echo, SECRET, limits=LIMITS, handshake_timeout_s=OK_S)
    yield s
    s.close()


def _client(server, **kwargs) -> ChannelClient:
    return ChannelClient(server.address, kwargs.pop("secret", SECRET), kwargs.pop("timeout_s", OK_S),
                         ReplyLimits(vocab_size=VOCAB), **kwargs)


def _still_serves(server) -> None:
    client = _client(server)
    try:
        assert [d.tokens for d in client.call(_requests()[:2], ["gone"])] == [[4], [3]]
    finally:
        client.close()


def _raw_authenticated(server) -> socket.socket:
    """A connection past the handshake, for writing frames by hand."""
    sock = socket.create_connection(server.address, timeout=OK_S)
    client_handshake(sock, SECRET)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def _wait_rejected(server, n: int) -> None:
    deadline = time.monotonic() + OK_S
    while server.num_rejected < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.num_rejected == n


# ---- the layout -------------------------------------------------------------------------------
def test_round_trip_of_realistic_calls_and_drafts(server):
    """Features (float32, bfloat16, empty), seeds past 64 bits, trees, probs, resends, None fields:
    equal after the codec, and after a real round trip over the socket."""
    requests, drafts = _requests(), _drafts()
    frame = encode_call(requests, ["verifier-a-9", "x"])
    assert HEADER.unpack(frame[:HEADER.size])[0] == len(frame) - HEADER.size
    got, released = decode_call(frame[HEADER.size:], LIMITS)
    assert released == ["verifier-a-9", "x"]
    for a, b in zip(requests, got, strict=True):
        _assert_same(a, b)
    back = decode_reply(encode_drafts(drafts)[HEADER.size:], ReplyLimits(vocab_size=VOCAB), len(drafts))
    for a, b in zip(drafts, back, strict=True):
        _assert_same(a, b)

    seen = []
    server._handler = lambda reqs, rel: seen.append((reqs, rel)) or _drafts()
    client = _client(server)
    for a, b in zip(drafts, client.call(requests, ["r"]), strict=True):
        _assert_same(a, b)
    for a, b in zip(requests, seen[0][0], strict=True):
        _assert_same(a, b)
    assert seen[0][1] == ["r"]
    server._handler = _echo
    assert client.call([], ["done"]) == []  # releases only
    client.close()
    assert server.num_connections == 1 and server.num_rejected == 0


def _call_body(**changes) -> bytes:
    request = ProposeRequest("s", [1, 2, 3], 2, features=torch.zeros(2, WIDTH))
    for name, value in changes.items():
        setattr(request, name, value)
    return encode_call([request], [])[HEADER.size:]


@pytest.mark.parametrize("mutate, needle", [
    (lambda b: b[:-1], "bytes announced"),  # cut short
    (lambda b: b + b"\0", "after the message"),  # trailing bytes
    (lambda b: b"\x02" + b[1:], "expected a propose call"),  # another kind
    (lambda b: b[:1] + struct.pack("<I", 2**32 - 1) + b[5:], "requests"),  # a count far past the bytes
    (lambda b: b[:5] + struct.pack("<I", 2) + b"\xff\xfe" + b[11:], "UTF-8"),  # the seq id is not text
])
def test_malformed_frames_are_refused(mutate, needle):
    with pytest.raises(MalformedFrame, match=needle):
        decode_call(mutate(_call_body()), LIMITS)


@pytest.mark.parametrize("changes, needle", [
    ({"features": torch.zeros(2, WIDTH + 1)}, "features: shape"),  # another hidden width
    ({"features": torch.zeros(5, WIDTH)}, "beyond the sequence"),  # more rows than the sequence has tokens
    ({"token_ids": [1, -5, 3]}, "negative"),
    ({"token_ids": list(range(65))}, "token_ids"),  # past max_seq_tokens
    ({"num_tokens": 17}, "num_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seq_id": "x" * 2000}, "string"),
])
def test_fields_outside_the_receivers_limits_are_refused(changes, needle):
    with pytest.raises(MalformedFrame, match=needle):
        decode_call(_call_body(**changes), LIMITS)


def test_tensor_dtype_and_shape_are_checked():
    body = bytearray(_call_body())
    at = body.index(bytes([1, 2]) + struct.pack("<II", 2, WIDTH))  # features: float32, 2-D, [2, WIDTH]
    for patch, needle in [(bytes([9, 2]), "dtype code 9"), (bytes([1, 3]), "3-D"),
                          (bytes([1, 2]) + struct.pack("<II", 3, WIDTH), "bytes announced")]:  # more rows than bytes
        bad = bytes(body[:at]) + patch + bytes(body[at + len(patch):])
        with pytest.raises(MalformedFrame, match=needle):
            decode_call(bad, LIMITS)
    with pytest.raises(MalformedFrame, match="takes none"):  # a proposer without EAGLE takes no features
        decode_call(bytes(body), CallLimits())
    with pytest.raises(MalformedFrame, match="int64"):  # not on the allow-list: not even sent
        encode_call([ProposeRequest("s", [1, 2], 1, features=torch.zeros(1, WIDTH, dtype=torch.int64))], [])
    lim = ReplyLimits(vocab_size=VOCAB)
    for draft, needle in [(Draft([1, 2], probs=torch.zeros(2, VOCAB + 1)), "probs: shape"),
                          (Draft([1, 2], probs=torch.zeros(1, VOCAB)), "probs: shape"),
                          (Draft([1, VOCAB]), "outside"),
                          (Draft([1, 2], parents=[-1, 1]), "parents"),
                          (Draft([1, 2], parents=[-1]), "parents")]:
        with pytest.raises(MalformedFrame, match=needle):
            decode_reply(encode_drafts([draft])[HEADER.size:], lim, 1)
    with pytest.raises(MalformedFrame, match="2 drafts for 1 requests"):
        decode_reply(encode_drafts([Draft([]), Draft([])])[HEADER.size:], lim, 1)


def test_no_pickle_on_the_channel():
    for name in ("transport/direct_channel.py", "transport/wire.py", "transport/remote_proposer.py",
                 "replicas/proposer.py"):
        source = (Path(__file__).resolve().parents[2] / "deployments" / name).read_text()
        assert "import pickle" not in source and "pickle." not in source, name


# ---- the server against hostile connections ------------------------------------------------------
class _Evil:
    """Unpickled, it would create the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_malicious_pickle_runs_nothing(server, tmp_path):
    """The old wire format (a length-prefixed pickle) whose unpickling would create a file: sent
    before the handshake and after it. Nothing runs, both connections are closed and counted, and
    a legitimate verifier is served as before."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(([_Evil(marker)], []))
    frame = struct.pack("!Q", len(payload)) + payload
    with socket.create_connection(server.address, timeout=OK_S) as sock:  # no handshake at all
        sock.recv(64)  # the server's hello
        sock.sendall(frame)
        assert _closed_by_peer(sock)
    _wait_rejected(server, 1)
    with _raw_authenticated(server) as sock:  # a holder of the secret sending a pickle
        sock.sendall(frame)
        assert _closed_by_peer(sock)
    _wait_rejected(server, 2)
    assert not marker.exists()
    _still_serves(server)


def test_a_garbage_frame_is_closed_and_counted(server):
    with _raw_authenticated(server) as sock:
        garbage = bytes(range(256)) * 4
        sock.sendall(HEADER.pack(len(garbage)) + garbage + b"t" * 32)  # and a tag made without the key
        assert _closed_by_peer(sock)
    _wait_rejected(server, 1)
    _still_serves(server)


def test_a_huge_length_prefix_is_refused_before_allocating(server):
    """2**60 bytes announced: refused from the prefix alone (nothing near that is allocated, and
    no byte more is read), the connection closed and counted, the server still up."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with _raw_authenticated(server) as sock:
            sock.sendall(HEADER.pack(2**60))
            assert _closed_by_peer(sock)
        _wait_rejected(server, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    _still_serves(server)


def test_a_frame_past_the_configured_maximum_is_refused():
    server = ChannelServer(_echo, SECRET, limits=LIMITS, max_frame_bytes=1024)
    try:
        with _raw_authenticated(server) as sock:
            sock.sendall(HEADER.pack(1025) + b"\0" * 1025)
            assert _closed_by_peer(sock)
        _wait_rejected(server, 1)
        client = _client(server, max_frame_bytes=1024)  # a client with the same limit does not even send it
        big = [ProposeRequest("s", list(range(60)), 1, features=torch.zeros(40, WIDTH))]
        with pytest.raises(CallTooLarge):
            client.call(big, [])
        assert [d.tokens for d in client.call(_requests()[:1], [])] == [[4]]  # nothing was sent: still usable
        client.close()
    finally:
        server.close()


def test_a_wrong_secret_is_refused(server):
    with pytest.raises(ChannelRefused):
        _client(server, secret=b"w" * 32)
    _wait_rejected(server, 1)
    with pytest.raises(ValueError, match="16 bytes"):  # nor can a client go without a real secret
        _client(server, secret=b"")
    _still_serves(server)


def test_a_server_made_without_a_secret_makes_its_own():
    """Unauthenticated is not an option: no secret given, the server has a random one of its own."""
    server = ChannelServer(_echo, limits=LIMITS)
    try:
        assert len(server.secret) == 32 and server.secret not in repr(server).encode()
        with pytest.raises(ChannelRefused):
            _client(server)  # SECRET is not the server's
        client = _client(server, secret=server.secret)
        assert [d.tokens for d in client.call(_requests()[:1], [])] == [[4]]
        client.close()
    finally:
        server.close()


def test_a_client_refuses_a_server_without_the_secret():
    """Mutual: a server that cannot prove the secret (an impostor on the port) is refused too."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def impostor():
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"RSPC\x02" + b"n" * 32)
                conn.recv(69)
                conn.sendall(b"m" * 32)  # not the HMAC it would need the secret for

        threading.Thread(target=impostor, daemon=True).start()
        with pytest.raises(ChannelRefused, match="prove"):
            ChannelClient(listener.getsockname(), SECRET, OK_S)


def test_a_silent_connection_times_out():
    server = ChannelServer(_echo, SECRET, limits=LIMITS, handshake_timeout_s=0.5)
    try:
        with socket.create_connection(server.address, timeout=OK_S) as silent:
            silent.recv(64)  # the hello; then nothing: the handshake times out
            assert _closed_by_peer(silent)
        _wait_rejected(server, 1)
        _still_serves(server)
    finally:
        server.close()


def test_sessions_are_capped():
    """At most max_connections authenticated sessions: the next verifier is closed at once."""
    server = ChannelServer(_echo, SECRET, limits=LIMITS, handshake_timeout_s=OK_S, max_connections=1)
    try:
        first = _client(server)
        first.call([], ["s"])  # (a call: the session holds the only slot)
        with pytest.raises(OSError):
            _client(server).call([], ["t"])
        _wait_rejected(server, 1)
        first.close()
        # the slot is free once the server's thread has seen the close (a moment after it, under load:
        # a verifier connecting in between is refused like the second one, BrokenPipeError in a CI run)
        deadline = time.monotonic() + OK_S
        while True:
            try:
                return _still_serves(server)
            except OSError:
                assert time.monotonic() < deadline, "the closed session's slot was never freed"
                time.sleep(0.05)
    finally:
        server.close()


def test_unauthenticated_connections_cannot_lock_verifiers_out():
    """Sockets opened and held without a handshake (issue #51: 64 of them took every slot) take no
    session's slot; past max_pending the oldest of them is closed; a verifier still gets in."""
    server = ChannelServer(_echo, SECRET, limits=LIMITS, handshake_timeout_s=30.0, max_connections=2, max_pending=3)
    silent = []
    try:
        for _ in range(8):  # more than max_connections and max_pending together
            sock = socket.create_connection(server.address, timeout=OK_S)
            sock.recv(64)  # the hello; then nothing
            silent.append(sock)
        _wait_rejected(server, 5)  # the 5 oldest, closed for newer ones
        assert all(_closed_by_peer(s) for s in silent[:5])
        _still_serves(server)  # a real verifier: handshake and call
    finally:
        for sock in silent:
            sock.close()
        server.close()


# ---- calls ------------------------------------------------------------------------------------
def test_handler_errors_come_back_and_leave_the_channel_usable(server):
    def handler(requests, released):
        if requests and requests[0].seq_id == "boom":
            raise ValueError("bad input")
        return _echo(requests, released)

    server._handler = handler
    client = _client(server)
    with pytest.raises(RuntimeError, match="ValueError: bad input"):
        client.call([ProposeRequest("boom", [1], 1)], [])
    assert [d.tokens for d in client.call([ProposeRequest("fine", [1], 2)], [])] == [[2]]
    server._handler = lambda requests, released: [Draft([VOCAB + 5])]  # a proposer gone wrong
    with pytest.raises(MalformedFrame, match="outside"):
        client.call([ProposeRequest("fine", [1], 2)], [])
    client.close()
    assert server.num_rejected == 0


def test_a_call_times_out_while_the_handler_blocks(server):
    release = threading.Event()
    server._handler = lambda requests, released: release.wait(OK_S) and _echo(requests, released)
    client = _client(server, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(OSError):  # socket.timeout
        client.call(_requests()[:1], [])
    assert time.monotonic() - started < OK_S
    client.close()
    release.set()
    server._handler = _echo
    _still_serves(server)
    server.close()
    with pytest.raises(OSError):  # closed: no new connections
        _client(server, timeout_s=5.0)


class _Recorder:
    """A man in the middle on localhost: relays both ways, keeps every chunk it relayed to the
    server, and can rewrite what goes from the server to the client (`rewriter()` makes one
    `rewrite(chunk) -> bytes` per connection)."""

    def __init__(self, target, rewriter=None):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address, self.target, self.rewriter = self.listener.getsockname(), target, rewriter
        self.to_server: list[bytes] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            rewrite = self.rewriter() if self.rewriter else None
            threading.Thread(target=self._pipe, args=(client, server, self.to_server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, [], rewrite), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, keep, rewrite):
        try:
            while chunk := src.recv(1 << 20):
                keep.append(chunk)
                dst.sendall(rewrite(chunk) if rewrite else chunk)
            dst.shutdown(socket.SHUT_WR)  # (close would wait for the other pipe's recv)
        except OSError:
            pass


def _reply_flipper():
    """Rewrites the first reply after the handshake (the 5 + 32 byte hello, the 32 byte proof):
    one byte of its body flipped, so the drafts' tokens change on the way."""
    seen = [0]

    def rewrite(chunk):
        start = seen[0]
        seen[0] += len(chunk)
        at = 5 + 32 + 32 + HEADER.size + 1 + 4 + 4 - start  # the first draft's first token
        if 0 <= at < len(chunk):
            chunk = chunk[:at] + bytes([chunk[at] ^ 1]) + chunk[at + 1:]
        return chunk
    return rewrite


def test_a_reply_altered_on_the_way_is_refused(server):
    """Without frame tags an attacker on the path rewrites drafts at will; with them the client
    refuses the altered reply (and would close the connection)."""
    mitm = _Recorder(server.address, _reply_flipper)
    client = _client(server)
    honest = [d.tokens for d in client.call(_requests()[:1], [])]
    client.close()
    assert honest == [[4]]
    tampered = ChannelClient(mitm.address, SECRET, OK_S, ReplyLimits(vocab_size=VOCAB))
    try:
        with pytest.raises(MalformedFrame, match="tag"):  # not [[5]]: the bit the attacker flipped
            tampered.call(_requests()[:1], [])
    finally:
        tampered.close()


def test_a_replayed_or_reordered_call_is_refused(server):
    """Frames recorded on the way and sent again (the same connection: a replay; frames swapped:
    a reorder) fail their tags: the server closes the connection and counts it."""
    mitm = _Recorder(server.address)
    client = ChannelClient(mitm.address, SECRET, OK_S, ReplyLimits(vocab_size=VOCAB))
    client.call(_requests()[:1], [])
    client.call(_requests()[1:2], [])
    deadline = time.monotonic() + OK_S
    while len(b"".join(mitm.to_server)) < 69 + 2 * HEADER.size and time.monotonic() < deadline:
        time.sleep(0.01)
    calls = b"".join(mitm.to_server)[69:]  # after the client's handshake answer
    n1 = HEADER.size + HEADER.unpack(calls[:HEADER.size])[0] + 32
    first, second = calls[:n1], calls[n1:]
    with client._sock as sock:  # the client's own connection, its counters in step with the server's
        sock.sendall(first)  # the first call again: its counter is 0, the server expects 2
        assert _closed_by_peer(sock)
    _wait_rejected(server, 1)
    mitm2 = _Recorder(server.address)
    again = ChannelClient(mitm2.address, SECRET, OK_S, ReplyLimits(vocab_size=VOCAB))
    with again._sock as sock:  # a new connection, the recorded frames in another order
        sock.sendall(second)
        assert _closed_by_peer(sock)
    _wait_rejected(server, 2)
    _still_serves(server)


def test_the_call_deadline_covers_the_whole_reply():
    """A server that trickles its reply a byte every 0.2 s never lets one read time out: the
    client's timeout is for the whole call, so it gives up after about timeout_s."""
    from deployments.transport.direct_channel import server_handshake

    with socket.create_server(("127.0.0.1", 0)) as listener:
        def trickler():
            conn, _ = listener.accept()
            with conn:
                server_handshake(conn, SECRET, time.monotonic() + OK_S)
                conn.recv(1 << 16)  # the call
                conn.sendall(HEADER.pack(100))  # a reply of 100 bytes announced, then sent
                for _ in range(100):  # a byte at a time, over 20 s
                    try:
                        conn.sendall(b"\0")
                    except OSError:
                        return
                    time.sleep(0.2)

        threading.Thread(target=trickler, daemon=True).start()
        client = ChannelClient(listener.getsockname(), SECRET, 1.0)
        started = time.monotonic()
        with pytest.raises(OSError):  # socket.timeout
            client.call(_requests()[:1], [])
        assert time.monotonic() - started < 5.0
        client.close()


class _ForgeReplies:
    """A server-to-client rewriter for _Recorder: every drafts reply becomes `forge(n)` (n: the
    number of drafts the genuine one had), its frame tag (if the layout has them) kept as it came."""

    def __init__(self, forge):
        self.forge, self.buffer, self.passed, self.tagged = forge, b"", 0, None

    def __call__(self, chunk: bytes) -> bytes:
        if self.tagged is None:
            self.tagged = chunk[4] >= 2  # the hello's layout version: 2 tags its frames
        out = chunk[:69 - self.passed]  # the hello and the proof (5 + 32, 32 bytes) pass as they are
        self.passed += len(out)
        self.buffer += chunk[len(out):]
        tag = 32 if self.tagged else 0
        while len(self.buffer) >= HEADER.size:
            n = HEADER.unpack(self.buffer[:HEADER.size])[0]
            if len(self.buffer) < HEADER.size + n + tag:
                break
            body = self.buffer[HEADER.size: HEADER.size + n]
            if body[0] == 2:  # DRAFTS
                body = encode_drafts(self.forge(struct.unpack("<I", body[1:5])[0]))[HEADER.size:]
            out += HEADER.pack(len(body)) + body + self.buffer[HEADER.size + n: HEADER.size + n + tag]
            self.buffer = self.buffer[HEADER.size + n + tag:]
        return out


def test_a_forged_q_on_the_path_cannot_force_a_sampled_output(tiny_model_dir):
    """The attack of issue #35 on localhost: an attacker between verifier and proposer replaces
    every reply with drafts of one token it chose, FORCED, and a q that looks like a distribution
    (finite, sums to 1) but claims q(FORCED) = 1e-12, so u * q < p(FORCED) accepts FORCED almost
    surely. Without frame tags a sampled request's output is then mostly FORCED; with them the
    verifier refuses the first forged reply, drops the channel, and samples as the target does."""
    from deployments.transport.remote_proposer import RemoteProposer
    from engine_utils import cached_model, make_engine
    from rayspec.sampling.sampler import SamplingParams

    forced, vocab, k = 1000, 49152, 4
    q = torch.full((vocab,), 1.0 / (vocab - 1))
    q[forced] = 1e-12
    proposer_server = ChannelServer(lambda requests, released: [Draft([]) for _ in requests], SECRET)
    mitm = _Recorder(proposer_server.address, lambda: _ForgeReplies(lambda n: [Draft([forced] * k, q.expand(k, vocab))] * n))
    remote = RemoteProposer(_Handle(mitm.address, lambda n: [Draft([])] * n), affinity="v", channel_secret=SECRET,
                            vocab_size=vocab)
    engine = make_engine(tiny_model_dir, "ngram", k=k, loaded=cached_model(str(tiny_model_dir)), proposer=remote)
    try:
        out = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))[0]
    finally:
        proposer_server.close()
    # the tiny model's next-token law is near uniform over its 8,192 ids: p(FORCED) ~ 1.2e-4 a token, so once
    # in 12 tokens happens in ~0.15% of runs (it did, in a CI run), twice in ~1e-6; the attack makes most of
    # the 12 FORCED
    assert out.token_ids.count(forced) <= 1, out.token_ids
    assert remote.num_failed_calls >= 1 and remote.num_direct_calls == 0  # each forged reply was refused


def test_error_frames_are_bounded():
    body = encode_error("x" * (1 << 20))[HEADER.size:]
    with pytest.raises(RuntimeError) as info:
        decode_reply(body, ReplyLimits(), 1)
    assert len(str(info.value)) < (64 << 10) + 100


# ---- the deployments around it ----------------------------------------------------------------
class _Handle:
    """The Serve handle a RemoteProposer holds, without Ray: pin answers the channel's address."""

    def __init__(self, address, drafts):
        self.address, self.drafts, self.propose_calls = address, drafts, 0

    def options(self, **kwargs):
        return self

    def __getattr__(self, name):
        outer = self

        class _Response:
            def __init__(self, value):
                self.value = value

            def result(self, timeout_s=None):
                return self.value

            def cancel(self):
                pass

        class _Method:
            def remote(self, *args):
                if name == "propose":
                    outer.propose_calls += 1
                    return _Response(outer.drafts(len(args[0])))
                return _Response({"feature_layers": None, "pin": {"channel": outer.address}}[name])

        return _Method()


def test_remote_proposer_uses_the_channel_only_with_the_secret(server):
    from deployments.transport.remote_proposer import RemoteProposer

    handle = _Handle(server.address, lambda n: [Draft([9])] * n)
    request = ProposeRequest("s", [1, 2], 3)
    keyed = RemoteProposer(handle, affinity="v", channel_secret=SECRET, vocab_size=VOCAB)
    assert [d.tokens for d in keyed.propose([request])] == [[3]] and keyed.num_direct_calls == 1
    big = ProposeRequest("s", list(range(50)), 3)
    keyed.max_frame_bytes = keyed._channel.max_frame_bytes = 64  # this call would not fit: Serve takes it
    assert [d.tokens for d in keyed.propose([big])] == [[9]] and handle.propose_calls == 1
    assert keyed._channel is not None and keyed.num_failed_calls == 0
    keyless = RemoteProposer(handle, affinity="w")  # no secret: never the channel
    assert [d.tokens for d in keyless.propose([request])] == [[9]] and keyless.num_direct_calls == 0
    wrong = RemoteProposer(handle, affinity="x", channel_secret=b"w" * 32)  # refused: Serve again
    assert [d.tokens for d in wrong.propose([request])] == [[9]] and wrong.num_direct_calls == 0
    _wait_rejected(server, 1)


@pytest.mark.parametrize("bad", ["token", "parents", "count", "probs"])
def test_drafts_through_serve_get_the_channels_checks(bad):
    """A cut channel (or a call too large for it) goes through Serve's handle: its drafts are held
    to the same checks as a frame's (issue #51: there they got none), refused as a failed call."""
    from deployments.transport.remote_proposer import RemoteProposer

    forged = {"token": lambda n: [Draft([VOCAB + 5])] * n,
              "parents": lambda n: [Draft([1, 2], parents=[1, -1])] * n,
              "count": lambda n: [Draft([1])] * (n + 1),
              "probs": lambda n: [Draft([1, 2], torch.ones(2, VOCAB + 1) / (VOCAB + 1))] * n}[bad]
    handle = _Handle(None, forged)
    remote = RemoteProposer(handle, affinity="v", vocab_size=VOCAB)  # no secret: Serve's handle only
    assert [d.tokens for d in remote.propose([ProposeRequest("s", [1, 2], 3)])] == [[]]
    assert handle.propose_calls == 1 and remote.num_failed_calls == 1
    fine = RemoteProposer(_Handle(None, lambda n: [Draft([1, 2], parents=[-1, 0])] * n), affinity="w",
                          vocab_size=VOCAB)
    assert [d.tokens for d in fine.propose([ProposeRequest("s", [1, 2], 3)])] == [[1, 2]]


def test_proposer_deployment_counts_rejected_connections(tmp_path):
    from serve_utils import tiny_args

    from deployments.replicas.proposer import Proposer

    marker = tmp_path / "pwned"
    args = tiny_args(tmp_path / "no-model", topology="disaggregated", engine={"device": "cpu", "num_threads": None})
    proposer = Proposer.func_or_class(args, SECRET)
    host, port = proposer._channel_address()
    payload = pickle.dumps(_Evil(marker))
    with socket.create_connection((host, port), timeout=OK_S) as sock:
        sock.recv(64)
        sock.sendall(struct.pack("!Q", len(payload)) + payload)
        assert _closed_by_peer(sock)
    client = ChannelClient((host, port), SECRET, OK_S)
    drafts = client.call([ProposeRequest("s", [1, 2, 3, 1, 2, 3, 1, 2], 2)], [])  # n-gram lookup
    client.close()
    assert drafts[0].tokens == [3, 1] and not marker.exists()
    _wait_rejected(proposer._channel, 1)  # the server counts after it closes: wait, as above
    stats = proposer.stats()
    assert stats["channel_rejected"] == 1 and stats["channel_connections"] == 1
    proposer._channel.close()


def test_closing_a_remote_proposer_ends_the_call_it_waits_on():
    """A replica shutting down (EngineLoop.shutdown) closes its remote proposer from another thread:
    a propose call waiting on a proposer that will never answer (its deployment going down too)
    returns at once without drafts, not after timeout_s, and later calls do not wait at all."""
    from deployments.transport.remote_proposer import RemoteProposer

    cancelled = threading.Event()

    class _Hanging:
        def result(self, timeout_s=None):
            if not cancelled.wait(timeout_s):
                raise TimeoutError
            raise RuntimeError("cancelled")

        def cancel(self):
            cancelled.set()

    class _HangingHandle(_Handle):
        def __getattr__(self, name):
            if name != "propose":
                return super().__getattr__(name)
            outer = self

            class _Method:
                def remote(self, *args):
                    outer.propose_calls += 1
                    return _Hanging()

            return _Method()

    handle = _HangingHandle(None, None)
    remote = RemoteProposer(handle, timeout_s=60.0)
    out = []
    waiting = threading.Thread(target=lambda: out.append(remote.propose([ProposeRequest("s", [1, 2], 3)])))
    waiting.start()
    deadline = time.monotonic() + OK_S
    while handle.propose_calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    remote.close()
    waiting.join(timeout=OK_S)
    assert not waiting.is_alive() and time.monotonic() - started < 5.0
    assert [d.tokens for d in out[0]] == [[]] and remote.num_failed_calls == 1
    assert [d.tokens for d in remote.propose([ProposeRequest("s", [1, 2, 3], 3)])] == [[]]
    assert handle.propose_calls == 1
