"""Which files of a checkpoint directory (or of a hub repo's file list) hold the weights:
*.safetensors or pytorch_model*.bin, at the top level, sharded by an index file or not."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch



class ModelNotFoundError(FileNotFoundError):
    """A model spec that names no usable checkpoint (no such directory or repo, no weights in it)."""


SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
LOOKED_FOR = (f"*.safetensors (+ {SAFETENSORS_INDEX}) or pytorch_model*.bin (+ {BIN_INDEX}), "
              "at the top level")


def weight_layout(names) -> tuple[str | None, str | None, list[str]]:
    """(format, index file, weight files) of a flat list of top-level file names. Safetensors wins over
    pytorch_model*.bin when both are there; with an index, the files are the shards it names."""
    names = set(names)
    for fmt, index, pattern in (("safetensors", SAFETENSORS_INDEX, "*.safetensors"),
                                ("bin", BIN_INDEX, "pytorch_model*.bin")):
        files = sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))
        if index in names:
            return fmt, index, []
        if files:
            return fmt, None, files
    return None, None, []


def index_shards(index_path: Path) -> list[str]:
    weight_map = json.loads(index_path.read_text()).get("weight_map") or {}
    return sorted(set(weight_map.values()))


def weight_files(model_dir: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "bin", the weight files) of a checkpoint directory: all shards named by
    model.safetensors.index.json (else every *.safetensors), or else the same for pytorch_model*.bin."""
    model_dir = Path(model_dir)
    names = [p.name for p in model_dir.iterdir() if p.is_file()] if model_dir.is_dir() else []
    fmt, index, files = weight_layout(names)
    if fmt is None:
        raise ModelNotFoundError(f"{model_dir} holds no weights (looked for {LOOKED_FOR})")
    if index is not None:
        files = index_shards(model_dir / index)
        if not files:
            raise ModelNotFoundError(f"{model_dir}: {index} names no weight files (no weight_map)")
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{model_dir}: {index} names shard {missing[0]}, which is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return fmt, [model_dir / f for f in files]


def torch_load(path: Path) -> dict:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # e.g. a checkpoint in the legacy (pre zip) format cannot be mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, safetensors or pytorch_model*.bin, on the CPU."""
    from safetensors.torch import load_file

    fmt, files = weight_files(model_dir)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device="cpu") if fmt == "safetensors" else torch_load(f))
    return state


def weight_names(model_dir: Path) -> set[str] | None:
    """The tensor names of a local checkpoint, read from safetensors headers or the shard index
    (no tensor data); None where that is not possible (pytorch_model*.bin, no weights here)."""
    try:
        fmt, files = weight_files(model_dir)
    except ModelNotFoundError:
        return None
    if fmt != "safetensors":
        return None
    index = Path(model_dir) / SAFETENSORS_INDEX
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map") or {})
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names
