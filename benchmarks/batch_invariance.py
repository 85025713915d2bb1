"""What batch-invariant decoding (EngineConfig.batch_invariant) costs on CPU, as ratios measured in one
process, the two settings taking turns (A/B interleaved) on the same loaded SmolLM2:

- step: one decode or verification forward of the target (forward, logits, the argmax read back),
  `batch` sequences of `rows` rows each after `context` cached tokens, each setting on a runner of its
  own; the median of `--repeats` each, and on / off.
- offline: tokens per second of the engine, `rayspec bench offline`'s loop (chat-templated mt_bench
  prompts, greedy, one at a time), for each method with batch_invariant on and off, prompt by prompt
  in turn; and whether both emitted the same tokens.

    python benchmarks/batch_invariance.py --json benchmarks/results/batch_invariance_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from rayspec.model.runner import make_runner  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
CASES = [(1, 1), (1, 6), (4, 1), (4, 6), (16, 1), (16, 6)]  # (sequences, rows each): decode, a k=5 verification
CONTEXTS = (128, 512)


def step_costs(model, repeats: int) -> list[dict]:
    """Median seconds of one static forward + logits + argmax read, batch_invariant off and on."""
    num_seqs = max(b for b, _ in CASES)
    runners = {on: make_runner(model, 1024, num_seqs, slack=8, batch_invariant=on) for on in (False, True)}
    vocab, rows_out = model.args.vocab_size, []
    g = torch.Generator().manual_seed(0)
    for context in CONTEXTS:
        prompts = [torch.randint(3, vocab, (context,), generator=g).tolist() for _ in range(num_seqs)]
        for on, runner in runners.items():
            model.set_batch_invariant(on)
            for i, p in enumerate(prompts):
                runner.kv.allocate(f"s{i}")
                with torch.inference_mode():
                    runner.forward_hidden([f"s{i}"], [p])
        for batch, rows in CASES:
            ids = [f"s{i}" for i in range(batch)]
            tokens = [torch.randint(3, vocab, (rows,), generator=g).tolist() for _ in ids]
            times = {False: [], True: []}
            for r in range(repeats + 2):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    model.set_batch_invariant(on)  # (the switch itself outside the timing)
                    runner = runners[on]
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        hidden, _ = runner.forward_hidden(ids, tokens, packed=True, static=True, advance=False)
                        model.logits(hidden).argmax(-1).tolist()
                        elapsed = time.perf_counter() - t0
                    if r >= 2:  # the first two rounds warm up
                        times[on].append(elapsed)
            off_ms, on_ms = (statistics.median(times[k]) * 1e3 for k in (False, True))
            rows_out.append({"context": context, "batch": batch, "rows": rows, "off_ms": round(off_ms, 3),
                             "on_ms": round(on_ms, 3), "on_over_off": round(on_ms / off_ms, 3)})
            print(rows_out[-1], flush=True)
        for runner in runners.values():
            for i in range(num_seqs):
                runner.kv.free(f"s{i}")
    return rows_out


def offline(loaded, method: str, spec: dict, num_prompts: int, max_tokens: int, rounds: int) -> dict:
    """tokens/s of method with batch_invariant off and on, prompt by prompt in turn."""
    model, tokenizer = loaded
    engines = {on: LLMEngine(EngineConfig(model=MODEL, max_num_seqs=1, max_model_len=2048, kv_cache_memory_gb=0.5,
                                          batch_invariant=on, speculative=SpeculativeConfig(method=method, **spec)),
                             model=model, tokenizer=tokenizer) for on in (False, True)}
    prompts = [engines[False].encode_chat([{"role": "user", "content": t}])
               for t in load_prompts("mt_bench")[:num_prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for engine in engines.values():
        engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    tokens, seconds, outputs = {False: 0, True: 0}, {False: 0.0, True: 0.0}, {False: [], True: []}
    for r in range(rounds):
        for i, p in enumerate(prompts):
            for on in ((False, True) if (r + i) % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                [out] = engines[on].generate([p], params)
                seconds[on] += time.perf_counter() - t0
                tokens[on] += len(out.token_ids)
                if r == 0:
                    outputs[on].append(out.token_ids)
    rate = {on: tokens[on] / seconds[on] for on in (False, True)}
    row = {"method": method, "spec": spec, "prompts": num_prompts, "max_tokens": max_tokens, "rounds": rounds,
           "off_tok_s": round(rate[False], 2), "on_tok_s": round(rate[True], 2),
           "on_over_off": round(rate[True] / rate[False], 3),
           "prompts_equal_on_vs_off": sum(a == b for a, b in zip(outputs[False], outputs[True]))}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-offline", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    head = str(assets_root() / "heads" / "smollm2-135m-eagle3")
    methods = {"ngram": dict(num_speculative_tokens=5), "eagle3": dict(num_speculative_tokens=5, draft_model=head)}
    result = {"command": "python " + " ".join(sys.argv), "environment": environment(), "threads": args.threads,
              "dtypes": {}}
    for dtype in args.dtypes.split(","):
        loaded = loader.load_model(MODEL, dtype=dtype)
        entry = {"cpu_kernels": loaded[0].cpu_kernels.describe(), "step": step_costs(loaded[0], args.repeats)}
        entry["invariant_kernels"] = loaded[0].invariant_kernels.describe()
        if not args.no_offline:
            entry["offline"] = [offline(loaded, m, spec, args.prompts, args.max_tokens, args.rounds)
                                for m, spec in methods.items()]
        result["dtypes"][dtype] = entry
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
