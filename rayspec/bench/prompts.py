"""Spec-Bench style prompt files: one JSON object per line, `turns[0]` is the user message."""

from __future__ import annotations

import json
from pathlib import Path


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[str]:
    prompts = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            turns = record.get("turns") or [record.get("prompt") or record.get("question")]
            prompts.append(turns[0])
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
