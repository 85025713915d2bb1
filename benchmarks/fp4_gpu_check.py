"""GPU checks of FP4 loading (issue #36), one script, JSON to stdout. Its two checks also run as part of
benchmarks/fp4_gpu.py (issue #52's GPU script, which imports them from here).

1. An NVFP4 Llama checkpoint (random codes and scales, tests/fp4_utils.random_nvfp4_llama) loaded
   into bfloat16 on the GPU, each weight dequantized there as it is read: the weights equal the
   bit-level reference dequantization (computed on the CPU), and the load's peak CUDA memory is set
   against the weights' bytes.
2. One gpt-oss-120b MoE expert layer (128 experts, hidden 2880, intermediate 2880, top-4) with random
   MXFP4 weights: the time of the routed experts' matmuls with the experts kept in bfloat16, against
   keeping them MXFP4 and dequantizing the routed experts per forward in torch (no 4-bit kernel),
   at 1 and 32 tokens; CUDA events, median of 20 after 3 warm-ups.

    python benchmarks/fp4_gpu_check.py            # on a GPU
    python benchmarks/fp4_gpu_check.py --small    # shapes small enough for a CPU (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fp4_utils import random_nvfp4_llama, reference_nvfp4  # noqa: E402

from rayspec.model import loader  # noqa: E402
from rayspec.model.formats import nvfp4  # noqa: E402
from rayspec.model.weights import checkpoint, hub  # noqa: E402

E2M1 = torch.tensor(nvfp4.E2M1_VALUES)


def check_nvfp4_load(device: str, hidden: int, layers: int, vocab: int) -> dict:
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        path = random_nvfp4_llama(Path(tmp) / "m", layers, hidden, vocab)
        config = hub.load_hf_config(path)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        model = loader.empty_model(config, device, torch.bfloat16)
        checkpoint.load_checkpoint(model, path)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        raw = load_file(str(path / "model.safetensors"))
        params = dict(model.named_parameters())
        checked = mismatched = 0
        for name in params:
            module = name.removesuffix(".weight")
            if f"{module}.weight_scale" in raw and (".layers.0." in name or f".layers.{layers - 1}." in name):
                ref = reference_nvfp4(raw[name], raw[module + ".weight_scale"], raw[module + ".weight_scale_2"],
                                      torch.bfloat16)
                checked += 1
                mismatched += not torch.equal(params[name].cpu().view(torch.int16), ref.view(torch.int16))
    return {"weights_bytes": weights, "load_peak_cuda_bytes": peak,
            "peak_over_weights": None if peak is None else round(peak / weights, 4), "load_s": round(seconds, 3),
            "quantized_weights_checked": checked, "bit_mismatches": mismatched}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """[rows, K/32, 16] uint8 + [rows, K/32] uint8 exponents -> [rows, K] (the gpt-oss layout)."""
    table = E2M1.to(blocks.device, dtype)
    values = torch.stack((table[(blocks & 0xF).int()], table[(blocks >> 4).int()]), dim=-1).flatten(-2)
    return torch.ldexp(values, (scales.int() - 127)[..., None].to(dtype)).flatten(-2)


def time_ms(fn, device: str, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def expert_layer(device: str, experts: int, hidden: int, inter: int, top_k: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    gu_blocks = torch.randint(0, 256, (experts, 2 * inter, hidden // 32, 16), generator=gen, dtype=torch.uint8)
    gu_scales = torch.randint(118, 124, (experts, 2 * inter, hidden // 32), generator=gen, dtype=torch.uint8)
    dn_blocks = torch.randint(0, 256, (experts, hidden, inter // 32, 16), generator=gen, dtype=torch.uint8)
    dn_scales = torch.randint(118, 124, (experts, hidden, inter // 32), generator=gen, dtype=torch.uint8)
    gu_blocks, gu_scales, dn_blocks, dn_scales = (t.to(device) for t in (gu_blocks, gu_scales, dn_blocks, dn_scales))
    gu_bf16 = torch.stack([dequantize_mxfp4(gu_blocks[e], gu_scales[e]) for e in range(experts)])  # [E, 2I, H]
    dn_bf16 = torch.stack([dequantize_mxfp4(dn_blocks[e], dn_scales[e]) for e in range(experts)])  # [E, H, I]
    out = {"experts": experts, "hidden": hidden, "intermediate": inter, "top_k": top_k,
           "bf16_expert_bytes": gu_bf16.nbytes + dn_bf16.nbytes,
           "mxfp4_expert_bytes": sum(t.nbytes for t in (gu_blocks, gu_scales, dn_blocks, dn_scales))}
    for tokens in (1, 32):
        x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
        routed = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
        active = sorted(set(routed.flatten().tolist()))

        def run(weights):
            y = torch.zeros_like(x)
            for e in active:
                rows = (routed == e).any(dim=1).nonzero().flatten()
                gu, dn = weights(e)
                h = x[rows] @ gu.T  # [n, 2I]
                h = torch.nn.functional.silu(h[:, ::2]) * h[:, 1::2]
                y.index_add_(0, rows, h @ dn.T)
            return y

        bf16 = time_ms(lambda: run(lambda e: (gu_bf16[e], dn_bf16[e])), device)
        fp4 = time_ms(lambda: run(lambda e: (dequantize_mxfp4(gu_blocks[e], gu_scales[e]),
                                             dequantize_mxfp4(dn_blocks[e], dn_scales[e]))), device)
        same = torch.equal(run(lambda e: (gu_bf16[e], dn_bf16[e])),
                           run(lambda e: (dequantize_mxfp4(gu_blocks[e], gu_scales[e]),
                                          dequantize_mxfp4(dn_blocks[e], dn_scales[e]))))
        out[f"tokens_{tokens}"] = {"active_experts": len(active), "bf16_ms": round(bf16, 3),
                                   "mxfp4_dequant_then_matmul_ms": round(fp4, 3),
                                   "mxfp4_over_bf16": round(fp4 / bf16, 2), "same_output": same}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="small shapes (a CPU smoke run)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    if args.small:
        report["nvfp4_load"] = check_nvfp4_load(device, hidden=128, layers=2, vocab=256)
        report["mxfp4_expert_layer"] = expert_layer(device, experts=8, hidden=128, inter=128, top_k=2)
    else:
        report["nvfp4_load"] = check_nvfp4_load(device, hidden=2048, layers=4, vocab=32000)
        report["mxfp4_expert_layer"] = expert_layer(device, experts=128, hidden=2880, inter=2880, top_k=4)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
