"""Overlap scheduling (EngineSettings.overlap_scheduling, rayspec.engine.overlap; issue #50 items 2a and 3):
a decode step that drafts nothing is queued on the device, fed the previous step's tokens where they
are, before the host reads the previous step's tokens.

The output with overlap on is the output without it, token for token: greedy, the target's own
(every proposer, with joins, prefix-cache hits, preemption, aborts, stop strings, EOS, logprobs);
sampled, the same draws (a seeded request's coupled draws at the same positions, an unseeded one's
from its engine-seeded stream, one draw a step as without overlap), so the sampled law is the one
the lossless grid and the distribution tests audit without overlap. The proposers' drafts are the
same too (equal draft and acceptance counts: the queued steps keep an EAGLE head's features as the
ordinary step does). The one read per queued step, made after the next step is queued, is counted
in tests/engine/test_host_syncs.py::test_overlapped_step_reads_once_after_queueing_the_next.

The batch sizes here make the engines alternate: speculative engines draft at batch < 3 and queue
at batch >= 3 (disable_by_batch_size 3), so every run crosses between the two kinds of step."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_utils import cached_model, make_engine, run_alone, run_joining, run_to_completion  # noqa: E402
from rayspec.assets import assets_root  # noqa: E402
from rayspec.engine.overlap import Overlap  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

HEAD = str(assets_root() / "heads" / "smollm2-135m-eagle3")
TEXTS = ["Write a short poem about the sea.", "List three prime numbers and explain why they are prime.",
         "def fibonacci(n):", "Repeat after me: one two three, one two three, one two three.",
         "Explain recursion to a child."]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
METHODS = ["none", "ngram", "draft_model", "eagle3-trees"]


@pytest.fixture(scope="module")
def loaded(smollm2):
    return cached_model(smollm2)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    from rayspec.engine.intake import encode_chat

    return [encode_chat(loaded[1], [{"role": "user", "content": t}]) for t in TEXTS]


@pytest.fixture(scope="module")
def target_only(smollm2, loaded, prompts) -> list[list[int]]:
    return run_alone(make_engine(smollm2, "none", loaded=loaded), prompts, GREEDY)


def _engine(smollm2, loaded, method: str, overlap: bool, **extra):
    if method == "draft_model":
        extra.update(draft_model=smollm2, draft_num_layers=2)
    elif method == "eagle3-trees":
        method = "eagle3"
        extra.update(draft_model=HEAD, eagle_topk=2, num_steps=4, eagle_prompt_lookup=5, tree_max_batch=8)
    if method != "none":
        extra.setdefault("disable_by_batch_size", 3)
        # a fixed budget: drafts at every step of a small batch (with the planner on the n-gram runs stopped
        # drafting after their first rejections), so the drafting steps between the queued ones are many
        extra.setdefault("adaptive", False)
    engine = make_engine(smollm2, method, k=6 if method == "eagle3" else 4, loaded=loaded, **extra)
    engine.config.overlap_scheduling = overlap
    return engine


def _stats(engine) -> tuple[int, int]:
    return engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_targets_with_joins_prefix_hits_and_preemption(smollm2, loaded, prompts, target_only,
                                                                            method):
    """Requests joining mid-decode, then every prompt again with its blocks cached (prefix hits), then
    in a pool small enough to preempt: target-only output, with steps queued in each run; in the first
    run the same drafts and accepted drafts as the same engine without overlap (where preemption
    strikes, a queued step grows the pool a row at a time, the ordinary step by the draft budget: the
    batches and so the drafts differ there, never the output)."""
    engine, off = _engine(smollm2, loaded, method, True), _engine(smollm2, loaded, method, False)
    assert run_joining(engine, prompts, GREEDY) == run_joining(off, prompts, GREEDY) == target_only
    assert engine.overlap.num_queued > 5 and off.overlap.num_queued == 0
    assert _stats(engine) == _stats(off) and (method == "none" or _stats(engine)[0] > 0)
    again = engine.generate(prompts[:3], GREEDY)
    assert [o.token_ids for o in again] == target_only[:3]
    assert all(o.num_cached_tokens > 0 for o in again)
    # (7 blocks: at most 2 sequences run, so here a batch of 2 is queued and 1 drafts)
    small = _engine(smollm2, loaded, method, True, kv_cache_memory_gb=0.006, max_model_len=256,
                    disable_by_batch_size=2)
    assert run_joining(small, prompts, GREEDY) == target_only
    assert small.num_preemptions > 0 and small.overlap.num_queued > 5, (small.num_blocks, small.overlap.num_queued)
    assert method == "none" or _stats(small)[0] > 0
    for e in (engine, small):
        assert e.kv.num_free_slots == e.num_slots  # every slot back


@pytest.mark.parametrize("method", ["none", "eagle3-trees"])
@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_sampled_output_is_the_same_draw_for_draw(smollm2, loaded, prompts, method, seeded):
    """T = 1 (unseeded: streams from an engine seed; seeded: coupled draws) and T = 0.7 with top-k and
    top-p: with overlap on, the same tokens as without, drafts and acceptances the same."""
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=7 + i if seeded else None) for i in range(3)]
    params += [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=16, seed=3 if seeded else None)] * 2
    outs, engines = [], []
    for overlap in (False, True):
        engine = _engine(smollm2, loaded, method, overlap, engine_seed=11)
        outs.append([o.token_ids for o in engine.generate(prompts, params)])
        engines.append(engine)
    assert outs[0] == outs[1]
    assert engines[1].overlap.num_queued > 5 and _stats(engines[0]) == _stats(engines[1])
    assert len({tuple(o) for o in outs[0]}) == len(prompts)


def test_stops_eos_logprobs_and_an_abort(smollm2, loaded, prompts, target_only):
    """Stop strings, EOS, max_tokens of 1 and 2, logprobs; and a request aborted while a step is queued:
    the others' outputs (tokens, text, finish reasons, logprobs) are the ones without overlap, the
    aborted one's tokens a prefix of its own, and every slot is free at the end."""
    def params(i):
        return [SamplingParams(temperature=0, max_tokens=32, logprobs=2),
                SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0, max_tokens=2),
                SamplingParams(temperature=0, max_tokens=24, stop=["three"]),
                SamplingParams(temperature=0, max_tokens=48, stop=["\n"])][i]

    results = {}
    for overlap in (False, True):
        engine = _engine(smollm2, loaded, "none", overlap)
        ids = [engine.add_request(p, params(i)) for i, p in enumerate(prompts)]
        victim = engine.add_request(prompts[1], GREEDY)
        done = {}
        for _ in range(8):  # (with overlap: until a step is queued)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if engine.overlap.in_flight is not None:
                break
        assert not overlap or engine.overlap.in_flight is not None
        assert engine.abort_request(victim)
        run_to_completion(engine, done)
        assert engine.kv.num_free_slots == engine.num_slots
        assert victim not in done or done[victim].finish_reason == "abort"
        results[overlap] = [done[i] for i in ids]
        assert not overlap or engine.overlap.num_queued > 8
    for off, on in zip(results[False], results[True]):
        assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, off.finish_reason)
        # (a sequence that finished at a read left a void row in the next queued step: that step's batch,
        # one row more than without overlap, rounds the others' logits differently in their last bits)
        assert [(t.token_id, [i for i, _, _ in t.top]) for t in on.logprobs or []] == \
               [(t.token_id, [i for i, _, _ in t.top]) for t in off.logprobs or []]
        assert np.allclose([t.logprob for t in on.logprobs or []], [t.logprob for t in off.logprobs or []], atol=1e-5)
    reasons = [o.finish_reason for o in results[True]]
    assert reasons[1:3] == ["length", "length"] and "stop" in reasons[3:], reasons
    assert results[True][0].token_ids[:len(target_only[0])] == target_only[0]


def test_a_request_failing_in_a_queued_step_fails_alone(smollm2, loaded, prompts, target_only):
    """A request whose postprocessing raises at a queued step's read finishes with "error"; the others'
    outputs are target-only decoding's, their steps still queued."""
    engine = _engine(smollm2, loaded, "none", True)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    victim = engine._requests[ids[1]]
    append = victim.append_tokens

    def failing(tokens):
        if engine.overlap.num_queued > 3:
            raise RuntimeError("the detokenizer broke")
        return append(tokens)

    victim.append_tokens = failing
    done = run_to_completion(engine)
    assert done[ids[1]].finish_reason == "error" and len(done[ids[1]].token_ids) < len(target_only[1])
    assert [done[i].token_ids for i in ids[:1] + ids[2:]] == target_only[:1] + target_only[2:]
    assert engine.overlap.num_queued > 10 and engine.kv.num_free_slots == engine.num_slots


def test_compiled_step_queues_the_device_tokens(smollm2, loaded, prompts, target_only, monkeypatch):
    """The compiled step (traced with aot_eager, as test_lossless_grid's compiled column) takes the queued
    tokens as its input ids: target-only output at batch 2."""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.model.compiled import CompiledForward

    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    config = EngineConfig(model=smollm2, max_model_len=256, max_num_seqs=2, kv_cache_memory_gb=1.0, compile=True,
                          overlap_scheduling=True, speculative=SpeculativeConfig(method="none", num_speculative_tokens=0))
    engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    assert engine.runner.compiled is not None
    params = SamplingParams(temperature=0, max_tokens=12)
    assert [o.token_ids for o in engine.generate(prompts[:2], params)] == [t[:12] for t in target_only[:2]]
    assert engine.overlap.num_queued >= 8


def test_on_where_a_read_waits_for_the_device():
    """None: on for CUDA, off on CPU; never with tensor parallelism, batch-invariant rows or sliding windows."""
    def engine(setting, device="cpu", ranks=None, invariant=False, sliding=()):
        return types.SimpleNamespace(config=types.SimpleNamespace(overlap_scheduling=setting),
                                     device=types.SimpleNamespace(type=device), ranks=ranks,
                                     runner=types.SimpleNamespace(batch_invariant=invariant),
                                     model=types.SimpleNamespace(args=types.SimpleNamespace(sliding_layers=sliding)))

    assert not Overlap(engine(None)).enabled() and Overlap(engine(None, "cuda")).enabled()
    assert Overlap(engine(True)).enabled() and not Overlap(engine(False, "cuda")).enabled()
    assert not Overlap(engine(True, ranks=object())).enabled()
    assert not Overlap(engine(True, invariant=True)).enabled()
    assert not Overlap(engine(True, sliding=(0,))).enabled()


def test_a_started_read_counts_once_when_waited_for():
    """device_io.start_read: the tensors' arrays at wait(), one counted read then (none at the start);
    integer and bool tensors only (the pinned copy's wire is int64)."""
    import torch

    from rayspec.device_io import count_host_reads, start_read

    tokens, flags = torch.tensor([3, 1, 4]), torch.tensor([[True], [False]])
    with count_host_reads() as started:
        pending = start_read(tokens, flags)
    with count_host_reads() as waited:
        got = pending.wait()
    assert (started.count, waited.count) == (0, 1)
    assert got[0].tolist() == [3, 1, 4] and got[1].tolist() == [[True], [False]]
    with pytest.raises(TypeError, match="integer or bool"):
        start_read(torch.zeros(2))
