"""rayspec.sampling.sampler.argmax (max's indices, faster than torch's argmax on CPU) returns what
torch's argmax returns: the first maximum on ties, a NaN where a row has one, index 0 for a row of -inf;
in every floating dtype the engine computes in, on non-contiguous views; and the benchmark's dry run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rayspec.sampling.sampler import argmax

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_argmax_is_torchs(dtype):
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = int(torch.randint(1, 5000, (1,), generator=gen))
        x = torch.randint(-3, 3, (6, vocab), generator=gen).to(dtype)  # many ties
        if trial % 3 == 0:
            x[1, int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")
        if trial % 4 == 0:
            x[2, :] = float("-inf")
            x[3, -1] = float("inf")
        assert torch.equal(argmax(x), x.argmax(-1)), (dtype, trial)
    # ties at the first and last index, and a view whose last dimension is strided
    x = torch.zeros(3, 7, dtype=dtype)
    x[1, -1] = 1
    assert argmax(x).tolist() == [0, 6, 0]
    y = torch.randint(-2, 2, (700, 5), generator=gen).to(dtype).t()
    assert not y.is_contiguous() and torch.equal(argmax(y), y.argmax(-1))
    z = torch.randint(-2, 2, (4, 3, 300), generator=gen).to(dtype)
    assert torch.equal(argmax(z), z.argmax(-1))


def test_argmax_cost_dry_run():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import argmax_cost

    report = argmax_cost.main(["--dry-run"])
    assert report["rows"] and report["rows"][0]["argmax_ms"] > 0 and report["cpu_model"]
