"""The native model families (rayspec.model.families.NATIVE_MODEL_TYPES): Llama (llama3 rope scaling,
attention and MLP biases), Mistral (sliding window), Qwen2 (q/k/v biases, sliding layers from
use_sliding_window / max_window_layers), Qwen3 (q/k norms, explicit head_dim, tied and untied
embeddings, alternating layer_types).

Each family is a tiny random checkpoint written by transformers itself (its own config class and
modeling code, float32); our engine's greedy output must equal transformers' `generate` token for
token with every proposer, alone and batched, and the sliding-window mask must give transformers'
logits for prefill, decode, padded batches and token trees whose paths cross the window's edge.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from engine_utils import cached_model, make_engine, run_alone, run_batch
from family_utils import _SHAPE, FAMILIES, GREEDY, HIDDEN, LAYERS, PROMPTS, SLIDING, VOCAB, write_family
from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
from rayspec.eagle.head import attach_target, build_head
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.families import NATIVE_MODEL_TYPES, ModelArgs, UnsupportedArchitectureError
from rayspec.model.loader import rope_from_config
from rayspec.model.runner import make_runner


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """name -> (name, checkpoint dir, transformers model, (our model, None), transformers' greedy
    outputs of PROMPTS), each family built once for the module."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(name) / "model"
            hf = write_family(name, path)
            reference = []
            with torch.no_grad():
                for prompt in PROMPTS:
                    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0)
                    reference.append(out[0, len(prompt):].tolist())
                    # no near-tie on the way (measured >= 1e-3 here): equality then does not hang on rounding
                    top2 = hf(out).logits[0, len(prompt) - 1: -1].topk(2, dim=-1).values  # [32, 2]
                    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, f"{name}: a near-tie in the reference"
            assert all(len(r) == GREEDY.max_tokens for r in reference)
            built[name] = name, path, hf, cached_model(str(path)), reference
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, build):
    return build(request.param)


@pytest.fixture(scope="module")
def eagle3_head(family, tmp_path_factory):
    """A random EAGLE-3 head for the family's target (Llama-style whatever the target)."""
    name, path, _, loaded, _ = family
    torch.manual_seed(1)
    head = build_head(new_eagle_config("eagle3", path, LAYERS, HIDDEN))
    attach_target(head, loaded[0], has_own_embedding=False)
    return save_eagle_head(head, tmp_path_factory.mktemp(f"eagle3-{name}") / "head", dtype=torch.float32)


# ---- config -> ModelArgs -------------------------------------------------------------------------

def test_family_args_follow_transformers(family):
    name, _, hf, loaded, _ = family
    args = loaded[0].args
    attn = hf.model.layers[0].self_attn
    assert (args.attention_bias, args.o_proj_bias) == (attn.q_proj.bias is not None, attn.o_proj.bias is not None)
    assert args.qk_norm == hasattr(attn, "q_norm")
    assert args.head_dim == attn.head_dim and args.tie_word_embeddings == (hf.lm_head.weight is hf.model.embed_tokens.weight)
    # the layers transformers gives a sliding window, and that window
    windows = tuple(getattr(layer.self_attn, "sliding_window", None) for layer in hf.model.layers)
    if name == "mistral":  # its layers all read config.sliding_window
        windows = (hf.config.sliding_window,) * LAYERS
    assert tuple(args.layer_window(i) for i in range(LAYERS)) == windows
    assert (name in SLIDING) == any(w is not None for w in windows)
    # rope: the family's own rotary embedding's frequencies and scaling
    inv_freq, scaling = rope_from_config(hf.config)
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq) and scaling == hf.model.rotary_emb.attention_scaling
    assert torch.equal(loaded[0].inv_freq, hf.model.rotary_emb.inv_freq)


def test_registry_and_unsupported_architectures():
    assert set(NATIVE_MODEL_TYPES) == {"llama", "mistral", "qwen2", "qwen3", "gpt_oss"}  # gpt_oss: test_gpt_oss.py
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'gpt2'"):
        ModelArgs.from_hf_config(GPT2Config())
    assert issubclass(UnsupportedArchitectureError, ValueError)
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'dynamic'"):  # inv_freq changes with length
        ModelArgs.from_hf_config(LlamaConfig(**_SHAPE, rope_parameters=dict(rope_type="dynamic", factor=2.0)))
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act 'gelu'"):
        ModelArgs.from_hf_config(LlamaConfig(**_SHAPE, hidden_act="gelu"))


def test_sliding_layers_from_config_fields():
    # Qwen2/3: no window unless use_sliding_window (Qwen2.5 configs carry sliding_window but do not use it)
    assert ModelArgs.from_hf_config(Qwen2Config(**_SHAPE, sliding_window=4096)).sliding_layers == ()
    args = ModelArgs.from_hf_config(Qwen3Config(**{**_SHAPE, "num_hidden_layers": 5}, use_sliding_window=True,
                                                sliding_window=16, max_window_layers=3))
    assert (args.sliding_window, args.sliding_layers) == (16, (3, 4))
    cut = Qwen3Config(**{**_SHAPE, "num_hidden_layers": 5}, use_sliding_window=True, sliding_window=16, max_window_layers=3)
    cut.num_hidden_layers = 2  # a truncated self-draft keeps the first layers: none slides
    assert ModelArgs.from_hf_config(cut).sliding_layers == ()
    assert ModelArgs.from_hf_config(MistralConfig(**_SHAPE, sliding_window=None)).sliding_layers == ()
    qwen2 = ModelArgs.from_hf_config(Qwen2Config(**_SHAPE))
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)


# ---- greedy equality with transformers, every proposer ---------------------------------------------

METHODS = [
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)),
    ("draft_model", dict(method="draft_model", k=3, draft_num_layers=1)),  # the target's first layer
    ("eagle3", dict(method="eagle3", k=6, eagle_topk=2, num_steps=3, tree_max_batch=8)),  # trees
]


@pytest.mark.parametrize("method,spec", METHODS, ids=[m[0] for m in METHODS])
def test_greedy_equals_transformers(family, eagle3_head, method, spec):
    name, path, _, loaded, reference = family
    spec = dict(spec)
    if method == "eagle3":
        spec["draft_model"] = str(eagle3_head)
    # adaptive off: verification must accept and reject drafts in every family (asserted below), and
    # on these random models the planner stopped drafting after its first few drafts (or made none)
    spec["adaptive"] = False
    alone = run_alone(make_engine(path, loaded=loaded, **spec), PROMPTS, GREEDY)
    # batched, with prefill in chunks of 16 tokens (rows whose window starts past the first key)
    engine = make_engine(path, loaded=loaded, max_num_batched_tokens=16, **spec)
    batch = run_batch(engine, PROMPTS, GREEDY)
    for i, ref in enumerate(reference):
        assert alone[i] == ref, f"{name}/{method}: prompt {i} alone differs from transformers"
        assert batch[i] == ref, f"{name}/{method}: prompt {i} in a batch of 4 differs from transformers"
    stats = engine.stats
    if method != "none":
        assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
        if method != "eagle3":  # a random head's drafts are (almost) all rejected
            assert stats.num_accepted_tokens > 0, f"{name}/{method}: no draft accepted"


# ---- the sliding-window mask against transformers' logits ------------------------------------------

def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [T, vocab]


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_logits_prefill_chunks_decode_and_padding(build, name):
    """Prefill in two chunks, decode one token at a time (no mask: the window cuts the keys) and a
    padded batch of two rows at different depths: every logit is transformers' within 1e-4."""
    _, _, hf, loaded, _ = build(name)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (48,), generator=g).tolist()
    expected = _hf_logits(hf, tokens)  # [48, vocab]
    runner = make_runner(loaded[0], 96, num_slots=2, slack=8)
    runner.kv.allocate("a")
    with torch.no_grad():
        got = [runner.forward(["a"], [tokens[:20]], last_only=False)[0],
               runner.forward(["a"], [tokens[20:30]], last_only=False)[0]]
        got += [runner.forward(["a"], [[t]], last_only=False)[0] for t in tokens[30:40]]
        # a second row joins far behind: padded [2, 8] queries, row "b" prefilling, row "a" at 40..47
        runner.kv.allocate("b")
        other = torch.randint(0, VOCAB, (20,), generator=g).tolist()
        runner.forward(["b"], [other[:12]], last_only=False)
        both = runner.forward(["a", "b"], [tokens[40:48], other[12:18]], last_only=False)  # [2, 8, vocab]
    got.append(both[0])
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(both[1, :6], _hf_logits(hf, other[:18])[12:], atol=1e-4, rtol=0)


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", SLIDING)
def test_tree_rows_across_the_window_edge(build, name, compiled, monkeypatch):
    """Token trees deeper than the window, node order unlike depth order (cache rows differ from
    positions): each node's logits are transformers' over prefix + its own path, in a batch of two
    trees at different depths. Then keeping a path leaves the cache as a plain forward would.
    compiled: the trees verified through the compiled step (traced with aot_eager), whose sliding layers
    mask every key outside their window."""
    from rayspec.model.compiled import CompiledForward

    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    _, _, hf, loaded, _ = build(name)
    window = loaded[0].args.sliding_window
    g = torch.Generator().manual_seed(1)
    # two chains from the root, their nodes interleaved (node i hangs from i - 2): node index != depth
    parents = [-1, 0] + [i - 2 for i in range(2, 2 * (window + 2))]
    depth = max(len(_path(parents, n)) for n in range(len(parents)))
    assert depth > window  # the deepest nodes' first ancestors lie outside their window
    runner = make_runner(loaded[0], 128, num_slots=2, slack=8, compile=compiled)
    prefixes, trees_tokens = {}, {}
    for seq, plen in (("a", 30), ("b", 11)):
        runner.kv.allocate(seq)
        prefixes[seq] = torch.randint(0, VOCAB, (plen,), generator=g).tolist()
        with torch.no_grad():
            runner.forward([seq], [prefixes[seq]], last_only=False)
        trees_tokens[seq] = torch.randint(0, VOCAB, (len(parents),), generator=g).tolist()
    with torch.no_grad():
        hidden, _ = runner.forward_hidden(["a", "b"], [trees_tokens["a"], trees_tokens["b"]],
                                          trees=[TreeQuery(parents), TreeQuery(parents)], static=compiled)
        logits = loaded[0].logits(hidden)  # [2, nodes, vocab]
    assert bool(runner.compiled and runner.compiled.shapes) == compiled
    for row, seq in enumerate(("a", "b")):
        for node in range(len(parents)):
            tokens = prefixes[seq] + [trees_tokens[seq][n] for n in _path(parents, node)]
            torch.testing.assert_close(logits[row, node], _hf_logits(hf, tokens)[-1], atol=1e-4, rtol=0,
                                       msg=f"{name}: tree node {node} of row {seq}")
    # keep the deep path of "a" and continue: the cache at the moved rows is a plain forward's
    deepest = max(range(len(parents)), key=lambda n: len(_path(parents, n)))
    kept = _path(parents, deepest)
    runner.kv.keep_paths([("a", kept)])
    nxt = int(torch.randint(0, VOCAB, (1,), generator=g))
    with torch.no_grad():
        last = runner.forward(["a"], [[nxt]], last_only=True)[0]
    tokens = prefixes["a"] + [trees_tokens["a"][n] for n in kept] + [nxt]
    torch.testing.assert_close(last, _hf_logits(hf, tokens)[-1], atol=1e-4, rtol=0)
