"""A drafting cycle's depth forwards prepared once on the host (rayspec.model.tree_steps, issue #50 item 2b's
ground): the EAGLE head's trees and chains are the ones each depth's own forward_hidden drafted, token for
token (greedy and sampled, trees and chains, batched with joins), the engine's output is unchanged, and the
host's preparation and copies to the device happen once per cycle, whatever the depth."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_utils import cached_model, make_engine, run_joining  # noqa: E402
from rayspec.assets import assets_root  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

HEAD = str(assets_root() / "heads" / "smollm2-135m-eagle3")
TEXTS = ["Write a short poem about the sea.", "def fibonacci(n):",
         "Repeat after me: one two three, one two three, one two three.", "Explain recursion to a child."]


@pytest.fixture(scope="module")
def loaded(smollm2):
    return cached_model(smollm2)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    from rayspec.engine.intake import encode_chat

    return [encode_chat(loaded[1], [{"role": "user", "content": t}]) for t in TEXTS]


def _run(smollm2, loaded, prompts, prepared: bool, topk: int, params: SamplingParams, defer: bool):
    """(outputs, every drafted token list per cycle) of one engine: EAGLE-3 trees (topk 3) or chains (topk 1)."""
    # adaptive off: every cycle drafts its whole budget (the comparison is of the drafts themselves)
    engine = make_engine(smollm2, "eagle3", k=8, loaded=loaded, draft_model=HEAD, eagle_topk=topk, num_steps=5,
                         adaptive=False, engine_seed=7)
    engine.config.defer_draft_reads = defer
    proposer = engine.proposer
    proposer.prepared_depths = prepared
    drafted, draft = [], proposer._draft

    def recording(reqs, last):
        out = draft(reqs, last)
        drafted.append([(r.seq_id, d.tokens, d.parents) if d.deferred is None else
                        (r.seq_id, d.deferred.tokens.tolist()) for r, d in zip(reqs, out)])
        return out

    proposer._draft = recording
    return run_joining(engine, prompts, params, first=2, steps_before_join=3), drafted


@pytest.mark.parametrize("topk", [3, 1], ids=["trees", "chains"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prepared_depths_draft_what_each_depth_drafted(smollm2, loaded, prompts, topk, sampled):
    params = SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0, max_tokens=24)
    before = _run(smollm2, loaded, prompts, False, topk, params, defer=False)
    after = _run(smollm2, loaded, prompts, True, topk, params, defer=False)
    assert after[1] == before[1]  # every cycle's drafts
    assert after[0] == before[0]
    assert sum(len(t) for cycle in after[1] for _, t, *_ in cycle) > 0


def test_prepared_depths_with_deferred_drafts(smollm2, loaded, prompts):
    """Drafts left on the device (defer_draft_reads, the GPU's default) are the same too."""
    params = SamplingParams(temperature=0, max_tokens=24)
    before = _run(smollm2, loaded, prompts, False, 3, params, defer=True)
    after = _run(smollm2, loaded, prompts, True, 3, params, defer=True)
    assert after == before


def test_one_preparation_per_cycle(smollm2, loaded, prompts, monkeypatch):
    """The host prepares and sends once per drafting cycle, not once per depth: during the head's depth
    loop nothing goes through forward_hidden, and the prepared steps copy to the device once."""
    import rayspec.model.tree_steps as tree_steps

    engine = make_engine(smollm2, "eagle3", k=8, loaded=loaded, draft_model=HEAD, eagle_topk=3, num_steps=6,
                         adaptive=False)
    proposer = engine.proposer
    counts = {"copies": 0, "depth_forwards": 0, "static_forward_hidden": 0, "cycles": 0}
    copy, forward_hidden, draft = tree_steps.to_device, proposer.runner.forward_hidden, proposer._draft
    step = tree_steps.TreeSteps.forward

    def counted_copy(*args, **kwargs):
        counts["copies"] += 1
        return copy(*args, **kwargs)

    def counted_forward_hidden(*args, **kwargs):
        counts["static_forward_hidden"] += bool(kwargs.get("static"))  # (a depth's, before; the catch-up is not)
        return forward_hidden(*args, **kwargs)

    def counted_step(self, *args, **kwargs):
        counts["depth_forwards"] += 1
        return step(self, *args, **kwargs)

    def counted_draft(reqs, last):
        counts["cycles"] += 1
        return draft(reqs, last)

    monkeypatch.setattr(tree_steps, "to_device", counted_copy)
    monkeypatch.setattr(tree_steps.TreeSteps, "forward", counted_step)
    monkeypatch.setattr(proposer.runner, "forward_hidden", counted_forward_hidden)
    monkeypatch.setattr(proposer, "_draft", counted_draft)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16))
    assert counts["cycles"] > 3 and counts["static_forward_hidden"] == 0, counts
    # one copy a cycle (a cycle whose budget is one token has no depth forward, and no copy), and it
    # serves every depth of the cycle (5 here, fewer near max_tokens)
    assert counts["cycles"] - 2 <= counts["copies"] <= counts["cycles"], counts
    assert counts["depth_forwards"] >= 4 * counts["copies"], counts


def test_depth_mask_is_the_spread_visibility(smollm2, loaded, prompts):
    """TreeSteps.mask (the prefix's part built once a cycle, each depth's node columns written into it) equals
    the additive form of spread_tree_visible's mask, for random ancestries over rows of different lengths."""
    import torch

    from rayspec.model.batch_layout import additive_mask, pad_rows, spread_tree_visible

    engine = make_engine(smollm2, "eagle3", k=8, loaded=loaded, draft_model=HEAD, eagle_topk=3, num_steps=4,
                         adaptive=False)
    for p in prompts[:3]:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=8))
    while engine.num_waiting or not all(s.prefilled for s in engine.running):
        engine.step()
    engine.step()  # a decode step: the head has cached every prompt
    runner, ids = engine.proposer.runner, [s.request_id for s in engine.running]
    width, steps = 3, 3
    starts = [runner.kv.cached_len(s) for s in ids]
    tree = runner.tree_steps(ids, width, steps)
    assert len(set(starts)) > 1 and tree.starts[: len(ids)].tolist() == starts
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        sees = torch.rand(len(ids), width, width * steps, generator=gen) < 0.4
        want = additive_mask(spread_tree_visible(pad_rows(sees, tree.Bp, width)[:, None], tree.starts, tree.kv_len),
                             runner.dtype)
        got = tree.mask(sees)
        assert got.shape == want.shape and torch.equal(got, want)
        assert torch.isinf(got).any() and (got == 0).sum() > sum(starts) * width  # (not all seen, not none)


@pytest.mark.parametrize("compare,a,b", [("prepared", "per_depth", "prepared"), ("captured", "loop", "captured")])
def test_draft_depths_benchmark_dry_run(tmp_path, compare, a, b):
    """benchmarks/draft_depths.py (the proposer's time per cycle: prepared depths against a forward per
    depth, or the whole loop captured against the loop from Python) on its smallest settings: both engines
    timed, their ratio recorded with the machine."""
    import json
    import subprocess

    out = tmp_path / "depths.json"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "draft_depths.py"), "--dry-run", "--compare", compare,
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    (cell,) = result["cells"]
    assert cell[f"{a}_s"] > 0 and cell[f"{b}_s"] > 0 and cell[f"{b}_over_{a}"] > 0
    assert result["environment"]["cpu_model"]


def test_one_compiled_graph_for_every_depth():
    """Through the compiled step every depth of a cycle takes the head's one graph: the prepared tensors are
    sliced per depth with the same strides (a [B, width] slice of [B, nodes] has its row stride, a graph
    specialises on strides, and such slices compiled a graph per depth). Counted as dynamo's recompiles of the
    head's forward over a run (aot_eager: the traced step, no inductor build)."""
    import random
    from types import SimpleNamespace

    import torch
    import torch._dynamo

    sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "benchmarks")]
    try:
        import gpu_engine
        from gpu_roofline import build_ours
    finally:
        del sys.path[:1]
    from rayspec.model.compiled import CompiledForward

    backend, CompiledForward.backend = CompiledForward.backend, "aot_eager"
    try:
        a = SimpleNamespace(device="cpu", dtype_name="float32", prompt_len=60, max_tokens=24, batches=[1], kv_gb=0.05,
                            chunk=8192, defer_draft_reads="on", overlap="off", nodes=16, topk=4, depth=8,
                            tree_max_batch=32, draft_vocab=256, warm_tokens=8)
        engine = gpu_engine.oracle_engine(a, build_ours("tiny", torch.device("cpu"), torch.float32), True)
        engine.proposer.p = 0.5
        engine.proposer.tree_graph = None  # the depth loop in Python (the captured loop: tests below)
        head = engine.proposer.runner.compiled
        calls = []
        original = head.fn

        def fn(input_ids, cache, batch, **kwargs):
            calls.append((tuple(batch.write_index.stride()), tuple(batch.cache_positions.stride())))
            return original(input_ids, cache, batch, **kwargs)

        head.fn = fn
        rng = random.Random(0)
        gpu_engine.run_batch(engine, [[rng.randrange(3, 512) for _ in range(a.prompt_len)]], a.max_tokens, "g", 0, False)
        assert len(calls) > 10 and len(set(calls)) == 1, set(calls)  # every depth: one layout of its inputs
    finally:
        CompiledForward.backend = backend


# ---- the whole depth loop as one graph (rayspec.proposers.tree_graph) ------------------------------------

def _captured_run(smollm2, loaded, prompts, captured: bool, params: SamplingParams, defer: bool, batch: int = 4):
    """(outputs, each cycle's drafts, the TreeGraph or None) of a compiled EAGLE-3 tree engine (aot_eager: the
    traced graphs, no inductor build), its depth loop captured whole or run in Python."""
    from rayspec.model.compiled import CompiledForward

    backend, CompiledForward.backend = CompiledForward.backend, "aot_eager"
    try:
        # the target eager (what is compared is the head's drafting; tracing SmolLM2's 30 layers for every
        # verification bucket at the engine's warm-up cost ~100 s of a CI run), the head's step compiled
        engine = make_engine(smollm2, "eagle3", k=8, loaded=loaded, draft_model=HEAD, eagle_topk=3, num_steps=5,
                             adaptive=False, engine_seed=7, compile=False)
        engine.config.defer_draft_reads = defer
        proposer = engine.proposer
        proposer.set_compile(True)
        assert proposer.tree_graph is not None  # made with the compiled step
        if not captured:
            proposer.tree_graph = None
        drafted, draft = [], proposer._draft

        def recording(reqs, last):
            out = draft(reqs, last)
            drafted.append([(r.seq_id, d.tokens, d.parents) if d.deferred is None else
                            (r.seq_id, d.deferred.tokens.tolist(), d.deferred.parents.tolist())
                            for r, d in zip(reqs, out)])
            return out

        proposer._draft = recording
        outputs = run_joining(engine, prompts[:batch], params, first=2, steps_before_join=3)
        return outputs, drafted, proposer.tree_graph
    finally:
        CompiledForward.backend = backend


@pytest.mark.parametrize("sampled,defer", [(False, False), (True, False), (False, True)],
                         ids=["greedy", "sampled", "deferred"])
def test_captured_depth_loop_drafts_what_the_python_loop_drafted(smollm2, loaded, prompts, sampled, defer):
    """The depth loop captured whole (one compiled graph of every depth's head forward, top-k and frontier) drafts
    the trees the Python loop drafted, cycle for cycle and node for node, greedy and sampled (T 0.8, top-p 0.95),
    read on the host or left on the device (deferred), in a batch with joins (rows padded to the bucket); the
    outputs are the same. Fails if a depth's visibility, frontier, parents or a padded row's masking differs."""
    params = SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0, max_tokens=24)
    before = _captured_run(smollm2, loaded, prompts, False, params, defer)
    after = _captured_run(smollm2, loaded, prompts, True, params, defer)
    assert after[2] is not None and after[2].shapes, "the captured loop never ran"
    assert after[1] == before[1]
    assert after[0] == before[0]
    assert sum(len(t) for cycle in after[1] for _, t, *_ in cycle) > 0


def test_captured_depth_loop_is_one_graph_per_bucket_and_reads_once(smollm2, loaded, prompts, monkeypatch):
    """A cycle's drafting is one call of the captured loop: no head forward of its own between depths, one
    graph per batch bucket and depth whatever the context length grows to (the keys' length a dynamic
    dimension: counted as dynamo's compiles of grow_tree over a run), and one read of the drafts to the host
    per cycle."""
    import torch._dynamo

    import rayspec.proposers.eagle as eagle
    from rayspec.model.compiled import CompiledForward
    from rayspec.proposers import tree_graph

    frames = []
    original_grow = tree_graph.grow_tree

    def counting_backend(gm, example_inputs):
        frames.append(len(example_inputs))
        return gm.forward

    backend, CompiledForward.backend = CompiledForward.backend, "aot_eager"
    try:
        engine = make_engine(smollm2, "eagle3", k=8, loaded=loaded, draft_model=HEAD, eagle_topk=3, num_steps=5,
                             adaptive=False, compile=False)
        engine.proposer.set_compile(True)  # the target eager (as above), the head compiled
    finally:
        CompiledForward.backend = backend
    proposer = engine.proposer
    torch._dynamo.reset()
    proposer.tree_graph.fn = torch.compile(original_grow, dynamic=False, backend=counting_backend)
    reads, cycles = [], []
    to_host, draft = eagle.to_host, proposer._draft
    monkeypatch.setattr(eagle, "to_host", lambda *a: reads.append(len(a)) or to_host(*a))

    def counted(reqs, last):
        cycles.append(len(reqs))
        before = len(reads)
        out = draft(reqs, last)
        assert len(reads) - before <= 1  # the drafts, once
        return out

    monkeypatch.setattr(proposer, "_draft", counted)
    head_calls = []
    step = proposer.runner.compiled.fn
    proposer.runner.compiled.fn = lambda *a, **k: head_calls.append(1) or step(*a, **k)  # the head's own step
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=40))  # contexts grow by ~40
    assert len(cycles) > 5 and not head_calls, (len(cycles), len(head_calls))
    # one graph per depth the cycles grew (5; fewer in the last cycles, whose budget is under 5 tokens),
    # none more as the context grew by 40 tokens
    shapes = proposer.tree_graph.shapes
    assert (1, 3, 5) in shapes and {s[:2] for s in shapes} == {(1, 3)}, shapes
    assert len(frames) == len(shapes), f"{len(frames)} graphs of the drafting loop for {sorted(shapes)}"
