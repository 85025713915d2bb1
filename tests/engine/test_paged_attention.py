"""Paged attention (rayspec.model.paged_attention, EngineConfig.paged_attention): attention that reads the
KV pool in place through the block tables equals today's gather + dense mask + SDPA, for one decode
token, chains with padded rows and EAGLE trees, with blocks scattered over the pool, scratch blocks
past a row's end, and grouped-query heads; through inductor's kernel (the CPU one here; the GPU's in
benchmarks/gpu_roofline.py, which records the largest difference beside the times); and the compiled
step and the engine with it give the same hidden states and greedy tokens as without it.

The compiled-step tests trace with torch.compile's "aot_eager" backend (the step as traced, FlexAttention
by its reference implementation): inductor's CPU compile of a whole step with FlexAttention takes minutes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine_utils import cached_model, run_to_completion
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.model.compiled import CompiledForward
from rayspec.model.paged_attention import PagedLayout, chain_tail, inverse_tables, tree_tail

BS, POOL_BLOCKS, KV_HEADS, HEADS, D = 4, 24, 2, 4, 8


def gathered(q, pool_k, pool_v, table, context, tail):
    """The reference: each row's keys gathered through its table, a dense mask, SDPA."""
    B, _, Q, _ = q.shape
    outs = []
    for b in range(B):
        rows = (table[b][:, None] * BS + torch.arange(BS)).reshape(-1)
        k, v = pool_k[rows].transpose(0, 1)[None], pool_v[rows].transpose(0, 1)[None]
        position = torch.arange(rows.numel())
        j = position[None, :] - context[b]
        in_tail = (j >= 0) & (j < tail.shape[-1]) & tail[b][:, j.clamp(0, tail.shape[-1] - 1)[0]]
        visible = (position[None, :] < context[b]) | in_tail
        outs.append(F.scaled_dot_product_attention(q[b:b + 1], k, v, attn_mask=visible[None, None], enable_gqa=True))
    return torch.cat(outs)


def layout(Q: int, parents: list[int] | None = None, seed: int = 0):
    """Three rows, their blocks a random scatter over the pool, the last row's table padded with the
    scratch block 0 past its context."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(POOL_BLOCKS - 1, generator=gen) + 1
    table = perm[:15].view(3, 5).clone()
    context = torch.tensor([13, 2, 7])
    table[2, -(-(7 + Q) // BS):] = 0  # past row 2's blocks: scratch
    tail = torch.from_numpy(tree_tail(parents, Q) if parents else chain_tail(Q))[None].expand(3, -1, -1).contiguous()
    return table, context, tail


@pytest.mark.parametrize("Q, parents", [(1, None), (3, None), (5, [-1, 0, 0, 1, 2])], ids=["decode", "chain", "tree"])
def test_attend_equals_gathered_attention(Q, parents):
    torch.manual_seed(1)
    pool_k, pool_v = torch.randn(POOL_BLOCKS * BS, KV_HEADS, D), torch.randn(POOL_BLOCKS * BS, KV_HEADS, D)
    table, context, tail = layout(Q, parents)
    q = torch.randn(3, HEADS, Q, D)
    out = PagedLayout.build(table, context, tail, BS, POOL_BLOCKS).attend(q, pool_k, pool_v)
    ref = gathered(q, pool_k, pool_v, table, context, tail)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the layout decides: a query that also saw the key after its own would differ
    wrong = tail.clone()
    wrong[:, 0, min(1, Q - 1) if Q > 1 else 0] = True
    if Q > 1:
        assert not torch.allclose(PagedLayout.build(table, context, wrong, BS, POOL_BLOCKS).attend(q, pool_k, pool_v), ref)


def test_tree_tail_is_ancestors_and_self():
    sees = tree_tail([-1, 0, 0, 1], 5)
    assert sees[:4].astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0]]
    assert sees[4, 4] and (sees[4, :4] == sees[3, :4]).all()  # padding: the last node's, and its own key
    assert (chain_tail(3) == np.tril(np.ones((3, 3), dtype=bool))).all()


def test_inverse_tables():
    table = torch.tensor([[3, 1, 0, 0], [2, 4, 5, 0]])
    inv = inverse_tables(table, 6)
    assert inv[0, 3] == 0 and inv[0, 1] == 1 and inv[0, 2] == -1 and inv[1, 5] == 2 and inv[1, 3] == -1
    assert inv[0, 0] in (2, 3)  # the scratch block, listed twice


def test_inductor_kernel_equals_gathered_attention():
    """inductor's own FlexAttention kernel (CPU) on the paged layout, the inverse table a graph input:
    computed inside the graph and read by the mask_mod it gave wrong outputs (CPU and H100)."""
    torch.manual_seed(2)
    pool_k, pool_v = torch.randn(POOL_BLOCKS * BS, KV_HEADS, D), torch.randn(POOL_BLOCKS * BS, KV_HEADS, D)
    table, context, tail = layout(1, seed=3)
    q = torch.randn(3, HEADS, 1, D)
    fn = torch.compile(lambda q_, k_, v_, t_, c_, tl_, lg_: PagedLayout(t_, c_, tl_, BS, lg_).attend(q_, k_, v_),
                       dynamic=False)
    out = fn(q, pool_k, pool_v, table, context, tail, inverse_tables(table, POOL_BLOCKS))
    torch.testing.assert_close(out, gathered(q, pool_k, pool_v, table, context, tail), rtol=1e-4, atol=1e-4)


@pytest.fixture
def traced_step(monkeypatch):
    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    torch._dynamo.reset()  # graphs compiled by other tests (dynamo's cache is per code object) retraced
    yield
    torch._dynamo.reset()


def test_compiled_step_hidden_states_equal(tiny_model_dir, traced_step):
    """The runner's compiled step with and without paged attention: decode, a chain with rows of
    different lengths (padding), trees; rows of different contexts."""
    from rayspec.model.batch_layout import TreeQuery
    from rayspec.model.runner import make_runner

    model = cached_model(str(tiny_model_dir))[0]
    results = []
    for paged in (False, True):
        runner = make_runner(model, max_model_len=96, num_slots=4, slack=8, compile=True, paged_attention=paged)
        out = []
        with torch.inference_mode():
            for b, n in enumerate([37, 5, 20]):
                runner.kv.allocate(f"s{b}")
                runner.forward_hidden([f"s{b}"], [[(3 * i + b) % 90 + 3 for i in range(n)]])
            ids = ["s0", "s1", "s2"]
            out.append(runner.forward_hidden(ids, [[5], [6], [7]], packed=True, static=True)[0])
            out.append(runner.forward_hidden(ids, [[5, 6, 7], [8], [9, 10]], packed=True, static=True)[0])
            trees = [TreeQuery(parents=[-1, 0, 0, 1]), TreeQuery(parents=[-1, 0]), TreeQuery(parents=[-1, 0, 1, 1, 2])]
            out.append(runner.forward_hidden(ids, [[11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21]], trees=trees,
                                             packed=True, static=True)[0])
        assert runner.compiled.shapes
        results.append(out)
    for gather, paged in zip(*results):
        torch.testing.assert_close(paged, gather, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["ngram", "eagle3-tree"])
def test_engine_greedy_equal_with_paged_attention(tiny_model_dir, traced_step, method, tmp_path):
    """Greedy tokens of the compiled engine with paged attention equal the eager engine's, requests
    joining mid-decode."""
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    loaded = cached_model(str(tiny_model_dir))
    spec = dict(method=method.split("-")[0], num_speculative_tokens=3, adaptive=False)
    if method == "eagle3-tree":
        from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
        from rayspec.eagle.head import attach_target, build_head

        torch.manual_seed(3)
        head = build_head(new_eagle_config("eagle3", tiny_model_dir, loaded[0].args.num_layers,
                                           loaded[0].args.hidden_size))
        attach_target(head, loaded[0], has_own_embedding=False)
        spec.update(draft_model=str(save_eagle_head(head, tmp_path / "head", dtype=torch.float32)), eagle_topk=2,
                    tree_max_batch=2)
    prompts = [[5, 17, 99, 3, 42, 8, 5, 17, 99], [7, 7, 7, 12, 30, 31, 7, 7, 7, 12], [100, 4, 64]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = []
    for compile, paged in ((False, False), (True, True)):
        config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.05,
                              compile=compile, paged_attention=paged, speculative=SpeculativeConfig(**spec))
        engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
        assert engine.runner.paged_attention == paged
        ids, done = [engine.add_request(prompts[0], params)], {}
        done.update({o.request_id: o for o in engine.step() if o.finished})
        ids += [engine.add_request(p, params) for p in prompts[1:]]
        run_to_completion(engine, done)
        outputs.append([done[i].token_ids for i in ids])
    assert outputs[1] == outputs[0]


def test_paged_attention_needs_the_compiled_step(tiny_model_dir):
    with pytest.raises(ValueError, match="paged_attention"):
        EngineConfig(model=str(tiny_model_dir), compile=False, paged_attention=True)


@pytest.mark.parametrize("faulty", [False, "all rows", "rows past the first"])
def test_warm_up_self_check_turns_a_faulty_kernel_off(tiny_model_dir, traced_step, monkeypatch, faulty):
    """The engine's warm-up compares one decode forward both ways: a paged attention that computes
    something else (here: every key of the row's first block only) is turned off, and the engine's
    greedy output stays the eager engine's. A fault only a batch shows (every row attending with the
    first row's context: a decode of one sequence is right) is caught too, by the batch and tree
    forwards of the check (issue #50 (f); the check of one decode let it through)."""
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    if faulty:
        original = PagedLayout.attend

        def wrong(self, q, cache_k, cache_v):
            context = (torch.zeros_like(self.context) if faulty == "all rows"
                       else self.context[:1].expand_as(self.context).contiguous())
            return original(PagedLayout(self.table, context, self.tail, self.block_size, self.logical), q,
                            cache_k, cache_v)

        monkeypatch.setattr(PagedLayout, "attend", wrong)
    loaded = cached_model(str(tiny_model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = []
    for compile in (False, True):
        config = EngineConfig(model=str(tiny_model_dir), max_model_len=128, max_num_seqs=2, kv_cache_memory_gb=0.05,
                              compile=compile, paged_attention=compile,
                              speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False))
        engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
        if compile:
            assert engine.runner.paged_attention == (not faulty)
        outputs.append(engine.generate([[5, 17, 99, 3, 42, 8, 5, 17]], params)[0].token_ids)
    assert outputs[1] == outputs[0]
