"""Target forward time at 1 vs 2 torch threads, alone and next to a light background load.

usage: python benchmarks/forward_threads.py [--load]

--load starts a process that keeps one core 10% busy (2 ms of work every 20 ms), a stand-in for
what Ray, the HTTP proxy and the ingress do while a served model decodes. Prints the median ms of
a SmolLM2-135M forward for (sequences x tokens) shapes, thread counts interleaved, 3 repeats.
"""

import multiprocessing as mp
import statistics
import sys
import time

import torch

from rayspec.model.loader import load_model
from rayspec.model.runner import make_runner


def _busy():
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002:
            pass
        time.sleep(0.018)


def main(load: bool) -> None:
    if load:
        mp.Process(target=_busy, daemon=True).start()
    model, _ = load_model("default", device="cpu", dtype=torch.float32)
    runner = make_runner(model, 1024, 8, slack=64)
    seqs = [f"s{i}" for i in range(8)]
    for s in seqs:
        runner.kv.allocate(s)
        runner.forward([s], [list(range(100, 300))], last_only=True)

    def median_ms(nseq: int, ntok: int, reps: int = 15) -> float:
        times = []
        for _ in range(reps):
            lens = [runner.kv.cached_len(s) for s in seqs[:nseq]]
            start = time.perf_counter()
            runner.forward(seqs[:nseq], [list(range(500, 500 + ntok))] * nseq, last_only=False)
            times.append(time.perf_counter() - start)
            for s, n in zip(seqs[:nseq], lens):
                runner.kv.set_cached_len(s, n)
        return round(1000 * statistics.median(times), 1)

    for threads in (1, 2):  # warm-up: oneDNN picks kernels per shape and thread count
        torch.set_num_threads(threads)
        median_ms(1, 1, 3)
    print(f"{'seqs x tokens':>14} {'1 thread ms':>20} {'2 threads ms':>20}")
    for nseq, ntok in [(1, 1), (1, 8), (1, 16), (4, 1), (8, 1), (8, 4)]:
        res = {1: [], 2: []}
        for _ in range(3):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                res[threads].append(median_ms(nseq, ntok))
        print(f"{f'{nseq} x {ntok}':>14} {str(res[1]):>20} {str(res[2]):>20}", flush=True)


if __name__ == "__main__":
    main("--load" in sys.argv[1:])
