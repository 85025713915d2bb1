"""The compiled step on CPU: SmolLM2 (float32), baseline and EAGLE-3 (the shipped head), concurrency 1
and 8, eager against compiled, tokens per second after a warm-up that compiles every shape; the
two engines take turns, 3 rounds, median; outputs compared token for token.

    python benchmarks/compiled_cpu.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayspec.assets import assets_root  # noqa: E402
from rayspec.bench.environment import environment  # noqa: E402
from rayspec.bench.prompts import load_prompts  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.model import loader  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="none:1,none:8,eagle3:1,eagle3:8", help="method:concurrency, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = loader.load_model("smollm2-135m-instruct")
    head = str(assets_root() / "heads" / "smollm2-135m-eagle3")
    texts = load_prompts("mt_bench")[:8]
    rows = []
    specs = {"none": {}, "eagle3": dict(draft_model=head, eagle_topk=2, num_steps=4, eagle_stop_prob=0.2)}
    for case in args.cases.split(","):
        method, c = case.split(":")
        c, spec = int(c), specs[method]
        if True:
            engines = {}
            for compile in (False, True):
                cfg = EngineConfig(model="smollm2-135m-instruct", max_model_len=2048, max_num_seqs=8,
                                   kv_cache_memory_gb=1.0, compile=compile,
                                   speculative=SpeculativeConfig(method=method, num_speculative_tokens=8, adaptive=False,
                                                                 **spec))
                engines[compile] = LLMEngine(cfg, model=loaded[0], tokenizer=loaded[1])
            prompts = [engines[False].encode_chat([{"role": "user", "content": t}]) for t in texts[:c]]
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            t0 = time.perf_counter()
            engines[True].generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            warm = time.perf_counter() - t0
            rates, outs = {False: [], True: []}, {}
            for _ in range(3):
                for compile in (False, True):
                    t = time.perf_counter()
                    got = engines[compile].generate(prompts, params)
                    rates[compile].append(sum(len(o.token_ids) for o in got) / (time.perf_counter() - t))
                    outs[compile] = [o.token_ids for o in got]
            med = {k: sorted(v)[1] for k, v in rates.items()}
            row = {"method": method, "concurrency": c, "tok_s_eager": round(med[False], 1),
                   "tok_s_compiled": round(med[True], 1), "compiled_over_eager": round(med[True] / med[False], 2),
                   "first_compile_s": round(warm, 1),
                   "outputs_equal": f"{sum(a == b for a, b in zip(outs[False], outs[True]))}/{c}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
