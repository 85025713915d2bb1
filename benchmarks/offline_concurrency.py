"""Speculation against the baseline at a fixed number of requests in flight, offline (no Ray).

usage: python benchmarks/offline_concurrency.py CONCURRENCY N_PROMPTS ROUNDS SETS [NAME='{"field": value}' ...]

Continuous batching as served: CONCURRENCY requests stay in flight until N_PROMPTS of each set
(comma-separated shared set names) are done; greedy, 128 tokens, 2 torch threads. Engines: `base`
(no speculation), `eagle_d3` (the default config's EAGLE-3 drafting, off at batch >= 3) and
`eagle_all` (the same drafting at every batch size: trees at batch <= 2, adaptive chains above),
plus any NAME given as SpeculativeConfig fields over the default's. Rounds rotate the order;
throughput is summed tokens over summed time.
"""

import json
import sys
import time

import torch

from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.engine.metrics import SpecDecodeStats
from rayspec.model import loader
from rayspec.sampling.sampler import SamplingParams

EAGLE = dict(method="eagle3", draft_model="heads/smollm2-135m-eagle3", num_speculative_tokens=8, eagle_topk=2,
             num_steps=4, eagle_stop_prob=0.2, eagle_prompt_lookup=5)


def run(engine: LLMEngine, prompts: list[str], concurrency: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=128)
    queue = [engine.encode_chat([{"role": "user", "content": p}]) for p in reversed(prompts)]
    tokens, start = 0, time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_running + engine.num_waiting < concurrency:
            engine.add_request(queue.pop(), params)
        tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
    return tokens, time.perf_counter() - start


def main(concurrency: int, num_prompts: int, rounds: int, sets: list[str], extra: list[str]) -> None:
    torch.set_num_threads(2)
    model, tokenizer = loader.load_model("smollm2-135m-instruct")
    configs = {"base": {"method": "none"}, "eagle_d3": dict(EAGLE, disable_by_batch_size=3), "eagle_all": EAGLE}
    for item in extra:
        name, fields = item.split("=", 1)
        configs[name] = dict(EAGLE, **json.loads(fields))
    engines = {name: LLMEngine(EngineConfig(model="smollm2-135m-instruct", speculative=SpeculativeConfig(**c),
                                            max_model_len=2048, max_num_seqs=8), model=model, tokenizer=tokenizer)
               for name, c in configs.items()}
    prompts = [p for s in sets for p in load_prompts(s, num_prompts)]  # bundled sets
    for engine in engines.values():  # warm-up (oneDNN packing, first-use allocations)
        run(engine, prompts[:concurrency], concurrency)
        engine.stats = SpecDecodeStats()
    totals = {name: [0, 0.0] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            tokens, seconds = run(engines[name], prompts, concurrency)
            totals[name][0] += tokens
            totals[name][1] += seconds
            print(f"round {r + 1} {name}: {tokens / seconds:.1f} tok/s", flush=True)
    base = totals["base"][0] / totals["base"][1]
    for name, (tokens, seconds) in totals.items():
        stats = engines[name].stats.as_dict()
        print(f"{name}: {tokens / seconds:.1f} tok/s, {tokens / seconds / base:.3f}x base, "
              f"acceptance length {stats.get('mean_acceptance_length', 0.0):.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), sys.argv[5:])
