"""4-bit checkpoints kept at 4 bits (issue #52, items 1 and 4): NVFP4 and MXFP4 projections held as their
codes and scales (rayspec.model.fp4_linear), target and draft, TP 1 and 2, against the same checkpoints
dequantized at load (`quantized_weights: dequantize`) and against the float model of the dequantized
weights. Fixtures: tiny random Llamas quantized with the formats' own math (tests/fp4_utils.py), served by
hub id from the localhost hub where a test is about loading as users do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model_dir
from engine_utils import make_engine, run_alone, run_batch
from fp4_utils import (quantize_mxfp4, quantize_nvfp4, random_nvfp4_llama, reference_mxfp4, reference_nvfp4,
                       write_float_checkpoint, write_mxfp4_llama, write_nvfp4_checkpoint)
from hub_server import FakeHub, use_hub
from rayspec.model import loader
from rayspec.model.fp4_linear import MXFP4, NVFP4, FP4Linear, held_bytes
from rayspec.model.linear import Linear
from rayspec.sampling.sampler import SamplingParams

VOCAB, LAYERS, HIDDEN = 256, 3, 64
PROMPTS = [[5, 17, 99, 5, 17, 99, 5, 17], [200, 3, 3, 3, 41], [9] * 12, [77, 78, 79, 80, 77, 78]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
TARGET, DRAFT = "nvidia/tiny-llama-FP4-kept", "nvidia/tiny-llama-draft-FP4-kept"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """An NVFP4 target (3 shards), an NVFP4 draft (the target's first layer), the float model of the target's
    dequantized weights, and an MXFP4 Llama (its dense projections MXFP4)."""
    root = tmp_path_factory.mktemp("fp4-kept")
    target = make_tiny_model_dir(root / "float", seed=31, num_layers=LAYERS, hidden=HIDDEN, vocab_size=VOCAB,
                                 with_tokenizer=False)
    draft = root / "draft-float"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(json.loads((target / "config.json").read_text())
                                                  | {"num_hidden_layers": 1}))
    state = load_file(str(target / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith(("model.layers.1.", "model.layers.2."))},
              str(draft / "model.safetensors"))
    fp4 = write_nvfp4_checkpoint(target, root / "fp4", num_shards=3)
    return {"fp4": fp4, "draft_fp4": write_nvfp4_checkpoint(draft, root / "draft-fp4", in_config=True),
            "dequantized": write_float_checkpoint(fp4, root / "dequantized"),
            "mxfp4": write_mxfp4_llama(target, root / "mxfp4")}


@pytest.fixture
def hub(checkpoints, tmp_path, monkeypatch):
    server = FakeHub()
    server.add_repo(TARGET, checkpoints["fp4"])
    server.add_repo(DRAFT, checkpoints["draft_fp4"])
    server.start()
    use_hub(monkeypatch, server.url, tmp_path / "hf-home")
    yield server
    server.stop()


# ---- the layer -------------------------------------------------------------------------------------------

def _layer(fmt: str, out_features: int, in_features: int, seed: int, scratch=None) -> tuple[FP4Linear, torch.Tensor]:
    """An FP4Linear holding a random weight quantized by the format's math, and that weight's reference
    dequantization (float32, from the bits: tests/fp4_utils.py)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    layer = FP4Linear(in_features, out_features, True, fmt, scratch)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(out_features, generator=gen))
        if fmt == NVFP4:
            q = quantize_nvfp4(w)
            layer.weight.copy_(q["weight"])
            layer.weight_scale.copy_(q["weight_scale"])
            layer.weight_scale_2.copy_(q["weight_scale_2"])
            ref = reference_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])
        else:
            blocks, scales = quantize_mxfp4(w)
            layer.weight_blocks.copy_(blocks)
            layer.weight_scales.copy_(scales)
            ref = reference_mxfp4(blocks, scales)
    return layer, ref


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
def test_layer_computes_the_dequantized_weight_to_the_bit(fmt):
    """A 4-bit layer's output equals F.linear on the reference dequantization of its codes, bit for bit, in
    float32 and bfloat16 (the weight rounded to bfloat16 as a dequantized load holds it), for 1 to 70 rows;
    two layers of one model share one scratch buffer, allocated once for the larger; a cast leaves the codes
    and scales as stored."""
    big, big_ref = _layer(fmt, 96, 256, seed=1)
    small, small_ref = _layer(fmt, 64, 128, seed=2, scratch=big.scratch)
    assert big.scratch is small.scratch and big.scratch.numel == 96 * 256
    for dtype in (torch.float32, torch.bfloat16):
        for layer, ref in ((big, big_ref), (small, small_ref)):
            layer.to(dtype)
            assert layer.codes.dtype == torch.uint8 and layer.bias.dtype == dtype
            for rows in (1, 5, 70):
                x = torch.randn(rows, layer.in_features).to(dtype)
                want = F.linear(x, ref.to(dtype), layer.bias)
                assert torch.equal(layer(x), want), (dtype, rows)
        work, _ = big.scratch._buffers[(torch.device("cpu"), dtype)]
        assert work.values.numel() == 96 * 256  # one float32 buffer, the larger layer's size
    # batch-invariant: rows in calls of one shape; a row's bits do not depend on the rows beside it
    big.tile_rows = 64
    x = torch.randn(9, 256).bfloat16()
    assert torch.equal(big(x)[3:4], big(x[3:4]))
    # the held bytes are the 4-bit ones: half a byte a weight and a scale byte per group (+ the float bias)
    group = {NVFP4: 16, MXFP4: 32}[fmt]
    assert big.stored_bytes() == 96 * 256 // 2 + 96 * 256 // group + (4 if fmt == NVFP4 else 0) + 96 * 2


# ---- the model ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_model_equals_the_dequantized_one(checkpoints, dtype):
    """Loaded `keep` (the default), every decoder projection is 4-bit and lm_head (excluded by the checkpoint)
    float; a prefill's logits equal those of the same checkpoint loaded `dequantize`: to float32 rounding
    (the dequantized model runs the CPU kernels it measured, oneDNN or another, on the same weights), and
    in bfloat16 within its rounding; the MXFP4 Llama likewise."""
    for name, atol in (("fp4", 1e-4), ("mxfp4", 1e-4)):
        kept, _ = loader.load_model(str(checkpoints[name]), device="cpu", dtype=dtype, tokenizer=False)
        float_twin, _ = loader.load_model(str(checkpoints[name]), device="cpu", dtype=dtype, tokenizer=False,
                                          quantized_weights="dequantize")
        layer = kept.model.layers[1]
        for proj in PROJECTIONS:
            module = getattr(layer.self_attn if proj in PROJECTIONS[:4] else layer.mlp, proj)
            assert isinstance(module, FP4Linear) and module.fmt == (NVFP4 if name == "fp4" else MXFP4), proj
        assert type(kept.lm_head) is Linear and not any(isinstance(m, FP4Linear) for m in float_twin.modules())
        ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
        got, want = _prefill_logits(kept, ids), _prefill_logits(float_twin, ids)
        if dtype == torch.float32:
            assert torch.allclose(got, want, rtol=0, atol=atol * want.abs().max()), (name, (got - want).abs().max())
        else:  # bfloat16 rounds each layer's output: a few units of its last place on the logits' scale
            assert (got - want).abs().max() <= 0.05 * want.abs().max(), (name, (got - want).abs().max())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def _prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[1, T] ids -> [T, vocab]: a prefill's logits through the model's paged KV cache."""
    from rayspec.model.runner import make_runner

    runner = make_runner(model, 64, num_slots=1, slack=1)
    runner.kv.allocate("a")
    with torch.no_grad():
        return runner.forward(["a"], [ids[0].tolist()], last_only=False)[0]


def test_target_and_draft_kept_by_hub_id_greedy(hub, checkpoints):
    """NVFP4 target + NVFP4 draft by hub id, both kept 4-bit: target-only greedy output equals the float
    model of the dequantized weights, and speculative greedy output (batched and alone) equals target-only,
    with drafts both accepted and rejected; `dequantize` gives the same tokens."""
    reference = run_alone(make_engine(checkpoints["dequantized"]), PROMPTS, GREEDY)
    target_only = make_engine(TARGET)
    assert isinstance(target_only.model.model.layers[0].mlp.down_proj, FP4Linear)
    assert run_alone(target_only, PROMPTS, GREEDY) == reference
    spec = make_engine(TARGET, method="draft_model", draft_model=DRAFT, k=3)
    draft = spec.proposer.runner.model
    assert isinstance(draft.model.layers[0].self_attn.q_proj, FP4Linear)
    assert run_batch(spec, PROMPTS, GREEDY) == reference
    assert run_alone(spec, PROMPTS[:2], GREEDY) == reference[:2]
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens
    from rayspec.config import EngineConfig
    from rayspec.engine.llm_engine import LLMEngine

    config = EngineConfig(model=TARGET, device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_gb=0.5,
                          quantized_weights="dequantize")
    dequantized = LLMEngine(config)
    assert type(dequantized.model.model.layers[0].mlp.down_proj) is Linear
    assert run_alone(dequantized, PROMPTS, GREEDY) == reference
    with pytest.raises(ValueError, match="quantized_weights 'bf16'"):
        EngineConfig(model=TARGET, quantized_weights="bf16")


def test_kept_weights_hold_the_4bit_bytes(tmp_path):
    """The process holds a kept model's 4-bit bytes: its parameters, buffers and dequantization scratch (after
    a forward allocated it) come within 1.1x of the checkpoint's stored bytes, where the same checkpoint
    dequantized to bfloat16 holds more than 2x them (so the bound tells the two apart)."""
    # deep and narrow, so that the one scratch (the largest layer's weight in float32 and bfloat16, its
    # int32 byte and scale indices: 8.25 bytes a weight, against 0.56 held) weighs what it does in a real model
    fp4 = random_nvfp4_llama(tmp_path / "fp4", num_layers=32, hidden=128, vocab_size=256)
    stored = sum(f.stat().st_size for f in fp4.glob("*.safetensors"))
    kept, _ = loader.load_model(str(fp4), device="cpu", dtype=torch.bfloat16, tokenizer=False)
    floats, _ = loader.load_model(str(fp4), device="cpu", dtype=torch.bfloat16, tokenizer=False,
                                  quantized_weights="dequantize")
    x = torch.randn(3, 128).bfloat16()
    kept.model.layers[0].mlp.down_proj(kept.model.layers[0].mlp.up_proj(x))  # allocates the scratch
    held = held_bytes(kept)
    assert kept.dequant_scratch._buffers, "the scratch was not allocated: the check would not count it"
    print({"stored": stored, "kept": held, "dequantized": held_bytes(floats)})
    assert held <= 1.1 * stored, (held, stored)
    assert held_bytes(floats) > 2 * stored


def test_tp2_kept_equals_tp1(hub, checkpoints):
    """The NVFP4 target kept 4-bit and split over two ranks (gloo, local processes: each holds its rows of the
    column-parallel codes and scales, its inputs of the row-parallel ones), the NVFP4 draft on rank 0: greedy
    output equals TP=1's."""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from tp_utils import ProcessLauncher

    reference = run_alone(make_engine(TARGET), PROMPTS, GREEDY)
    config = EngineConfig(model=TARGET, device="cpu", tensor_parallel_size=2, max_model_len=256, max_num_seqs=8,
                          kv_cache_memory_gb=0.5,
                          speculative=SpeculativeConfig(method="draft_model", draft_model=DRAFT,
                                                        num_speculative_tokens=3, adaptive=False))
    engine = LLMEngine(config, rank_launcher=ProcessLauncher())
    try:
        attn, mlp = engine.model.model.layers[0].self_attn, engine.model.model.layers[0].mlp
        assert isinstance(attn.o_proj, FP4Linear) and attn.o_proj.codes.shape == (HIDDEN, HIDDEN // 4)  # half the inputs
        assert mlp.gate_proj.codes.shape == (HIDDEN, HIDDEN // 2)  # half the rows of [2 * HIDDEN, HIDDEN / 2]
        assert run_batch(engine, PROMPTS, GREEDY) == reference
        assert engine.stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()


def test_sampled_4bit_target_and_draft_follow_the_target(tmp_path):
    """Sampled losslessness with a 4-bit target and a 4-bit draft (both NVFP4, kept): 3000 unseeded requests
    (rejection sampling of the draft's sampled chains, k = 3) at temperature 0.9, top-k 6, top-p 0.9 on a
    16-token model; the first three tokens' marginals pass Pearson's chi-square test against the exact
    marginals of the float model of the target's dequantized weights (tests/marginals.py: transformers'
    forward and the sampler's transform in numpy, not rayspec's). Power, asserted here for this target:
    a two-token shift of TV 0.05 at any checked position is rejected with probability >= 0.99 at alpha 1e-4
    (stat_utils.power, noncentral chi-square); a bias spread in proportion over every token from TV ~0.07."""
    import stat_utils
    from marginals import (ALPHA, NUM_REQUESTS, PROMPT, SHIFT, TEMPERATURE, TOP_K, TOP_P, VOCAB, assert_marginals,
                           marginals, shifted)

    target = make_tiny_model_dir(tmp_path / "target", seed=11, vocab_size=VOCAB, with_tokenizer=False)
    draft = make_tiny_model_dir(tmp_path / "draft", seed=12, num_layers=1, vocab_size=VOCAB, with_tokenizer=False)
    target_fp4 = write_nvfp4_checkpoint(target, tmp_path / "target-fp4")
    draft_fp4 = write_nvfp4_checkpoint(draft, tmp_path / "draft-fp4", in_config=True)
    exact = marginals(write_float_checkpoint(target_fp4, tmp_path / "dequantized"), None)
    for pos in range(3):
        null = {t: float(v) for t, v in enumerate(exact[pos]) if v > 0}
        assert stat_utils.power(null, shifted(exact[pos], SHIFT), NUM_REQUESTS, ALPHA) >= 0.99, pos
    # adaptive off: every step drafts k = 3 (the planner's modelled costs would let this draft pass), so every
    # request's tokens go through the rejection rule
    engine = make_engine(target_fp4, method="draft_model", k=3, adaptive=False, draft_model=str(draft_fp4),
                         max_model_len=40, max_num_seqs=64, engine_seed=4321)
    assert isinstance(engine.model.model.layers[0].mlp.gate_proj, FP4Linear)
    assert isinstance(engine.proposer.runner.model.model.layers[0].mlp.gate_proj, FP4Linear)
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, max_tokens=4, ignore_eos=True)
              for _ in range(NUM_REQUESTS)]
    outs = engine.generate([PROMPT] * NUM_REQUESTS, params)
    assert all(len(o.token_ids) == 4 for o in outs)
    assert_marginals(outs, exact, "4-bit target + 4-bit draft")
    stats = engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were verified, some rejected


def test_the_option_is_an_engine_setting_an_app_arg_and_a_flag():
    """`quantized_weights` (keep | dequantize, default keep) is an EngineSettings field: a serve config's
    `engine:` key and a `rayspec serve` / `bench` flag (rayspec_cli.flags makes one per scalar field); other
    values are refused by name."""
    from deployments.config import load_app_args
    from rayspec.config import EngineConfig
    from rayspec_cli.flags import engine_flag_fields

    assert EngineConfig().quantized_weights == "keep"
    args = load_app_args({"model": TARGET, "engine": {"quantized_weights": "dequantize"}})
    assert args.engine_config().quantized_weights == "dequantize"
    with pytest.raises(ValueError, match="quantized_weights 'fp16'"):
        load_app_args({"model": TARGET, "engine": {"quantized_weights": "fp16"}}).engine_config()
    assert ("quantized_weights", str, "keep") in engine_flag_fields()
