"""The only ways data crosses between the host and the device during an engine step.

- `to_host(*tensors)`: one blocking device-to-host read of any number of tensors (on CUDA, the one
  point where the host waits for the GPU). Every read of a step goes through it, so the reads are
  counted (`host_reads`, `count_host_reads`) and a test can hold a step to a small constant number
  of them, whatever the batch size or draft length (tests/engine/test_host_syncs.py).
- `to_device(*arrays, device=...)`: host-built index arrays (block tables, positions, token ids)
  to the device without a wait: on CUDA one pinned buffer per dtype and a non-blocking copy (a
  plain `torch.tensor(list, device="cuda")` is a blocking copy, a sync of its own); on CPU the arrays
  are wrapped as they are.

Reads of data that only the device knows (drafted tokens, verification results) happen once per
proposer call and once per verification; everything derived from them in between stays on the
device.
"""

from __future__ import annotations

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
    global _reads
    with _lock:
        _reads += 1
    _inside.active = True
    try:
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
    finally:
        _inside.active = False


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
