"""Drafts left on the device until the verdict's read (EngineSettings.defer_draft_reads; issue #50 item
2a, rayspec.proposers.deferred, rayspec.engine.deferred_verify): the device's choice of tree nodes is the
host's, and the engine's output is what it is without deferring (greedy: the target's own; sampled
from an engine seed: the same tokens, draw for draw). The one read per cycle is counted in
tests/engine/test_host_syncs.py::test_one_read_per_cycle_with_deferred_drafts; the sampled law
with deferred drafts is audited in tests/engine/test_lossless_grid.py (column "deferred")."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_utils import cached_model, make_engine, run_alone, run_joining  # noqa: E402
from rayspec.assets import assets_root  # noqa: E402
from rayspec.model.batch_layout import tree_depths  # noqa: E402
from rayspec.proposers.deferred import ancestry, defer_trees  # noqa: E402
from rayspec.proposers.eagle import EagleProposer, _Node  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

HEAD = str(assets_root() / "heads" / "smollm2-135m-eagle3")
TEXTS = ["Write a short poem about the sea.", "List three prime numbers and explain why they are prime.",
         "def fibonacci(n):", "Repeat after me: one two three, one two three, one two three.",
         "Explain recursion to a child."]


def _host_choice(tok, score, parent, depth, chain, budget):
    """EagleProposer's host path (_draft_trees' node list, _add_lookup_branch, _keep, _tree_draft)."""
    nodes, number = [], {}
    for n in range(len(tok)):
        if score[n] == float("-inf"):
            continue
        number[n] = len(nodes)
        nodes.append(_Node(int(tok[n]), number[int(parent[n])] if parent[n] >= 0 else -1, float(score[n]),
                           depth[n], None))
    EagleProposer._add_lookup_branch(types.SimpleNamespace(_lookup_chain=lambda req: chain), None, nodes)
    return EagleProposer._tree_draft(nodes, EagleProposer._keep(nodes, budget))


def _raw_trees(gen, B, w, D, vocab):
    """Random raw EAGLE trees as _draft_trees grows them: w children of the root, then per depth w
    children of each of the w best frontier nodes; some rows dead from some depth (-inf)."""
    toks, scores, parents, depth = [], [], [], []
    f_score = torch.log(torch.rand(B, w, generator=gen)).sort(descending=True).values
    f_node = torch.arange(w).expand(B, w)
    toks.append(torch.randint(0, vocab, (B, w), generator=gen))
    scores.append(f_score)
    parents.append(torch.full((B, w), -1))
    depth += [1] * w
    num = w
    dead_from = torch.randint(2, D + 2, (B,), generator=gen)
    for d in range(2, D + 1):
        child = torch.log(torch.rand(B, w, w, generator=gen))
        c_score = (f_score[..., None] + child).reshape(B, w * w)
        c_score = c_score.masked_fill((dead_from <= d)[:, None], float("-inf"))
        toks.append(torch.randint(0, vocab, (B, w * w), generator=gen))
        scores.append(c_score)
        parents.append(f_node[..., None].expand(B, w, w).reshape(B, w * w))
        depth += [d] * (w * w)
        best = torch.topk(c_score, w)
        f_score, f_node = best.values, num + best.indices
        num += w * w
    return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), depth


@pytest.mark.parametrize("seed", range(40))
def test_tree_choice_on_the_device_is_the_hosts(seed):
    """graft_lookup + select_tree (device ops) keep the nodes _keep keeps, in its order, with its
    parents; the device ancestry and depths are the host tree's; rows past the kept nodes are
    not kept. Random trees (topk 2-3, depth 1-6, dead rows, budgets 1-16) with lookup chains
    that follow head nodes (grafted) and leave them (new nodes)."""
    gen = torch.Generator().manual_seed(seed)
    B, w, D, vocab = 4, 2 + seed % 2, 1 + seed % 6, 5 + seed % 4  # a small vocabulary: chains match nodes
    tok, score, parent, depth = _raw_trees(gen, B, w, D, vocab)
    budgets = [int(x) for x in torch.randint(1, 17, (B,), generator=gen)]
    chains = []
    for b in range(B):
        n = int(torch.randint(0, 6, (), generator=gen))
        chains.append([int(x) for x in torch.randint(0, vocab, (n,), generator=gen)])
    drafts = defer_trees(tok, score, parent, depth, budgets, chains)
    batch = drafts[0].deferred.batch
    batch.finish([t.numpy() for t in batch.tensors])
    for b, d in enumerate(drafts):
        want = _host_choice(tok[b].tolist(), score[b].tolist(), parent[b].tolist(), depth, chains[b], budgets[b])
        got = batch.drafts[b]
        assert (got.tokens, got.parents) == (want.tokens, want.parents), (b, budgets[b], chains[b])
        row = d.deferred
        assert row.num_nodes == min(budgets[b], batch.tensors[0].shape[1]) >= len(want.tokens)
        n = len(want.tokens)
        host_depth = [d + 1 for d in tree_depths(want.parents)]
        assert row.depth[:n].tolist() == host_depth
        assert row.tokens[:n].tolist() == want.tokens
        sees = ancestry(torch.tensor([want.parents]), max(host_depth, default=0))[0]
        assert torch.equal(row.sees[:n, :n], sees)


@pytest.fixture(scope="module")
def loaded(smollm2):
    return cached_model(smollm2)


def _engine(smollm2, loaded, defer: bool, topk: int, **extra):
    """EAGLE-3 trees (topk 2) or chains (topk 1) with the shipped head; topk 0: a 2-layer draft model."""
    # adaptive off: accepted drafts are asserted in every run, and with the planner on (make_engine's
    # default) the chain and draft-model runs stopped drafting after their first rejections
    extra.setdefault("adaptive", False)
    if topk == 0:
        engine = make_engine(smollm2, "draft_model", k=4, loaded=loaded, draft_model=smollm2, draft_num_layers=2,
                             **extra)
    else:
        extra.setdefault("eagle_stop_prob", 0.2)
        engine = make_engine(smollm2, "eagle3", k=8, loaded=loaded, draft_model=HEAD, eagle_topk=topk, num_steps=4,
                             eagle_prompt_lookup=5 if topk > 1 else 0, tree_max_batch=8, **extra)
    engine.config.defer_draft_reads = defer
    return engine


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    from rayspec.engine.intake import encode_chat

    return [encode_chat(loaded[1], [{"role": "user", "content": t}]) for t in TEXTS]


GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def target_only(smollm2, loaded, prompts) -> list[list[int]]:
    return run_alone(make_engine(smollm2, "none", loaded=loaded), prompts, GREEDY)


@pytest.mark.parametrize("topk", [2, 1, 0], ids=["trees", "chains", "draft-model"])
def test_greedy_output_is_the_targets_with_joins_prefix_hits_and_preemption(smollm2, loaded, prompts, target_only,
                                                                             topk):
    """Greedy, with defer_draft_reads on: requests joining mid-decode, then again with every prompt's
    blocks cached (prefix hits), and in a pool small enough to preempt: the output is target-only
    decoding's; accepted drafts counted."""
    engine = _engine(smollm2, loaded, True, topk, enable_prefix_caching=True)
    assert run_joining(engine, prompts, GREEDY) == target_only
    again = engine.generate(prompts[:3], GREEDY)
    assert [o.token_ids for o in again] == target_only[:3]
    assert all(o.num_cached_tokens > 0 for o in again)
    small = _engine(smollm2, loaded, True, topk, kv_cache_memory_gb=0.012, max_model_len=256)
    assert run_joining(small, prompts, GREEDY) == target_only
    assert small.num_preemptions > 0, small.num_blocks
    assert engine.stats.num_accepted_tokens > 0 and small.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("topk", [2, 1, 0], ids=["trees", "chains", "draft-model"])
def test_sampled_output_is_the_same_draw_for_draw(smollm2, loaded, topk):
    """Unseeded T = 1 requests from an engine seed (reproducible streams): deferring changes no draw,
    so the outputs equal the ones without it token for token (the drafts, rows and rule are the same;
    the rule's law is audited in test_lossless_grid's "deferred" column). The trees without the stop
    rule: a deferred tree takes its budget of rows and the rule a uniform per row, kept or not (the
    host's kept count is known only after the read), so where the stop rule keeps fewer nodes the
    stream moves on further than the host tree's and the later draws differ (the same law)."""
    outs = []
    for defer in (False, True):
        engine = _engine(smollm2, loaded, defer, topk, engine_seed=11, **({"eagle_stop_prob": 0.0} if topk == 2 else {}))
        prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in TEXTS[:3]]
        outs.append([o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24))])
        assert engine.stats.num_draft_tokens > 0
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[0]}) == 3
    assert np.mean([len(o) for o in outs[0]]) > 4


@pytest.mark.parametrize("topk", [2, 1, 0], ids=["trees", "chains", "draft-model"])
def test_seeded_output_is_target_only_decoding(smollm2, loaded, topk):
    """Seeded sampled requests (coupled draws: the target's draw at each position comes from the seed and
    the position alone) verified with their drafts still on the device, the draws' keys at a tree's
    depths made there (rejection.coupled_choices): the output is target-only decoding's with those
    seeds, token for token, at T = 1 and at T = 0.8 with top-k / top-p, the stop rule on; drafts were
    deferred and accepted."""
    engine = _engine(smollm2, loaded, True, topk)
    deferred, propose = [0], engine.proposer.propose

    def counting(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        deferred[0] += sum(d.deferred is not None for d in drafts)
        return drafts

    engine.proposer.propose = counting
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in TEXTS[:3]]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=24),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=4, max_tokens=24),
              SamplingParams(temperature=1.0, seed=5, max_tokens=24)]
    want = [o.token_ids for o in make_engine(smollm2, "none", loaded=loaded).generate(prompts, params)]
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert deferred[0] > 0 and engine.stats.num_accepted_tokens > 0, (deferred, engine.stats.num_accepted_tokens)


@pytest.mark.parametrize("defer", [False, True], ids=["host", "deferred"])
def test_depth_six_trees_greedy_output_is_the_targets(smollm2, loaded, defer):
    """EAGLE-3 trees 6 levels deep (topk 2, 12 nodes, stop rule off so every level grows, the lookup
    branch on), alone and batched: target-only decoding's output; some cycle accepts 4 or more drafts."""
    engine = make_engine(smollm2, "eagle3", k=12, loaded=loaded, draft_model=HEAD, eagle_topk=2, num_steps=6,
                         eagle_prompt_lookup=5, tree_max_batch=8)
    engine.config.defer_draft_reads = defer
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in TEXTS[2:4]]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = run_alone(make_engine(smollm2, "none", loaded=loaded), prompts, params)
    accepted = []
    take = engine._take_tokens

    def spy(seq, draft, asked, tree, num_pending, emitted, rows, raw_logits):
        accepted.append(len(emitted) - 1)
        return take(seq, draft, asked, tree, num_pending, emitted, rows, raw_logits)

    engine._take_tokens = spy
    assert run_alone(engine, prompts, params) == want
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert max(accepted) >= 4, accepted


# The compiled test's target: conftest's tiny model with seed 3, whose greedy continuations of these prompts
# an oracle head (eagle_utils.oracle_head) drafts, so its trees are accepted (test_compiled_step's choice)
ORACLE_PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 7, 7, 12, 30, 31, 32, 33, 5]]


@pytest.fixture(scope="module")
def tiny_oracle(tmp_path_factory):
    """(target dir, oracle EAGLE-3 head dir, loaded target, its greedy outputs of ORACLE_PROMPTS)."""
    from conftest import make_tiny_model_dir
    from eagle_utils import oracle_head
    from rayspec.eagle.checkpoint import save_eagle_head

    target = make_tiny_model_dir(tmp_path_factory.mktemp("deferred-tiny") / "model", seed=3)
    loaded = cached_model(str(target))
    ref = run_alone(make_engine(target, "none", loaded=loaded), ORACLE_PROMPTS,
                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    args = loaded[0].args
    head = oracle_head(target, args.num_layers, args.hidden_size, [p[-1:] + r for p, r in zip(ORACLE_PROMPTS, ref)])
    return target, save_eagle_head(head, tmp_path_factory.mktemp("deferred-head") / "head", dtype=torch.float32), \
        loaded, ref


def test_compiled_step_with_deferred_drafts_is_the_targets(tiny_oracle, monkeypatch):
    """The compiled step (traced with aot_eager, as test_lossless_grid's compiled column: the padded
    buckets, a deferred tree's device mask and depths placed into the static batch) verifies deferred
    EAGLE-3 trees into target-only greedy output (a batch of 2 whose last steps run one sequence: the
    requests ask for 24 and 13 tokens), with no graph compiled after the warm-up. (On the tiny model and an
    oracle head: SmolLM2's 30 layers traced at four shapes took ~26 s of a CI run.)"""
    from engine_utils import run_to_completion
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.model.compiled import CompiledForward

    target, head, loaded, ref = tiny_oracle
    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    config = EngineConfig(model=str(target), max_model_len=256, max_num_seqs=2, kv_cache_memory_gb=0.05, compile=True,
                          defer_draft_reads=True,
                          speculative=SpeculativeConfig(method="eagle3", draft_model=str(head), num_speculative_tokens=8,
                                                        eagle_topk=2, num_steps=4, eagle_prompt_lookup=5,
                                                        adaptive=False))
    engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    assert engine.runner.compiled is not None
    warmed = set(engine.runner.compiled.shapes)  # compile_buckets': batch 1 and 2 at 1 row and at 16 (1 + 8)
    assert warmed == {(1, 1), (2, 1), (1, 16), (2, 16)}, warmed
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for p, n in zip(ORACLE_PROMPTS, (24, 13))]
    done = run_to_completion(engine)
    assert [done[i].token_ids for i in ids] == [ref[0], ref[1][:13]]
    assert engine.stats.num_accepted_tokens > 0
    # the last cycles verify smaller trees (a request's budget under 8 tokens): padded to the warmed 16
    # rows, no graph compiled after the warm-up (issue #50 (e); before, (1, 8) and (1, 4) were compiled
    # mid-generation, on CUDA a recording each)
    assert engine.runner.compiled.shapes == warmed
