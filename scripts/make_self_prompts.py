#!/usr/bin/env python3
"""Let the target model write user prompts for head training (self-written instructions).

An instruction-tuned model, given its chat template up to the start of a user turn and
nothing else, samples a user message like the ones it was aligned on (the "Magpie" idea).
Those are open-ended assistant requests, the kind the templated prompts of
`make_train_prompts.py` (rayspec/eagle/prompt_pools.py) cover worst, and they come from the target's own idea of a user,
so no outside dataset is needed.

    python scripts/make_self_prompts.py --count 1500        # -> data/train/self_prompts.jsonl

Each request is sampled with its own seed (temperature 1, top-p 0.95): the file is
reproducible with the same torch build. Kept: messages that ended on their own (not cut by
the token cap), 4-150 words, plain text (almost all ASCII), not a repeat, at most
`--max-per-opening` sharing their first four words, and no 8-word sequence in common with
an evaluation prompt (the bundled sets in rayspec/data/prompts/, the same check as
`make_train_prompts.py`; here an overlapping prompt is dropped, not fatal).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rayspec.eagle.prompt_pools import eval_shingles, shingles  # noqa: E402


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins."""
    marker = "\x00MSG\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


class Filter:
    def __init__(self, max_per_opening: int):
        self.seen: set[str] = set()
        self.openings: Counter = Counter()
        self.max_per_opening = max_per_opening
        self.eval = set(eval_shingles())
        self.dropped: Counter = Counter()

    def keep(self, text: str, finish_reason: str) -> bool:
        text = text.strip()
        words = text.split()
        key = " ".join(re.findall(r"[a-z0-9]+", text.lower()))
        opening = " ".join(key.split()[:4])
        reason = None
        if finish_reason != "stop":
            reason = "cut at the token cap"
        elif not 4 <= len(words) <= 150:
            reason = "length"
        elif sum(not c.isascii() for c in text) > 0.02 * len(text) or "<|" in text:
            reason = "not plain text"
        elif key in self.seen:
            reason = "repeat"
        elif self.openings[opening] >= self.max_per_opening:
            reason = "common opening"
        elif shingles(text) & self.eval:
            reason = "overlaps an evaluation prompt"
        if reason:
            self.dropped[reason] += 1
            return False
        self.seen.add(key)
        self.openings[opening] += 1
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--count", type=int, default=1500, help="prompts to keep")
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "train" / "self_prompts.jsonl")
    ap.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-per-opening", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()

    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.model.loader import load_model
    from rayspec.sampling.sampler import SamplingParams

    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    engine = LLMEngine(EngineConfig(model=args.model, speculative=SpeculativeConfig(method="none"),
                                    max_num_seqs=16, max_model_len=512), model=model, tokenizer=tokenizer)
    prefix = user_turn_prefix(tokenizer)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    filt = Filter(args.max_per_opening)
    kept: dict[int, str] = {}  # request index -> prompt (written in index order: reproducible)
    next_index, finished, in_flight = 0, 0, {}
    with tqdm(total=args.count, desc="self prompts", unit="prompt") as bar:
        while len(kept) < args.count:
            while engine.num_waiting < engine.num_slots:
                params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                        seed=args.seed + next_index, stop_token_ids=[end_of_turn])
                in_flight[engine.add_request(prefix, params)] = next_index
                next_index += 1
            for out in engine.step():
                if out.finished:
                    finished += 1
                    i = in_flight.pop(out.request_id)
                    if filt.keep(out.text, out.finish_reason):
                        kept[i] = out.text.strip()
                        bar.update(1)
    rows = [kept[i] for i in sorted(kept)][: args.count]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for n, text in enumerate(rows):
            f.write(json.dumps({"question_id": f"self-{n}", "category": "self-written", "turns": [text]},
                               ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(rows)} prompts from {finished} samples; dropped: {dict(filt.dropped)}")


if __name__ == "__main__":
    main()
