"""Checks of the CUDA path that the CPU suite cannot make, for a session that is lent a GPU.

Random-weight models of SmolLM2's shapes (hidden 576, 9 query / 3 KV heads, 8,192 positions; 4
layers for the exactness runs, 30 for the memory runs), built on the spot (no download):

1. exactness in bfloat16 and float32 on CUDA: speculative output (n-gram, a 2-layer draft model,
   the target as its own draft, an EAGLE-3 head with random weights) equal to target-only output,
   token for token, 10 prompts decoded together, and the same prompts one at a time;
2. chunked prefill: one 8,000-token prompt, peak CUDA memory above the weights and KV cache
   (torch.cuda.max_memory_allocated) for max_num_batched_tokens 512 / 2048 / unchunked, and a
   chunked vs unchunked greedy output comparison;
3. which SDPA backend our attention layouts get on CUDA (decode, verification, a prefill chunk).

    python benchmarks/gpu_checks.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

VOCAB = 49152


def make_model_dir(path: Path, num_layers: int, seed: int) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits: fewer near-ties
        model.model.embed_tokens.weight.mul_(8.0)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


def make_head_dir(path: Path, target_dir: Path, target) -> Path:
    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head

    torch.manual_seed(5)
    head = build_head(new_eagle_config("eagle3", target_dir, target.args.num_layers, target.args.hidden_size))
    attach_target(head, target, has_own_embedding=False)
    return save_eagle_head(head, path, dtype=torch.float32)


def exactness(root: Path, results: dict) -> None:
    from rayspec.model import loader

    target_dir = make_model_dir(root / "target", 4, 0)
    rng = random.Random(0)
    base = [rng.randrange(3, VOCAB) for _ in range(12)]
    prompts = [base * 3 + [rng.randrange(3, VOCAB) for _ in range(n)] for n in range(8)]
    prompts += [[rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rows = []
    for dtype in ("bfloat16", "float32"):
        loaded = loader.load_model(str(target_dir), device="cuda", dtype=dtype)
        head_dir = make_head_dir(root / f"head-{dtype}", target_dir, loaded[0])

        def run(method, together: bool, **spec):
            config = EngineConfig(model=str(target_dir), device="cuda", dtype=dtype, max_model_len=1024,
                                  max_num_seqs=10, kv_cache_memory_gb=1.0,
                                  speculative=SpeculativeConfig(method=method, num_speculative_tokens=4,
                                                                adaptive=False, **spec))
            engine = LLMEngine(config, model=loaded[0], tokenizer=None)
            if together:
                outs = engine.generate(prompts, params)
            else:
                outs = [engine.generate([p], params)[0] for p in prompts]
            return [o.token_ids for o in outs], sum(o.num_accepted_tokens for o in outs)

        for together in (True, False):
            ref, _ = run("none", together)
            for label, method, spec in [
                ("ngram", "ngram", {}),
                ("draft model (first 2 layers)", "draft_model", {"draft_model": str(target_dir), "draft_num_layers": 2}),
                ("self-draft", "draft_model", {"draft_model": str(target_dir)}),
                ("eagle3 chain (random head)", "eagle3", {"draft_model": str(head_dir)}),
                ("eagle3 tree (random head)", "eagle3", {"draft_model": str(head_dir), "eagle_topk": 2,
                                                         "tree_max_batch": 16}),
            ]:
                got, accepted = run(method, together, **spec)
                equal = sum(g == r for g, r in zip(got, ref))
                row = {"dtype": dtype, "batch": "10 together" if together else "one at a time", "proposer": label,
                       "equal": f"{equal}/{len(ref)}", "accepted": accepted}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del loaded
        torch.cuda.empty_cache()
    results["exactness"] = rows


def chunked_prefill(root: Path, results: dict) -> None:
    from rayspec.model import loader

    model_dir = make_model_dir(root / "smollm2-shapes", 30, 1)
    loaded = loader.load_model(str(model_dir), device="cuda", dtype="bfloat16")
    prompt = [(i * 7919) % (VOCAB - 10) + 5 for i in range(8000)]
    rows, outputs = [], {}
    for budget in (512, 2048, None):
        config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=8192,
                              max_num_seqs=1, kv_cache_memory_gb=2.0, max_num_batched_tokens=budget,
                              speculative=SpeculativeConfig(method="none"))
        engine = LLMEngine(config, model=loaded[0], tokenizer=None)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[budget] = out.token_ids
            steps += 1
        torch.cuda.synchronize()
        row = {"max_num_batched_tokens": budget, "steps": steps, "seconds": round(time.perf_counter() - started, 2),
               "peak_above_weights_and_cache_mib": round((torch.cuda.max_memory_allocated() - baseline) / 2**20, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        torch.cuda.empty_cache()
    results["chunked_prefill"] = {"rows": rows, "outputs_equal": outputs[512] == outputs[None] == outputs[2048],
                                  "outputs": {str(k): v for k, v in outputs.items()}}
    print("chunked outputs equal:", results["chunked_prefill"]["outputs_equal"], flush=True)


def sdpa_backends(results: dict) -> None:
    from torch.nn.attention import SDPBackend

    from rayspec.model.batch_layout import additive_mask
    from rayspec.model.native import repeats_kv_heads

    names = {b.value: name for name, b in SDPBackend.__members__.items()}
    rows = []
    for label, q_len, kv_len, masked in [("decode, 1 sequence", 1, 4000, False), ("verification, 9 rows", 9, 4000, True),
                                         ("prefill chunk 2048 over 8192 keys", 2048, 8192, True)]:
        q = torch.randn(1, 9, q_len, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 3, kv_len, 64, device="cuda", dtype=torch.bfloat16)
        mask = None
        if masked:
            pos = kv_len - q_len + torch.arange(q_len, device="cuda")
            mask = additive_mask((torch.arange(kv_len, device="cuda")[None, :] <= pos[:, None])[None, None],
                                 torch.bfloat16)
        gqa = torch._fused_sdp_choice(q, k, k, mask, 0.0, False, enable_gqa=True)
        row = {"layout": label, "grouped-query call": names.get(gqa, gqa), "repeats_kv_heads": repeats_kv_heads(q, k, mask)}
        if row["repeats_kv_heads"]:
            kk = k.repeat_interleave(3, 1)
            row["after repeating KV heads"] = names.get(torch._fused_sdp_choice(q, kk, kk, mask, 0.0, False), None)
            for how, call in (("grouped-query call", lambda: torch.nn.functional.scaled_dot_product_attention(
                                  q, k, k, attn_mask=mask, enable_gqa=True)),
                              ("repeated KV heads", lambda: torch.nn.functional.scaled_dot_product_attention(
                                  q, k.repeat_interleave(3, 1), k.repeat_interleave(3, 1), attn_mask=mask))):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                call()
                torch.cuda.synchronize()
                row[f"peak MiB, {how}"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    results["sdpa"] = rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(results, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("sdpa", lambda: sdpa_backends(results)), ("chunked", lambda: chunked_prefill(Path(tmp), results)),
                         ("exactness", lambda: exactness(Path(tmp), results))):
            if name in args.skip:
                continue
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - report and go on to the next check
                import traceback
                traceback.print_exc()
                results[name + "_error"] = repr(err)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
