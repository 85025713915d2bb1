#!/usr/bin/env python3
"""Write rayspec/data/prompts/long_documents.jsonl: long prompts, the other traffic where speculation must not lose.

Each prompt is a document of 1,400-1,800 SmolLM2 tokens (word problems from the GSM8K *train* split, never the
evaluation prompts, joined into one numbered worksheet) with a task about it: summarise it, list what it
asks, answer its last problem. Long contexts make every verified draft row read more KV, so a draft
that pays on short prompts may not here (issue #34; `rayspec bench sweep --prompts long_documents`).
Seeded: the same file every run, from the GSM8K train file (../shared/data/train/gsm8k_train.jsonl,
or --train).

    python scripts/make_long_document_prompts.py [--train PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS_DIR = REPO / "rayspec" / "data" / "prompts"
DEFAULT_TRAIN = REPO.parent / "shared" / "data" / "train" / "gsm8k_train.jsonl"
COUNT, SEED = 40, 3434
# SmolLM2's tokenizer gives about 1.45 tokens per word on these problems: 1,375-1,808 tokens (mean 1,561)
MIN_WORDS, MAX_WORDS = 950, 1200
TASKS = [
    "Summarise the worksheet above in one paragraph: what kinds of problems it holds and what they have in common.",
    "List, one line each, what every problem in the worksheet above asks for.",
    "Solve the last problem of the worksheet above, step by step.",
    "Which problems in the worksheet above are about money? Name them by number and say what each asks.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=Path, default=DEFAULT_TRAIN, help="GSM8K train JSONL (question, answer)")
    args = parser.parse_args()
    questions = [json.loads(line)["question"] for line in args.train.read_text().splitlines() if line.strip()]
    rng = random.Random(SEED)
    rows = []
    for i in range(COUNT):
        target = rng.randint(MIN_WORDS, MAX_WORDS)
        picked, words = [], 0
        while words < target:
            q = rng.choice(questions)
            picked.append(q)
            words += len(q.split())
        worksheet = "\n".join(f"{n}. {q}" for n, q in enumerate(picked, 1))
        rows.append({"question_id": i, "category": "long_document",
                     "turns": [f"Worksheet:\n\n{worksheet}\n\n{TASKS[i % len(TASKS)]}"]})
    out = PROMPTS_DIR / "long_documents.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()
