"""MXFP4 weights as gpt-oss ships them: its MoE experts only. The native model keeps them as codes and
scales and dequantizes an expert when a token routes to it (rayspec.model.moe, `dequantize` here); the
generic path has transformers dequantize them at load.

Per expert projection (E experts of `rows` outputs x K inputs) a checkpoint holds
  `<proj>_blocks`  uint8 [E, rows, K / 32, 16]: two E2M1 codes per byte, the even input in the low nibble
  `<proj>_scales`  uint8 [E, rows, K / 32]: an E8M0 exponent per 32 inputs (value 2^(s - 127))
so W[e, o, i] = E2M1[code] * 2^(scale[e, o, i // 32] - 127), exact in bfloat16 and float32; everything
else (attention, router, embeddings, LM head) is bfloat16.

transformers' gpt_oss (the generic path) reads this layout: `Mxfp4Config(dequantize=True)` makes it dequantize in plain
torch as each tensor loads, on any device (without it transformers would fetch Triton kernels from the
hub on a GPU: rayspec never downloads kernels). Dequantized, gpt-oss-20b is about 42 GB in bfloat16,
gpt-oss-120b about 234 GB: more than one GPU holds; on the native path the experts stay 4-bit (about
65 GB for 120b) and split over tensor-parallel ranks.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
SCALE_BIAS = 127
BITS_PER_WEIGHT = 4 + 8 / GROUP_SIZE  # a code per weight, an 8-bit exponent per 32


def transformers_config():
    """The quantization_config for transformers' from_pretrained: dequantize at load, in torch."""
    from transformers import Mxfp4Config

    return Mxfp4Config(dequantize=True)


EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # transformers' GptOssExperts parameters
BLOCKS, SCALES = "_blocks", "_scales"  # a checkpoint's <projection>_blocks / <projection>_scales


def _e2m1_values(device) -> torch.Tensor:
    """[16] float32: the value of each E2M1 code (bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa),
    computed on `device` (no host copy per call: a step dequantizes an expert per layer)."""
    code = torch.arange(16, device=device)
    exponent, mantissa = (code >> 1) & 3, (code & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent.to(torch.float32) - 1) * (1 + 0.5 * mantissa))
    return torch.where(code >= 8, -magnitude, magnitude)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., rows, K / 32, 16] (two E2M1 codes a byte, the even input in the low nibble),
    scales uint8 [..., rows, K / 32] (E8M0) -> [..., rows, K] in `dtype`, on blocks' device. Exact: a
    code's value times a power of two, in float32, then the cast (exact in bfloat16 too)."""
    values, codes = _e2m1_values(blocks.device), blocks.to(torch.int32)
    pairs = torch.stack((values[codes & 0xF], values[codes >> 4]), dim=-1)  # [..., rows, K / 32, 16, 2]
    pairs = pairs.flatten(-2) * torch.exp2(scales.to(torch.float32) - SCALE_BIAS)[..., None]
    return pairs.flatten(-2).to(dtype)


def quantized_params(model, quantization) -> dict[int, int]:
    """id(parameter) -> its stored bytes, for the MoE expert projections (gpt-oss's `mlp.experts.
    gate_up_proj` / `down_proj`): a byte per two weights, one exponent byte per 32."""
    out = {}
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if module.endswith("experts") and leaf in EXPERT_PROJECTIONS and not quantization.excludes(module):
            out[id(param)] = param.numel() // 2 + param.numel() // GROUP_SIZE
        elif module.endswith("experts") and leaf.removesuffix(BLOCKS).removesuffix(SCALES) in EXPERT_PROJECTIONS:
            out[id(param)] = param.numel()  # the native model's packed experts: stored as they are held
    return out


@torch.no_grad()
def fill_dense(param: torch.Tensor, name: str, tensors, shard: tuple[int, int, int] | None) -> None:
    """Fill a float dense projection `param` ([out, in], or its tp_shard: rows, or inputs in whole groups)
    named `name` ("<module>.weight") from the checkpoint's MXFP4 `<module>.weight_blocks` [out, in / 32, 16]
    and `_scales` [out, in / 32] (a checkpoint whose dense projections are MXFP4, read with
    quantized_weights dequantize). tensors: rayspec.model.weights.checkpoint.CheckpointTensors."""
    blocks, scales = tensors.read(name + BLOCKS), tensors.read(name + SCALES)
    if shard is not None:
        dim, start, stop = shard
        if dim == 1 and (start % GROUP_SIZE or stop % GROUP_SIZE):
            raise ValueError(f"{name}: a tensor-parallel slice of inputs {start}..{stop} does not fall on MXFP4's "
                             f"groups of {GROUP_SIZE}")
        if dim == 1:
            start, stop = start // GROUP_SIZE, stop // GROUP_SIZE
        blocks, scales = blocks.narrow(dim, start, stop - start), scales.narrow(dim, start, stop - start)
    want = (blocks.shape[0], blocks.shape[1] * GROUP_SIZE)
    if tuple(param.shape) != want:
        raise ValueError(f"{name}: the model's parameter has shape {list(param.shape)}, the checkpoint's MXFP4 "
                         f"weight dequantizes to {list(want)}")
    param.copy_(dequantize(blocks.to(param.device), scales.to(param.device), param.dtype))
