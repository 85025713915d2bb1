"""FP4 checkpoints as published: NVFP4 (ModelOpt) Llama targets and drafts on the native path, at
TP 1 and 2, served from the localhost hub by hub id. The fixtures are tiny random Llamas quantized
with the format's own math (tests/fp4_utils.py); the loader's dequantization must equal a bit-level
reference, and greedy output must equal that of the float model built from the dequantized weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model_dir
from engine_utils import make_engine, run_alone, run_batch
from fp4_utils import (dequantized_state, quantize_nvfp4, reference_nvfp4, write_float_checkpoint,
                       write_nvfp4_checkpoint)
from hub_server import FakeHub, use_hub
from rayspec.model import loader
from rayspec.model.formats import UnsupportedQuantizationError, nvfp4
from rayspec.model.weights import checkpoint, hub as weights_hub
from rayspec.sampling.sampler import SamplingParams

VOCAB, LAYERS, HIDDEN = 256, 3, 64
PROMPTS = [[5, 17, 99, 5, 17, 99, 5, 17], [200, 3, 3, 3, 41], [9] * 12, [77, 78, 79, 80, 77, 78]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
TARGET, DRAFT = "nvidia/tiny-llama-FP4", "nvidia/tiny-llama-draft-FP4"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The float target, its NVFP4 export (3 shards, hf_quant_config.json), an NVFP4 draft (the target's
    first layer, quantization_config in config.json), and the float model of the target's dequantized weights."""
    root = tmp_path_factory.mktemp("fp4")
    target = make_tiny_model_dir(root / "float", seed=31, num_layers=LAYERS, hidden=HIDDEN, vocab_size=VOCAB,
                                 with_tokenizer=False)
    draft = root / "draft-float"  # the target cut to one layer: a draft that agrees with it often
    draft.mkdir()
    config = json.loads((target / "config.json").read_text()) | {"num_hidden_layers": 1}
    (draft / "config.json").write_text(json.dumps(config))
    state = load_file(str(target / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith(("model.layers.1.", "model.layers.2."))},
              str(draft / "model.safetensors"))
    fp4 = write_nvfp4_checkpoint(target, root / "fp4", num_shards=3)
    return {"float": target, "fp4": fp4, "draft_fp4": write_nvfp4_checkpoint(draft, root / "draft-fp4", in_config=True),
            "dequantized": write_float_checkpoint(fp4, root / "dequantized")}


def _serve_hub(monkeypatch, tmp_path, repos: dict):
    """A localhost hub holding `repos` (hub id -> directory), the process pointed at it."""
    server = FakeHub()
    for repo_id, path in repos.items():
        server.add_repo(repo_id, path)
    server.start()
    use_hub(monkeypatch, server.url, tmp_path / "hf-home")
    return server


@pytest.fixture
def hub(checkpoints, tmp_path, monkeypatch):
    server = _serve_hub(monkeypatch, tmp_path, {TARGET: checkpoints["fp4"], DRAFT: checkpoints["draft_fp4"]})
    yield server
    server.stop()


def test_dequantize_equals_the_bit_reference():
    """Every byte value, scales over the float8 range (subnormals, zero, 448) and a per-tensor scale
    that rounds: the loader's table lookup gives the reference's bits, in float32 and bfloat16."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.arange(256, dtype=torch.uint8).repeat(8, 4)  # [8, 1024]: each byte in every position
    scale_bits = torch.randint(0, 0x7F, (8, 2048 // 16), generator=gen, dtype=torch.uint8)  # no NaN (0x7F)
    scale_bits[0, :3] = torch.tensor([0, 1, 0x7E], dtype=torch.uint8)  # zero, smallest subnormal, 448
    scale = scale_bits.view(torch.float8_e4m3fn)
    scale_2 = torch.tensor(0.0123456789, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        ours = nvfp4.dequantize(packed, scale, scale_2, dtype)
        ref = reference_nvfp4(packed, scale, scale_2, dtype)
        assert ours.dtype == dtype and torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                                   ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    # the layout: even input in the low nibble; codes 1 (0.5) and 15 (-6) in one byte
    one = nvfp4.dequantize(torch.full((1, 8), 0xF1, dtype=torch.uint8), torch.ones(1, 1).to(torch.float8_e4m3fn), 1.0)
    assert one[0, :4].tolist() == [0.5, -6.0, 0.5, -6.0]
    # the quantizer the fixtures use is the format's: a weight made of E2M1 values times one scale per 16
    # comes back up to the rounding of the per-tensor scale (amax / 2688)
    w = torch.tensor(nvfp4.E2M1_VALUES).repeat(4, 2) * torch.tensor([[0.25], [1.0], [2.0], [0.125]])
    q = quantize_nvfp4(w)
    assert torch.allclose(nvfp4.dequantize(q["weight"], q["weight_scale"], q["weight_scale_2"]), w, rtol=1e-6, atol=0)


def _sliced(module, dim: int, start: int, stop: int) -> torch.nn.Parameter:
    shape = list(module.weight.shape)
    shape[dim] = stop - start
    module.weight = torch.nn.Parameter(torch.full(shape, float("nan"), dtype=module.weight.dtype))
    module.weight.tp_shard = (dim, start, stop)
    return module.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_equal_the_reference_dequantization(checkpoints, dtype, monkeypatch):
    """Three shards (weights and their scales in different files), chunks of a few rows, and the slices
    tensor parallelism reads (rows of a column-parallel layer, inputs of a row-parallel one): every
    parameter holds the reference dequantization to the bit; lm_head, embeddings and norms load as stored."""
    monkeypatch.setitem(nvfp4.CHUNK_ELEMENTS, "cpu", 1000)  # several chunks per weight, not row multiples
    ref = dequantized_state(checkpoints["fp4"], dtype)
    model = loader.empty_model(weights_hub.load_hf_config(checkpoints["fp4"]), "cpu", dtype)
    layer = model.model.layers[1]
    column = _sliced(layer.mlp.gate_proj, 0, 32, 96)
    row = _sliced(layer.mlp.down_proj, 1, 64, 128)
    checkpoint.load_checkpoint(model, checkpoints["fp4"])
    assert torch.equal(column, ref["model.layers.1.mlp.gate_proj.weight"][32:96])
    assert torch.equal(row, ref["model.layers.1.mlp.down_proj.weight"][:, 64:128])
    floats = load_file(str(checkpoints["float"] / "model.safetensors"))
    for name, param in model.named_parameters():
        if name not in ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"):
            assert torch.equal(param, ref[name]), name
        if "layers" not in name or "norm" in name:  # unquantized: as stored
            assert torch.equal(param, floats[name].to(dtype)), name
    # quantized: close to the float weights it was made from, not equal (4 bits)
    q = model.model.layers[0].self_attn.q_proj.weight.float()
    w = floats["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, w) and (q - w).abs().max() < 0.25 * w.abs().max()
    # an input slice that cuts a group of 16 is refused by name
    bad = _sliced(model.model.layers[0].self_attn.o_proj, 1, 8, 40)
    with pytest.raises(ValueError, match="o_proj.weight.*groups of 16"):
        checkpoint.load_checkpoint(model, checkpoints["fp4"])
    assert bad.isnan().all()


def test_target_and_draft_by_hub_id_greedy_equals_the_dequantized_float_model(hub, checkpoints):
    """NVFP4 target + NVFP4 draft from the localhost hub: speculative greedy output equals target-only,
    which equals the float checkpoint of the dequantized weights; only the files a load needs came."""
    reference = run_alone(make_engine(checkpoints["dequantized"]), PROMPTS, GREEDY)
    target_only = make_engine(TARGET)
    assert run_alone(target_only, PROMPTS, GREEDY) == reference
    assert set(hub.downloads(TARGET)) >= {"hf_quant_config.json", "model.safetensors.index.json"}
    spec = make_engine(TARGET, method="draft_model", draft_model=DRAFT, k=3)
    assert run_batch(spec, PROMPTS, GREEDY) == reference
    assert run_alone(spec, PROMPTS[:2], GREEDY) == reference[:2]
    stats = spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both accepted and rejected
    draft = spec.proposer.runner.model
    assert draft.args.num_layers == 1
    # the original float weights give other tokens: the test sees the quantization
    assert run_alone(make_engine(checkpoints["float"]), PROMPTS, GREEDY) != reference


def test_tp2_by_hub_id_equals_tp1(hub, checkpoints):
    """The NVFP4 target loaded `quantized_weights: dequantize` and split over two ranks (gloo, local processes),
    each dequantizing only its slice, with the NVFP4 draft on rank 0: greedy output equals TP=1 target-only on
    the dequantized weights (kept 4-bit at TP 2: tests/test_fp4_kept.py)."""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from tp_utils import ProcessLauncher

    reference = run_alone(make_engine(checkpoints["dequantized"]), PROMPTS, GREEDY)
    config = EngineConfig(model=TARGET, device="cpu", tensor_parallel_size=2, max_model_len=256, max_num_seqs=8,
                          kv_cache_memory_gb=0.5, quantized_weights="dequantize",
                          speculative=SpeculativeConfig(method="draft_model", draft_model=DRAFT,
                                                        num_speculative_tokens=3, adaptive=False))
    engine = LLMEngine(config, rank_launcher=ProcessLauncher())
    try:
        assert engine.model.tp.size == 2
        attn = engine.model.model.layers[0].self_attn
        assert attn.o_proj.weight.shape == (HIDDEN, HIDDEN // 2)  # this rank's inputs only
        assert run_batch(engine, PROMPTS, GREEDY) == reference
        assert engine.stats.num_accepted_tokens > 0
    finally:
        engine.shutdown()


def test_unsupported_quantizations_fail_by_name(checkpoints, tmp_path):
    import shutil

    fp8 = tmp_path / "fp8"
    shutil.copytree(checkpoints["fp4"], fp8)
    (fp8 / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(UnsupportedQuantizationError, match="quant_algo 'FP8'"):
        loader.load_model(str(fp8), device="cpu", tokenizer=False)
    awq = tmp_path / "awq"
    shutil.copytree(checkpoints["float"], awq)
    config = json.loads((awq / "config.json").read_text())
    (awq / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(UnsupportedQuantizationError, match="quant_method 'awq'"):
        loader.load_model(str(awq), device="cpu", tokenizer=False)


# ---- MXFP4 gpt-oss with its EAGLE-3 head (the native path, experts kept 4-bit) ------------------------

GPT_OSS, GPT_OSS_HEAD = "openai/tiny-gpt-oss", "nvidia/tiny-gpt-oss-Eagle3"
AUX_LAYERS = [0, 1, 3]  # not the default for 4 layers: the head's eagle_config must be read
OSS_PROMPTS = [[5, 17, 99, 5, 17, 99, 5, 17], [100, 3, 3, 3, 41], [9] * 12]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> dict[str, Path]:
    """A tiny gpt_oss with MXFP4 experts, the float model of its dequantized weights, and a ModelOpt-style
    EAGLE-3 head: a reduced draft vocabulary with `d2t` and no `t2d`, its feature layers in `eagle_config`."""
    from fp4_utils import write_mxfp4_float, write_mxfp4_gpt_oss

    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head
    from rayspec.model.generic import load_generic_model

    root = tmp_path_factory.mktemp("gpt-oss")
    mxfp4 = write_mxfp4_gpt_oss(root / "mxfp4", seed=5)
    dequantized = write_mxfp4_float(mxfp4, root / "dequantized")
    target = load_generic_model(dequantized, weights_hub.load_hf_config(dequantized), "cpu", torch.float32)
    config = new_eagle_config("eagle3", dequantized, target.args.num_layers, target.args.hidden_size, draft_vocab_size=96)
    config.hf_config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}
    torch.manual_seed(4)
    head = build_head(config)
    attach_target(head, target, has_own_embedding=False)
    ids = torch.cat((torch.arange(0, 64), torch.arange(96, 128)))  # draft id -> target id
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(96))
        head.lm_head.weight.copy_(target.lm_head.weight[ids])
    head_dir = save_eagle_head(head, root / "head", dtype=torch.float32)
    state = load_file(str(head_dir / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "t2d"}, str(head_dir / "model.safetensors"))
    return {"mxfp4": mxfp4, "dequantized": dequantized, "head": head_dir, "draft_ids": ids}


@pytest.fixture
def oss_hub(gpt_oss, tmp_path, monkeypatch):
    server = _serve_hub(monkeypatch, tmp_path, {GPT_OSS: gpt_oss["mxfp4"], GPT_OSS_HEAD: gpt_oss["head"]})
    yield server
    server.stop()


def test_mxfp4_gpt_oss_and_eagle3_head_by_hub_id(oss_hub, gpt_oss):
    """The MXFP4 gpt_oss from the hub, on the native path: its experts held as the checkpoint's codes and
    scales, whose dequantization (rayspec.model.formats.mxfp4) equals a bit-level one; dequantized at load
    when asked; target-only greedy output equals the dequantized float model's, and EAGLE-3 speculation
    (features from the layers the head's eagle_config names, t2d rebuilt from d2t) gives the same tokens."""
    from fp4_utils import mxfp4_dequantized_state

    from rayspec.model.formats import mxfp4
    from rayspec.model.native import CausalLM

    model, _ = loader.load_model(GPT_OSS, device="cpu", tokenizer=False)
    assert isinstance(model, CausalLM) and model.args.mxfp4_experts
    raw = load_file(str(gpt_oss["mxfp4"] / "model.safetensors"))
    ref = mxfp4_dequantized_state(gpt_oss["mxfp4"])
    params = dict(model.named_parameters())
    packed = [n for n in raw if n.endswith(("_blocks", "_scales"))]
    assert len(packed) == 16 and all(torch.equal(params[n], raw[n]) for n in packed)
    for name in (n.removesuffix("_blocks") for n in packed if n.endswith("_blocks")):
        assert torch.equal(mxfp4.dequantize(raw[name + "_blocks"], raw[name + "_scales"]).transpose(1, 2), ref[name])
    assert all(torch.equal(params[n], ref[n]) for n in ref if n in params)
    dequantized, _ = loader.load_model(GPT_OSS, device="cpu", tokenizer=False, dequantize_experts=True)
    assert all(torch.equal(p, ref[n]) for n, p in dequantized.named_parameters())

    reference = run_alone(make_engine(gpt_oss["dequantized"]), OSS_PROMPTS, GREEDY)
    assert run_alone(make_engine(GPT_OSS, loaded=(model, None)), OSS_PROMPTS, GREEDY) == reference
    spec = make_engine(GPT_OSS, method="eagle3", draft_model=GPT_OSS_HEAD, k=3, loaded=(model, None))
    assert spec.feature_layers == tuple(AUX_LAYERS)
    head = spec.proposer.head
    assert torch.equal(torch.nonzero(head.t2d).flatten(), gpt_oss["draft_ids"])
    assert run_batch(spec, OSS_PROMPTS, GREEDY) == reference
    assert spec.stats.num_draft_tokens > 0


def test_nvfp4_on_the_generic_path_is_refused(checkpoints, tmp_path):
    """An NVFP4 checkpoint of a family the native model does not run (Gemma 2) fails by name at load."""
    import shutil

    from transformers import Gemma2Config

    other = tmp_path / "gemma2-nvfp4"
    shutil.copytree(checkpoints["fp4"], other)
    (other / "config.json").write_text(json.dumps(Gemma2Config(vocab_size=VOCAB, hidden_size=HIDDEN,
                                                               num_hidden_layers=LAYERS).to_dict()))
    with pytest.raises(UnsupportedQuantizationError, match="native model families only"):
        loader.load_model(str(other), device="cpu", tokenizer=False)


# ---- memory: a load holds the weights once ------------------------------------------------------------

_PEAK_SCRIPT = """
import json, sys
import torch, transformers
from transformers import AutoConfig  # what a load imports lazily: part of the baseline
from rayspec.model import loader
from rayspec.model.weights import checkpoint, hub as weights_hub

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

checkpoint.READ_CHUNK_BYTES = 1 << 20  # the float tensors' read buffer: a constant 16 MiB otherwise, not the weights
warm = loader.empty_model(weights_hub.load_hf_config(sys.argv[2]), "cpu", torch.float32)  # first-load set-up
checkpoint.load_checkpoint(warm, sys.argv[2])
del warm
config = weights_hub.load_hf_config(sys.argv[1])
open("/proc/self/clear_refs", "w").write("5")  # reset the peak mark to the current RSS
baseline = status("VmRSS")
model = loader.empty_model(config, "cpu", torch.float32)
checkpoint.load_checkpoint(model, sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak": status("VmHWM") - baseline, "weights": weights, "baseline": baseline}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_nvfp4_load_peak_stays_well_under_two_copies_of_the_weights(tmp_path):
    """Loading an NVFP4 checkpoint whose float32 weights are 88 MB (decoder Linears 4-bit: 15 MB on disk)
    raises the process's peak RSS by at most 1.4x those weights: the weights are dequantized into their
    parameters, never held as a second float copy of the model (that would read 2x). The slack above 1x is
    the allocator's and the read buffers': measured 1.07-1.13x on an AMD EPYC, 1.21x once on CI's machine
    (where a 1.2x bound failed), so this bound tells "one copy" from "two" and not one machine's malloc
    from another's."""
    from fp4_utils import random_nvfp4_llama

    fp4 = random_nvfp4_llama(tmp_path / "fp4", num_layers=4, hidden=768, vocab_size=512)
    warm = random_nvfp4_llama(tmp_path / "warm", num_layers=1, hidden=64, vocab_size=256)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(fp4), str(warm)], cwd=root, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["weights"] > 80e6
    assert figures["peak"] <= 1.4 * figures["weights"], figures
