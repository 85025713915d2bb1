"""Linear layers with fast CPU inference paths: oneDNN with prepacked weights (fewer rows padded up),
W @ x^T, or F.linear, chosen per row count from what rayspec.cpu.kernels measured on the CPU at
hand; FusedProjection runs q/k/v (or gate/up) as one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayspec.cpu import kernels as cpu_kernels


def _onednn_linear_available() -> bool:
    return cpu_kernels.onednn_available()


def cpu_bf16_fast() -> bool:
    """True when this CPU runs oneDNN bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    return _onednn_linear_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# oneDNN ran 1 or 2 rows against a prepacked weight slower than 4 on one AMD VM (30 MLPs + LM
# head, 1 thread, 36-45 ms for 1-2 rows, 28-37 ms for 4; docs/benchmarks-history.md, "Small matmuls"),
# so fewer rows may be padded up to this many. Whether to (and whether to use oneDNN at all) is
# measured on the CPU at hand when a model loads (rayspec.cpu.kernels); this is the default for
# layers built outside a model's pack_for_cpu.
ONEDNN_MIN_ROWS = 4


def onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  min_rows: int = ONEDNN_MIN_ROWS) -> torch.Tensor:
    """rows: [N, in] -> [N, out] with a prepacked oneDNN weight (fewer than min_rows rows padded)."""
    n = rows.shape[0]
    if n < min_rows:
        rows = torch.cat((rows, rows.new_zeros(min_rows - n, rows.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")[:n]
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


# batch-invariant projections off the CPU (CausalLM.set_batch_invariant): rows go through the GEMM in
# calls of exactly this many (the compiled step's most padded rows, rayspec.model.compiled.MAX_ROWS), so
# every call has one shape and one kernel, and a row's reduction order does not depend on how many
# rows came with it. A decode's one row costs a 64-row GEMM, which on a GPU reads the same weights
# in about the same time (written for review: not yet run on a GPU)
DEVICE_TILE_ROWS = 64


def tiled_rows(fn, rows: torch.Tensor, tile: int) -> torch.Tensor:
    """fn over rows [N, in] -> [N, out] in calls of exactly `tile` rows, the last padded with zeros."""
    n = rows.shape[0]
    pad = -n % tile
    if pad:
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
    if n + pad == tile:
        return fn(rows)[:n]
    return torch.cat([fn(chunk) for chunk in rows.split(tile)])[:n]


def device_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int | None) -> torch.Tensor:
    """F.linear, or with `tile` (batch-invariant) its rows in calls of exactly `tile` rows (tiled_rows)."""
    if tile is None:
        return F.linear(x, weight, bias)
    out = tiled_rows(lambda rows: F.linear(rows, weight, bias), x.reshape(-1, x.shape[-1]), tile)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _packable(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_fast())


class Linear(nn.Linear):
    """nn.Linear with fast CPU inference paths.

    Why: on this kind of CPU, MKL's x @ W^T with few rows (decode, verification of k+1 tokens)
    runs far below memory bandwidth. Measured on 2 cores, 60 weights of 1536x576:
    F.linear 14-32 ms for 1-8 rows, W @ x^T 7-25 ms, oneDNN with a prepacked weight 7-9 ms
    for any row count up to 16 (and 2x faster than F.linear for a 300-row prefill).
    So `pack_for_cpu()` keeps a oneDNN-packed copy of the weight for inference; without
    oneDNN, few-row inputs fall back to (W @ x^T)^T (a single row doubled).
    """

    FEW_ROWS = 8
    min_rows = ONEDNN_MIN_ROWS  # the default's padding (no measured choice)
    # the kernel per row count, measured on this CPU (set by CausalLM.pack_for_cpu); None: oneDNN when
    # packed, else W @ x^T up to FEW_ROWS rows, else F.linear
    kernels: "cpu_kernels.CpuKernels | None" = None
    _packed: torch.Tensor | None = None
    _packed_version: int = -1
    int8 = None  # a rayspec.model.quantize.Int8Weight (weight-only int8): replaces the float weight
    tile_rows: int | None = None  # off the CPU, batch-invariant: DEVICE_TILE_ROWS (CausalLM.set_batch_invariant)

    def pack_for_cpu(self) -> None:
        w = self.weight
        if self.int8 is not None:
            return
        if w.device.type == "cpu" and _onednn_linear_available() and _packable(w.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
            self._packed_version = w._version

    def path_for(self, rows: int) -> str:
        if self.kernels is not None:
            return self.kernels.path_for(rows)
        if self._packed is not None:
            return "onednn_pad4" if self.min_rows >= 4 else "onednn"
        return "wxt" if rows <= self.FEW_ROWS else "flinear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(x)
        if x.device.type != "cpu" or torch.compiler.is_compiling():  # (compiled: inductor picks the kernel)
            return device_linear(x, self.weight, self.bias, self.tile_rows)
        tile = self.kernels.tile if self.kernels is not None else None
        if tile is None:
            return self._rows(x)
        out = tiled_rows(self._rows, x.reshape(-1, x.shape[-1]), tile)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out] on the kernel chosen for its number of rows (F.linear takes x as
        it is: no reshape it does not need)."""
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        n = rows.shape[0]
        path = self.path_for(n)
        if (path in cpu_kernels.ONEDNN and self._packed is not None and rows.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (rows.requires_grad or self.weight.requires_grad))
                and self.weight._version == self._packed_version):  # stale after in-place updates
            out = onednn_linear(rows, self._packed, self.bias, cpu_kernels.ONEDNN[path])
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if path != "wxt" or n > cpu_kernels.ROWS[-1]:
            return F.linear(x, self.weight, self.bias)
        if n == 1:
            rows = rows.expand(2, -1).contiguous()
        out = (self.weight @ rows.t()).t()[:n]  # [N, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class FusedProjection:
    """Several Linear layers that read the same input, run as one oneDNN matmul at inference.

    Why: each oneDNN call has a fixed cost of tens of microseconds on CPU; q/k/v and gate/up
    fused save about 40 us per decoder layer for 1 to 9 rows (measured on 2 cores). Built by
    `pack_for_cpu`; the parts keep their own weights (checkpoints load and train unchanged), and
    the fused copy is skipped when a part's weight has changed since (`None` from `__call__`).
    """

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self.versions = [p.weight._version for p in parts]
        weight = torch.cat([p.weight.detach() for p in parts])  # [sum(out), in]
        self.bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        self.lead = parts[0]  # whose kernel choice (path_for) this follows
        for p in parts:  # the fused copy replaces the parts' own packed copies
            p._packed = None

    @classmethod
    def build(cls, parts: list[Linear]) -> "FusedProjection | None":
        w = parts[0].weight
        usable = (w.device.type == "cpu" and _onednn_linear_available() and _packable(w.dtype)
                  and all(p.weight.dtype == w.dtype for p in parts) and len({p.bias is None for p in parts}) == 1)
        return cls(parts) if usable else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        if (x.device.type != "cpu" or torch.compiler.is_compiling() or x.dtype != self.parts[0].weight.dtype
                or torch.is_grad_enabled()
                or any(p.weight._version != v for p, v in zip(self.parts, self.versions))):
            return None
        if self.lead.kernels is not None and self.lead.kernels.tile:  # batch-invariant in tiles: the parts' own
            return None
        rows = x.reshape(-1, x.shape[-1])
        path = self.lead.path_for(rows.shape[0]) if self.lead.kernels is not None else (
            "onednn_pad4" if self.lead.min_rows >= 4 else "onednn")
        if path not in cpu_kernels.ONEDNN:  # this row count runs faster on another kernel: the parts' own
            return None
        out = onednn_linear(rows, self.packed, self.bias, cpu_kernels.ONEDNN[path])
        return list(out.reshape(*x.shape[:-1], out.shape[-1]).split(self.sizes, dim=-1))


def fuse_weights(parts: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """Off the CPU: the parts' weights (and biases) become views of one tensor, so one matmul computes
    them all (q/k/v, gate/up: one kernel launch instead of three or two) with no extra memory; the
    parts stay Parameters of their own (checkpoints load, TP shards, state_dict unchanged).
    Returns (weight, bias, sizes), or None where the parts cannot be fused."""
    w = parts[0].weight
    if (any(p.weight.dtype != w.dtype or p.weight.device != w.device for p in parts)
            or len({p.bias is None for p in parts}) != 1 or w.device.type == "meta"):
        return None
    sizes = [p.weight.shape[0] for p in parts]
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    for i, (p, view) in enumerate(zip(parts, weight.split(sizes))):
        tied = p.weight
        p.weight = nn.Parameter(view, requires_grad=tied.requires_grad)
        if bias is not None:
            p.bias = nn.Parameter(bias.split(sizes)[i], requires_grad=p.bias.requires_grad)
    return weight, bias, sizes
