"""Greedy speculative output against target-only output, prompt by prompt, for every proposer, with
batch-invariant decoding (EngineConfig.batch_invariant) on and off: SmolLM2-135M-Instruct, every prompt of
a set chat-templated and decoded together (one engine step verifies them all), greedy.

Proposers: n-gram (k 5), the target's first 8 layers as a draft model (k 3), the shipped EAGLE-3 head
as chains (k 5) and as trees (top-2, 8 nodes), and an untrained EAGLE-1 head as trees (its drafts are
nearly all rejected: it exercises the verification rows, not acceptance).
Prints and records, per setting and proposer, how many prompts equal target-only output.

    python benchmarks/batch_invariance_greedy.py --dtype bfloat16 --num-prompts 20 --max-tokens 256 \
        --json benchmarks/results/batch_invariance_greedy_smollm2_bf16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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

MODEL = "smollm2-135m-instruct"


def random_eagle1_head(model, out_dir: Path) -> Path:
    """An untrained EAGLE-1 head for SmolLM2 (no EAGLE-1 head ships), saved as a checkpoint."""
    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head
    from rayspec.model.weights.hub import resolve_model_dir

    torch.manual_seed(1)
    head = build_head(new_eagle_config("eagle", resolve_model_dir(MODEL), model.args.num_layers, model.args.hidden_size))
    attach_target(head, model, has_own_embedding=False)
    return save_eagle_head(head, out_dir / "eagle1")


def proposers(model, work: Path) -> dict[str, dict]:
    eagle3 = str(assets_root() / "heads" / "smollm2-135m-eagle3")
    eagle1 = str(random_eagle1_head(model, work))
    trees = dict(eagle_topk=2, num_speculative_tokens=8, tree_max_batch=64)
    return {
        "ngram": dict(method="ngram", num_speculative_tokens=5),
        "draft_model": dict(method="draft_model", num_speculative_tokens=3, draft_num_layers=8),
        "eagle3 chain": dict(method="eagle3", num_speculative_tokens=5, draft_model=eagle3),
        "eagle3 tree": dict(method="eagle3", draft_model=eagle3, **trees),
        "eagle tree": dict(method="eagle", draft_model=eagle1, **trees),
    }


def run(loaded, spec: dict, prompts, max_tokens: int, invariant: bool, num_seqs: int) -> tuple[list, dict, float]:
    model, tokenizer = loaded
    config = EngineConfig(model=MODEL, max_num_seqs=num_seqs, max_model_len=2048, kv_cache_memory_gb=1.0,
                          batch_invariant=invariant, speculative=SpeculativeConfig(adaptive=False, **spec))
    engine = LLMEngine(config, model=model, tokenizer=tokenizer)
    started = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.token_ids for o in outs], engine.stats.as_dict(), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", default="mt_bench")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default="on,off", help="batch_invariant on, off, or both")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = loader.load_model(MODEL, dtype=args.dtype)
    engine = LLMEngine(EngineConfig(model=MODEL, speculative=SpeculativeConfig(method="none")),
                       model=loaded[0], tokenizer=loaded[1])
    prompts = [engine.encode_chat([{"role": "user", "content": t}])
               for t in load_prompts(args.prompts, args.num_prompts)]
    result = {"command": "python " + " ".join(sys.argv), "environment": environment(), "model": MODEL,
              "dtype": args.dtype, "prompts": f"{args.prompts}, first {len(prompts)}", "max_tokens": args.max_tokens,
              "decoded": f"all {len(prompts)} prompts together (max_num_seqs {len(prompts)})", "settings": {}}
    with tempfile.TemporaryDirectory() as work:
        specs = proposers(loaded[0], Path(work))
        for setting in args.settings.split(","):
            invariant = setting == "on"
            reference, _, ref_s = run(loaded, dict(method="none", num_speculative_tokens=0), prompts,
                                      args.max_tokens, invariant, len(prompts))
            rows = {"target_only_s": round(ref_s, 1)}
            for name, spec in specs.items():
                got, stats, seconds = run(loaded, spec, prompts, args.max_tokens, invariant, len(prompts))
                equal = sum(g == r for g, r in zip(got, reference))
                rows[name] = {"prompts_equal": equal, "prompts": len(prompts), "seconds": round(seconds, 1),
                              "num_drafts": stats["num_drafts"], "num_draft_tokens": stats["num_draft_tokens"],
                              "num_accepted_tokens": stats["num_accepted_tokens"],
                              "differing_prompts": [i for i, (g, r) in enumerate(zip(got, reference)) if g != r]}
                print(setting, name, rows[name], flush=True)
            result["settings"][f"batch_invariant {setting}"] = rows
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
