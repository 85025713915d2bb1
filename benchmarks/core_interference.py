"""How much one core's model forwards slow the other's on this machine (issue 20): the float32
target and the int8 self-draft (SmolLM2-135M, one thread each, one token a forward over a 300-token
context), each alone, then both at once in two processes started together.

    python benchmarks/core_interference.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def forward_ms(quantization: str | None, seconds: float, start_at: float) -> float:
    import warnings

    import torch

    from rayspec.model.loader import load_model
    from rayspec.model.runner import make_runner

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, _ = load_model("smollm2-135m-instruct", quantization=quantization, tokenizer=False)
    runner = make_runner(model, 2048, 2, slack=8)
    ids = list(range(300))
    runner.kv.allocate("a", ids)
    runner.kv.commit("a", ids)
    runner.forward(["a"], [ids], last_only=True)
    time.sleep(max(0.0, start_at - time.time()))
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        runner.kv.set_cached_len("a", len(ids))
        runner.forward(["a"], [[5]], last_only=True)
        n += 1
    return 1e3 * (time.perf_counter() - started) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--one", choices=["float32", "int8"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(f"{forward_ms(None if a.one == 'float32' else 'int8', a.seconds, a.start_at):.1f}")
        return

    def run(kinds):
        start = time.time() + 30  # both loaded by then
        procs = [subprocess.Popen([sys.executable, __file__, "--one", k, "--seconds", str(a.seconds),
                                   "--start-at", str(start)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True) for k in kinds]
        return [float(proc.communicate()[0].strip().splitlines()[-1]) for proc in procs]

    alone = {k: run([k])[0] for k in ("float32", "int8")}
    together = dict(zip(("float32", "int8"), run(["float32", "int8"])))
    for k in alone:
        print(f"{k}: {alone[k]:.1f} ms a forward alone, {together[k]:.1f} beside the other "
              f"({together[k] / alone[k]:.2f}x)")


if __name__ == "__main__":
    main()
