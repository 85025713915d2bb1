"""The CPU matmul path is measured at load time (rayspec.cpu_kernels), not fixed by a constant."""

from __future__ import annotations

import time

import pytest
import torch

from rayspec import cpu_kernels
from rayspec.cpu_kernels import VARIANTS, choose, pick
from rayspec.model import Linear

needs_onednn = pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="oneDNN is one of the candidates")


def test_pick_takes_the_least_total_time():
    assert pick({"plain": {1: 1.0, 9: 1.0}, "onednn": {1: 0.5, 9: 1.2}, "onednn_pad4": {1: 0.6, 9: 1.2}}) == "onednn"
    assert pick({"plain": {1: 1.0, 9: 1.0}, "onednn": {1: 1.5, 9: 1.2}, "onednn_pad4": {1: 1.6, 9: 1.0}}) == "plain"


@needs_onednn
@pytest.mark.parametrize("fast", sorted(VARIANTS))
def test_choose_keeps_what_runs_fastest(monkeypatch, fast):
    """Candidates that sleep except the fast one: the measurement finds it, whichever it is."""
    monkeypatch.setenv(cpu_kernels.ENV, "measure")

    def factory(variant):
        return lambda x: time.sleep(0 if variant == fast else 0.002)

    chosen = choose(factory, 16, torch.float32)
    assert chosen.variant == fast and chosen.source == "measured"
    assert set(chosen.median_ms) == set(VARIANTS) and all(set(m) == set(cpu_kernels.ROWS) for m in chosen.median_ms.values())
    assert fast in chosen.describe()


def test_environment_names_the_path(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "plain")
    assert choose(lambda v: None, 16, torch.float32).variant == "plain"
    monkeypatch.setenv(cpu_kernels.ENV, "fastest")
    with pytest.raises(ValueError, match="RAYSPEC_CPU_KERNELS"):
        choose(lambda v: None, 16, torch.float32)


@needs_onednn
def test_every_path_computes_the_same_model(tiny_model_dir, monkeypatch):
    """A model loaded under each path (and under measurement) gives the same logits; the chosen
    path is what its projections then use (packed or not, padding rows or not)."""
    from rayspec import loader
    from rayspec.model import ForwardBatch, KVCache

    outputs = {}
    for variant in ["measure", *sorted(VARIANTS)]:
        monkeypatch.setenv(cpu_kernels.ENV, variant)
        model, _ = loader.load_model(str(tiny_model_dir))
        kernels = model.cpu_kernels
        assert kernels.variant in VARIANTS and (variant == "measure") == (kernels.source == "measured")
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        packed = any(m._packed is not None for m in linears) or model.model.layers[0].mlp.gate_up is not None
        assert packed == kernels.onednn
        if kernels.onednn:
            assert model.model.layers[0].mlp.gate_up.min_rows == kernels.min_rows
        cache = KVCache(model.args, 1, 16, torch.float32, torch.device("cpu"))
        ids = torch.tensor([[5, 9, 200, 31, 7]])
        batch = ForwardBatch(slots=torch.tensor([0]), positions=torch.arange(5)[None], kv_len=5, mask=None,
                             slot_range=(0, 1))
        with torch.inference_mode():
            from rayspec.runner import additive_mask
            batch.mask = additive_mask((torch.arange(5)[None, :] <= torch.arange(5)[:, None])[None, None], torch.float32)
            outputs[variant] = model.logits(model(ids, cache, batch))
    for variant, logits in outputs.items():
        torch.testing.assert_close(logits, outputs["plain"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_follows_the_cpu(monkeypatch, caplog, native):
    """`dtype: auto` is bfloat16 where oneDNN runs it natively (AMX / AVX512-BF16), else float32, and
    says which; None stays float32 on every CPU (exact, the same bits everywhere); CUDA: bfloat16."""
    import logging

    from rayspec import loader, model
    monkeypatch.setattr(model, "cpu_bf16_fast", lambda: native)
    with caplog.at_level(logging.INFO, logger="rayspec.loader"):
        assert loader.parse_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert "dtype auto" in caplog.text
    assert loader.parse_dtype(None, torch.device("cpu")) == torch.float32
    assert loader.parse_dtype("auto", torch.device("cuda")) == torch.bfloat16
