"""gpt-oss on the native path (rayspec.model.native with rayspec.model.moe): a tiny random gpt_oss (4 experts,
top-2 routing, the clamped SwiGLU, sinks and biases non-zero, sliding window 8 on alternate layers, YaRN
rope) computes transformers' GptOssForCausalLM logits for prefill chunks, decode steps, padded batches
and token trees across the window; its MXFP4 experts kept 4-bit give the logits of their dequantized
twin; greedy output equals transformers' `generate` token for token under every proposer and through
the compiled step; split over two ranks (experts by rank) it equals one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_utils import make_engine, run_alone, run_batch
from fp4_utils import EXPERT_PROJECTIONS, quantize_mxfp4, write_mxfp4_float
from rayspec.model import loader
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.families import ModelArgs
from rayspec.model.moe import MoE
from rayspec.model.runner import make_runner
from rayspec.sampling.sampler import SamplingParams
from test_families import _path  # (the tree helper the families tests use)

VOCAB, HIDDEN, LAYERS, WINDOW = 128, 64, 4, 8
AUX_LAYERS = [0, 1, 3]  # the head's eagle_config names them (not the default for 4 layers)
GREEDY = SamplingParams(temperature=0, max_tokens=24)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [20, 21, 22, 20, 21, 22, 20, 21, 22, 20], [40, 41, 42]]


def gpt_oss_config():
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, num_hidden_layers=LAYERS,
                        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                        num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # no EOS: every output is full
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=64, truncate=False))


def write_checkpoints(root: Path) -> dict[str, Path]:
    """A random gpt_oss with its experts in MXFP4 (gpt-oss's published layout, config.json's
    quantization_config) and its float twin (the dequantized experts: what transformers runs here)."""
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM

    config = gpt_oss_config()
    torch.manual_seed(52)
    hf = GptOssForCausalLM(config).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):  # zero at init: one left out would go unnoticed
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.3)
        hf.lm_head.weight.mul_(2.0)  # sharper logits: fewer near-ties
    out = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith(tuple(f"experts.{p}" for p in EXPERT_PROJECTIONS)):  # [E, in, out] -> rows = outputs
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
        else:
            out[name] = tensor.contiguous()
    mx = root / "mxfp4"
    mx.mkdir(parents=True)
    save_file(out, str(mx / "model.safetensors"))
    doc = config.to_dict() | {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (mx / "config.json").write_text(json.dumps(doc))
    return {"mxfp4": mx, "float": write_mxfp4_float(mx, root / "float")}


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """Checkpoints, transformers' model of the float twin, our models of both, transformers' greedy outputs."""
    from transformers import GptOssForCausalLM

    dirs = write_checkpoints(tmp_path_factory.mktemp("gpt-oss"))
    hf = GptOssForCausalLM.from_pretrained(dirs["float"], dtype=torch.float32).eval()
    reference = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                               do_sample=False, pad_token_id=0)
            reference.append(full[0, len(prompt):].tolist())
            top2 = hf(full).logits[0, len(prompt) - 1: -1].topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4, "a near-tie in the reference"
    native = loader.load_model(str(dirs["float"]), device="cpu", tokenizer=False)
    packed = loader.load_model(str(dirs["mxfp4"]), device="cpu", tokenizer=False)
    return dict(dirs=dirs, hf=hf, reference=reference, native=native, packed=packed)


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]  # [T, vocab]


def test_args_and_modules_follow_the_config(oss):
    model = oss["native"][0]
    args = model.args
    assert (args.attention_bias, args.o_proj_bias, args.attention_sinks) == (True, True, True)
    assert (args.num_experts, args.experts_per_token, args.swiglu_alpha, args.swiglu_limit) == (4, 2, 1.702, 7.0)
    assert tuple(args.layer_window(i) for i in range(LAYERS)) == (WINDOW, None, WINDOW, None)
    assert isinstance(model.model.layers[0].mlp, MoE) and not args.mxfp4_experts
    assert loader.is_native(oss["hf"].config)
    # the packed model holds the checkpoint's codes and scales, no float expert weight
    packed = oss["packed"][0]
    assert packed.args.mxfp4_experts
    params = dict(packed.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in params)
    rope = oss["hf"].model.rotary_emb  # YaRN: the frequencies and attention scaling transformers uses
    assert torch.equal(model.inv_freq, rope.inv_freq) and model.attention_scaling == rope.attention_scaling


def test_logits_prefill_chunks_decode_and_padding(oss):
    """Prefill in two chunks, decode one token at a time (past the window), and a padded batch of two
    rows at different depths: every logit is transformers' within float32 tolerance."""
    hf, model = oss["hf"], oss["native"][0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    expected = _hf_logits(hf, tokens)
    runner = make_runner(model, 96, num_slots=2, slack=8)
    runner.kv.allocate("a")
    with torch.no_grad():
        got = [runner.forward(["a"], [tokens[:14]], last_only=False)[0],
               runner.forward(["a"], [tokens[14:22]], last_only=False)[0]]
        got += [runner.forward(["a"], [[t]], last_only=False)[0] for t in tokens[22:34]]
        runner.kv.allocate("b")
        other = torch.randint(0, VOCAB, (16,), generator=g).tolist()
        runner.forward(["b"], [other[:10]], last_only=False)
        both = runner.forward(["a", "b"], [tokens[34:40], other[10:14]], last_only=False)  # [2, 6, vocab]
    got.append(both[0])
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(both[1, :4], _hf_logits(hf, other[:14])[10:], atol=1e-4, rtol=0)




@pytest.mark.parametrize("mode", ["batched", "compiled"])
def test_tree_rows_across_the_window(oss, mode, monkeypatch):
    """A token tree deeper than the window, node order unlike depth order (cache rows differ from rope
    positions), verified as one forward: each node's logits are transformers' over prefix + its path.
    compiled: through the compiled step (traced with aot_eager), the sliding layers' mask built there."""
    from rayspec.model.compiled import CompiledForward

    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    hf, model = oss["hf"], oss["native"][0]
    parents = [-1, 0] + [i - 2 for i in range(2, 2 * (WINDOW + 2))]  # two interleaved chains
    assert max(len(_path(parents, n)) for n in range(len(parents))) > WINDOW
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    tokens = torch.randint(0, VOCAB, (len(parents),), generator=g).tolist()
    runner = make_runner(model, 96, num_slots=1, slack=8, compile=mode == "compiled")
    assert (runner.compiled is not None) == (mode == "compiled")
    runner.kv.allocate("a")
    with torch.no_grad():
        runner.forward(["a"], [prefix], last_only=False)
        hidden, _ = runner.forward_hidden(["a"], [tokens], trees=[TreeQuery(parents)], static=True)
        logits = model.logits(hidden)[0]  # [nodes, vocab]
    for node in range(len(parents)):
        want = _hf_logits(hf, prefix + [tokens[n] for n in _path(parents, node)])[-1]
        torch.testing.assert_close(logits[node], want, atol=1e-4, rtol=0, msg=f"tree node {node}")


def test_batch_invariance_is_refused_and_row_attention_takes_sinks(oss):
    """Batch-invariant decoding is refused for a mixture of experts (an expert's matmul takes the tokens
    routed to it, a count the batch sets); its row-by-row attention (rayspec.model.row_attention) takes
    sinks as the batched attention does."""
    from rayspec.model.native import sink_attention
    from rayspec.model.row_attention import RowKeys, row_key_spans

    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_runner(oss["native"][0], 64, num_slots=1, slack=8, batch_invariant=True)
    g = torch.Generator().manual_seed(2)
    q, keys, values = (torch.randn(*shape, generator=g) for shape in ((1, 4, 3, 16), (1, 2, 7, 16), (1, 2, 7, 16)))
    sinks = torch.randn(4, generator=g)
    visible = torch.arange(7)[None, :] <= torch.arange(4, 7)[:, None]  # 3 queries at positions 4..6
    mask = torch.zeros(1, 1, 3, 7).masked_fill(~visible, float("-inf"))
    want = sink_attention(q, keys, values, mask, sinks)[0].transpose(0, 1)  # [3, heads, D]
    spans, _ = row_key_spans([4], [3], None)
    got = RowKeys(spans).attend(q[0].transpose(0, 1), keys, values, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_mxfp4_experts_equal_their_dequantized_twin(oss):
    """Experts kept as MXFP4 codes (dequantized per expert on use) give the float twin's logits, bit for
    bit; asked
    to, the loader dequantizes them into float experts equal to the twin's weights, bit for bit."""
    native, packed = oss["native"][0], oss["packed"][0]
    tokens = PROMPTS[0] + PROMPTS[1]
    outs = []
    for model in (native, packed):
        runner = make_runner(model, 64, num_slots=1, slack=8)
        runner.kv.allocate("a")
        with torch.no_grad():
            outs.append(torch.cat([runner.forward(["a"], [tokens[:15]], last_only=False)[0],
                                   *[runner.forward(["a"], [[t]], last_only=False)[0] for t in tokens[15:]]]))
    assert torch.equal(outs[1], outs[0])  # the same matmuls on the same values (rayspec.model.moe)
    dequantized, _ = loader.load_model(str(oss["dirs"]["mxfp4"]), device="cpu", tokenizer=False,
                                       dequantize_experts=True)
    assert not dequantized.args.mxfp4_experts
    twin = dict(native.named_parameters())
    for name, param in dequantized.named_parameters():
        assert torch.equal(param, twin[name]), name


def test_float_experts_under_an_mxfp4_config(oss, tmp_path):
    """A checkpoint whose config.json still names MXFP4 but whose experts are float (a dequantized export)
    loads them as float experts."""
    import shutil

    path = shutil.copytree(oss["dirs"]["float"], tmp_path / "float-mx-config")
    doc = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(doc | {"quantization_config": {"quant_method": "mxfp4"}}))
    model, _ = loader.load_model(str(path), device="cpu", tokenizer=False)
    assert not model.args.mxfp4_experts
    twin = dict(oss["native"][0].named_parameters())
    assert all(torch.equal(p, twin[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("experts", ["mxfp4", "dequantized"])
def test_a_rank_loads_its_experts_only(oss, experts):
    """Rank 1 of 2 holds experts 2 and 3 (their codes and scales, or their dequantization), heads 2 and 3's
    sinks, the whole router; built without a process group (loading needs none)."""
    from safetensors.torch import load_file

    from rayspec.model.parallel import TPGroup
    from rayspec.model.weights.hub import load_hf_config

    path = oss["dirs"]["mxfp4"]
    model = loader.build_model(load_hf_config(path), model_dir=path, tp=TPGroup(rank=1, size=2),
                               dequantize_experts=experts == "dequantized")
    params = dict(model.named_parameters())
    raw = load_file(str(path / "model.safetensors"))
    whole = dict(oss["native"][0].named_parameters())
    layer = "model.layers.1."
    assert torch.equal(params[layer + "self_attn.sinks"], raw[layer + "self_attn.sinks"][2:])
    assert torch.equal(params[layer + "mlp.router.weight"], raw[layer + "mlp.router.weight"])
    assert torch.equal(params[layer + "mlp.experts.down_proj_bias"], raw[layer + "mlp.experts.down_proj_bias"][2:])
    for proj in EXPERT_PROJECTIONS:
        name = layer + "mlp.experts." + proj
        if experts == "mxfp4":
            assert torch.equal(params[name + "_blocks"], raw[name + "_blocks"][2:])
            assert torch.equal(params[name + "_scales"], raw[name + "_scales"][2:])
        else:
            assert torch.equal(params[name], whole[name][2:])


@pytest.fixture(scope="module")
def eagle3_head(oss, tmp_path_factory):
    """A random EAGLE-3 head for the native gpt-oss, its features from the layers its eagle_config names."""
    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head

    config = new_eagle_config("eagle3", oss["dirs"]["float"], LAYERS, HIDDEN)
    config.hf_config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}
    torch.manual_seed(3)
    head = build_head(config)
    attach_target(head, oss["native"][0], has_own_embedding=False)
    return save_eagle_head(head, tmp_path_factory.mktemp("oss-eagle3") / "head", dtype=torch.float32)


METHODS = [
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)),
    ("draft_model", dict(method="draft_model", k=3, draft_num_layers=1)),  # the target's first layer
    ("eagle3", dict(method="eagle3", k=4, eagle_topk=2, num_steps=3, tree_max_batch=8)),  # trees
]


@pytest.mark.parametrize("method,spec", METHODS, ids=[m[0] for m in METHODS])
def test_greedy_equals_transformers(oss, eagle3_head, method, spec):
    """Target-only and speculative greedy output, alone and batched (prefill in chunks of 8 tokens), the
    MXFP4 model's too: transformers' generate() token for token."""
    spec = dict(spec)
    if method == "eagle3":
        spec["draft_model"] = str(eagle3_head)
    path, reference = oss["dirs"]["float"], oss["reference"]
    # adaptive off: drafts made (and accepted, but for the random head) are asserted, and on this random
    # model the planner made none for the n-gram proposer
    spec["adaptive"] = False
    assert run_alone(make_engine(path, loaded=oss["native"], **spec), PROMPTS, GREEDY) == reference
    engine = make_engine(oss["dirs"]["mxfp4"], loaded=oss["packed"], max_num_batched_tokens=8, **spec)
    assert run_batch(engine, PROMPTS, GREEDY) == reference
    if method == "eagle3":
        assert engine.feature_layers == tuple(AUX_LAYERS)
    if method != "none":
        assert engine.stats.num_drafts > 0
        if method != "eagle3":  # a random head's drafts are (almost) all rejected
            assert engine.stats.num_accepted_tokens > 0


def test_compiled_step_equals_transformers(oss, monkeypatch):
    """The compiled step (traced with torch.compile's aot_eager backend: the step as traced, without
    inductor's CPU kernels): decode and n-gram verification forwards past the window, batched and padded
    to the buckets, sliding layers through their own mask and the expert loop one opaque op in the graph
    (rayspec::moe_experts, no graph break): greedy output equals transformers'."""
    from rayspec.model.compiled import CompiledForward

    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    # adaptive off: the n-gram verification forwards must run through the compiled step (accepted
    # drafts asserted), and on this random model the planner made no draft
    engine = make_engine(oss["dirs"]["float"], "ngram", k=3, loaded=oss["native"], prompt_lookup_min=1,
                         prompt_lookup_max=3, adaptive=False)
    engine.runner.set_compile(True)
    assert engine.runner.compiled is not None
    params = SamplingParams(temperature=0, max_tokens=12)  # (a prefix of the reference's 24)
    assert run_batch(engine, PROMPTS[:2], params) == [r[:12] for r in oss["reference"][:2]]
    assert engine.runner.compiled.shapes and engine.stats.num_accepted_tokens > 0


def test_tp2_experts_by_rank_equal_tp1(oss):
    """The MXFP4 gpt-oss split over two ranks (gloo, a spawned process): each rank holds half the heads,
    sinks and experts (and reads only their codes); n-gram speculation there gives transformers' output."""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from tp_utils import ProcessLauncher

    config = EngineConfig(model=str(oss["dirs"]["mxfp4"]), device="cpu", tensor_parallel_size=2, max_model_len=128,
                          max_num_seqs=4, kv_cache_memory_gb=0.1,
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False,
                                                        prompt_lookup_min=1, prompt_lookup_max=3))
    engine = LLMEngine(config, rank_launcher=ProcessLauncher())
    try:
        layer = engine.model.model.layers[0]
        assert layer.mlp.experts.num_local == 2 and layer.mlp.experts.gate_up_proj_blocks.shape[0] == 2
        assert layer.self_attn.sinks.shape == (2,)
        assert run_batch(engine, PROMPTS, GREEDY) == oss["reference"]
        assert engine.stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()


def test_family_registry_names_gpt_oss():
    from rayspec.model.families import NATIVE_MODEL_TYPES

    assert "gpt_oss" in NATIVE_MODEL_TYPES
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelArgs(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                  head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts=2, experts_per_token=3)
