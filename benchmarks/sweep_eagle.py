"""Interleaved sweep of drafting configurations against the baseline (offline, greedy, c1).

usage: python benchmarks/sweep_eagle.py THREADS SETS N [CONFIG,...]
  e.g. python benchmarks/sweep_eagle.py 2 mt_bench,humaneval,gsm8k 5
  CONFIG@HEAD_DIR runs CONFIG with another head (to compare heads):
  python benchmarks/sweep_eagle.py 2 mt_bench 10 k8t2s4_p.2_L5,k8t2s4_p.2_L5@/tmp/new-head

All engines share one target in memory; per prompt every configuration runs back to back, so
drift in machine speed hits them alike. Prints speedup over `none` and acceptance length, and
flags any output that differs from the baseline's.
"""

import sys

import torch

from rayspec.bench.offline import SystemRun, _run_engine
from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.model import loader
from rayspec.model.weights import hub

HEAD = "heads/smollm2-135m-eagle3"


def eagle(k, topk, depth, stop=0.0, lookup=0):
    return dict(method="eagle3", draft_model=HEAD, num_speculative_tokens=k, eagle_topk=topk, num_steps=depth,
                eagle_stop_prob=stop, eagle_prompt_lookup=lookup)


CONFIGS = {
    "none": dict(method="none", num_speculative_tokens=0),
    "ngram": dict(method="ngram", num_speculative_tokens=5),
    "k6t2s4": eagle(6, 2, 4),
    "k6t2s4_p.1": eagle(6, 2, 4, 0.1),
    "k6t2s4_p.2": eagle(6, 2, 4, 0.2),
    "k6t2s4_p.1_L3": eagle(6, 2, 4, 0.1, 3),
    "k6t2s4_p.3_L3": eagle(6, 2, 4, 0.3, 3),
    "k8t2s5_p.1_L4": eagle(8, 2, 5, 0.1, 4),
    "k8t2s4_p.2_L5": eagle(8, 2, 4, 0.2, 5),
    "k8t3s4_p.2_L4": eagle(8, 3, 4, 0.2, 4),
    "k10t2s5_p.2_L5": eagle(10, 2, 5, 0.2, 5),
    "k12t3s5_p.1_L5": eagle(12, 3, 5, 0.1, 5),
}


def config(name: str) -> dict:
    base, _, head = name.partition("@")
    return {**CONFIGS[base], "draft_model": head} if head else CONFIGS[base]


def main(threads: int, sets: list[str], n: int, names: list[str], max_tokens: int = 128) -> None:
    torch.set_num_threads(threads)
    names = ["none"] + [x for x in names if x != "none"]
    target, tokenizer = loader.load_model("default", device="cpu")
    eos = hub.generation_eos_ids("default") | {tokenizer.eos_token_id}
    engines = {}
    for name in names:
        engine = LLMEngine(EngineConfig(model="default", speculative=SpeculativeConfig(**config(name)), device="cpu",
                                        max_num_seqs=1), model=target, tokenizer=tokenizer)
        engine.eos_token_ids |= eos
        engines[name] = engine
    for s in sets:
        texts = load_prompts(s, n)  # a bundled set
        ids = [engines["none"].encode_chat([{"role": "user", "content": t}]) for t in texts]
        for engine in engines.values():  # warm-up
            _run_engine(engine, ids[:1], 8, SystemRun())
        runs = {name: SystemRun() for name in engines}
        before = {name: e.stats.as_dict() for name, e in engines.items()}
        for prompt in ids:
            for name, engine in engines.items():
                _run_engine(engine, [prompt], max_tokens, runs[name])
        base = runs["none"]
        line = [f"{s:9s} none {base.throughput:5.1f} tok/s"]
        for name, engine in engines.items():
            if name == "none":
                continue
            after = engine.stats.as_dict()
            drafts = after["num_drafts"] - before[name]["num_drafts"]
            accepted = after["num_accepted_tokens"] - before[name]["num_accepted_tokens"]
            same = "" if runs[name].outputs == base.outputs else " MISMATCH"
            line.append(f"{name} {runs[name].throughput / base.throughput:.2f}x al={1 + accepted / max(drafts, 1):.2f}{same}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]),
         sys.argv[4].split(",") if len(sys.argv) > 4 else list(CONFIGS))
