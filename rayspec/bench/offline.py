"""`rayspec bench offline`: rayspec baseline vs a speculative method vs HF transformers, in-process.

All systems decode the same chat-templated prompts greedily (or, with a temperature, sampling each
prompt from the same seed), interleaved prompt by prompt
(so machine noise hits them alike); throughput is output tokens / wall time per system.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

from rayspec.bench.environment import environment
from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.progress import progress_bar
from rayspec.sampling.sampler import SamplingParams


@dataclass
class SystemRun:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0  # engine steps (rayspec engines only)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def step_ms(self) -> float | None:
        return 1000 * self.seconds / self.steps if self.steps else None


def sampling_params(batch_start: int, batch_size: int, max_tokens: int, temperature: float = 0.0,
                    num_speculative_tokens: int | None = None, seeded: bool = True) -> list[SamplingParams]:
    """One request's parameters per prompt of a batch: greedy, or at temperature > 0 seeded by the
    prompt's index (every system samples prompt i from the same seed: coupled draws, so rayspec's
    speculative and target-only runs emit the same tokens; HF's do not). seeded=False: no seed, as most
    served requests come (their drafts go through rejection sampling, which accepts more of a draft
    model's sampled drafts than coupled draws do)."""
    seed = (lambda i: None) if temperature == 0 or not seeded else (lambda i: 1000 + i)
    return [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed(batch_start + j),
                           num_speculative_tokens=num_speculative_tokens) for j in range(batch_size)]


def _run_engine(engine: LLMEngine, batch: list[list[int]], max_tokens: int, run: SystemRun,
                temperature: float = 0.0, batch_start: int = 0, num_speculative_tokens: int | None = None,
                seeded: bool = True) -> None:
    params = sampling_params(batch_start, len(batch), max_tokens, temperature, num_speculative_tokens, seeded)
    start, steps = time.perf_counter(), engine.num_steps
    outs = engine.generate(batch, params)
    run.seconds += time.perf_counter() - start
    run.steps += engine.num_steps - steps
    for out in outs:
        run.tokens += len(out.token_ids)
        run.outputs.append(out.token_ids)


def _run_hf(model, prompt_ids: list[int], max_tokens: int, run: SystemRun, eos_ids, temperature: float = 0.0,
            **kwargs) -> None:
    ids = torch.tensor([prompt_ids])
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0], **sampling, **kwargs)
    run.seconds += time.perf_counter() - start
    new = out[0, len(prompt_ids):].tolist()
    run.tokens += len(new)
    run.outputs.append(new)


def _load_hf(model_dir, num_layers: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()


def load_target(model: str, device: str = "cpu", dtype: str | None = None, tensor_parallel_size: int = 1,
                rank_launcher=None) -> tuple:
    """(target, tokenizer, eos token ids, tensor-parallel ranks or None): the one target every engine
    of a benchmark shares."""
    from rayspec.model import loader
    from rayspec.model.tp_ranks import start_tensor_parallel
    from rayspec.model.weights import hub

    ranks = None
    if tensor_parallel_size > 1:
        target, tokenizer, ranks = start_tensor_parallel(
            EngineConfig(model=model, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size),
            rank_launcher)
    else:
        target, tokenizer = loader.load_model(model, device=device, dtype=dtype)
    eos = hub.generation_eos_ids(model) | {tokenizer.eos_token_id}
    return target, tokenizer, eos, ranks


def build_engine(model: str, target, tokenizer, eos: set[int], spec: SpeculativeConfig, concurrency: int = 1,
                 device: str = "cpu", dtype: str | None = None, engine_overrides: dict | None = None) -> LLMEngine:
    """An engine on the shared target: max_num_seqs = concurrency unless engine_overrides say otherwise."""
    settings = {"max_num_seqs": max(concurrency, 1), **(engine_overrides or {})}
    config = EngineConfig(model=model, speculative=spec, device=device, dtype=dtype, **settings)
    eng = LLMEngine(config, model=target, tokenizer=tokenizer)
    eng.eos_token_ids |= eos
    return eng


def chat_prompts(engine: LLMEngine, prompts_file: str, num_prompts: int | None) -> list[list[int]]:
    """The prompt set's user messages, chat-templated."""
    return [engine.encode_chat([{"role": "user", "content": t}]) for t in load_prompts(prompts_file, num_prompts)]


def run_offline_benchmark(model: str, spec: SpeculativeConfig, prompts_file: str, num_prompts: int, max_tokens: int,
                          concurrency: int = 1, with_hf: bool = True, progress: bool = True,
                          tensor_parallel_size: int = 1, dtype: str | None = None, device: str = "cpu",
                          rank_launcher=None, engine_overrides: dict | None = None, temperature: float = 0.0,
                          seeded: bool = True) -> dict:
    """The target alone against the target with spec's proposer (and HF transformers' assisted decoding).
    temperature > 0: every system samples (prompt i seeded alike, or with seeded=False unseeded);
    greedy_match is then None.
    engine_overrides: EngineConfig fields for every engine (compile, kv_cache_memory_gb,
    max_model_len, ...: the flags `rayspec serve` takes).
    tensor_parallel_size > 1: both engines run on one tensor-parallel target (ranks started by
    rank_launcher), and a TP=1 target-only engine runs the same prompts beside them (interleaved):
    `tp1_greedy_match`, `tp_vs_tp1`, step times."""
    from rayspec.model import loader
    from rayspec.model.weights import hub

    target, tokenizer, eos, ranks = load_target(model, device, dtype, tensor_parallel_size, rank_launcher)

    def engine(spec: SpeculativeConfig, on=None) -> LLMEngine:
        return build_engine(model, on if on is not None else target, tokenizer, eos, spec, concurrency, device,
                            dtype, engine_overrides)

    baseline = engine(SpeculativeConfig(method="none", num_speculative_tokens=0))
    tp1 = None
    if tensor_parallel_size > 1:
        tp1 = engine(SpeculativeConfig(method="none", num_speculative_tokens=0),
                     on=loader.load_model(model, device=device, dtype=dtype, tokenizer=False)[0])
    speculative = engine(spec)
    prompt_ids = chat_prompts(baseline, prompts_file, num_prompts)

    method, k = spec.method, spec.num_speculative_tokens
    hf_model = hf_assistant = None
    hf_kwargs: dict = {}
    with_hf = with_hf and concurrency == 1
    if with_hf:
        model_dir = hub.resolve_model_dir(model)
        hf_model = _load_hf(model_dir)
        if method == "ngram":
            hf_kwargs = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": spec.prompt_lookup_max}
        elif method == "draft_model":  # (a float assistant even where ours is int8: transformers has no such draft)
            hf_assistant = _load_hf(hub.resolve_model_dir(spec.draft_model or model), spec.draft_num_layers)
            hf_kwargs = {"assistant_model": hf_assistant}

    # warm-up (allocations, kernel selection) outside the timed runs
    _run_engine(baseline, prompt_ids[:1], 8, SystemRun())
    _run_engine(speculative, prompt_ids[:1], 8, SystemRun())
    if tp1 is not None:
        _run_engine(tp1, prompt_ids[:1], 8, SystemRun())
    if hf_model is not None:
        _run_hf(hf_model, prompt_ids[0], 8, SystemRun(), eos)

    runs = {name: SystemRun() for name in ("baseline", "method", "hf", "hf_assisted", "baseline_c1", "tp1")}
    batches = [prompt_ids[i:i + concurrency] for i in range(0, len(prompt_ids), concurrency)]
    spec_stats_before = speculative.stats.as_dict()
    bar = progress_bar(enabled=progress, total=len(prompt_ids), desc=f"bench offline {method}", unit="prompt")
    for b, batch in enumerate(batches):
        first = b * concurrency
        _run_engine(baseline, batch, max_tokens, runs["baseline"], temperature, first, seeded=seeded)
        _run_engine(speculative, batch, max_tokens, runs["method"], temperature, first, seeded=seeded)
        if tp1 is not None:
            _run_engine(tp1, batch, max_tokens, runs["tp1"], temperature, first)
        if concurrency > 1:  # the same prompts one at a time: how well batching scales
            for j, prompt in enumerate(batch):
                _run_engine(baseline, [prompt], max_tokens, runs["baseline_c1"], temperature, first + j)
        if hf_model is not None:
            _run_hf(hf_model, batch[0], max_tokens, runs["hf"], eos, temperature)
            if method != "none":
                _run_hf(hf_model, batch[0], max_tokens, runs["hf_assisted"], eos, temperature, **hf_kwargs)
        bar.update(len(batch))
        if runs["baseline"].throughput:
            bar.set_postfix(speedup=f"{runs['method'].throughput / runs['baseline'].throughput:.2f}x")
    bar.close()
    stats = speculative.stats
    drafts = stats.num_drafts - spec_stats_before["num_drafts"]
    draft_tokens = stats.num_draft_tokens - spec_stats_before["num_draft_tokens"]
    accepted = stats.num_accepted_tokens - spec_stats_before["num_accepted_tokens"]
    base, meth, tp1_run = runs["baseline"], runs["method"], runs["tp1"]
    eagle = method in ("eagle3", "eagle")
    if ranks is not None:
        target.tp.stop()
        ranks.shutdown()
    return {
        "model": model,
        "method": method,
        "num_speculative_tokens": k,
        "adaptive": spec.adaptive,
        "draft_model": spec.draft_model,
        **{name: getattr(spec, name) if eagle else None
           for name in ("eagle_topk", "num_steps", "eagle_stop_prob", "eagle_prompt_lookup")},
        "disable_by_batch_size": spec.disable_by_batch_size,
        "speculative": asdict(spec),
        "prompts": prompts_file,
        "num_prompts": len(prompt_ids),
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "engine": {"compile": speculative.compile, "max_model_len": speculative.config.max_model_len,
                   "kv_cache_memory_gb": speculative.config.kv_cache_memory_gb, **(engine_overrides or {})},
        "total_output_tokens": meth.tokens,
        "output_throughput": meth.throughput,
        "baseline_output_throughput": base.throughput,
        "speedup": meth.throughput / base.throughput if base.throughput else None,
        "baseline_concurrency1_output_throughput": runs["baseline_c1"].throughput if concurrency > 1 else None,
        "baseline_concurrency_scaling": (base.throughput / runs["baseline_c1"].throughput
                                         if concurrency > 1 and runs["baseline_c1"].throughput else None),
        "hf_output_throughput": runs["hf"].throughput if with_hf else None,
        "hf_assisted_output_throughput": runs["hf_assisted"].throughput if with_hf and method != "none" else None,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "temperature": temperature,
        "seeded": seeded if temperature > 0 else None,
        "greedy_match": meth.outputs == base.outputs if temperature == 0 else None,
        # seeded requests draw coupled (rayspec.sampling.sampler): the speculative run emits the baseline's tokens
        "seeded_match": meth.outputs == base.outputs if temperature > 0 and seeded else None,
        "hf_greedy_match": runs["hf"].outputs == base.outputs if with_hf and temperature == 0 else None,
        "baseline_vs_hf": base.throughput / runs["hf"].throughput if with_hf and runs["hf"].throughput else None,
        "method_vs_hf_assisted": (meth.throughput / runs["hf_assisted"].throughput
                                  if with_hf and method != "none" and runs["hf_assisted"].throughput else None),
        "dtype": str(baseline.dtype).removeprefix("torch."),
        # greedy_match may be false without it, after a near-tie (EngineConfig.batch_invariant)
        "batch_invariant": baseline.runner.batch_invariant,
        "device": str(baseline.device),
        "tensor_parallel_size": tensor_parallel_size,
        "baseline_step_ms": base.step_ms,
        "method_step_ms": meth.step_ms,
        "tp1_output_throughput": tp1_run.throughput if tp1 is not None else None,
        "tp1_step_ms": tp1_run.step_ms if tp1 is not None else None,
        "tp_vs_tp1": base.throughput / tp1_run.throughput if tp1 is not None and tp1_run.throughput else None,
        "tp1_greedy_match": (base.outputs == tp1_run.outputs and meth.outputs == tp1_run.outputs
                             if tp1 is not None and temperature == 0 else None),
        "cpu_kernels": target.cpu_kernels.describe() if getattr(target, "cpu_kernels", None) else None,
        "environment": environment(),
    }


def format_result(result: dict) -> str:
    keys = ["method", "prompts", "concurrency", "temperature", "output_throughput", "baseline_output_throughput", "speedup",
            "baseline_concurrency_scaling",
            "hf_output_throughput", "hf_assisted_output_throughput", "spec_decode_acceptance_length",
            "spec_decode_acceptance_rate", "greedy_match", "batch_invariant", "seeded_match", "baseline_vs_hf",
            "method_vs_hf_assisted",
            "tensor_parallel_size", "dtype", "baseline_step_ms", "tp1_step_ms", "tp_vs_tp1", "tp1_greedy_match",
            "cpu_kernels"]
    env = result["environment"]
    return json.dumps({**{k: result[k] for k in keys}, "cpu_model": env["cpu_model"], "gpu_model": env["gpu_model"]},
                      indent=2)
