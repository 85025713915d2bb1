"""Share of the target's greedy output tokens that an EAGLE-3 head's draft vocabulary holds, per shared set.

usage: python benchmarks/draft_vocab_coverage.py HEAD_DIR [HEAD_DIR ...] [--prompts-dir DIR] [--num-prompts N]

A token outside the draft vocabulary can never be drafted, so this bounds what the head can accept.
Same prompts and decoding as the offline benchmark (chat template, greedy, 128 new tokens).
"""

import argparse
import json
from pathlib import Path

import torch

from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig
from rayspec.eagle.checkpoint import read_state_dict
from rayspec.engine.llm_engine import LLMEngine
from rayspec.model.weights.hub import resolve_model_dir
from rayspec.sampling.sampler import SamplingParams

SETS = ("mt_bench", "humaneval", "gsm8k")


def draft_vocabulary(head_dir: str) -> torch.Tensor | None:
    """[vocab] bool: the head's t2d; None for a head without a reduced vocabulary."""
    state = read_state_dict(resolve_model_dir(head_dir))
    return state["t2d"].bool() if "t2d" in state else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--prompts-dir", default=None, help="default: the bundled sets")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    vocabs = {h: draft_vocabulary(h) for h in args.heads}
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=2048, max_num_seqs=8))
    result = {}
    for name in SETS:
        texts = load_prompts(Path(args.prompts_dir, f"{name}.jsonl") if args.prompts_dir else name, args.num_prompts)
        prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        tokens = torch.tensor([t for o in outs for t in o.token_ids])  # [T]
        for head, t2d in vocabs.items():
            share = 1.0 if t2d is None else t2d[tokens].float().mean().item()
            result.setdefault(head, {})[name] = {"tokens": len(tokens), "in_draft_vocab": round(share, 3),
                                                 "draft_vocab_size": None if t2d is None else int(t2d.sum())}
    for head, sets in result.items():
        print(head, json.dumps(sets))


if __name__ == "__main__":
    main()
