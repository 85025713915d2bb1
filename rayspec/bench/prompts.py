"""Spec-Bench style prompt files: one JSON object per line, `turns[0]` is the user message.

Three evaluation sets ship with the package (rayspec/data/prompts/, sources and licenses in its
NOTICE.md): `mt_bench`, `humaneval`, `gsm8k`, 80 prompts each, and an adversarial one of our own,
`unguessable` (80 prompts asking for more shuffled words, random numbers or nonsense words: no
draft guesses the answers; scripts/make_unguessable_prompts.py). `--prompts mt_bench` names one;
any other value is a path to a JSONL file of your own.
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPT_SETS_DIR = Path(__file__).resolve().parent.parent / "data" / "prompts"


def prompt_sets() -> list[str]:
    """Names of the bundled evaluation sets."""
    return sorted(p.stem for p in PROMPT_SETS_DIR.glob("*.jsonl"))


def prompts_path(name_or_path: str | Path) -> Path:
    """A file that exists, else the bundled set of that name (`mt_bench` or `mt_bench.jsonl`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = PROMPT_SETS_DIR / f"{path.name.removesuffix('.jsonl')}.jsonl"
    if path.parent == Path(".") and bundled.is_file():
        return bundled
    raise FileNotFoundError(f"{name_or_path}: no such file, and not a bundled prompt set ({', '.join(prompt_sets())})")


def load_prompts(name_or_path: str | Path, num_prompts: int | None = None) -> list[str]:
    path = prompts_path(name_or_path)
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
