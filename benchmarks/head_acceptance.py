"""Greedy acceptance length of an EAGLE-3 head per shared set, with and without the lookup branch.

usage: python benchmarks/head_acceptance.py HEAD_DIR [N_PROMPTS] [MAX_TOKENS]

Drafting as the default config (k 8, topk 2, depth 4, stop 0.2); acceptance does not depend on
machine speed, so this can run next to other work. Compares heads; not a speed benchmark.
"""

import json
import sys

import torch

from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.engine.metrics import SpecDecodeStats
from rayspec.model import loader
from rayspec.sampling.sampler import SamplingParams

SETS = ("mt_bench", "humaneval", "gsm8k")


def main(head: str, num_prompts: int, max_tokens: int) -> None:
    torch.set_num_threads(1)
    model, tokenizer = loader.load_model("smollm2-135m-instruct")
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    for lookup in (0, 5):
        spec = SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=8, eagle_topk=2,
                                 num_steps=4, eagle_stop_prob=0.2, eagle_prompt_lookup=lookup)
        engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", speculative=spec, max_model_len=1024,
                                        max_num_seqs=1), model=model, tokenizer=tokenizer)
        results = {}
        for name in SETS:
            engine.stats = SpecDecodeStats()
            for prompt in load_prompts(name, num_prompts):  # a bundled set
                ids = engine.encode_chat([{"role": "user", "content": prompt}])
                engine.generate([ids], greedy)
            s = engine.stats.as_dict()
            results[name] = {"acceptance_length": round(s["mean_acceptance_length"], 2),
                             "accepted_at_depth_1_3": s["num_accepted_tokens_per_pos"][:3],
                             "steps": s["num_drafts"]}
        print(head, f"lookup {lookup}", json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5, int(sys.argv[3]) if len(sys.argv) > 3 else 96)
