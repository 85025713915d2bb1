"""Acceptance of EAGLE trees vs sampled chains for sampled requests (temperature > 0).

usage: python benchmarks/sampled_trees.py [--prompts N] [--tokens T]

Trees (tree_max_batch 2: a batch of one always drafts a tree) are verified with multi-round
rejection over siblings; tree_max_batch 0 makes the head draft chains sampled from its own
distribution. Both are lossless; this prints how many tokens each accepts per step.
"""

import argparse

import torch

from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.engine.metrics import SpecDecodeStats
from rayspec.sampling.sampler import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--file", default="humaneval", help="a bundled set or a Spec-Bench JSONL")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = load_prompts(args.file, args.prompts)
    for tree_max_batch in (0, 2):
        spec = SpeculativeConfig(method="eagle3", draft_model="heads/smollm2-135m-eagle3", num_speculative_tokens=8,
                                 eagle_topk=2, num_steps=4, eagle_stop_prob=0.2, eagle_prompt_lookup=5,
                                 tree_max_batch=tree_max_batch)
        engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", speculative=spec, max_model_len=1024,
                                        max_num_seqs=1))
        for temperature in (0.3, 1.0):
            engine.stats = SpecDecodeStats()
            for i, p in enumerate(prompts):
                ids = engine.encode_chat([{"role": "user", "content": p}])
                engine.generate([ids], SamplingParams(temperature=temperature, max_tokens=args.tokens, seed=i))
            s = engine.stats.as_dict()
            print(f"{'trees' if tree_max_batch else 'chains':>6} T={temperature}: acceptance length "
                  f"{s['mean_acceptance_length']:.2f}, accepted per position {s['num_accepted_tokens_per_pos']}")


if __name__ == "__main__":
    main()
