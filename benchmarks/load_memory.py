"""Peak resident memory while loading a model, rayspec's loader against an older one.

Each case runs in a fresh process: torch, transformers and the loader are imported first (with
the transformers modules a load imports lazily: AutoConfig, AutoTokenizer, the Llama modeling
module; about 100 MiB of code, reported as lazy_imports_rss), the kernel's peak-RSS mark is reset
there (`/proc/self/clear_refs` 5; where that is refused, the peak after the imports is the
baseline), then `load_model(model, device="cpu", dtype=...)` runs.
Reported, above that baseline:

  load_peak   the peak while the weights are read, up to the model's pack_for_cpu (the goal:
              at most 1.2x the weights in bfloat16)
  pack_extra  what pack_for_cpu keeps resident (oneDNN-packed copies of the projections; none where
              the CPU has no native kernel for the dtype)
  total_peak  the peak of the whole load_model call (pack and tokenizer included)

`--old REF` adds the loader of git commit REF (879c473: before streaming, which read every tensor
into one dict, built in float32 and cast at the end), imported from a temporary copy.

    python benchmarks/load_memory.py --json benchmarks/results/load_memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's rayspec, whatever an installed copy points at


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        return True
    except OSError:
        return False


def _import_loader(old_ref: str | None):
    if old_ref is None:
        from rayspec.model import loader

        return loader
    from revisions import module_at

    return module_at(old_ref, "rayspec/model/loader.py", cwd=REPO)


def measure(model: str, dtype: str, old_ref: str | None) -> dict:
    """In this process: import, reset the peak mark, load, return the figures (bytes)."""
    import gc

    import torch  # noqa: F401
    import transformers  # noqa: F401

    import rayspec
    from rayspec.model.native import CausalLM

    loader = _import_loader(old_ref)
    before_lazy = _status_bytes("VmRSS")
    # what transformers imports lazily during a load (the config and tokenizer classes, the Llama
    # module the rotary tables come from): code, not weights, and imported once per process
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    gc.collect()
    reset = _reset_peak()
    baseline = _status_bytes("VmRSS") if reset else _status_bytes("VmHWM")
    at_pack = {}
    pack = CausalLM.pack_for_cpu

    def spy(self):  # the loaders' last step: what came before it is the weights' load
        at_pack["peak"], at_pack["rss"] = _status_bytes("VmHWM"), _status_bytes("VmRSS")
        out = pack(self)
        at_pack["after"] = _status_bytes("VmRSS")
        return out

    CausalLM.pack_for_cpu = spy
    start = time.perf_counter()
    lm, _ = loader.load_model(model, device="cpu", dtype=dtype)
    seconds = time.perf_counter() - start
    num_params = sum(p.numel() for p in lm.parameters())  # tied embeddings once
    return {
        "loader": f"old ({old_ref})" if old_ref else "new", "dtype": dtype, "seconds": round(seconds, 2),
        "num_params": num_params, "weight_bytes": sum(p.numel() * p.element_size() for p in lm.parameters()),
        "bf16_weight_bytes": num_params * 2, "baseline_rss": baseline,
        "lazy_imports_rss": baseline - before_lazy, "peak_mark_reset": reset,
        "load_peak": at_pack["peak"] - baseline, "pack_extra": at_pack["after"] - at_pack["rss"],
        "total_peak": _status_bytes("VmHWM") - baseline, "ru_maxrss": _maxrss(),
        "rayspec": str(Path(rayspec.__file__).parent),
    }


def _maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.processor())


def _describe(case: dict) -> str:
    return (f"{case['loader']:>14} {case['dtype']:>9}: load peak {case['load_peak'] / MIB:7.1f} MiB "
            f"({case['load_peak_over_bf16_weights']:.2f}x the bf16 weights, {case['bf16_weight_bytes'] / MIB:.1f} MiB; "
            f"{case['load_peak_over_weights']:.2f}x at this dtype), pack +{case['pack_extra'] / MIB:.1f} MiB, "
            f"whole load_model {case['total_peak'] / MIB:.1f} MiB, baseline {case['baseline_rss'] / MIB:.0f} MiB, "
            f"{case['seconds']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--old", default="879c473", help="git ref of the loader to compare with ('' for none)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "OLD_REF"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dtype, old_ref = args.child
        print(json.dumps(measure(args.model, dtype, old_ref or None)))
        return

    import torch

    cases = []
    for dtype in args.dtypes:
        for old_ref in ([None, args.old] if args.old else [None]):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", dtype, old_ref or ""],
                                 cwd=REPO, check=True, capture_output=True, text=True).stdout
            case = json.loads(out.strip().splitlines()[-1])
            case["load_peak_over_bf16_weights"] = round(case["load_peak"] / case["bf16_weight_bytes"], 3)
            case["load_peak_over_weights"] = round(case["load_peak"] / case["weight_bytes"], 3)  # at this dtype
            cases.append(case)
            print(_describe(case), flush=True)
    result = {"model": args.model, "cpu": _cpu_model(), "torch": torch.__version__, "python": platform.python_version(),
              "goal": "load_peak <= 1.2x the bf16 weight bytes (bfloat16 load)", "cases": cases}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
