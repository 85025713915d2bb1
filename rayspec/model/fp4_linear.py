"""Linear layers whose weights stay 4-bit in memory: NVFP4 (ModelOpt) and MXFP4 dense projections, held
as the checkpoint's codes and scales (`EngineSettings.quantized_weights: keep`, the default).

One layout serves both formats: codes uint8 [out, in / 2] (two E2M1 codes a byte, the even input in the
low nibble), a scale per `group` inputs [out, in / group], and for NVFP4 one float32 scale per tensor:
  NVFP4  W = E2M1[code] * fp8_e4m3(scale) * global_scale      group 16 (rayspec.model.formats.nvfp4)
  MXFP4  W = E2M1[code] * 2^(scale - 127)                     group 32 (rayspec.model.formats.mxfp4)
computed in float32 in that order and rounded once to the compute dtype: the same bits as the weight a
`dequantize` load holds, so a kept layer computes what its dequantized twin computes.

How a forward runs:
- CPU (eager): the layer's weight is dequantized into one scratch buffer the model's 4-bit layers share
  (`DequantScratch`: one buffer per model, as large as its largest layer, not one per layer), then the
  usual F.linear. Exact.
- CUDA: one opaque op, rayspec::fp4_linear: up to SKINNY_ROWS rows (decode, verification) a Triton kernel
  that reads the 4-bit bytes and dequantizes them in registers (rayspec.model.fp4_triton); more rows (a
  prefill) dequantize into a temporary weight and one cuBLAS GEMM. Triton is imported only there.
- Compiled (torch.compile, any device): the same op, opaque to the compiler.

The parameters keep the checkpoint's names (`weight`, `weight_scale`, `weight_scale_2` for NVFP4;
`weight_blocks`, `weight_scales` for MXFP4), so the loader copies them as stored; a tensor-parallel rank's
slices are the column- or row-parallel slices of a float Linear in units of bytes and scale groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rayspec.model.schemes import MODES, check_mode  # noqa: F401 (re-exported)

NVFP4, MXFP4 = "NVFP4", "MXFP4"
GROUP = {NVFP4: 16, MXFP4: 32}
SKINNY_ROWS = 64  # at most this many rows take the Triton kernel (the compiled step's most padded rows)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def byte_table(device) -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values of every byte (low nibble first)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)


def group_scales(scales: torch.Tensor, e8m0: bool) -> torch.Tensor:
    """scales [out, in / group] as stored (uint8 bits) -> float32: E8M0 2^(s - 127), else FP8-E4M3 (exact)."""
    if e8m0:
        return torch.exp2(scales.to(torch.float32) - 127)
    return scales.view(torch.float8_e4m3fn).to(torch.float32)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, group: int,
               dtype: torch.dtype, out: torch.Tensor | None = None, work: "Work | None" = None) -> torch.Tensor:
    """codes uint8 [out, in / 2]; scales uint8 [out, in / group] (E8M0 where group is 32, FP8-E4M3 bits
    where 16); global_scale float32 [] or None -> the weight [out, in] in `dtype`, the format's order of
    float32 products (module doc). out / work (DequantScratch's buffers): written there, nothing allocated."""
    rows, half = codes.shape
    n = rows * half
    e8m0 = group == GROUP[MXFP4]
    if work is None:
        values = byte_table(codes.device)[codes.to(torch.int32)]  # [rows, in / 2, 2]
        scale = group_scales(scales, e8m0)
    else:  # table lookups as 1-D gathers: a byte's two float32 values as one int64 (4x faster on CPU
        # than gathering [256, 2] rows), a scale's value from its bits (8x faster than casting FP8)
        index, values = work.index[:n], work.values[:2 * n]
        index.copy_(codes.view(-1))
        torch.index_select(work.pairs, 0, index, out=values.view(torch.int64))
        scale_index = work.scale_index[:scales.numel()]
        scale_index.copy_(scales.reshape(-1))
        scale = torch.index_select(work.e8m0 if e8m0 else work.e4m3, 0, scale_index).view(scales.shape)
    values = values.view(rows, -1, group)
    values.mul_(scale[..., None])  # exact
    if global_scale is not None:
        values.mul_(global_scale)
    values = values.view(rows, 2 * half)
    if out is None:
        return values.to(dtype)  # (float32 into work: the buffer itself)
    out = out.view(rows, 2 * half)
    if out.data_ptr() != values.data_ptr():
        out.copy_(values)
    return out


@dataclass
class Work:
    """DequantScratch's buffers on one device: int32 byte and scale indices, float32 values, and the lookup
    tables (a byte's two E2M1 values as one int64; the float32 value of every FP8-E4M3 and E8M0 scale)."""

    index: torch.Tensor
    scale_index: torch.Tensor
    values: torch.Tensor
    pairs: torch.Tensor
    e4m3: torch.Tensor
    e8m0: torch.Tensor

    @classmethod
    def allocate(cls, numel: int, device) -> "Work":
        bits = torch.arange(256, device=device)
        return cls(torch.empty(numel // 2, dtype=torch.int32, device=device),
                   torch.empty(numel // GROUP[NVFP4], dtype=torch.int32, device=device),
                   torch.empty(numel, dtype=torch.float32, device=device),
                   byte_table(device).contiguous().view(torch.int64).view(256),
                   group_scales(bits.to(torch.uint8), False), group_scales(bits.to(torch.uint8), True))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.index, self.scale_index, self.values, self.pairs, self.e4m3, self.e8m0)


class DequantScratch:
    """The buffers a model's 4-bit layers dequantize into on CPU: one set per model, sized for its largest
    layer (`reserve` at build time), allocated on first use on the first forward's device."""

    def __init__(self):
        self.numel = 0  # weight elements of the largest layer
        self._buffers: dict = {}  # (device, dtype) -> (Work, out at dtype or None)

    def reserve(self, numel: int) -> None:
        self.numel = max(self.numel, numel)

    def buffers(self, device: torch.device, dtype: torch.dtype) -> tuple[Work, torch.Tensor | None]:
        key = (device, dtype)
        if key not in self._buffers:
            self._buffers.clear()  # one set: a model runs on one device at one dtype
            out = None if dtype == torch.float32 else torch.empty(self.numel, dtype=dtype, device=device)
            self._buffers[key] = (Work.allocate(self.numel, device), out)
        return self._buffers[key]

    def held(self) -> list[torch.Tensor]:
        return [t for work, out in self._buffers.values() for t in (*work.tensors(), out) if t is not None]


class FP4Linear(nn.Module):
    """A Linear (in_features -> out_features, this rank's slice) whose weight is held 4-bit (module doc).
    The bias, where there is one, is float."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, scratch: DequantScratch | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        group = GROUP[fmt]
        if in_features % group:
            raise ValueError(f"a {fmt} weight needs its inputs ({in_features}) in groups of {group}")
        self.in_features, self.out_features, self.fmt, self.group = in_features, out_features, fmt, group
        self.scratch = scratch if scratch is not None else DequantScratch()
        self.scratch.reserve(in_features * out_features)
        self.tile_rows: int | None = None  # batch-invariant: rows in calls of exactly this many (CausalLM)

        def held(*shape, dtype=torch.uint8):
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        if fmt == NVFP4:
            self.weight = held(out_features, in_features // 2)
            self.weight_scale = held(out_features, in_features // group, dtype=torch.float8_e4m3fn)
            self.weight_scale_2 = held(dtype=torch.float32)
        else:
            self.weight_blocks = held(out_features, in_features // group, group // 2)
            self.weight_scales = held(out_features, in_features // group)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def _apply(self, fn, recurse=True):
        """Casts (`.to(bfloat16)`) leave the codes and scales as stored; moves between devices apply."""
        kept = {name: p.detach() for name, p in self.named_parameters(recurse=False) if name != "bias"}  # (a cast
        # may replace a parameter's data in place: the detached views keep the stored tensors)
        super()._apply(fn, recurse)
        for name, before in kept.items():
            now = getattr(self, name)
            if now.dtype != before.dtype:
                setattr(self, name, nn.Parameter(before.to(device=now.device), requires_grad=False))
        return self

    # the one layout (module doc) over either format's parameters
    @property
    def codes(self) -> torch.Tensor:  # uint8 [out, in / 2]
        return (self.weight if self.fmt == NVFP4 else self.weight_blocks).view(self.out_features, -1)

    @property
    def scales(self) -> torch.Tensor:  # uint8 [out, in / group]
        return self.weight_scale.view(torch.uint8) if self.fmt == NVFP4 else self.weight_scales

    @property
    def global_scale(self) -> torch.Tensor | None:
        return self.weight_scale_2 if self.fmt == NVFP4 else None

    def stored_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype` (a new tensor)."""
        return dequantize(self.codes, self.scales, self.global_scale, self.group, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return fp4_linear(x, self.codes, self.scales, self.global_scale, self.bias, self.group, self.tile_rows)
        work, out = self.scratch.buffers(x.device, x.dtype)
        n = self.out_features * self.in_features
        weight = dequantize(self.codes, self.scales, self.global_scale, self.group, x.dtype,
                            None if out is None else out[:n], work)
        if self.tile_rows is None:
            return F.linear(x, weight, self.bias)
        from rayspec.model.linear import device_linear

        return device_linear(x, weight, self.bias, self.tile_rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, bias={self.bias is not None}"


def fp4_linear(x, codes, scales, global_scale, bias, group: int, tile_rows: int | None = None) -> torch.Tensor:
    """x [..., in] through a 4-bit weight (module doc), as one op (rayspec::fp4_linear)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.rayspec.fp4_linear(rows, codes, scales, global_scale, bias, group, tile_rows or 0)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _matmul(rows, codes, scales, global_scale, bias, group):
    """rows [N, in] -> [N, out]: the Triton kernel for skinny rows on CUDA, else dequantize + one GEMM."""
    if rows.device.type == "cuda" and rows.shape[0] <= SKINNY_ROWS:
        from rayspec.model import fp4_triton

        return fp4_triton.skinny_matmul(rows, codes, scales, global_scale, bias, group)
    weight = dequantize(codes, scales, global_scale, group, rows.dtype)
    return F.linear(rows, weight, bias)


@torch.library.custom_op("rayspec::fp4_linear", mutates_args=(), schema=(
    "(Tensor x, Tensor codes, Tensor scales, Tensor? global_scale, Tensor? bias, int group, int tile_rows) -> Tensor"))
def _fp4_linear_op(x, codes, scales, global_scale, bias, group, tile_rows):
    """x [N, in] -> [N, out]; tile_rows > 0: the rows in calls of exactly that many (batch-invariant: every
    call the same shape, so the same kernel and reduction order for a row whatever came with it)."""
    if tile_rows <= 0:
        return _matmul(x, codes, scales, global_scale, bias, group)
    from rayspec.model.linear import tiled_rows

    return tiled_rows(lambda rows: _matmul(rows, codes, scales, global_scale, bias, group), x, tile_rows)


@_fp4_linear_op.register_fake
def _(x, codes, scales, global_scale, bias, group, tile_rows):
    return x.new_empty(x.shape[0], codes.shape[0])


# ---- building a model with 4-bit layers ----------------------------------------------------------

def _shards_of(linear: nn.Module, fmt: str, name: str) -> dict:
    """The float Linear's tp_shards (column: rows; row: inputs) as slices of the 4-bit parameters."""
    shards = getattr(linear, "tp_shards", None)
    if not shards or "weight" not in shards:
        return {}
    dim, start, stop = shards["weight"]
    group = GROUP[fmt]
    params = ("weight", "weight_scale") if fmt == NVFP4 else ("weight_blocks", "weight_scales")
    out = {"bias": shards["bias"]} if "bias" in shards else {}
    if dim == 0:
        return out | {p: (0, start, stop) for p in params}
    if start % group or stop % group:
        raise ValueError(f"{name}: a tensor-parallel slice of inputs {start}..{stop} does not fall on {fmt}'s groups "
                         f"of {group}; use a tensor_parallel_size that splits them evenly")
    codes_dim = (1, start // 2, stop // 2) if fmt == NVFP4 else (1, start // group, stop // group)
    return out | {params[0]: codes_dim, params[1]: (1, start // group, stop // group)}


def keep_4bit(model: nn.Module, quantized: dict[str, str]) -> int:
    """Replace the Linear modules named in `quantized` (module name -> NVFP4 / MXFP4) by FP4Linear ones of
    the same shape and tensor-parallel slice, sharing one DequantScratch; before the model is allocated (on
    the meta device). Returns how many were replaced."""
    from rayspec.model.linear import Linear

    scratch = DequantScratch()
    count = 0
    for name, fmt in sorted(quantized.items()):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, leaf, None)
        if not isinstance(linear, Linear):
            raise ValueError(f"{name}: the checkpoint holds a {fmt} weight for it, the model has no Linear there")
        bias = linear.bias
        with torch.device(linear.weight.device):
            new = FP4Linear(linear.in_features, linear.out_features, bias is not None, fmt, scratch,
                            None if bias is None else bias.dtype)
        new.tp_shards = _shards_of(linear, fmt, name)
        if getattr(linear, "tp_row_parallel", False):
            new.tp_row_parallel = True
        setattr(parent, leaf, new)
        count += 1
    model.dequant_scratch = scratch
    return count


def checkpoint_fp4_modules(names, linears: set[str]) -> dict[str, str]:
    """Module name -> format of the modules among `linears` whose weight a checkpoint (its tensor `names`)
    holds 4-bit: NVFP4 (`<m>.weight` with `<m>.weight_scale`) or MXFP4 (`<m>.weight_blocks` / `_scales`)."""
    names = set(names)
    out = {}
    for module in linears:
        if f"{module}.weight" in names and f"{module}.weight_scale" in names:
            out[module] = NVFP4
        elif f"{module}.weight_blocks" in names and f"{module}.weight_scales" in names:
            out[module] = MXFP4
    return out


def held_bytes(model: nn.Module) -> int:
    """Bytes a model's weights hold in memory: its parameters and buffers (tied ones once) and its 4-bit
    layers' dequantization scratch once allocated."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    scratch = getattr(model, "dequant_scratch", None)
    if scratch is not None:
        total += sum(b.numel() * b.element_size() for b in scratch.held())
    return total
