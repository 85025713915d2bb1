"""Numerics that must hold whatever dtype the model runs in: rotary tables stay float32 after a
cast, and equal transformers' up to the model's maximum position (default and llama3 rope scaling)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rayspec.eagle.checkpoint import new_eagle_config
from rayspec.eagle.head import build_head
from rayspec.model.loader import build_model, rope_from_config

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _config(scaling: dict | None) -> LlamaConfig:
    # Llama-3.1's rotary settings (head_dim 64 here, as SmolLM2's) on a one-layer model
    return LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=64, rope_theta=500000.0 if scaling else 100000.0,
                       max_position_embeddings=131072 if scaling else 8192, rope_scaling=scaling)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_tables_float32_and_equal_to_transformers(scaling, dtype):
    config = _config(scaling)
    model = build_model(config, None, "cpu", dtype)
    assert next(model.parameters()).dtype == dtype and model.inv_freq.dtype == torch.float32
    model = model.to(torch.float32).to(dtype)  # any later cast keeps them too
    assert model.inv_freq.dtype == torch.float32
    reference = LlamaRotaryEmbedding(config)
    positions = torch.cat([torch.arange(0, 2048), torch.arange(2048, config.max_position_embeddings, 97),
                           torch.tensor([config.max_position_embeddings - 1])])[None]
    cos, sin = model.rope(positions, torch.float32)  # the tables before the cast to the activations' dtype
    want_cos, want_sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    assert (cos[:, 0] - want_cos).abs().max().item() <= 1e-6
    assert (sin[:, 0] - want_sin).abs().max().item() <= 1e-6
    # what the test guards against: frequencies rounded to the model's dtype are far off at long range
    rounded = positions.float()[..., None] * model.inv_freq.to(dtype).float()
    assert (torch.cat((rounded, rounded), -1).cos() * reference.attention_scaling - want_cos).abs().max() > 0.1
    # the activations' tables come out in their dtype
    assert model.rope(positions[:, :8], dtype)[0].dtype == dtype


def test_eagle_head_rotary_stays_float32(tmp_path):
    config = _config(LLAMA3_SCALING)
    config.save_pretrained(tmp_path)
    head_config = new_eagle_config("eagle3", tmp_path, 3, config.hidden_size)
    inv_freq, _ = rope_from_config(LlamaConfig(**head_config.hf_config))
    head = build_head(head_config).to(torch.bfloat16)
    assert next(head.parameters()).dtype == torch.bfloat16
    assert head.inv_freq.dtype == torch.float32 and torch.equal(head.inv_freq, inv_freq)


# ---- lossless in reduced precision ---------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    from conftest import make_tiny_model_dir
    return make_tiny_model_dir(tmp_path_factory.mktemp("bf16-target") / "model", seed=11, num_layers=3,
                               hidden=64, vocab_size=512, with_tokenizer=False)


BF16_PROPOSERS = {
    "ngram": {},
    "draft_model": {"draft_num_layers": 2},  # the target's first 2 of 3 layers
    "self-draft": {},  # the target as its own draft: nearly every draft accepted
    "eagle3 chain": {},
    "eagle3 tree": {"eagle_topk": 2, "tree_max_batch": 16},
    "eagle tree": {"eagle_topk": 2, "tree_max_batch": 16},
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("proposer", sorted(BF16_PROPOSERS))
def test_speculation_equals_target_only_in_reduced_precision(bf16_target, tmp_path, proposer, dtype):
    """In bfloat16 and float16 (CPU), greedy speculative output equals our own target-only output in
    the same dtype, token for token, prompts decoded together (rows of different lengths batched)
    and one at a time. The verification forward computes each row as decoding alone would
    (see rayspec.model.native.attention); before that, 6-7 of 10 prompts drifted apart in bfloat16."""
    import random

    from engine_utils import make_engine, run_joining
    from rayspec.model.loader import load_model
    from rayspec.sampling.sampler import SamplingParams

    rng = random.Random(2)
    base = [rng.randrange(3, 512) for _ in range(7)]
    prompts = [base * 3 + [rng.randrange(3, 512) for _ in range(n)] for n in range(6)]
    prompts += [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    loaded = load_model(str(bf16_target), dtype=dtype)
    method = {"ngram": "ngram", "draft_model": "draft_model", "self-draft": "draft_model"}.get(
        proposer, proposer.split()[0])
    spec = dict(BF16_PROPOSERS[proposer])
    if method == "draft_model":
        spec["draft_model"] = str(bf16_target)
    reference = make_engine(bf16_target, "none", loaded=loaded, max_num_seqs=8).generate(prompts, params)
    if method in ("eagle3", "eagle"):
        # an oracle head (eagle_utils.oracle_head): it drafts the target's greedy continuations in this
        # dtype, so accepted chains and tree paths (not only rejection rows) must equal target-only
        from eagle_utils import oracle_head
        from rayspec.eagle.checkpoint import save_eagle_head

        head = oracle_head(bf16_target, 3, 64, [p[-1:] + r.token_ids for p, r in zip(prompts, reference)], kind=method)
        spec["draft_model"] = str(save_eagle_head(head, tmp_path / "head", dtype=torch.float32))
        # adaptive off: long accepted paths are asserted below (mean accepted length > 1.5), and the
        # planner cut the budgets of the heads' chains to 2 here (accepted length ~1.47 in bfloat16)
        spec["adaptive"] = False
    engine = make_engine(bf16_target, method, k=4, loaded=loaded, max_num_seqs=8, **spec)
    assert engine.dtype == getattr(torch, dtype)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts[:3]]
    for i, ref in enumerate(reference):
        assert together[i].token_ids == ref.token_ids, (proposer, dtype, i)
    for i, out in enumerate(alone):
        assert out.token_ids == reference[i].token_ids, (proposer, dtype, i)
    # requests joining mid-decode, prompts prefilled in chunks of 8: cut at the same places with
    # and without speculation (whatever else runs), so the same KV, so the same tokens
    chunked_ref = run_joining(make_engine(bf16_target, "none", loaded=loaded, max_num_seqs=8,
                                          max_num_batched_tokens=8), prompts, params)
    chunked = run_joining(make_engine(bf16_target, method, k=4, loaded=loaded, max_num_seqs=8,
                                      max_num_batched_tokens=8, **spec), prompts, params)
    assert chunked == chunked_ref, (proposer, dtype)
    if proposer in ("ngram", "self-draft"):
        assert engine.stats.num_accepted_tokens > 0
    if method in ("eagle3", "eagle"):  # most drafts accepted: mean accepted length > 1.5
        print(proposer, dtype, engine.stats.as_dict())
        assert engine.stats.num_accepted_tokens > 1.5 * engine.stats.num_drafts, engine.stats.as_dict()
