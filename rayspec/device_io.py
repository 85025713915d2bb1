"""The only ways data crosses between the host and the device during an engine step.

- `to_host(*tensors)`: one blocking device-to-host read of any number of tensors (on CUDA, the one
  point where the host waits for the GPU). Every read of a step goes through it, so the reads are
  counted (`host_reads`, `count_host_reads`) and a test can hold a step to a small constant number
  of them, whatever the batch size or draft length (tests/engine/test_host_syncs.py).
- `to_device(*arrays, device=...)`: host-built index arrays (block tables, positions, token ids)
  to the device without a wait: on CUDA one pinned buffer per dtype and a non-blocking copy (a
  plain `torch.tensor(list, device="cuda")` is a blocking copy, a sync of its own); on CPU the arrays
  are wrapped as they are.

- `start_read(*tensors)`: a read started now and waited for later (`PendingRead.wait`), so the host can
  queue the next step on the device before it waits for this one's tokens (overlap scheduling,
  rayspec.engine.overlap); counted when waited for.

Reads of data that only the device knows (drafted tokens, verification results) happen once per
proposer call and once per verification; everything derived from them in between stays on the
device.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

_lock = threading.Lock()
_reads = 0
_inside = threading.local()  # set while to_host itself reads (tests/engine/test_host_syncs.py lets those through)


def host_reads() -> int:
    """Device-to-host reads made through `to_host` so far (this process, all threads)."""
    return _reads


def inside_to_host() -> bool:
    return getattr(_inside, "active", False)


class count_host_reads:
    """with count_host_reads() as c: ...; c.count: the reads made inside the block."""

    def __enter__(self):
        self._start, self.count = _reads, 0
        return self

    def __exit__(self, *exc):
        self.count = _reads - self._start
        return False


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """One counted blocking read: the tensors (any shapes, one device) as numpy arrays, each its
    own dtype (integers and bools exact; floats widened to float64 only in transit when the
    tensors' dtypes differ)."""
    with _counted_read():
        if len(tensors) == 1:
            return [_numpy(tensors[0].detach().cpu())]
        dtypes = {t.dtype for t in tensors}
        wire = dtypes.pop() if len(dtypes) == 1 else (
            torch.float64 if any(t.is_floating_point() for t in tensors) else torch.int64)
        flat = torch.cat([t.detach().reshape(-1).to(wire) for t in tensors]).cpu()
        out, pos = [], 0
        for t in tensors:
            part = flat[pos: pos + t.numel()].view(t.shape)
            out.append(_numpy(part.to(t.dtype) if part.dtype != t.dtype else part))
            pos += t.numel()
        return out


@contextlib.contextmanager
def _counted_read():
    """One read: counted, and marked as routed while it runs (tests/engine/test_host_syncs.py)."""
    global _reads
    with _lock:
        _reads += 1
    _inside.active = True
    try:
        yield
    finally:
        _inside.active = False


class PendingRead:
    """A device-to-host read started now and waited for later (`start_read`): on CUDA the tensors are
    copied into pinned host memory behind the work already queued and an event marks the copy's end,
    so the host may queue more device work (the next step's forward) before it waits, and waiting
    waits for that copy only, not for what was queued after it. On CPU the tensors are at hand. Counted
    as one read (`host_reads`) when waited for."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self._shapes = [t.shape for t in tensors]
        self._dtypes = [t.dtype for t in tensors]
        self._event = None
        if tensors and tensors[0].device.type == "cuda":
            flat = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in tensors])
            self._host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._tensors = tensors

    def wait(self) -> list[np.ndarray]:
        with _counted_read():
            if self._event is None:
                return [_numpy(t.detach().cpu()) for t in self._tensors]
            self._event.synchronize()
            out, pos, flat = [], 0, self._host.numpy()
            for shape, dtype in zip(self._shapes, self._dtypes):
                n = int(np.prod(shape)) if len(shape) else 1
                out.append(flat[pos: pos + n].reshape(shape).astype(_NUMPY_INT[dtype], copy=False))
                pos += n
            return out


_NUMPY_INT = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.uint8: np.uint8}


def start_read(*tensors: torch.Tensor) -> PendingRead:
    """Start reading integer or bool tensors (one device) to the host without waiting; `.wait()` for
    their numpy arrays. One counted read, as `to_host`, made when waited for."""
    for t in tensors:
        if t.dtype not in _NUMPY_INT:
            raise TypeError(f"start_read takes integer or bool tensors, not {t.dtype}")
    return PendingRead(tensors)


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.numpy()


def to_device(*arrays: np.ndarray, device: torch.device) -> list[torch.Tensor]:
    """Host arrays as tensors on `device`, in the order given, without a blocking copy."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    out: list[torch.Tensor | None] = [None] * len(arrays)
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    for dtype, idx in groups.items():
        total = sum(arrays[i].size for i in idx)
        staging = torch.empty(total, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
        view, pos = staging.numpy(), 0
        for i in idx:
            view[pos: pos + arrays[i].size] = arrays[i].reshape(-1)
            pos += arrays[i].size
        on_device, pos = staging.to(device, non_blocking=True), 0
        for i in idx:
            out[i] = on_device[pos: pos + arrays[i].size].view(arrays[i].shape)
            pos += arrays[i].size
    return out
