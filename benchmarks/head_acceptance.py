"""Greedy acceptance length of an EAGLE-3 head per shared set, with and without the lookup branch.

usage: python benchmarks/head_acceptance.py HEAD_DIR [N_PROMPTS] [MAX_TOKENS]
Drafting as the default config (k 8, topk 2, depth 4, stop 0.2); acceptance does not depend on
machine speed, so this can run next to other work. Compares heads; not a speed benchmark.
"""
import sys, json, torch
from rayspec import loader
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine import LLMEngine
from rayspec.metrics import SpecDecodeStats
from rayspec.sampling import SamplingParams
torch.set_num_threads(1)
head = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 5; T = int(sys.argv[3]) if len(sys.argv) > 3 else 96
loaded = loader.load_model("smollm2-135m-instruct")
for lookup in (0, 5):
    spec = SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=8, eagle_topk=2, num_steps=4,
                             eagle_stop_prob=0.2, eagle_prompt_lookup=lookup)
    eng = LLMEngine(EngineConfig(model="smollm2-135m-instruct", speculative=spec, max_model_len=1024, max_num_seqs=1),
                    model=loaded[0], tokenizer=loaded[1])
    res = {}
    for s in ("mt_bench", "humaneval", "gsm8k"):
        eng.stats = SpecDecodeStats()
        prompts = [json.loads(l)["turns"][0] for l in open(f"../shared/data/prompts/{s}.jsonl")][:N]
        for p in prompts:
            eng.generate([eng.encode_chat([{"role": "user", "content": p}])], SamplingParams(temperature=0, max_tokens=T))
        d = eng.stats.as_dict()
        res[s] = (round(d["mean_acceptance_length"], 2), d["num_accepted_tokens_per_pos"][:3], d["num_drafts"])
    print(head, "lookup", lookup, res, flush=True)
