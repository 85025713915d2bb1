"""Helpers shared by the core engine tests (not a test module)."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.drafting import ModelledCosts
from rayspec.engine.llm_engine import LLMEngine, RequestOutput
from rayspec.model import loader
from rayspec.proposers.base import Draft, Proposer
from rayspec.sampling.sampler import SamplingParams
from planner_costs import MODELLED_COSTS  # noqa: F401 - the tests' modelled costs, named here too

# One intra-op thread: these models are small, and on a 2-core machine that also runs other
# work, two spinning OpenMP threads make each step 3-30x slower (measured), one never does.
torch.set_num_threads(int(os.environ.get("RAYSPEC_TEST_THREADS", "1")))


# RAYSPEC_TEST_COMPILE=1: every engine these tests build runs the compiled step (a one-off check of
# the greedy and distribution tests through it; slow on CPU: every shape compiles)
TEST_COMPILE = True if os.environ.get("RAYSPEC_TEST_COMPILE", "").strip() in ("1", "true") else None


def make_engine(model: str | Path, method: str = "none", k: int = 4, adaptive: bool = True,
                max_model_len: int = 256, max_num_seqs: int = 8, loaded=None, proposer=None,
                kv_cache_memory_gb: float = 2.0, measured_costs: bool = False,
                max_num_batched_tokens: int | None = 2048, engine_seed: int | None = None,
                enable_prefix_caching: bool = True, compile: bool | None = None, **spec) -> LLMEngine:
    """An engine on `model`; `loaded=(model, tokenizer)` reuses weights already in memory.
    The production defaults are on, as in EngineConfig and the served fixture (serve_utils.tiny_args):
    the adaptive draft planner and prefix caching (issue #53, item 5). A test that needs one off
    passes `adaptive=False` / `enable_prefix_caching=False` with a comment saying why (typically: it
    counts the drafts, steps or cached blocks of a fixed budget, or needs drafts verified on every
    step where the planner would stop drafting after the first rejections).
    engine_seed: EngineConfig.seed (unseeded sampled requests draw reproducible streams).
    compile: EngineConfig.compile (None: the suite's, TEST_COMPILE).

    With `adaptive`, the draft planner weighs modelled step costs (MODELLED_COSTS, the config's
    `draft_costs`), so the budgets it picks, and every count a test asserts, are the same on a
    loaded machine as on an idle one; `measured_costs=True` keeps the host timers."""
    if adaptive and not measured_costs:
        spec.setdefault("draft_costs", MODELLED_COSTS)
    config = EngineConfig(model=str(model), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          kv_cache_memory_gb=kv_cache_memory_gb, max_num_batched_tokens=max_num_batched_tokens,
                          compile=TEST_COMPILE if compile is None else compile, seed=engine_seed, enable_prefix_caching=enable_prefix_caching,
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                        adaptive=adaptive, **spec))
    if loaded is None:
        return LLMEngine(config, proposer=proposer)
    return LLMEngine(config, model=loaded[0], tokenizer=loaded[1], proposer=proposer)




def modelled_step_costs(engine: LLMEngine, costs: dict | None = None) -> LLMEngine:
    """The draft planner (rayspec.engine.drafting) times steps on the wall clock, which makes the budgets
    it picks depend on how busy the machine is. Here it weighs a cost model instead (MODELLED_COSTS:
    base + per verified row), so it still trades acceptance against cost, deterministically."""
    engine.planner.costs = ModelledCosts(costs or MODELLED_COSTS)
    return engine


def run_to_completion(engine: LLMEngine, done: dict[str, RequestOutput] | None = None,
                      max_steps: int = 10_000) -> dict[str, RequestOutput]:
    done = {} if done is None else done
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def run_alone(engine: LLMEngine, prompts, params: SamplingParams) -> list[list[int]]:
    """Each prompt on its own (batch size 1), one after the other."""
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def run_batch(engine: LLMEngine, prompts, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(list(prompts), params)]


def run_joining(engine: LLMEngine, prompts, params: SamplingParams, first: int = 2,
                steps_before_join: int = 3) -> list[list[int]]:
    """Start `first` requests, step a few times, then add the rest while those are mid-decode."""
    ids = [engine.add_request(p, params) for p in prompts[:first]]
    done: dict[str, RequestOutput] = {}
    for _ in range(steps_before_join):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.num_running > 0, "the first requests finished before the others joined"
    ids += [engine.add_request(p, params) for p in prompts[first:]]
    run_to_completion(engine, done)
    return [done[i].token_ids for i in ids]


@functools.lru_cache(maxsize=None)
def cached_model(spec: str, num_layers: int | None = None):
    """(model, tokenizer), loaded once per process and shared by every test module."""
    return loader.load_model(spec, num_layers=num_layers)


@functools.lru_cache(maxsize=None)
def greedy_reference(spec: str, prompt: str, max_tokens: int) -> tuple[int, ...]:
    """Target-only greedy output of one prompt run alone (cached across modules)."""
    engine = make_engine(spec, "none", loaded=cached_model(spec))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return tuple(engine.generate([prompt], params)[0].token_ids)


@functools.lru_cache(maxsize=None)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def assert_target_logprobs(model_dir, prompt_ids: list[int], out: RequestOutput, num_top: int,
                           atol: float = 1e-3) -> None:
    """`out.logprobs` are the target's raw log-probabilities of `out.token_ids` given everything
    before them, with the `num_top` most likely tokens, as an independent forward computes them
    (transformers' Llama over prompt + output)."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ids = torch.tensor([list(prompt_ids) + list(out.token_ids)])
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(ids).logits[0].float()  # [P + T, vocab]
    expected = logits[len(prompt_ids) - 1: -1].log_softmax(-1)  # [T, vocab]: row j predicts output token j
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == tok
        assert abs(entry.logprob - float(expected[j, tok])) < atol, (j, entry.logprob, float(expected[j, tok]))
        assert len(entry.top) == num_top
        values, _ = expected[j].topk(num_top)
        assert all(abs(got - want) < atol for (_, _, got), want in zip(entry.top, values.tolist())), j
        for t, _, v in entry.top:  # each alternative's own value is the target's too
            assert abs(v - float(expected[j, t])) < atol


def binomial_interval(p: float, n: int, delta: float = 1e-4) -> tuple[float, float]:
    """Where the frequency of an event of probability p over n independent trials falls with
    probability > 1 - delta (Chernoff's relative-entropy bound on each tail; tight for small p,
    unlike Hoeffding's)."""
    def kl(q: float) -> float:
        q = min(max(q, 1e-12), 1 - 1e-12)
        pp = min(max(p, 1e-12), 1 - 1e-12)
        return q * math.log(q / pp) + (1 - q) * math.log((1 - q) / (1 - pp))

    target = math.log(2 / delta) / n

    def solve(lo: float, hi: float, upper: bool) -> float:
        for _ in range(60):  # bisection: the point where n * KL reaches log(2 / delta)
            mid = (lo + hi) / 2
            if (kl(mid) < target) == upper:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    return solve(0.0, p, upper=False), solve(p, 1.0, upper=True)


def submit_all(loop, prompts: dict, params: SamplingParams, timeout: float) -> dict[str, list]:
    """Submit each prompt to an EngineLoop under its request id and wait for all to finish (their last
    output, or the exception they ended with): every item delivered, per request id."""
    import threading

    got: dict[str, list] = {}
    finished = threading.Semaphore(0)

    def deliver_to(rid):
        def deliver(item):
            got.setdefault(rid, []).append(item)
            if isinstance(item, Exception) or item.finished:
                finished.release()
        return deliver

    for rid, prompt in prompts.items():
        loop.submit(rid, prompt, params, deliver_to(rid))
    for _ in prompts:
        assert finished.acquire(timeout=timeout)
    return got


class OracleProposer(Proposer):
    """Drafts the expected output itself (so long drafts are accepted and later rows matter), as a
    chain, or as a tree whose true path is interleaved with wrong siblings."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], k: int, wrong: int, force_tree: bool = False):
        self.expected, self.k, self.wrong, self.force_tree = expected, k, wrong, force_tree

    def propose(self, requests):
        drafts = []
        for r in requests:
            prompt = next(p for p in self.expected if tuple(r.token_ids[:len(p)]) == p)
            done = len(r.token_ids) - len(prompt)
            want = self.expected[prompt][done: done + r.num_tokens]
            if not (r.tree or self.force_tree):
                drafts.append(Draft(want))
                continue
            tokens, parents, last = [], [], -1
            for j, tok in enumerate(want[: r.num_tokens // 2]):  # pairs: a wrong sibling, then the true token
                # the sibling is the next true token where it can be: counted on the wrong path it
                # would be penalized one row too early
                sibling = want[j + 1] if j + 1 < len(want) and want[j + 1] != tok else self.wrong
                tokens += [sibling, tok]
                parents += [last, last]
                last = len(tokens) - 1
            drafts.append(Draft(tokens, parents=parents))
        return drafts


def bench_prompts_file(path):
    """A prompts file for `rayspec bench offline` (prompts whose answers repeat: n-gram hits)."""
    lines = [{"question_id": i, "category": "t", "turns": [f"Repeat after me: {w} {w} {w} {w}."]}
             for i, w in enumerate(["alpha beta", "one two three", "red green", "up down"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
