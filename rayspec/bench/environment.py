"""What a benchmark figure depends on besides the code: the machine and the library versions.

The same code measured 1.6x HF transformers on one CPU and 0.8x on another, so every benchmark
JSON carries this record under "environment". Nothing here imports Ray or transformers (the
versions come from the installed distributions), so `bench serve` stays a light client.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# the CPU features that decide which matmul kernels run
CPU_FEATURES = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def cpu_model() -> tuple[str, list[str]]:
    """(lscpu's "Model name", else /proc/cpuinfo's, else platform.processor(); the CPU_FEATURES it has)."""
    fields: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    except (OSError, subprocess.SubprocessError):
        pass
    if "Model name" not in fields and Path("/proc/cpuinfo").is_file():
        names = {"model name": "Model name", "flags": "Flags"}  # /proc/cpuinfo's keys -> lscpu's
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in names:
                fields.setdefault(names[key.strip()], value.strip())
    name = fields.get("Model name") or platform.processor() or platform.machine()
    return name, sorted(set(fields.get("Flags", "").split()) & CPU_FEATURES)


def gpu_models() -> list[str]:
    """Names of the visible CUDA devices: torch's where it is loaded and sees them, else nvidia-smi's."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def rayspec_version() -> str | None:
    """The installed version of the distribution that provides the `rayspec` package, whatever its name."""
    for dist in metadata.packages_distributions().get("rayspec", []):
        if version(dist):
            return version(dist)
    return None


def rayspec_commit() -> str | None:
    """The git commit of a source checkout (None for an installed wheel), "+dirty" with local changes."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def environment() -> dict:
    """The record: CPU, GPUs, library versions, python, torch's thread count (where torch is loaded)."""
    cpu, features = cpu_model()
    torch = sys.modules.get("torch")
    gpus = gpu_models()
    return {
        "cpu_model": cpu,
        "cpu_features": features,
        "cpu_count": os.cpu_count(),
        "gpu_model": gpus[0] if gpus else None,
        "gpu_count": len(gpus),
        "cuda": getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None,
        "torch": version("torch"),
        "transformers": version("transformers"),
        "ray": version("ray"),
        "rayspec": rayspec_version(),
        "rayspec_commit": rayspec_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
    }
