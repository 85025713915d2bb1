"""Weight-only int8 drafts (rayspec.model.quantize, `draft_quantization: int8`): the kernels' accuracy,
what quantizing a model keeps and frees, the draft's agreement with its float self, the configs
and vLLM's name. Greedy and sampled losslessness with an int8 draft: tests/engine/test_greedy_equivalence.py
("draft-self-int8") and tests/engine/test_lossless_sampled.py ("draft_model-int8")."""

from __future__ import annotations

import pytest
import torch

from engine_utils import cached_model, make_engine
from rayspec.config import SpeculativeConfig
from rayspec.memory.plan import DraftShape
from rayspec.memory.weight_memory import causal_lm_weights, int8_weights
from rayspec.model import loader
from rayspec.model.families import ModelArgs
from rayspec.model.linear import Linear
from rayspec.model.quantize import Int8Weight, quantize_int8
from rayspec.sampling.sampler import SamplingParams


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["fbgemm", "int8pack_mm"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_int8_linear_is_close_to_the_float_one(cpu_kernel, rows):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=True)
    q = Int8Weight(lin.weight, lin.bias, cpu_kernel=cpu_kernel)
    assert (q.packed is not None) == cpu_kernel and (q.q is None) == cpu_kernel  # (fbgemm: this torch has it)
    x = torch.randn(2, rows, 96)
    with torch.no_grad():
        want = lin(x)
    got = q(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    # per-channel int8 weights (and, with fbgemm, 8-bit activations per call): about 1% of the scale
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.03, err
    # and not the float result itself: the weights were rounded
    assert not torch.equal(got, want)


def test_int8_linear_is_close_where_int16_pairs_would_saturate():
    """Gaussian weights and activations (real layers have such outliers): without VNNI, fbgemm's
    8-bit activations overflow its int16 pair sums (an AVX2 EPYC: a third of the scale off); the
    probe then quantizes activations to 7 bits."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 256), torch.randn(8, 256)
    want = x @ w.T
    got = Int8Weight(w, None)(x)
    assert (got - want).abs().max() / want.abs().max() < 0.03


def test_quantize_int8_frees_untied_weights_and_keeps_the_tied_embedding(tiny_model_dir):
    model, _ = loader.load_model(str(tiny_model_dir), tokenizer=False)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n = quantize_int8(model)
    assert n == len(linears) and model.quantization == "int8"
    assert all(m.int8 is not None and m.weight.numel() == 0 for m in linears)  # untied here: all freed
    assert model.model.embed_tokens.weight.numel() > 0
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < float_bytes / 2
    assert quantize_int8(model) == 0  # already done: nothing quantized twice

    # a tied LM head keeps the embedding's weight (the embedding still reads it)
    tied, _ = loader.load_model(str(tiny_model_dir), tokenizer=False)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    quantize_int8(tied)
    assert tied.lm_head.int8 is not None and tied.model.embed_tokens.weight.numel() > 0
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_loaded_int8_model_predicts_like_the_float_one(tiny_model_dir):
    """The int8 copy's greedy tokens agree with the float model's on most positions."""
    float_model, _ = cached_model(str(tiny_model_dir))
    int8_model, _ = loader.load_model(str(tiny_model_dir), tokenizer=False, quantization="int8")
    assert int8_model.cpu_kernels is None  # no oneDNN choice, no prepacked float copies
    from rayspec.model.runner import make_runner

    torch.manual_seed(1)
    ids = torch.randint(3, 200, (64,)).tolist()
    tops = []
    for m in (float_model, int8_model):
        runner = make_runner(m, 256, 1, slack=4)
        runner.kv.allocate("s", ids)
        logits = runner.forward(["s"], [ids], last_only=False)  # [1, 64, vocab]
        tops.append(logits.argmax(-1).flatten())
    agree = (tops[0] == tops[1]).float().mean().item()
    assert agree > 0.8, agree


def test_int8_self_draft_is_mostly_accepted(tiny_model_dir):
    """The target's own checkpoint as an int8 draft: greedy output is the target's (the rule is
    unchanged) and the drafts are mostly accepted (the test_greedy_equivalence case checks the
    output over batches and joining requests)."""
    loaded = cached_model(str(tiny_model_dir))
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    params = SamplingParams(temperature=0, max_tokens=40)
    ref = make_engine(tiny_model_dir, "none", loaded=loaded).generate([prompt], params)[0].token_ids
    engine = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, draft_quantization="int8")
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == ref
    assert out.num_accepted_tokens / max(1, out.num_steps) > 1.5  # of at most 3 per step


def test_draft_quantization_config_errors():
    with pytest.raises(ValueError, match="not supported"):
        SpeculativeConfig(method="draft_model", draft_quantization="fp4")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="eagle3", draft_quantization="int8")
    assert SpeculativeConfig(method="draft_model", draft_quantization="int8").draft_quantization == "int8"


def test_vllm_quantization_key_names_the_draft_quantization():
    from deployments.config import AppArgs

    args = AppArgs.model_validate({"model": "m", "speculative_config": {
        "method": "draft_model", "model": "m", "num_speculative_tokens": 3, "quantization": "int8"}})
    assert args.speculative.draft_quantization == "int8" and args.speculative.draft_model == "m"
    with pytest.raises(ValueError):
        AppArgs.model_validate({"model": "m", "speculative": {"method": "draft_model", "draft_quantization": "awq"}})


def test_plan_counts_an_int8_draft_at_a_quarter(tiny_model_dir):
    """`rayspec plan`'s draft weights with int8: a quarter of float32's bytes for the linears, the
    embedding kept in float; within 10% of the bytes the quantized model holds."""
    from transformers import AutoConfig

    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(tiny_model_dir))
    full = causal_lm_weights(args, torch.float32)
    planned = int8_weights(args, full, torch.float32)
    # (this tiny model is mostly its float32 embedding and read-out: 8192 x 64 each)
    assert planned.bytes < 0.7 * full.bytes and planned.linear_bytes == 0
    model, _ = loader.load_model(str(tiny_model_dir), tokenizer=False, quantization="int8")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(b.numel() * b.element_size() for b in model.buffers())
    held += sum(m.int8.nbytes() for m in model.modules() if isinstance(m, Linear))
    assert abs(planned.bytes - held) / held < 0.1, (planned.bytes, held)
    assert DraftShape(model=args).weights(torch.float32).bytes == full.bytes
