"""Progress bars for the long waits (download, GGUF conversion, load, benchmarks), on stderr.

RAYSPEC_NO_PROGRESS=1 turns every one of them off (logs, CI); `quiet` callers pass
enabled=False.
"""

from __future__ import annotations

import os

from tqdm import tqdm


def progress_enabled() -> bool:
    return os.environ.get("RAYSPEC_NO_PROGRESS", "").strip().lower() not in ("1", "true", "yes")


def progress_bar(*, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm on stderr, disabled where RAYSPEC_NO_PROGRESS is set or `enabled` is false."""
    return tqdm(disable=not (enabled and progress_enabled()), dynamic_ncols=True, **kwargs)
