#!/usr/bin/env python3
"""Write rayspec/data/prompts/unguessable.jsonl: prompts whose answers no draft can guess.

Shuffled words, nonsense words and random numbers, each with an instruction to go on in the same
random way: the model's continuation is the worst case for every proposer (an n-gram finds no
repeat, a draft model or EAGLE head guesses badly), the traffic where speculation must not lose
(issue #34; `rayspec bench sweep --prompts unguessable`). The words are the bundled MT-bench
prompts' own, shuffled. Seeded: the same file every run.

    python scripts/make_unguessable_prompts.py
"""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "rayspec" / "data" / "prompts"
COUNT, SEED = 80, 34
TEMPLATES = [
    "Continue this list of words in random order, adding about 80 more words that do not repeat any "
    "and follow no pattern:\n\n{words}",
    "Here is a scrambled passage. Keep writing it in the same scrambled way, word salad, for 100 words:\n\n{words}",
    "Continue this sequence of random numbers with 60 more, no pattern:\n\n{numbers}",
    "Invent 50 more nonsense words like these, each different, separated by spaces:\n\n{nonsense}",
]


def main() -> None:
    rng = random.Random(SEED)
    text = " ".join(json.loads(line)["turns"][0] for line in (PROMPTS_DIR / "mt_bench.jsonl").read_text().splitlines())
    vocab = sorted({w.lower() for w in re.findall(r"[A-Za-z]{3,}", text)})
    rows = []
    for i in range(COUNT):
        template = TEMPLATES[i % len(TEMPLATES)]
        words = " ".join(rng.choice(vocab) for _ in range(rng.randint(40, 80)))
        numbers = " ".join(str(rng.randint(0, 99999)) for _ in range(rng.randint(25, 45)))
        nonsense = " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 9)))
                            for _ in range(rng.randint(20, 35)))
        rows.append({"question_id": i, "category": ["shuffled", "salad", "numbers", "nonsense"][i % len(TEMPLATES)],
                     "turns": [template.format(words=words, numbers=numbers, nonsense=nonsense)]})
    out = PROMPTS_DIR / "unguessable.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()
