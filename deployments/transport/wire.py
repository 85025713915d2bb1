"""The direct channel's message layout: ProposeRequest / Draft lists as fixed binary records.

No pickle: a frame is plain numbers, strings and raw tensor bytes, read back by the functions
below, which check every field against what the receiver expects (types, ranges, lengths,
tensor dtypes and shapes) and raise MalformedFrame on anything else. Nothing in a frame can
make the receiver run code, and nothing is allocated beyond what the frame's own bytes hold
(a list or tensor whose declared size exceeds the bytes left is refused before it is built).

Layout, little-endian (the byte order of every platform Ray runs on; checked at import):

    frame      u64 body length, then the body: u8 kind, then by kind (on the direct channel each
               frame is followed by its 32-byte HMAC-SHA256 tag: deployments.transport.direct_channel.Session)
    CALL  (1)  u32 n, n x request, u32 m, m x str (sequences released)
    DRAFTS(2)  u32 n, n x draft  (n = the number of requests of the call)
    ERROR (3)  str (the handler's error, for the caller to raise)

    request    str seq_id, ints token_ids, u32 num_tokens, f64 temperature, int top_k, f64 top_p,
               opt int seed, opt tensor features, u32 features_start, u8 tree (0 or 1),
               opt str cache_salt, opt int stream_seed
    draft      ints tokens, opt tensor probs, opt ints parents, opt u32 resend_features_from,
               u8 pre_drafted (0 None, 1 False: drafted on the call, 2 True: a speculation-cache hit)

    str        u32 byte length, UTF-8
    ints       u32 count, count x i32
    int        u16 byte length, two's complement (Python ints of any size: seeds are not bounded)
    opt X      u8 0 (None) or 1, then X
    tensor     u8 dtype (1 float32, 2 float16, 3 bfloat16, 4 float64), u8 ndim (always 2),
               ndim x u32 dims, then dims' product x itemsize raw bytes, C order
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from dataclasses import dataclass

import torch

from rayspec.proposers import Draft, ProposeRequest

if sys.byteorder != "little":  # tensors and int arrays go out in native order
    raise ImportError("deployments.transport.wire assumes a little-endian host")

CALL, DRAFTS, ERROR = 1, 2, 3
HEADER = struct.Struct("<Q")  # body length
DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.float64}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
MAX_ID_BYTES = 1024  # a sequence id (the verifier's are ~20 bytes)
MAX_SALT_BYTES = 4096  # a cache_salt (the OpenAI routes take 1,024 characters)
MAX_ERROR_BYTES = 64 << 10
MAX_INT_BYTES = 2048  # a seed or top_k: Python's default int-from-text limit is 4300 digits (~1.8 KB)
MAX_VOCAB = 1 << 24

_U8, _U16, _U32, _F64 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<d")


class MalformedFrame(ValueError):
    """A frame that does not follow the layout or the receiver's limits."""


class FrameTooLarge(MalformedFrame):
    """A frame longer than the receiver accepts (refused from its length prefix alone)."""


@dataclass(frozen=True)
class CallLimits:
    """What a proposer accepts in one call."""

    feature_width: int | None = None  # F of features [m, F] (EAGLE); None: features are refused
    max_requests: int = 4096
    max_seq_tokens: int = 1 << 20  # token ids of one sequence (the app's max_model_len)
    max_draft_tokens: int = 4096  # num_tokens of one request
    max_released: int = 1 << 20


@dataclass(frozen=True)
class ReplyLimits:
    """What a verifier accepts back."""

    vocab_size: int | None = None  # draft tokens < vocab_size, probs [len(tokens), vocab_size]
    max_draft_tokens: int = 4096
    max_seq_tokens: int = 1 << 20  # bounds resend_features_from


# ---- writing ----------------------------------------------------------------------------------
class _Writer:
    def __init__(self, kind: int):
        self.parts: list = [b"", _U8.pack(kind)]  # parts[0]: the length prefix, set by frame()

    def u8(self, v: int) -> None:
        self.parts.append(_U8.pack(v))

    def u32(self, v: int) -> None:
        self.parts.append(_U32.pack(v))

    def f64(self, v: float) -> None:
        self.parts.append(_F64.pack(v))

    def string(self, s: str, limit: int) -> None:
        data = s.encode("utf-8")
        if len(data) > limit:
            raise MalformedFrame(f"a string of {len(data)} bytes; at most {limit}")
        self.u32(len(data))
        self.parts.append(data)

    def big_int(self, v: int) -> None:
        data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        if len(data) > MAX_INT_BYTES:
            raise MalformedFrame(f"an integer of {len(data)} bytes; at most {MAX_INT_BYTES}")
        self.parts.append(_U16.pack(len(data)))
        self.parts.append(data)

    def ints(self, values: list[int]) -> None:
        packed = array("i", values)  # raises OverflowError outside int32
        self.u32(len(packed))
        self.parts.append(packed.tobytes())

    def flag(self, present: bool) -> bool:
        self.u8(1 if present else 0)
        return present

    def tensor(self, t: torch.Tensor) -> None:
        if t.dtype not in _CODES or t.dim() != 2:
            raise MalformedFrame(f"tensors travel as 2-D float32/float16/bfloat16/float64, "
                                 f"not {t.dtype} {tuple(t.shape)}")
        t = t.detach().to("cpu").contiguous()
        self.u8(_CODES[t.dtype])
        self.u8(t.dim())
        for n in t.shape:
            self.u32(n)
        self.parts.append(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, no copy yet

    def frame(self) -> bytes:
        self.parts[0] = HEADER.pack(sum(len(p) for p in self.parts[1:]))  # bytes, or 1-D uint8 arrays
        return b"".join(self.parts)


def _write_request(w: _Writer, r: ProposeRequest) -> None:
    w.string(r.seq_id, MAX_ID_BYTES)
    w.ints(r.token_ids)
    w.u32(r.num_tokens)
    w.f64(r.temperature)
    w.big_int(r.top_k)
    w.f64(r.top_p)
    if w.flag(r.seed is not None):
        w.big_int(r.seed)
    if w.flag(r.features is not None):
        w.tensor(r.features)
    w.u32(r.features_start)
    w.u8(1 if r.tree else 0)
    if w.flag(r.cache_salt is not None):
        w.string(r.cache_salt, MAX_SALT_BYTES)
    if w.flag(r.stream_seed is not None):
        w.big_int(r.stream_seed)


def _write_draft(w: _Writer, d: Draft) -> None:
    w.ints(d.tokens)
    if w.flag(d.probs is not None):
        w.tensor(d.probs)
    if w.flag(d.parents is not None):
        w.ints(d.parents)
    if w.flag(d.resend_features_from is not None):
        w.u32(d.resend_features_from)
    w.u8(0 if d.pre_drafted is None else 1 + int(d.pre_drafted))


def encode_call(requests: list[ProposeRequest], released: list[str]) -> bytes:
    """The whole frame (length prefix included) of one propose call."""
    w = _Writer(CALL)
    w.u32(len(requests))
    for r in requests:
        _write_request(w, r)
    w.u32(len(released))
    for seq_id in released:
        w.string(seq_id, MAX_ID_BYTES)
    return w.frame()


def encode_drafts(drafts: list[Draft]) -> bytes:
    w = _Writer(DRAFTS)
    w.u32(len(drafts))
    for d in drafts:
        _write_draft(w, d)
    return w.frame()


def encode_error(message: str) -> bytes:
    w = _Writer(ERROR)
    w.string(message.encode("utf-8")[:MAX_ERROR_BYTES].decode("utf-8", "ignore"), MAX_ERROR_BYTES)
    return w.frame()


# ---- reading ----------------------------------------------------------------------------------
class _Reader:
    def __init__(self, body):
        self.view, self.pos = memoryview(body).cast("B"), 0

    def take(self, n: int) -> memoryview:
        if n > len(self.view) - self.pos:
            raise MalformedFrame(f"{n} bytes announced, {len(self.view) - self.pos} left in the frame")
        self.pos += n
        return self.view[self.pos - n: self.pos]

    def _unpack(self, s: struct.Struct):
        return s.unpack(self.take(s.size))[0]

    def u8(self) -> int:
        return self._unpack(_U8)

    def u32(self, limit: int | None = None, what: str = "a count") -> int:
        v = self._unpack(_U32)
        if limit is not None and v > limit:
            raise MalformedFrame(f"{what} of {v}; at most {limit}")
        return v

    def f64(self, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
        v = self._unpack(_F64)
        if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            raise MalformedFrame(f"{what} {v} out of range")
        return v

    def flag(self) -> bool:
        v = self.u8()
        if v > 1:
            raise MalformedFrame(f"a flag of {v}")
        return v == 1

    def string(self, limit: int) -> str:
        data = self.take(self.u32(limit, "a string length"))
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError:
            raise MalformedFrame("a string that is not UTF-8") from None

    def big_int(self) -> int:
        n = self._unpack(_U16)
        if n > MAX_INT_BYTES:
            raise MalformedFrame(f"an integer of {n} bytes; at most {MAX_INT_BYTES}")
        return int.from_bytes(self.take(n), "little", signed=True)

    def ints(self, limit: int, what: str) -> list[int]:
        n = self.u32(limit, f"{what}: a length")
        values = array("i")
        values.frombytes(self.take(4 * n))
        return values.tolist()

    def tensor(self, rows: int | None, cols: int | None, what: str) -> torch.Tensor:
        """A 2-D float tensor; rows / cols: the shape the receiver expects (None: any, up to the bytes)."""
        code, ndim = self.u8(), self.u8()
        if code not in DTYPES:
            raise MalformedFrame(f"{what}: dtype code {code} is not one of {sorted(DTYPES)}")
        if ndim != 2:
            raise MalformedFrame(f"{what}: {ndim}-D; expected 2-D")
        shape = (self.u32(), self.u32())
        if not 1 <= shape[1] <= MAX_VOCAB:  # a row has room for a vocabulary or features, not more
            raise MalformedFrame(f"{what}: rows of {shape[1]} values")
        if (rows is not None and shape[0] != rows) or (cols is not None and shape[1] != cols):
            raise MalformedFrame(f"{what}: shape {shape}; expected ({rows}, {cols}) (None: any)")
        dtype = DTYPES[code]
        raw = self.take(shape[0] * shape[1] * dtype.itemsize)  # refused here when the bytes are not there
        if not len(raw):
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)  # its own copy of the bytes

    def kind(self) -> int:
        return self.u8()

    def end(self) -> None:
        if self.pos != len(self.view):
            raise MalformedFrame(f"{len(self.view) - self.pos} bytes after the message")


def _read_request(r: _Reader, lim: CallLimits) -> ProposeRequest:
    seq_id = r.string(MAX_ID_BYTES)
    token_ids = r.ints(lim.max_seq_tokens, "token_ids")
    if token_ids and min(token_ids) < 0:
        raise MalformedFrame("token_ids: a negative id")
    num_tokens = r.u32(lim.max_draft_tokens, "num_tokens")
    temperature = r.f64("temperature", 0.0, math.inf)
    top_k = r.big_int()
    if top_k < -1:
        raise MalformedFrame(f"top_k {top_k} out of range")
    top_p = r.f64("top_p", 0.0, 1.0, lo_open=True)
    seed = r.big_int() if r.flag() else None
    features = None
    if r.flag():
        if lim.feature_width is None:
            raise MalformedFrame("features sent to a proposer that takes none")
        features = r.tensor(None, lim.feature_width, "features")
    features_start = r.u32(lim.max_seq_tokens, "features_start")
    if features is not None and features_start + len(features) > len(token_ids):
        raise MalformedFrame(f"features of positions {features_start}..{features_start + len(features)} "
                             f"beyond the sequence's {len(token_ids)} tokens")
    tree = r.flag()
    cache_salt = r.string(MAX_SALT_BYTES) if r.flag() else None
    stream_seed = r.big_int() if r.flag() else None
    return ProposeRequest(seq_id, token_ids, num_tokens, temperature, top_k, top_p, seed, features,
                          features_start, tree, cache_salt, stream_seed)


def _read_draft(r: _Reader, lim: ReplyLimits) -> Draft:
    tokens = r.ints(lim.max_draft_tokens, "draft tokens")
    vocab = lim.vocab_size or MAX_VOCAB
    if tokens and not (0 <= min(tokens) and max(tokens) < vocab):
        raise MalformedFrame(f"draft tokens outside [0, {vocab})")
    probs = r.tensor(len(tokens), lim.vocab_size, "probs") if r.flag() else None
    parents = None
    if r.flag():
        parents = r.ints(lim.max_draft_tokens, "parents")
        if len(parents) != len(tokens) or any(not -1 <= p < j for j, p in enumerate(parents)):
            raise MalformedFrame("parents: one per token, each -1 or an earlier token's index")
    resend = r.u32(lim.max_seq_tokens, "resend_features_from") if r.flag() else None
    pre_drafted = r.u8()
    if pre_drafted > 2:
        raise MalformedFrame("pre_drafted: 0, 1 or 2")
    return Draft(tokens, probs, parents, resend, None if pre_drafted == 0 else pre_drafted == 2)


def check_drafts(drafts, limits: ReplyLimits, num_requests: int) -> list[Draft]:
    """Drafts that came as Python objects (a proposer reached through Serve's handle, where the
    channel is cut or a call was too large for it) held to what decode_reply checks in a frame: one
    Draft per request, tokens in the vocabulary and at most max_draft_tokens, probs a float tensor
    [len(tokens), vocab_size], parents a tree's, resend_features_from in range. Raises MalformedFrame."""
    if not isinstance(drafts, list) or len(drafts) != num_requests or not all(isinstance(d, Draft) for d in drafts):
        raise MalformedFrame(f"expected {num_requests} drafts")
    vocab = limits.vocab_size or MAX_VOCAB
    for d in drafts:
        tokens = d.tokens
        if not isinstance(tokens, list) or len(tokens) > limits.max_draft_tokens \
                or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise MalformedFrame(f"draft tokens: at most {limits.max_draft_tokens} ints in [0, {vocab})")
        if d.probs is not None:
            p = d.probs
            if not (isinstance(p, torch.Tensor) and p.is_floating_point() and p.dim() == 2 and p.shape[0] == len(tokens)
                    and (limits.vocab_size is None or p.shape[1] == limits.vocab_size)):
                raise MalformedFrame("probs: a float tensor [len(tokens), vocab_size]")
        if d.parents is not None and (not isinstance(d.parents, list) or len(d.parents) != len(tokens)
                                      or any(type(q) is not int or not -1 <= q < j for j, q in enumerate(d.parents))):
            raise MalformedFrame("parents: one per token, each -1 or an earlier token's index")
        resend = d.resend_features_from
        if resend is not None and not (type(resend) is int and 0 <= resend <= limits.max_seq_tokens):
            raise MalformedFrame("resend_features_from out of range")
        if d.pre_drafted not in (None, True, False):
            raise MalformedFrame("pre_drafted: None or a bool")
    return drafts


def decode_call(body, limits: CallLimits) -> tuple[list[ProposeRequest], list[str]]:
    """body: a frame without its length prefix. Raises MalformedFrame."""
    r = _Reader(body)
    if r.kind() != CALL:
        raise MalformedFrame("expected a propose call")
    requests = [_read_request(r, limits) for _ in range(r.u32(limits.max_requests, "requests"))]
    released = [r.string(MAX_ID_BYTES) for _ in range(r.u32(limits.max_released, "released ids"))]
    r.end()
    return requests, released


def decode_reply(body, limits: ReplyLimits, num_requests: int) -> list[Draft]:
    """The drafts, one per request; raises RuntimeError for the handler's error, MalformedFrame
    for anything that is not a well-formed reply."""
    r = _Reader(body)
    kind = r.kind()
    if kind == ERROR:
        message = r.string(MAX_ERROR_BYTES)
        r.end()
        raise RuntimeError(f"proposer call failed: {message}")
    if kind != DRAFTS:
        raise MalformedFrame(f"expected drafts, got message kind {kind}")
    n = r.u32()
    if n != num_requests:
        raise MalformedFrame(f"{n} drafts for {num_requests} requests")
    drafts = [_read_draft(r, limits) for _ in range(n)]
    r.end()
    return drafts
