"""CPU seconds of a process that starts, builds an LLMEngine (a model, optionally with an EAGLE head) and
generates 4 greedy tokens: what every Serve replica, tensor-parallel rank and CLI that loads a model pays
before it serves. Side by side with another revision of this repository (a git worktree made here),
alternated, as ratios:

    python benchmarks/load_cpu.py --model default --head heads/smollm2-135m-eagle3 --against HEAD~3 --rounds 4

Each measurement is a fresh `python` (one OpenMP thread) importing the checkout it runs from; both
checkouts are byte-compiled first (this machine sets PYTHONDONTWRITEBYTECODE). Prints a table; --json
writes the figures with the machine's CPU model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from revisions import worktree  # noqa: E402

CHILD = """
import resource, sys, time
t0 = time.time()
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams
model, head = sys.argv[1], sys.argv[2]
kw = {"speculative": SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=3)} if head else {}
engine = LLMEngine(EngineConfig(model=model, max_model_len=256, max_num_seqs=2, kv_cache_memory_gb=0.05, device="cpu", **kw))
engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
r = resource.getrusage(resource.RUSAGE_SELF)
print(f"{r.ru_utime + r.ru_stime:.3f} {time.time() - t0:.3f}")
"""


def measure(checkout: Path, model: str, head: str) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, model, head], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: {out.stderr[-2000:]}")
    cpu, wall = out.stdout.split()[-2:]
    return float(cpu), float(wall)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--head", default="", help="an EAGLE head directory (relative to the repository), or none")
    parser.add_argument("--against", default="", help="a git revision to compare with (a worktree is made)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    head = str((REPO / args.head).resolve()) if args.head else ""
    checkouts = {"this": REPO}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.against:
            checkouts = {args.against: stack.enter_context(worktree(args.against, Path(tmp), cwd=REPO)), "this": REPO}
        for checkout in checkouts.values():
            subprocess.run([sys.executable, "-m", "compileall", "-q", "rayspec", "deployments"], cwd=checkout,
                           capture_output=True)
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in checkouts}
        for _ in range(args.rounds):  # alternated: the VM's speed drifts
            for name, checkout in checkouts.items():
                figures[name].append(measure(checkout, args.model, head))
    rows = {name: {"cpu_s_median": statistics.median(c for c, _ in runs), "wall_s_median": statistics.median(w for _, w in runs),
                   "cpu_s": [c for c, _ in runs]} for name, runs in figures.items()}
    print(f"| checkout | CPU s (median of {args.rounds}) | wall s |\n|---|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['cpu_s_median']:.2f} | {row['wall_s_median']:.2f} |")
    if args.against:
        print(f"this / {args.against}: {rows['this']['cpu_s_median'] / rows[args.against]['cpu_s_median']:.2f}x CPU")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "head": args.head, "cpu": cpu_model(),
                                               "rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
