"""4-bit weights on one GPU (issue #52, item 5), one script, <= 8 minutes on an H200, no network: random
weights of the published shapes, JSON out.

1. linear: the 4-bit linear (rayspec.model.fp4_linear: the Triton kernel up to 64 rows) at the 8B and 70B
   Llama projections (NVFP4) and gpt-oss-120b's expert projections (MXFP4), 1-64 rows, against (a) the time
   to read its 4-bit bytes at the copy bandwidth measured in the same run (the roofline) and (b) bf16
   F.linear on the dequantized weight. Enough copies of each weight are cycled that none is read from L2.
   Each output is checked against F.linear on the torch dequantization (relative max error).
2. decode: a whole decode step (batch 1 and 8, eager; compiled when --compile) of a model of
   Llama-3.3-70B's shapes with every decoder projection NVFP4 (random codes and scales: about 44.6 GB held),
   against the time to read what it holds.
3. load and expert layer: benchmarks/fp4_gpu_check.py's two checks (an NVFP4 load dequantized on the GPU
   equals the bit reference; gpt-oss's MXFP4 expert layer bf16 vs dequantized per forward), folded in.

    python benchmarks/fp4_gpu.py --json benchmarks/results/fp4_gpu_h200.json     # on a GPU
    python benchmarks/fp4_gpu.py --dry-run                                      # CPU, tiny shapes (CI)
    TRITON_INTERPRET=1 python benchmarks/fp4_gpu.py --dry-run                   # + the Triton kernel in
                                                                                # Triton's interpreter

On CPU (--dry-run) the 4-bit linear is the exact torch path (dequantize into the scratch, then F.linear):
the figures only show that the script runs. Written for review: not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from rayspec.model import fp4_linear  # noqa: E402
from rayspec.model.fp4_linear import FP4Linear  # noqa: E402

import fp4_gpu_check  # noqa: E402 - beside this script (its folded checks, its timer)

# (name, format, out_features, in_features)
SHAPES = {
    "llama-8b": [("q/o", "NVFP4", 4096, 4096), ("k/v", "NVFP4", 1024, 4096), ("gate/up", "NVFP4", 14336, 4096),
                 ("down", "NVFP4", 4096, 14336), ("lm_head-like", "NVFP4", 128256, 4096)],
    "llama-70b": [("q/o", "NVFP4", 8192, 8192), ("k/v", "NVFP4", 1024, 8192), ("gate/up", "NVFP4", 28672, 8192),
                  ("down", "NVFP4", 8192, 28672)],
    "gpt-oss-120b expert": [("gate_up", "MXFP4", 5760, 2880), ("down", "MXFP4", 2880, 2880)],
}
DRY_SHAPES = {"tiny": [("q", "NVFP4", 96, 128), ("down", "NVFP4", 64, 256), ("expert", "MXFP4", 64, 96)]}
ROWS, DRY_ROWS = (1, 2, 4, 8, 16, 32, 64), (1, 4, 64)
L2_BYTES = 256 << 20  # cycle at least this much weight: above any GPU's L2 (H200: 50 MB)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


time_ms = fp4_gpu_check.time_ms  # median ms of fn: CUDA events on a GPU, the wall clock on CPU


def copy_bandwidth(device: str, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write) of nbytes: the roofline a weight read is set against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def random_layer(fmt: str, out_features: int, in_features: int, device: str, gen: torch.Generator,
                 scratch=None) -> FP4Linear:
    """An FP4Linear of random codes and of scales in a sane range (no NaN / inf), on `device`."""
    layer = FP4Linear(in_features, out_features, False, fmt, scratch)
    group = fp4_linear.GROUP[fmt]
    codes = torch.randint(0, 256, (out_features, in_features // 2), generator=gen, dtype=torch.uint8)
    with torch.no_grad():
        if fmt == "NVFP4":
            layer.weight.copy_(codes)
            layer.weight_scale.copy_((torch.rand(out_features, in_features // group, generator=gen) * 4 + 0.25)
                                     .to(torch.float8_e4m3fn))
            layer.weight_scale_2.fill_(1.0 / 64)
        else:
            layer.weight_blocks.copy_(codes.view(out_features, in_features // group, group // 2))
            layer.weight_scales.copy_(torch.randint(118, 124, (out_features, in_features // group), generator=gen,
                                                    dtype=torch.uint8))
    return layer.to(device)


def bench_linear(device: str, shapes: dict, rows_list, reps: int, bandwidth: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    results = []
    for model, layers in shapes.items():
        for name, fmt, out_features, in_features in layers:
            probe = random_layer(fmt, out_features, in_features, "cpu", gen)
            nbytes = probe.stored_bytes()
            copies = max(1, min(16, L2_BYTES // nbytes)) if device == "cuda" else 1
            scratch = fp4_linear.DequantScratch()
            layers_4bit = [random_layer(fmt, out_features, in_features, device, gen, scratch) for _ in range(copies)]
            bf16 = [layer.dequantized(torch.bfloat16) for layer in layers_4bit]
            read_ms = nbytes / (bandwidth * 1e9 / 2) * 1e3  # the copy's figure counts read + write
            for rows in rows_list:
                dtype = torch.bfloat16 if device == "cuda" else torch.float32
                x = torch.randn(rows, in_features, generator=gen).to(device, dtype)
                state = {"i": 0}

                def run_4bit():
                    state["i"] = (state["i"] + 1) % copies
                    return layers_4bit[state["i"]](x)

                def run_bf16():
                    state["i"] = (state["i"] + 1) % copies
                    return F.linear(x.to(torch.bfloat16), bf16[state["i"]])

                ms_4bit = time_ms(run_4bit, device, reps)
                ms_bf16 = time_ms(run_bf16, device, reps)
                got = layers_4bit[0](x).float()
                want = F.linear(x, layers_4bit[0].dequantized(dtype)).float()
                err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
                results.append({"model": model, "projection": name, "format": fmt, "out": out_features,
                                "in": in_features, "rows": rows, "bytes_4bit": nbytes, "ms_4bit": round(ms_4bit, 4),
                                "ms_bf16": round(ms_bf16, 4), "read_ms_4bit": round(read_ms, 4),
                                "vs_read_time": round(ms_4bit / read_ms, 2), "vs_bf16": round(ms_4bit / ms_bf16, 3),
                                "max_rel_err": err})
            del layers_4bit, bf16
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def llama_4bit_model(device: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int):
    """A native Llama whose every decoder projection is NVFP4 (random codes and scales), built straight on
    `device` (no checkpoint: nothing read from disk)."""
    from transformers import LlamaConfig

    from rayspec.model import loader
    from rayspec.model.linear import Linear

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False,
                         max_position_embeddings=8192)
    names = {f"model.layers.{i}.{part}.{proj}.{suffix}" for i in range(layers)
             for part, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 ("mlp", ("gate_proj", "up_proj", "down_proj")))
             for proj in projs for suffix in ("weight", "weight_scale")}
    model = loader.empty_model(config, device, torch.bfloat16, checkpoint_names=names)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FP4Linear):
                module.weight.random_(0, 256, generator=gen)
                scale = torch.rand(module.weight_scale.shape, device=device, generator=gen) * 4 + 0.25
                module.weight_scale.copy_(scale.to(torch.float8_e4m3fn))
                module.weight_scale_2.fill_(1.0 / (64 * module.in_features ** 0.5))
            elif isinstance(module, Linear) or isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0, 0.02, generator=gen)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
    return model.eval().pack_for_cpu()


def bench_decode(device: str, dims: dict, bandwidth: float, reps: int, compile_step: bool, context: int) -> dict:
    from rayspec.model.fp4_linear import held_bytes
    from rayspec.model.runner import make_runner

    t0 = time.perf_counter()
    model = llama_4bit_model(device, **dims)
    sync(device)
    build_s = time.perf_counter() - t0
    out = {"dims": dims, "held_bytes": held_bytes(model), "build_s": round(build_s, 1), "context": context, "steps": []}
    read_ms = out["held_bytes"] / (bandwidth * 1e9 / 2) * 1e3
    out["read_ms"] = round(read_ms, 3)
    for compiled in ((False, True) if compile_step else (False,)):
        for batch in ((1,) if compiled else (1, 8)):  # (a compile of 80 layers takes minutes: batch 1 only)
            runner = make_runner(model, context + 64, num_slots=batch, slack=8, compile=compiled)
            seqs = [f"s{i}" for i in range(batch)]
            gen = torch.Generator().manual_seed(batch)
            try:
                with torch.no_grad():
                    for s in seqs:
                        runner.kv.allocate(s)
                        runner.forward([s], [torch.randint(0, dims["vocab"], (context,), generator=gen).tolist()],
                                       last_only=True)
                    tokens = [[1] for _ in seqs]
                    t0 = time.perf_counter()
                    step_ms = time_ms(lambda: runner.forward(seqs, tokens, last_only=True), device, reps)
                    first_s = time.perf_counter() - t0
            except Exception as err:  # noqa: BLE001 - a figure missing, recorded, not a failed script
                out["steps"].append({"batch": batch, "compiled": compiled, "error": repr(err)[:500]})
                continue
            out["steps"].append({"batch": batch, "compiled": compiled, "ms_per_step": round(step_ms, 3),
                                 "vs_read_time": round(step_ms / read_ms, 2), "timing_s": round(first_s, 1)})
            del runner
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def triton_interpret_check() -> list[dict]:
    """With TRITON_INTERPRET=1 and Triton installed: the Triton kernel against the torch path on tiny shapes
    (float32 and float16: the interpreter runs bfloat16 through numpy, which has none)."""
    from rayspec.model import fp4_triton

    gen = torch.Generator().manual_seed(1)
    rows = []
    for fmt, out_features, in_features, m in (("NVFP4", 96, 256, 1), ("NVFP4", 64, 384, 17), ("MXFP4", 80, 320, 5)):
        layer = random_layer(fmt, out_features, in_features, "cpu", gen)
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(m, in_features, generator=gen).to(dtype)
            got = fp4_triton.skinny_matmul(x, layer.codes, layer.scales, layer.global_scale, None, layer.group,
                                           num_sms=2).float()
            want = F.linear(x.float(), layer.dequantized(dtype).float())
            rows.append({"format": fmt, "shape": [out_features, in_features], "rows": m, "dtype": str(dtype),
                         "max_rel_err": ((got - want).abs().max() / want.abs().max()).item()})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the script runs (CI)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the compiled decode step (default on; off in a dry run)")
    parser.add_argument("--skip-folded", action="store_true", help="skip fp4_gpu_check.py's load and expert checks")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__,
              "dry_run": args.dry_run}
    report["copy_gb_s"] = round(copy_bandwidth(device, (1 << 30) if device == "cuda" else (16 << 20)), 1)
    reps = 30 if device == "cuda" else 3
    report["linear"] = bench_linear(device, DRY_SHAPES if args.dry_run else SHAPES, DRY_ROWS if args.dry_run else ROWS,
                                    reps, report["copy_gb_s"])
    dims = (dict(hidden=128, inter=256, layers=2, heads=4, kv_heads=2, vocab=256) if args.dry_run else
            dict(hidden=8192, inter=28672, layers=80, heads=64, kv_heads=8, vocab=128256))
    report["decode"] = bench_decode(device, dims, report["copy_gb_s"], reps=5 if args.dry_run else 20,
                                    compile_step=args.compile and not args.dry_run, context=32 if args.dry_run else 512)
    if not args.skip_folded:

        small = args.dry_run
        report["nvfp4_load"] = fp4_gpu_check.check_nvfp4_load(device, hidden=128 if small else 2048,
                                                               layers=2 if small else 4, vocab=256 if small else 32000)
        report["mxfp4_expert_layer"] = fp4_gpu_check.expert_layer(device, *((8, 128, 128, 2) if small else
                                                                            (128, 2880, 2880, 4)))
    if os.environ.get("TRITON_INTERPRET") == "1":
        report["triton_interpret"] = triton_interpret_check()
    report["seconds"] = round(time.perf_counter() - started, 1)
    for r in report["linear"]:
        print(f"{r['model']:>20} {r['projection']:>12} {r['format']} rows {r['rows']:>2}: 4-bit {r['ms_4bit']:.4f} ms "
              f"({r['vs_read_time']:.2f}x its read time), bf16 {r['ms_bf16']:.4f} ms ({r['vs_bf16']:.2f}x)")
    for s in report["decode"]["steps"]:
        print(f"decode batch {s['batch']} {'compiled' if s['compiled'] else 'eager'}: "
              + (f"{s['ms_per_step']:.3f} ms ({s['vs_read_time']:.2f}x the read time of "
                 f"{report['decode']['held_bytes'] / 1e9:.2f} GB)" if "error" not in s else s["error"]))
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
