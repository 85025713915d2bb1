"""NVFP4 weights as NVIDIA ModelOpt exports them, dequantized as they are read.

Per quantized Linear (out x in) a checkpoint holds:
  `weight`          uint8 [out, in / 2]: two E2M1 codes per byte, the even input in the low nibble
  `weight_scale`    float8_e4m3fn [out, in / 16]: one scale per 16 inputs
  `weight_scale_2`  float32 [] (or [1]): one scale per tensor
  `input_scale`     float32 []: the activations' scale of W4A4 kernels; not read (rayspec runs
                    weight-only: activations stay in the engine's dtype)
and W[o, i] = E2M1[code[o, i]] * weight_scale[o, i // 16] * weight_scale_2, computed in float32 in
that order (the first product is exact, so the only rounding is the second one, then the cast to
the engine's dtype): any implementation that follows it gets the same bits.

E2M1 (1 sign, 2 exponent, 1 mantissa bits): codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes
8..15 the same negated. The k_scale / v_scale tensors of an FP8-KV export are not read either: the
KV cache stays in the engine's dtype.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
# weight elements dequantized per step: what a load holds beyond the weights is about 7 bytes each
# (int32 indices of the packed bytes, the float32 values); a GPU takes larger steps (fewer launches)
CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 24}


def _byte_table(device) -> torch.Tensor:
    """[256, 2] float32: the two values of every byte (low nibble first)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float,
               dtype: torch.dtype = torch.float32, table: torch.Tensor | None = None) -> torch.Tensor:
    """packed: uint8 [rows, n / 2]; scale: float8_e4m3fn [rows, n / 16]; scale_2: float32 scalar
    -> [rows, n] in `dtype`, on packed's device."""
    rows, half = packed.shape
    if table is None:
        table = _byte_table(packed.device)
    values = table[packed.to(torch.int32)]  # [rows, n / 2, 2]; in place from here: a chunk's one float copy
    values.view(rows, -1, GROUP_SIZE).mul_(scale.to(torch.float32)[..., None])  # exact
    values.mul_(torch.as_tensor(scale_2, dtype=torch.float32, device=packed.device))
    return values.view(rows, 2 * half).to(dtype)


def quantized_weights(names) -> set[str]:
    """The `<module>.weight` names of a checkpoint that are NVFP4 (those with a `weight_scale`)."""
    names = set(names)
    return {n.removesuffix("_scale") for n in names if n.endswith(".weight_scale") and n[:-len("_scale")] in names}


@torch.no_grad()
def fill(param: torch.Tensor, name: str, tensors, shard: tuple[int, int, int] | None) -> None:
    """Fill `param` (float, any device; [out, in], or its tp_shard slice: rows for a column-parallel
    layer, inputs for a row-parallel one) with the dequantized weight `name` ("<module>.weight"),
    CHUNK_ELEMENTS at a time: only the packed bytes and scales of the slice are read, moved to the
    param's device and dequantized there. tensors: rayspec.model.weights.checkpoint.CheckpointTensors."""
    module = name.removesuffix(".weight")
    packed_shape = tensors.shape(name)
    if tensors.dtype(name) != torch.uint8 or len(packed_shape) != 2:
        raise ValueError(f"{name}: an NVFP4 weight must be uint8 [out, in/2], the checkpoint has "
                         f"{tensors.dtype(name)} {list(packed_shape)}")
    out_features, in_features = packed_shape[0], 2 * packed_shape[1]
    scale_shape = tensors.shape(module + ".weight_scale")
    if tuple(scale_shape) != (out_features, in_features // GROUP_SIZE) or in_features % GROUP_SIZE:
        raise ValueError(f"{module}.weight_scale has shape {list(scale_shape)}; NVFP4 wants "
                         f"[{out_features}, {in_features // GROUP_SIZE}] for a [{out_features}, {in_features}] weight")
    rows, cols = (0, out_features), (0, in_features)
    if shard is not None:
        dim, start, stop = shard
        if dim not in (0, 1) or not 0 <= start < stop <= (out_features, in_features)[dim]:
            raise ValueError(f"{name}: tp_shard {shard} does not fit the weight [{out_features}, {in_features}]")
        if dim == 1 and (start % GROUP_SIZE or stop % GROUP_SIZE):
            raise ValueError(f"{name}: a tensor-parallel slice of inputs {start}..{stop} does not fall on NVFP4's "
                             f"groups of {GROUP_SIZE}; use a tensor_parallel_size that splits them evenly")
        rows, cols = ((start, stop), cols) if dim == 0 else (rows, (start, stop))
    want = (rows[1] - rows[0], cols[1] - cols[0])
    if tuple(param.shape) != want:
        raise ValueError(f"{name}: the model's parameter has shape {list(param.shape)}, the NVFP4 weight "
                         f"{'slice ' if shard else ''}dequantizes to {list(want)}")
    device = param.device
    scale_2 = tensors.read(module + ".weight_scale_2").to(torch.float32).reshape(())
    table = _byte_table(device)
    step = max(1, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cpu"]) // want[1])
    for r in range(rows[0], rows[1], step):
        stop = min(r + step, rows[1])
        packed = tensors.read(name, (r, stop), (cols[0] // 2, cols[1] // 2)).to(device)
        scale = tensors.read(module + ".weight_scale", (r, stop),
                             (cols[0] // GROUP_SIZE, cols[1] // GROUP_SIZE)).to(device)
        param[r - rows[0]:stop - rows[0]].copy_(dequantize(packed, scale, scale_2.to(device), param.dtype, table))


def quantized_params(model, quantization) -> dict[int, int]:
    """id(weight) -> its stored bytes, for the Linear weights of `model`'s decoder layers that
    `quantization` does not exclude (what ModelOpt quantizes: attention and MLP projections): a
    byte per two weights, one per 16 (the scales), and the two float32 scalars."""
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and weight is not None
                and not quantization.excludes(name)):
            out[id(weight)] = weight.numel() // 2 + weight.numel() // GROUP_SIZE + 8
    return out
