"""Batch-invariant decoding (EngineConfig.batch_invariant: CausalLM.set_batch_invariant for the
projections, rayspec.model.row_attention for attention): a row's logits in a K+1-row verification
(a chain or a token tree, batched with other sequences) equal, bit for bit, its logits in a 1-row
decode, in float32 and bfloat16; so in bfloat16 greedy speculative output equals target-only output
for every proposer, where without it (this CPU: an AMD EPYC with AVX-512 BF16) it did not.

Full size, by hand (20 prompts x 256 tokens, every proposer): benchmarks/batch_invariance_greedy.py,
benchmarks/results/batch_invariance_greedy_smollm2_bf16.json. Here 4 prompts x 32 tokens (2 for trees)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model_dir
from engine_utils import make_engine
from rayspec.cpu import kernels as cpu_kernels
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.linear import device_linear
from rayspec.model.loader import load_model
from rayspec.model.row_attention import row_key_spans
from rayspec.model.runner import make_runner

K = 5  # drafted tokens per verification: K + 1 rows


def row_checks(model, runner, seed: int = 0, trials: int = 2) -> list[tuple[str, bool]]:
    """(what, equal) for every row of: two sequences verified together as chains of K+1 and 3 rows,
    one as a tree (a wrong sibling beside the true path), and both decoded in one 1-row-each batch,
    each against the same token decoded alone, one row at a time, after the same cached context."""
    g = torch.Generator().manual_seed(seed)
    vocab, checks = model.args.vocab_size, []
    for trial in range(trials):
        seqs = [f"a{trial}", f"b{trial}"]
        prompts = [torch.randint(3, vocab, (int(torch.randint(20, 200, (1,), generator=g)),), generator=g).tolist()
                   for _ in seqs]
        toks = [torch.randint(3, vocab, (K + 1,), generator=g).tolist() for _ in seqs]
        with torch.inference_mode():
            for s, p in zip(seqs, prompts):
                runner.kv.allocate(s)
                runner.forward_hidden([s], [p])
            starts = [runner.kv.cached_len(s) for s in seqs]
            alone = []
            for s, start, ts in zip(seqs, starts, toks):
                rows = [model.logits(runner.forward_hidden([s], [[t]], packed=True, static=True)[0]) for t in ts]
                alone.append(torch.cat(rows))
                runner.kv.set_cached_len(s, start)

            def forward(ids, tokens, trees=None):
                hidden, _ = runner.forward_hidden(ids, tokens, trees=trees, packed=True, static=True, advance=False)
                return model.logits(hidden)

            chains = forward(seqs, [toks[0], toks[1][:3]])
            checks += [(f"chain row {j}", torch.equal(alone[0][j], chains[j])) for j in range(K + 1)]
            checks += [(f"second chain row {j}", torch.equal(alone[1][j], chains[K + 1 + j])) for j in range(3)]
            tree = forward(seqs[:1], [[toks[0][0], 7, toks[0][1], toks[0][2]]], [TreeQuery([-1, 0, 0, 2])])
            checks += [(f"tree node {n}", torch.equal(alone[0][j], tree[n])) for j, n in ((0, 0), (1, 2), (2, 3))]
            decode = forward(seqs, [[toks[0][0]], [toks[1][0]]])
            checks += [(f"batched decode {b}", torch.equal(alone[b][0], decode[b])) for b in range(2)]
        for s in seqs:
            runner.kv.free(s)
    return checks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """12 layers of width 256: in bfloat16 a narrower or shallower random model's rows mostly round alike
    even without batch invariance (0-3 of 28 rows differed at 2-8 layers of 128-512), so its check would
    pass without the fix; this one's differ (14 of 28)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("invariant") / "model", seed=2, num_layers=12, hidden=256,
                               vocab_size=512, with_tokenizer=False)


@pytest.fixture(scope="module")
def models(tiny_dir, smollm2):
    """(model name, dtype) -> (model, tokenizer), each loaded once."""
    cache = {}

    def get(name: str, dtype: str):
        if (name, dtype) not in cache:
            cache[name, dtype] = load_model(str(tiny_dir) if name == "tiny" else smollm2, dtype=dtype)
        return cache[name, dtype]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_row_logits_equal_a_one_row_decode(models, name, dtype):
    model = models(name, dtype)[0]
    runner = make_runner(model, 512, 4, slack=K + 2, batch_invariant=True)
    checks = row_checks(model, runner)
    assert all(equal for _, equal in checks), [what for what, equal in checks if not equal]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("tiny", "float32"), ("tiny", "bfloat16"), ("smollm2", "bfloat16")])
def test_rows_differ_without_it(models, name, dtype):
    """What the option changes: the same checks with it off. On the AMD EPYC this was written on, 26 of 28
    rows differed for the tiny model in float32, 14 of 28 in bfloat16, 19 of 28 for SmolLM2 in bfloat16
    (the projections on the tests' pinned onednn_pad4 kernel, batch-invariant there: attention's part)."""
    model = models(name, dtype)[0]
    checks = row_checks(model, make_runner(model, 512, 4, slack=K + 2, batch_invariant=False))
    differ = sum(not equal for _, equal in checks)
    print(f"{name} {dtype}: {differ} of {len(checks)} rows differ from a 1-row decode without batch_invariant")
    if differ == 0:
        pytest.skip("this CPU computed every row alike even without batch_invariant")
    assert model.batch_invariant is False


# ---- greedy output: speculative == target-only, bfloat16, SmolLM2 ------------------------------

NUM_PROMPTS, MAX_TOKENS = 4, 32


@pytest.fixture(scope="module")
def smol_bf16(models):
    return models("smollm2", "bfloat16")


@pytest.fixture(scope="module")
def greedy_setup(smol_bf16, tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from batch_invariance_greedy import proposers

    from rayspec.bench.prompts import load_prompts

    engine = make_engine("smollm2-135m-instruct", "none", loaded=smol_bf16)
    prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in load_prompts("mt_bench", NUM_PROMPTS)]
    return prompts, proposers(smol_bf16[0], tmp_path_factory.mktemp("heads"))


def greedy(smol_bf16, spec: dict, prompts, invariant: bool) -> list[list[int]]:
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    config = EngineConfig(model="smollm2-135m-instruct", max_num_seqs=len(prompts), max_model_len=512,
                          kv_cache_memory_gb=0.25, batch_invariant=invariant,
                          speculative=SpeculativeConfig(adaptive=False, **spec))
    engine = LLMEngine(config, model=smol_bf16[0], tokenizer=smol_bf16[1])
    assert engine.runner.batch_invariant == invariant
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def reference(smol_bf16, greedy_setup):
    """Target-only output, prompts decoded together; with batch_invariant on and off."""
    prompts, _ = greedy_setup
    none = dict(method="none", num_speculative_tokens=0)
    return {on: greedy(smol_bf16, none, prompts, on) for on in (True, False)}


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "eagle3 chain", "eagle3 tree", "eagle tree"])
def test_speculative_greedy_equals_target_only_bf16(smol_bf16, greedy_setup, reference, proposer):
    """Every proposer (EAGLE-3: the shipped head, chains and top-2 trees; EAGLE-1: an untrained head, as
    trees, every draft rejected), the prompts decoded together (trees: the first 2), in bfloat16."""
    prompts, specs = greedy_setup
    n = 2 if "tree" in proposer else len(prompts)
    got = greedy(smol_bf16, specs[proposer], prompts[:n], invariant=True)
    want = reference[True] if n == len(prompts) else greedy(smol_bf16, dict(method="none", num_speculative_tokens=0),
                                                            prompts[:n], invariant=True)
    assert [i for i, (g, w) in enumerate(zip(got, want)) if g != w] == [], proposer


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "eagle3 chain"])
def test_greedy_output_differs_without_it(smol_bf16, greedy_setup, reference, proposer):
    """The option is what makes them equal: the same prompts with batch_invariant off. On the AMD EPYC this
    was written on, 2 of 4 prompts differed from target-only output for n-gram and 4 of 4 for EAGLE-3."""
    prompts, specs = greedy_setup
    got = greedy(smol_bf16, specs[proposer], prompts, invariant=False)
    differ = [i for i, (g, w) in enumerate(zip(got, reference[False])) if g != w]
    print(f"{proposer}: {len(differ)} of {len(prompts)} prompts differ from target-only without batch_invariant")
    if not differ:
        pytest.skip("this CPU decoded every prompt alike even without batch_invariant")


# ---- the parts ------------------------------------------------------------------------------------

def test_row_key_spans_chain_tree_and_window():
    spans, index = row_key_spans([10, 4], [3, 1], None)
    assert spans == [(0, 0, 11, -1), (0, 0, 12, -1), (0, 0, 13, -1), (1, 0, 5, -1)] and index is None
    spans, _ = row_key_spans([10], [2], None, window=4)
    assert spans == [(0, 7, 11, -1), (0, 8, 12, -1)]
    # nodes 0 (root), 1 and 2 under 0, 3 under 2: node 3 sees the prefix, then nodes 0, 2, 3
    spans, index = row_key_spans([5], [4], [TreeQuery([-1, 0, 0, 2])])
    cols = [index[at: at + hi - lo].tolist() for _, lo, hi, at in spans]
    assert cols == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7], [0, 1, 2, 3, 4, 5, 7, 8]]
    # a window of 3 from node 3 (position 5 + depth 2 = 7): positions 5..7, its ancestors' and its own
    spans, index = row_key_spans([5], [4], [TreeQuery([-1, 0, 0, 2])], window=3)
    assert index[spans[3][3]: spans[3][3] + spans[3][2]].tolist() == [5, 7, 8]


def test_choose_invariant_takes_the_first_that_passes_else_tiles():
    """A kernel whose row depends on the row count is passed over; with none that passes, calls of
    TILE_ROWS rows (each call one shape) are used."""
    def factory(coupled: set[str]):
        def mlp_for(kernels):  # a coupled variant adds the batch's mean to every row, unless in fixed-size calls
            return lambda x: x + x.mean(0, keepdim=True) if kernels.variant in coupled and not kernels.tile else x * 2
        return mlp_for

    chosen = cpu_kernels.choose_invariant(factory({"onednn_pad4"}), 8, torch.float32, variants=("onednn_pad4", "flinear"))
    assert chosen.variant == "flinear" and chosen.tile is None
    tiled = cpu_kernels.choose_invariant(factory({"wxt"}), 8, torch.float32, variants=("wxt",))
    assert tiled.tile == cpu_kernels.TILE_ROWS and "batch-invariant" in tiled.source


def test_device_tiles_compute_rows_alike():
    """The GEMMs off the CPU in calls of a fixed row count (rayspec.model.linear.device_linear, here on
    the CPU's F.linear): every row as it is alone; and the values F.linear's."""
    torch.manual_seed(0)
    w, x = torch.randn(96, 80), torch.randn(40, 80)
    alone = torch.cat([device_linear(x[i: i + 1], w, None, 16) for i in range(40)])
    for m in (1, 2, 5, 16, 17, 40):
        assert torch.equal(device_linear(x[:m], w, None, 16), alone[:m])
    torch.testing.assert_close(device_linear(x, w, None, 16), x @ w.t())


def test_config_and_default():
    from rayspec.config import EngineConfig
    from rayspec.model.row_attention import default_batch_invariant

    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, paged_attention=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant=True, compile=True)
    model = torch.nn.Linear(2, 2)  # no set_batch_invariant: the generic path
    assert default_batch_invariant(EngineConfig(), model, torch.device("cpu")) is False
    assert default_batch_invariant(EngineConfig(batch_invariant=True), model, torch.device("cpu"))
