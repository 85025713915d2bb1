"""The generic path (rayspec.model.generic): transformers' own modeling code over our KV cache
is greedy-identical to transformers' `generate()` under every proposer, for architectures the
native model does not implement: Gemma 2 (attention and final soft-capping, sliding layers,
query_pre_attn_scalar) and Granite (embedding/residual/attention multipliers, logits scaling); and
gpt-oss (mixture of experts, attention sinks, alternating sliding-window layers, YaRN rope), which
`model:` now runs on the native path (tests/engine/test_gpt_oss.py) but the generic path still runs when
built directly (load_generic_model)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from engine_utils import make_engine, run_alone, run_batch
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.generic import GenericCausalLM, load_generic_model
from rayspec.model.runner import make_runner
from rayspec.proposers.draft_model import DraftModelProposer
from rayspec.sampling.sampler import SamplingParams

WINDOW = 8  # sliding layers' window: far shorter than prompt + output, so it shapes every step
MAX_TOKENS = 28
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# token-id prompts (no tokenizer): repeats for the n-gram proposer, and lengths around the window
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21, 22, 20, 21],
    [40, 41, 42],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 60, 61, 62, 63],
]


def _common(vocab: int = 128) -> dict:
    # no eos: transformers' generate and the engine both run to max_new_tokens
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def _gpt_oss_config(num_layers: int = 4, sliding_window: int = WINDOW):
    from transformers import GptOssConfig

    return GptOssConfig(**_common(), num_hidden_layers=num_layers, sliding_window=sliding_window,
                        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
                        num_local_experts=4, num_experts_per_tok=2,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=64))


def _gemma2_config():
    from transformers import Gemma2Config

    return Gemma2Config(**_common(), num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                        attn_logit_softcapping=5.0, final_logit_softcapping=30.0, tie_word_embeddings=False,
                        layer_types=["sliding_attention", "full_attention"] * 2)


def _granite_config():
    from transformers import GraniteConfig

    return GraniteConfig(**_common(), num_hidden_layers=3, embedding_multiplier=4.0, residual_multiplier=0.5,
                         attention_multiplier=0.2, logits_scaling=0.5)


CONFIGS = {"gpt_oss": _gpt_oss_config, "gemma2": _gemma2_config, "granite": _granite_config}


def _save(config, path, seed: int) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharper logits: fewer near-ties, more repetition (n-gram hits)
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    return str(path)


@functools.lru_cache(maxsize=None)
def _hf(model_dir: str):
    """transformers' own model, its default (eager) attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def _ours(model_dir: str, num_layers: int | None = None) -> GenericCausalLM:
    from transformers import AutoConfig

    return load_generic_model(model_dir, AutoConfig.from_pretrained(model_dir), "cpu", torch.float32,
                              num_layers=num_layers)


@functools.lru_cache(maxsize=None)
def hf_greedy(model_dir: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = _hf(model_dir).generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      min_new_tokens=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Per architecture: (target, unrelated draft of the same vocabulary)."""
    root = tmp_path_factory.mktemp("generic")
    return {name: (_save(make(), root / name, seed=0), _save(make(), root / f"{name}-draft", seed=1))
            for name, make in CONFIGS.items()}


def _engine(target_dir: str, method: str, draft: str | None = None, **spec):
    model = _ours(target_dir)
    proposer = None
    if method == "draft_model":
        draft_model = _ours(target_dir, num_layers=1) if draft == "self" else _ours(draft)
        proposer = DraftModelProposer(draft_model, max_model_len=256, num_slots=8, max_draft_tokens=spec["k"])
    return make_engine(target_dir, method, loaded=(model, None), proposer=proposer, **spec)


METHODS = [
    ("none", "none", None, {}),
    # prompts prefilled 5 tokens a step: chunks start mid-prompt, their window reaching into earlier chunks
    ("none-chunked", "none", None, dict(max_num_batched_tokens=5)),
    ("ngram", "ngram", None, dict(k=4, prompt_lookup_min=1, prompt_lookup_max=3)),
    ("draft-self-1layer", "draft_model", "self", dict(k=3)),
    ("draft-other", "draft_model", "other", dict(k=2)),
]


@pytest.mark.parametrize("mode", ["alone", "batch"])
@pytest.mark.parametrize("name,method,draft,spec", METHODS, ids=[m[0] for m in METHODS])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_generic_greedy_matches_transformers(model_dirs, arch, name, method, draft, spec, mode):
    target, other = model_dirs[arch]
    # adaptive off: verification must accept and reject drafts on every architecture (asserted below),
    # and on these random models the planner stopped drafting after its first 4-5 drafts
    engine = _engine(target, method, draft=other if draft == "other" else draft, adaptive=False, **spec)
    run = run_alone if mode == "alone" else run_batch
    got = run(engine, PROMPTS, PARAMS)
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == hf_greedy(target, tuple(prompt)), f"{arch} prompt {i}: {name}/{mode} differs from generate()"
    stats = engine.stats
    if method != "none":  # speculation happened, and verification both accepted and rejected
        assert stats.num_drafts > 0
        if draft != "other":
            assert stats.num_accepted_tokens > 0, f"{arch}/{name}: no draft accepted"
        assert stats.num_accepted_tokens < stats.num_draft_tokens, f"{arch}/{name}: no draft rejected"
    assert engine.kv.num_free_slots == engine.num_slots


def test_sliding_window_holds_under_speculation(model_dirs, tmp_path):
    """Every verification here reads past the window of the sliding layers (prompt + output is
    several windows long), and n-gram drafts are accepted: the outputs still equal generate()'s.
    The window really shapes these outputs: the same weights with a window wider than the whole
    sequence (every layer full attention) decode differently, so an engine that ignored the window
    under speculation would fail the comparison."""
    target, _ = model_dirs["gpt_oss"]
    engine = _engine(target, "ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)
    prompts = PROMPTS[:2]
    got = run_batch(engine, prompts, PARAMS)
    assert engine.stats.num_accepted_tokens > 0
    assert got == [hf_greedy(target, tuple(p)) for p in prompts]

    from transformers import AutoConfig

    wide = AutoConfig.from_pretrained(target)
    wide.sliding_window = 4096
    wide_dir = tmp_path / "wide"
    _hf(target).save_pretrained(wide_dir)
    wide.save_pretrained(wide_dir)
    assert [hf_greedy(str(wide_dir), tuple(p)) for p in prompts] != got, "the window does not change these outputs"


def _tree_logits(model, prefix: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
    runner = make_runner(model, max_model_len=128, num_slots=1, slack=16)
    runner.kv.allocate("s")
    with torch.inference_mode():
        runner.forward(["s"], [prefix[:-1]], last_only=True)
        hidden, _ = runner.forward_hidden(["s"], [[prefix[-1]] + tokens], trees=[TreeQuery([-1] + parents)])
        return model.logits(hidden[0])  # [1 + len(tokens), vocab]


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2"])
def test_tree_query_across_the_window(model_dirs, arch):
    """A token tree (siblings share a rope position, not a cache row) hanging off a prefix longer
    than the window, deeper than the window: each node's logits equal transformers' over prefix +
    its path. The sliding layers must measure the window in rope positions (a node's depth), not
    cache rows."""
    target, _ = model_dirs[arch]
    prefix = PROMPTS[3]  # 20 tokens: the window (8) reaches back into it from every node
    # node j+1 hangs from node parents[j] (0: the prefix's last token): four siblings at depth 1,
    # then a chain from the last of them 10 deep, whose far end (depth 11, cache row 14) must not see
    # its ancestors more than a window away in depth, though they are fewer than a window away in rows
    tokens = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    parents = [0, 0, 0, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    got = _tree_logits(_ours(target), prefix, tokens, parents)
    full_parents = [-1] + parents
    for node in range(len(full_parents)):
        path, a = [], node
        while a > 0:
            path.append(([0] + tokens)[a])
            a = full_parents[a]
        ids = torch.tensor([prefix + path[::-1]])
        with torch.no_grad():
            want = _hf(target)(ids).logits[0, -1].float()
        torch.testing.assert_close(got[node], want, atol=2e-4, rtol=1e-4, msg=f"{arch} tree node {node}")


def test_transformers_builds_no_mask_or_cache(model_dirs, monkeypatch):
    """transformers builds no mask for an attention implementation it has no mask function for
    (our batch's mask is used), and no cache of its own: the attention function sees mask None and
    the current tokens' keys only."""
    from transformers import AttentionInterface

    from rayspec.model import generic as generic_model

    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, key.shape[2], kwargs.get("cache")))
        return generic_model.rayspec_attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, generic_model.ATTN_IMPLEMENTATION, spy)
    target, _ = model_dirs["gpt_oss"]
    engine = _engine(target, "ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)
    run_batch(engine, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))
    assert seen and all(mask is None and cache is None for mask, _, cache in seen)
    assert max(q for _, q, _ in seen) == len(PROMPTS[1])  # the longest forward: the prefill, no past keys


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma2"])
def test_aux_layers_are_layer_inputs(model_dirs, arch):
    """aux_layers gives the inputs of those decoder layers (EAGLE-3's features), as transformers'
    output_hidden_states does (hidden_states[i]: the input of layer i)."""
    target, _ = model_dirs[arch]
    model = _ours(target)
    prompt = PROMPTS[0]
    runner = make_runner(model, max_model_len=128, num_slots=1, slack=8)
    runner.kv.allocate("s")
    with torch.inference_mode():
        (hidden, aux), _ = runner.forward_hidden(["s"], [prompt], aux_layers=(0, 1, 3))
    with torch.no_grad():
        ref = _hf(target)(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    H = model.args.hidden_size
    assert aux.shape == (1, len(prompt), 3 * H)
    for j, layer in enumerate((0, 1, 3)):
        torch.testing.assert_close(aux[0, :, j * H:(j + 1) * H], ref[layer][0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def eagle3_head(model_dirs, tmp_path_factory) -> str:
    """An EAGLE-3 head for the tiny gpt-oss, trained for a few seconds on features the generic
    path extracts (aux_layers through rayspec.eagle.data, as `rayspec train` does): drafts the
    target really accepts."""
    import json
    import random

    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.data import extract_features, read_answers
    from rayspec.eagle.head import attach_target, build_head
    from rayspec.eagle.train import collate, load_examples, ttt_loss

    target, _ = model_dirs["gpt_oss"]
    model = _ours(target)
    work = tmp_path_factory.mktemp("eagle3")
    rng = random.Random(7)
    prompts = PROMPTS + [[rng.randrange(3, 128) for _ in range(rng.randrange(4, 10))] for _ in range(28)]
    answers = run_batch(make_engine(target, "none", loaded=(model, None)), prompts,
                        SamplingParams(temperature=0, max_tokens=40))
    (work / "answers.jsonl").write_text("".join(json.dumps({"prompt": str(i), "prompt_ids": p, "output_ids": a}) + "\n"
                                               for i, (p, a) in enumerate(zip(prompts, answers))))
    config = new_eagle_config("eagle3", Path(target), model.args.num_layers, model.args.hidden_size)
    shards = extract_features(model, read_answers(work / "answers.jsonl"), work, config.aux_layers)
    torch.manual_seed(0)
    head = build_head(config)
    attach_target(head, model, has_own_embedding=False)
    with torch.no_grad():  # start from the target's own output layer
        head.lm_head.weight.copy_(model.lm_head.weight)
        head.norm.weight.copy_(model.model.norm.weight)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=3e-3)
    examples = load_examples(shards, "eagle3")
    batch = collate(examples, list(range(len(examples))), None)
    head.train()
    for _ in range(40):
        loss, _ = ttt_loss(head, *batch, steps=3)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return str(save_eagle_head(head.eval(), work / "head", dtype=torch.float32))


@pytest.mark.parametrize("topk,depth", [(1, None), (2, 3)], ids=["chain", "tree"])
def test_eagle3_on_the_generic_path(model_dirs, eagle3_head, topk, depth):
    """EAGLE-3 drafting from the features the generic path hands over (aux_layers: inputs of
    layers 0, 2, 3), chains and trees verified over sliding layers, accepted paths moved in the
    cache (keep_path): greedy output equals generate()'s."""
    target, _ = model_dirs["gpt_oss"]
    engine = make_engine(target, "eagle3", k=4, loaded=(_ours(target), None), draft_model=eagle3_head,
                         eagle_topk=topk, num_steps=depth, tree_max_batch=8)
    assert engine.feature_layers == (0, 2, 3)
    got = run_batch(engine, PROMPTS, PARAMS)
    assert got == [hf_greedy(target, tuple(p)) for p in PROMPTS]
    stats = engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_unknown_logit_processing_is_refused(model_dirs):
    """A causal LM whose logits the generic path would not reproduce is refused at load, not run
    wrong: here Granite, with a `logits` that forgets its logits_scaling."""
    from transformers import AutoModelForCausalLM

    class Forgetful(GenericCausalLM):
        def logits(self, hidden):
            return self.lm_head(hidden).float()

    target, _ = model_dirs["granite"]
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    GenericCausalLM(hf)  # as it is: accepted
    with pytest.raises(ValueError, match="logits"):
        Forgetful(hf)


@pytest.mark.parametrize("num_layers", [0, 1])
def test_load_first_layers(model_dirs, num_layers):
    """num_layers keeps the first layers (a self-draft; 0: the embedding and head an EAGLE proposer
    deployment loads of its target), sliding/full layer types cut to match."""
    target, _ = model_dirs["gpt_oss"]
    model = _ours(target, num_layers=num_layers)
    assert model.args.num_layers == len(model.layers) == num_layers
    assert model.config.layer_types == ["sliding_attention", "full_attention"][:num_layers]
    assert torch.equal(model.model.embed_tokens.weight, _ours(target).model.embed_tokens.weight)


@pytest.mark.parametrize("arch", ["gemma2"])
def test_engine_config_routes_non_native_models_to_the_generic_path(model_dirs, arch):
    """`model:` naming a Gemma 2 checkpoint (not a native family) builds the engine on the generic
    path, with the draft model loaded the same way, and stays greedy-identical to transformers; asking
    for tensor parallelism there fails clearly. (A gpt_oss checkpoint goes to the native path.)"""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.model import loader
    from rayspec.model.parallel import TPGroup
    from rayspec.model.weights import hub

    target, draft = model_dirs[arch]
    assert not loader.is_native(hub.load_hf_config(Path(target)))
    assert loader.is_native(hub.load_hf_config(Path(model_dirs["gpt_oss"][0])))
    engine = LLMEngine(EngineConfig(model=target, max_model_len=256, max_num_seqs=4, speculative=SpeculativeConfig(
        method="draft_model", draft_model=draft, num_speculative_tokens=2, adaptive=False)))
    assert isinstance(engine.model, GenericCausalLM) and isinstance(engine.proposer.runner.model, GenericCausalLM)
    prompt = PROMPTS[0]
    out = engine.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert out.token_ids == hf_greedy(target, tuple(prompt))
    with pytest.raises(ValueError, match="natively supported"):
        loader.load_model(target, device="cpu", tp=TPGroup(rank=1, size=2))
