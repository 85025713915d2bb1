"""A checkpoint streamed into a built model, tensor by tensor: each parameter is read from its
file (safetensors with positioned reads, or a memory-mapped pytorch_model*.bin), cast and copied to
its device, so a load never holds the weights twice. 4-bit projections (NVFP4, MXFP4) load as stored into a
model that keeps them so (rayspec.model.fp4_linear), or are dequantized as they are read (rayspec.model.formats);
MXFP4 experts (gpt-oss) load as codes and scales into a model that keeps them so,
or dequantized into one with float experts (rayspec.model.moe)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
from pathlib import Path

import torch

from rayspec.model import moe
from rayspec.model.formats import mxfp4, nvfp4
from rayspec.model.native import CausalLM
from rayspec.model.weights.files import torch_load, weight_files
from rayspec.progress import progress_bar

LOAD_PROGRESS_BYTES = 200 * 10**6  # a load this large shows a progress bar even where stderr is no terminal


# ---- filling a model's parameters ------------------------------------------------------------
#
# Each parameter is filled from its checkpoint tensor: cast to the parameter's dtype and copied to
# its device, one tensor at a time. A parameter with a `tp_shard = (dim, start, stop)` attribute
# (tensor parallelism) holds `checkpoint_tensor.narrow(dim, start, stop - start)`, and only that
# slice is read. Checkpoint tensors the model has no parameter for (layers past num_layers,
# anything outside `model.` / `lm_head.`, lm_head.weight of a model with tied embeddings, whose
# weight is embed_tokens') are skipped.

# bytes read from disk per step; what a load holds beyond the weights themselves
READ_CHUNK_BYTES = 16 << 20


def _shard_of(param: torch.Tensor) -> tuple[int, int, int] | None:
    shard = getattr(param, "tp_shard", None)
    return None if shard is None else tuple(int(v) for v in shard)


def _source_shape(name: str, shape: tuple[int, ...], shard: tuple[int, int, int] | None,
                  param: torch.Tensor) -> tuple[int, ...]:
    """The shape of what `param` takes from a checkpoint tensor of `shape` (its tp_shard slice);
    ValueError when the slice is out of range or does not fit the parameter."""
    if shard is not None:
        dim, start, stop = shard
        if not (0 <= dim < len(shape) and 0 <= start < stop <= shape[dim]):
            raise ValueError(f"{name}: tp_shard {shard} does not fit the checkpoint tensor of shape {list(shape)}")
        shape = shape[:dim] + (stop - start,) + shape[dim + 1:]
    if tuple(param.shape) != tuple(shape):
        what = f"its tp_shard {shard} of the checkpoint tensor" if shard is not None else "the checkpoint tensor"
        raise ValueError(f"{name}: the model's parameter has shape {list(param.shape)}, "
                         f"{what} has shape {list(shape)}")
    return shape


def _check_filled(model: CausalLM, filled: set[str]) -> None:
    missing = [name for name, _ in model.named_parameters() if name not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{more}")


def _copy_tensor(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Fill `param` from a whole checkpoint tensor already in memory (its tp_shard slice)."""
    shard = _shard_of(param)
    _source_shape(name, tuple(tensor.shape), shard, param)
    if shard is not None:
        dim, start, stop = shard
        tensor = tensor.narrow(dim, start, stop - start)
    param.copy_(tensor)  # casts to the parameter's dtype, moves to its device


@torch.no_grad()
def load_state(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Fill every parameter of `model` from a state dict (tensors anywhere, any float dtype)."""
    filled = set()
    for name, param in model.named_parameters():
        if name in state_dict:
            _copy_tensor(name, param, state_dict[name])
            filled.add(name)
    _check_filled(model, filled)


@torch.no_grad()
def load_checkpoint(model: CausalLM, model_dir: Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, tensor by tensor, so that
    the weights are never held twice: safetensors shards are read with plain positioned reads
    through one READ_CHUNK_BYTES buffer (a memory map would leave the pages it touched resident: a
    float32 file is twice a bfloat16 model), pytorch_model*.bin files are memory-mapped one at a
    time. ValueError names the parameters the checkpoint lacks."""
    params = dict(model.named_parameters())  # tied lm_head.weight is not here: embed_tokens' is
    fmt, files = weight_files(model_dir)
    quantization = checkpoint_quantization(model_dir, fmt)
    filled: set[str] = set()
    buffer = None
    with _load_bar(model_dir, files) as bar, contextlib.ExitStack() as stack:
        # NVFP4: a weight's scales may lie in another shard, so every shard's header is read first
        tensors = CheckpointTensors([stack.enter_context(SafetensorsReader(p)) for p in files]) if quantization else None
        quantized = nvfp4.quantized_weights(tensors.names()) if tensors is not None else set()
        # MXFP4 experts into float ones (a model built with dequantized experts): "<proj>" -> "<proj>_blocks"
        mx_float = {name: blocks for name, blocks in moe.dequantized_names(tensors.names()).items()
                    if name in params} if tensors is not None else {}
        for name, blocks in mx_float.items():
            if params[name].dim() == 2:  # a dense projection's "<module>.weight" from "<module>.weight_blocks"
                mxfp4.fill_dense(params[name], name, tensors, _shard_of(params[name]))
            else:
                moe.fill_dequantized(params[name], name, tensors, _shard_of(params[name]))
            filled.add(name)
        for path in files:
            if fmt == "safetensors":
                with SafetensorsReader(path) as reader:
                    names = reader.names()
                    bar.update(path.stat().st_size - sum(reader.nbytes(name) for name in names))  # the header
                    for name in names:  # in file order: reads go forward through the file
                        if name in quantized and name in params and params[name].dtype != torch.uint8:
                            nvfp4.fill(params[name], name, tensors, _shard_of(params[name]))  # dequantized
                            filled.add(name)
                        elif name in params and params[name].dim() == 0:  # a scalar ([] or [1] as stored)
                            params[name].copy_(reader.read(name).reshape(()))
                            filled.add(name)
                        elif name in params:
                            buffer = buffer if buffer is not None else bytearray(READ_CHUNK_BYTES)
                            reader.copy_into(name, params[name], buffer)
                            filled.add(name)
                        bar.update(reader.nbytes(name))
            else:
                filled |= _copy_bin_file(path, params)
                bar.update(path.stat().st_size)
    _check_filled(model, filled)


def checkpoint_quantization(model_dir: Path, fmt: str | None = None):
    """The checkpoint's rayspec.model.formats.Quantization when the native path loads it (NVFP4, MXFP4
    experts), None for a float checkpoint; UnsupportedQuantizationError for any other."""
    from rayspec.model.formats import SUPPORTED, UnsupportedQuantizationError, read_quantization

    quantization = read_quantization(model_dir)
    if quantization is None:
        return None
    if quantization.algo not in SUPPORTED:
        raise UnsupportedQuantizationError(f"{model_dir}: {quantization.algo} weights do not load into rayspec's "
                                           "native model")
    if fmt is not None and fmt != "safetensors":
        raise UnsupportedQuantizationError(f"{model_dir}: an {quantization.algo} checkpoint must be in safetensors")
    return quantization


def _load_bar(model_dir: Path, files: list[Path]):
    """A bar of checkpoint bytes read: shown for a large checkpoint, or any where stderr is a terminal."""
    total = sum(path.stat().st_size for path in files)
    tty = sys.stderr.isatty()
    shown = total > LOAD_PROGRESS_BYTES or tty  # a test's tiny model: no bar in its captured output
    return progress_bar(enabled=shown, total=total, desc=f"loading {Path(model_dir).name}", unit="B", unit_scale=True,
                        unit_divisor=1024, leave=not tty, mininterval=0.5 if tty else 10.0)


def _copy_bin_file(path: Path, params: dict[str, torch.Tensor]) -> set[str]:
    """Fill the parameters one pytorch_model*.bin file has (memory-mapped: unmapped on return, when
    the last of its tensors goes)."""
    filled = set()
    for name, tensor in torch_load(path).items():
        if name in params:
            _copy_tensor(name, params[name], tensor)
            filled.add(name)
    return filled


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsReader:
    """One safetensors file read with positioned reads from its header's offsets.

    Layout: 8 bytes (little-endian u64) header length N, N bytes of JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data, offsets relative to
    byte 8 + N, each tensor row-major and contiguous."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", self._read(0, 8))
            header = json.loads(self._read(8, length))
        except Exception:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        self._entries: dict[str, dict] = header

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)

    def _read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise ValueError(f"{self.path}: truncated (wanted {size} bytes at {offset}, got {len(data)})")
        return data

    def names(self) -> list[str]:
        """Tensor names in the order of their data in the file."""
        return sorted(self._entries, key=lambda name: self._entries[name]["data_offsets"][0])

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name]["data_offsets"]
        return end - begin

    def entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of tensor `name`."""
        entry = self._entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: {name} has dtype {entry['dtype']}, which rayspec cannot read")
        return dtype, tuple(entry["shape"])

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` as stored (its dtype, on the CPU), or rows r0..r1-1 and columns c0..c1-1 of a
        2-D one: only those bytes are read (one read per row when the columns are a slice)."""
        dtype, shape = self.entry(name)
        begin = self._entries[name]["data_offsets"][0] + self._data_start
        if rows is None and cols is None:
            data = bytearray(self._read(begin, math.prod(shape) * dtype.itemsize))
            return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) if data else \
                torch.empty(shape, dtype=dtype)
        n_rows, n_cols = shape
        (r0, r1), (c0, c1) = rows or (0, n_rows), cols or (0, n_cols)
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= n_cols):
            raise ValueError(f"{self.path}: rows {r0}..{r1}, columns {c0}..{c1} are outside {name} {list(shape)}")
        size = dtype.itemsize
        out = bytearray((r1 - r0) * (c1 - c0) * size)
        whole = c0 == 0 and c1 == n_cols  # whole rows: one read
        view, run = memoryview(out), len(out) if whole else (c1 - c0) * size
        for i, r in enumerate([r0] if whole else range(r0, r1)):
            offset = begin + (r * n_cols + c0) * size
            if run and os.preadv(self._fd, [view[i * run:(i + 1) * run]], offset) != run:
                raise ValueError(f"{self.path}: truncated in {name} (wanted {run} bytes at {offset})")
        return torch.frombuffer(out, dtype=torch.uint8).view(dtype).reshape(r1 - r0, c1 - c0) if out else \
            torch.empty(r1 - r0, c1 - c0, dtype=dtype)

    def copy_into(self, name: str, param: torch.Tensor, buffer: bytearray) -> None:
        """Fill `param` (contiguous, any device and float dtype) with tensor `name`, or its tp_shard
        slice, through `buffer`: only the bytes of that slice are read."""
        entry = self._entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: {name} has dtype {entry['dtype']}, which rayspec cannot read")
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.path}: {name}'s header gives {end - begin} bytes for shape {list(shape)} "
                             f"in {entry['dtype']}")
        shard = _shard_of(param)
        _source_shape(name, shape, shard, param)
        if not param.is_contiguous():
            raise ValueError(f"{name}: the model's parameter is not contiguous")
        # the slice as `outer` contiguous runs of `run` elements, `stride` elements apart:
        # shape [outer, shape[dim], inner] narrowed on its middle dim (one run for a whole tensor)
        dim, start, stop = shard if shard is not None else (0, 0, shape[0] if shape else 1)
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1:])
        run, stride = (stop - start) * inner, (shape[dim] if shape else 1) * inner
        first = start * inner
        size = dtype.itemsize
        begin += self._data_start
        dest = param.view(-1)  # [numel]
        staging = torch.frombuffer(buffer, dtype=torch.uint8)  # [READ_CHUNK_BYTES], shares `buffer`
        capacity = len(buffer) // size  # elements per buffer
        view = memoryview(buffer)
        written = held = 0  # elements of dest filled, elements waiting in the buffer

        def flush() -> None:
            nonlocal written, held
            dest[written:written + held].copy_(staging[:held * size].view(dtype))  # cast + device move
            written, held = written + held, 0

        for o in range(outer):
            done = 0
            while done < run:  # a run longer than the buffer is read in pieces
                if held == capacity:
                    flush()
                n = min(run - done, capacity - held)
                offset = begin + (o * stride + first + done) * size
                got = os.preadv(self._fd, [view[held * size:(held + n) * size]], offset)
                if got != n * size:
                    raise ValueError(f"{self.path}: truncated in {name} (wanted {n * size} bytes at {offset})")
                held, done = held + n, done + n
        if held:
            flush()


class CheckpointTensors:
    """Every tensor of a sharded safetensors checkpoint by name, whichever shard holds it (readers open)."""

    def __init__(self, readers: list[SafetensorsReader]):
        self._where = {name: reader for reader in readers for name in reader.names()}

    def names(self) -> list[str]:
        return list(self._where)

    def dtype(self, name: str) -> torch.dtype:
        return self._reader(name).entry(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader(name).entry(name)[1]

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        return self._reader(name).read(name, rows, cols)

    def _reader(self, name: str) -> SafetensorsReader:
        if name not in self._where:
            raise ValueError(f"the checkpoint has no tensor {name}")
        return self._where[name]
