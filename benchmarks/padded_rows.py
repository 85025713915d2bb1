"""Cost of a target forward (+ logits) over 8 sequences by row lengths: do padded rows cost?

usage: python benchmarks/padded_rows.py [THREADS] [REPS]

Each of 8 sequences holds a 300-token random prompt; every case appends rows of the given
lengths (1 = a decode step, 1 + k = a step verifying k drafts), times the forward plus the
logits of the real rows, and rolls the cache back. Before packing, a batch cost what
max(length) x 8 rows cost; packed, it costs about what its real rows cost.
"""

import statistics
import sys
import time

import torch

from rayspec.model import loader
from rayspec.model.runner import make_runner

CASES = ([1] * 8, [1] * 7 + [6], [2] * 8, [1] * 4 + [6] * 4, [3] * 8, [6] * 8)


def main(threads: int, reps: int) -> None:
    torch.set_num_threads(threads)
    model, _ = loader.load_model("smollm2-135m-instruct")  # outside inference mode: weights keep versions
    with torch.inference_mode():
        run(model, reps)


def run(model, reps: int) -> None:
    runner = make_runner(model, 1024, 8, slack=16)
    ids = [f"s{i}" for i in range(8)]
    gen = torch.Generator().manual_seed(0)
    for s in ids:
        runner.kv.allocate(s)
        runner.forward_hidden([s], [torch.randint(100, 40000, (300,), generator=gen).tolist()])

    def median_ms(lengths: list[int]) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            hidden, _ = runner.forward_hidden(ids, [[7] * n for n in lengths], packed=True)
            model.logits(hidden)
            times.append(time.perf_counter() - t)
            for s in ids:
                runner.kv.set_cached_len(s, 300)
        return statistics.median(times) * 1e3

    median_ms([1] * 8)  # warm-up
    for lengths in CASES:
        print(f"rows {lengths}: real {sum(lengths):2d}, padded {8 * max(lengths):2d}: {median_ms(lengths):6.1f} ms",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, int(sys.argv[2]) if len(sys.argv) > 2 else 12)
