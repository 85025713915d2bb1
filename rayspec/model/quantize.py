"""Weight-only int8 for a draft model (`SpeculativeConfig.draft_quantization: int8`).

Why: a draft only steers speed (the verifier's rule keeps the output the target's), so it can trade
precision for memory traffic. Decoding reads every weight once per token; on CPU that is memory
bound, and int8 weights are a quarter of float32's bytes. Measured on an AMD EPYC (1 thread, 40
weights of 1536x576 so that none stays in cache): float32 407 us per weight and row, fbgemm's
dynamic int8 92 us; the 49152x576 LM head 11.5 ms against 2.0 ms (docs/benchmarks-history.md, "An int8
self-draft"). The target's own checkpoint in int8 is a draft that agrees with it on most tokens.

Each Linear keeps its output channels' int8 weights and one float scale per channel (symmetric,
max-abs); its float weight is dropped unless another module shares it (a tied LM head keeps the
embedding's). Kernels: on CPU fbgemm's dynamic int8 linear (activations quantized per call, int32
accumulation); elsewhere `torch._weight_int8pack_mm` (float activations times int8 weights: the
kernel gpt-fast uses for int8 weight-only decoding), which runs on CUDA with bfloat16 / float16.
"""

from __future__ import annotations

import warnings

import torch

from rayspec.model.schemes import SCHEMES, check_scheme  # noqa: F401 (re-exported)


def _fbgemm_ready() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


def _fbgemm_pack(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed weight, or None where this torch lacks it (PyTorch deprecates its quantized
    tensors, pytorch/pytorch#184982; then `_weight_int8pack_mm` runs instead, slower on CPU)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the deprecation notice, once per layer
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                            torch.qint8)
            return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


_REDUCE_RANGE: bool | None = None


def _reduce_range() -> bool:
    """Whether fbgemm's dynamic int8 linear must quantize activations to 7 bits here: without VNNI
    (AVX2-only CPUs) its int8 x int8 products are summed in saturating int16 pairs, and full-range
    activations overflow them (measured on an AVX2 AMD EPYC: errors of a third of the outputs, an
    int8 self-draft accepting nothing). Probed once: the full range where it is exact enough."""
    global _REDUCE_RANGE
    if _REDUCE_RANGE is None:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(64, 256, generator=gen), torch.randn(8, 256, generator=gen)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        packed = _fbgemm_pack(w, scale, None)
        if packed is None:
            _REDUCE_RANGE = False
        else:
            ref = x @ w.T
            err = (torch.ops.quantized.linear_dynamic(x, packed, False) - ref).abs().max()
            _REDUCE_RANGE = bool(err > 0.05 * ref.abs().max())
    return _REDUCE_RANGE


class Int8Weight:
    """A Linear's weight as int8 per output channel: `w ~= q * scale[:, None]`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, cpu_kernel: bool | None = None):
        w = weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [out]
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
        self.scale = scale  # float32 [out]
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = w.shape
        use_cpu = weight.device.type == "cpu" and _fbgemm_ready() if cpu_kernel is None else cpu_kernel
        self.packed = None
        if use_cpu:  # fbgemm's prepacked per-channel weight (the int8 tensor above is then not needed)
            self.packed = _fbgemm_pack(w, scale, bias)
            if self.packed is not None:
                self.q = None

    def nbytes(self) -> int:
        n = self.out_features * self.in_features + 4 * self.out_features
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        if self.packed is not None:
            out = torch.ops.quantized.linear_dynamic(rows.float(), self.packed, _reduce_range()).to(x.dtype)
        else:
            out = torch._weight_int8pack_mm(rows, self.q, self.scale.to(rows.dtype))
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: torch.nn.Module, cpu_kernel: bool | None = None) -> int:
    """Every rayspec Linear of `model` (projections and LM head) to int8 weights, in place; float
    weights no other module shares are freed. Returns the number of layers quantized.
    cpu_kernel: force (True) or refuse (False) fbgemm's CPU kernel; None: fbgemm on CPU."""
    from rayspec.model.linear import Linear

    shared = {id(p) for name, m in model.named_modules() if not isinstance(m, Linear)
              for p in m.parameters(recurse=False)}
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.int8 is None:
            module.int8 = Int8Weight(module.weight, module.bias, cpu_kernel)
            if id(module.weight) not in shared:  # (a tied LM head's weight is the embedding's)
                module.weight = torch.nn.Parameter(torch.empty(0, dtype=module.weight.dtype,
                                                               device=module.weight.device), requires_grad=False)
            count += 1
    model.quantization = "int8"
    return count
