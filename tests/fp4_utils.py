"""Tiny FP4 checkpoints made with the formats' own math, for the loader's tests.

`quantize_nvfp4` is ModelOpt's NVFP4 weight quantization (per-tensor scale amax / (6 * 448), per-16
scale block amax / 6 rounded to float8_e4m3fn, codes rounded to the nearest E2M1 value);
`reference_nvfp4` decodes the bits (sign, exponent, mantissa) instead of the loader's table, so
the two agree only if both read the layout right. `write_nvfp4_checkpoint` saves a float
checkpoint's decoder Linears in ModelOpt's names and layout with its `hf_quant_config.json`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FP8_MAX, E2M1_MAX, GROUP = 448.0, 6.0, 16
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# the decoder Linears ModelOpt quantizes in a Llama (lm_head and the embeddings stay float)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (0..15, sign in bit 3) of each element of x (|x| <= 6); a tie goes to the smaller
    magnitude (the midpoints between grid values belong to the lower one)."""
    magnitude = torch.bucketize(x.abs(), (_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2)
    return (magnitude | ((x < 0).long() << 3)).to(torch.uint8)


def quantize_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight [out, in] -> {"weight": uint8 [out, in/2], "weight_scale": float8_e4m3fn [out, in/16],
    "weight_scale_2": float32 [], "input_scale": float32 []}."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    scale_2 = w.abs().max() / (E2M1_MAX * FP8_MAX)
    blocks = w.view(out_features, in_features // GROUP, GROUP)
    scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / scale_2).to(torch.float8_e4m3fn)
    divisor = (scale.float() * scale_2)[..., None]
    scaled = torch.where(divisor > 0, blocks / divisor.clamp(min=1e-30), torch.zeros_like(blocks)).clamp(-6, 6)
    codes = _e2m1_codes(scaled).view(out_features, in_features)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even element in the low nibble
    return {"weight": packed.contiguous(), "weight_scale": scale.contiguous(),
            "weight_scale_2": scale_2.reshape(()).clone(), "input_scale": torch.tensor(1.0)}


def reference_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize from the bits: each nibble's sign, exponent and mantissa (E2M1, bias 1)."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).float()
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent.float() - 1) * (1 + 0.5 * mantissa))
    value = sign * magnitude
    scales = scale.float().repeat_interleave(GROUP, dim=1)
    return ((value * scales) * scale_2.float()).to(dtype)


def _is_quantized(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def write_nvfp4_checkpoint(float_dir: Path, out_dir: Path, num_shards: int = 1,
                           in_config: bool = False) -> Path:
    """Quantize a float Llama checkpoint (config.json + model.safetensors) to NVFP4 in ModelOpt's
    layout: `hf_quant_config.json` (or, in_config, config.json's `quantization_config` as newer
    exports write it), FP8-KV k/v scales as ModelOpt adds them, and the tensors over `num_shards`
    safetensors files with an index (a weight and its scales may land in different shards)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(Path(float_dir) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _is_quantized(name):
            module = name.removesuffix(".weight")
            out.update({f"{module}.{k}": v for k, v in quantize_nvfp4(tensor).items()})
        else:
            out[name] = tensor
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # FP8 KV-cache scales (not read)
            out[f"{name.removesuffix('.weight')}.{name.split('.')[-2][0]}_scale"] = torch.tensor(1.0)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": GROUP, "exclude_modules": ["lm_head"]}
    config = json.loads((Path(float_dir) / "config.json").read_text())
    if in_config:
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                                         "ignore": ["lm_head"], "kv_cache_quant_algo": "FP8"}
    else:
        (out_dir / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.23.0"}, "quantization": quant}, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config))
    for f in Path(float_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(f, out_dir / f.name)
    names = sorted(out)
    if num_shards == 1:
        save_file(out, str(out_dir / "model.safetensors"))
        return out_dir
    # round robin: a weight's scales land in other shards than the weight
    shards = [{n: out[n].contiguous() for n in names[i::num_shards]} for i in range(num_shards)]
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for f, shard in zip(files, shards):
        save_file(shard, str(out_dir / f))
    index = {"metadata": {}, "weight_map": {n: files[i % num_shards] for i, n in enumerate(names)}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return out_dir


def random_nvfp4_llama(out_dir: Path, num_layers: int, hidden: int, vocab_size: int, seed: int = 0) -> Path:
    """An NVFP4 Llama checkpoint of random codes and scales (no float model: fast at any size), for tests
    that need bytes, not a model that means anything."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (rows, *cols) in shapes.items():
        if _is_quantized(name):
            module = name.removesuffix(".weight")
            out[name] = torch.randint(0, 256, (rows, cols[0] // 2), generator=gen, dtype=torch.uint8)
            out[module + ".weight_scale"] = (torch.rand(rows, cols[0] // GROUP, generator=gen) * 448).to(
                torch.float8_e4m3fn)
            out[module + ".weight_scale_2"] = torch.tensor(1e-3)
        else:
            out[name] = torch.randn(rows, *cols, generator=gen) * 0.02
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    (out_dir / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4", "group_size": GROUP, "exclude_modules": ["lm_head"]}}))
    return out_dir


def dequantized_state(nvfp4_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The float state dict an NVFP4 checkpoint stands for (reference_nvfp4 of each quantized weight)."""
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for f in sorted(Path(nvfp4_dir).glob("*.safetensors")):
        raw |= load_file(str(f))
    state = {}
    for name, tensor in raw.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.weight_scale" in raw:
            state[name] = reference_nvfp4(tensor, raw[f"{module}.weight_scale"], raw[f"{module}.weight_scale_2"], dtype)
        elif not name.endswith(("_scale", "_scale_2")):
            state[name] = tensor.to(dtype)
    return state


def write_float_checkpoint(nvfp4_dir: Path, out_dir: Path) -> Path:
    """The float32 checkpoint of the dequantized weights (config without quantization)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dequantized_state(nvfp4_dir).items()}, str(out_dir / "model.safetensors"))
    config = json.loads((Path(nvfp4_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(config))
    for f in Path(nvfp4_dir).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


# ---- MXFP4 (gpt-oss experts) -----------------------------------------------------------------------

MX_GROUP = 32
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # transformers' GptOssExperts: [E, in, out] parameters


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., rows, K] -> (blocks uint8 [..., rows, K/32, 16], scales uint8 [..., rows, K/32]): the
    OCP MX rule, a shared exponent floor(log2(block amax)) - 2 (E2M1's largest exponent), codes rounded
    to the nearest E2M1 value."""
    *lead, rows, k = weight.shape
    blocks = weight.detach().float().reshape(*lead, rows, k // MX_GROUP, MX_GROUP)
    exponent = (torch.floor(torch.log2(blocks.abs().amax(dim=-1).clamp(min=2.0 ** -120))) - 2).clamp(-127, 127)
    codes = _e2m1_codes((blocks / torch.exp2(exponent)[..., None]).clamp(-6, 6))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even element in the low nibble
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, K/32, 16] codes + [..., rows, K/32] exponents -> float32 [..., rows, K], from the bits."""
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).long()  # [..., rows, K/32, 16, 2]
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).float()
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    value = sign * torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent.float() - 1) * (1 + 0.5 * mantissa))
    value = value.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # [..., rows, K/32, 32]
    return value.flatten(-2)


def tiny_gpt_oss_config(num_layers: int = 4, vocab: int = 128):
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0, num_hidden_layers=num_layers, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
                        num_local_experts=4, num_experts_per_tok=2,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                             beta_slow=1.0, original_max_position_embeddings=64))


def write_mxfp4_gpt_oss(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random gpt_oss saved as gpt-oss is published: expert weights as MXFP4 `_blocks` / `_scales`
    (rows = output features: transformers' [E, in, out] parameters transposed), the rest float, and
    config.json's `quantization_config` {"quant_method": "mxfp4", ...}."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = tiny_gpt_oss_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # sharper logits: fewer near-ties
        model.lm_head.weight.mul_(8.0)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(tuple(f"experts.{p}" for p in EXPERT_PROJECTIONS)):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            out[name] = tensor.contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"))
    doc = config.to_dict() | {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (out_dir / "config.json").write_text(json.dumps(doc))
    return out_dir


def mxfp4_dequantized_state(mxfp4_dir: Path) -> dict[str, torch.Tensor]:
    """The float32 state dict (transformers' names and layouts) an MXFP4 gpt_oss checkpoint stands for."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(mxfp4_dir) / "model.safetensors"))
    state = {}
    for name, tensor in raw.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            state[base] = reference_mxfp4(tensor, raw[base + "_scales"]).transpose(1, 2).contiguous()
        elif not name.endswith("_scales"):
            state[name] = tensor.float()
    return state


def write_mxfp4_float(mxfp4_dir: Path, out_dir: Path) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(mxfp4_dequantized_state(mxfp4_dir), str(out_dir / "model.safetensors"))
    config = json.loads((Path(mxfp4_dir) / "config.json").read_text())
    config.pop("quantization_config")
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def write_mxfp4_llama(float_dir: Path, out_dir: Path) -> Path:
    """A float Llama checkpoint's decoder projections in MXFP4 (`<module>.weight_blocks` [out, in/32, 16] and
    `_scales` [out, in/32], rows = outputs; the rest float), config.json's quantization_config "mxfp4"."""
    from safetensors.torch import load_file, save_file

    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(Path(float_dir) / "model.safetensors")).items():
        if _is_quantized(name):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor)
        else:
            out[name] = tensor
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"))
    config = json.loads((Path(float_dir) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
