"""Does speculative decoding equal target-only decoding token for token in a given dtype?

A tiny random Llama (tests/conftest.make_tiny_model_dir, built once under /tmp), 10 prompts,
96 greedy tokens, batch of 8 slots: n-gram, a draft model with other weights, and the target as
its own draft, each against method none in the same dtype. Prints equal prompts / 10 and the
accepted drafts. Usage: python benchmarks/bf16_equality.py bfloat16   (or float32)

Session 15 (AMD EPYC, 2 cores, no AVX-512): float32 10/10 for all three; bfloat16 ngram 7/10,
draft model 6/10 (0 drafts accepted), self-draft 6/10. Session 16 traced it (same CPU): the
projections were batch-invariant in bfloat16; the CPU flash attention kernel in bfloat16 was not
(it rounds the probabilities to bfloat16 in blocks shaped by the query and key counts). With
attention computed in float32 on CPU (rayspec.model.native.attention): bfloat16 10/10, 10/10, 10/10
(40, 0 and 760 drafts accepted). On an H100 (torch 2.11) bfloat16 was 10/10 without that
(benchmarks/gpu_checks.py). Tested: tests/engine/test_numerics.py, every proposer, bf16 and fp16.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model_dir  # noqa: E402

from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

ROOT = Path("/tmp/rayspec-bf16-equality")
TARGET, DRAFT = ROOT / "model", ROOT / "draft"
PROMPTS = [f"{i} one two three four five {i} one two three four five {i} six" for i in range(8)]
PROMPTS += ["Hello there, how", "def fib(n): return"]


def main(dtype: str) -> None:
    if not (TARGET / "config.json").exists():
        make_tiny_model_dir(TARGET)
    if not (DRAFT / "config.json").exists():
        make_tiny_model_dir(DRAFT, seed=1, num_layers=1)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)

    def run(method, **spec):
        engine = LLMEngine(EngineConfig(model=str(TARGET), dtype=dtype, max_model_len=512, max_num_seqs=8,
                                        kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(
                                            method=method, num_speculative_tokens=4, adaptive=False, **spec)))
        outs = engine.generate(PROMPTS, params)
        return [o.token_ids for o in outs], sum(o.num_accepted_tokens for o in outs)

    ref, _ = run("none")
    for label, method, spec in [("ngram", "ngram", {}), ("draft model", "draft_model", {"draft_model": str(DRAFT)}),
                                ("self-draft", "draft_model", {"draft_model": str(TARGET)})]:
        got, accepted = run(method, **spec)
        equal = sum(g == r for g, r in zip(got, ref))
        print(f"{dtype} {label}: {equal}/{len(ref)} equal to target-only, {accepted} drafts accepted")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
