"""Check `rayspec plan`'s figures (rayspec.memory.plan) against what CUDA allocates, on one GPU.

Streams a checkpoint of the target of tests/data/llama-3.1-8b-instruct (Llama-3.1-8B-Instruct's
published config) cut to LOAD_LAYERS layers, written in float32 to a temporary directory, into
bfloat16 on the GPU (rayspec.model.loader.build_model, as a load does): the load peak. Then builds the
whole target (weights left uninitialized: only the sizes matter) the way build_model does, its KV
cache as the engine sizes it for configs/llama3_eagle3.yaml, the EAGLE-3 head of
tests/data/eagle3-llama3.1-instruct-8b attached as rayspec.eagle.checkpoint does, then one
prefill forward of a 2048-token chunk at the end of an 8192-token context (the EAGLE feature
layers handed out, as the engine asks), under SDPA's default backend choice and under its math
backend. Prints planned and measured bytes side by side (torch.cuda.memory_allocated /
max_memory_allocated: the caching allocator's reserve beyond them is not counted).

    python benchmarks/plan_memory_check.py          # needs a GPU with ~45 GB free, ~6 GB of disk
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.eagle.checkpoint import eagle_config_from_hf
from rayspec.eagle.head import attach_target, build_head
from rayspec.memory.activation_memory import forward_activations
from rayspec.memory.plan import kv_cache_plan
from rayspec.memory.weight_memory import causal_lm_weights, eagle_head_weights, load_bytes
from rayspec.model.families import ModelArgs
from rayspec.model.loader import build_model, empty_model
from rayspec.model.runner import make_runner

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
CHUNK, CONTEXT = 2048, 8192
LOAD_LAYERS = 2  # the streamed load's checkpoint: the embedding, LM head and this many layers (about 6 GB in float32)


def row(name: str, planned: int, measured: int) -> None:
    print(f"{name:<52}{planned / 1e9:>10.3f} GB{measured / 1e9:>10.3f} GB{measured / max(planned, 1):>8.3f}")


def main() -> None:
    from transformers import LlamaConfig

    device, dtype = torch.device("cuda"), torch.bfloat16
    hf = LlamaConfig(**json.loads((DATA / "llama-3.1-8b-instruct" / "config.json").read_text()))
    args = ModelArgs.from_hf_config(hf)
    config = EngineConfig(model="llama", dtype="bfloat16", max_model_len=CONTEXT, max_num_seqs=32,
                          kv_cache_memory_gb=16.0, speculative=SpeculativeConfig(
                              method="eagle3", num_speculative_tokens=8, eagle_topk=4, num_steps=5))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'':<52}{'planned':>13}{'measured':>13}{'ratio':>8}")

    cut = copy.deepcopy(hf)
    cut.num_hidden_layers = LOAD_LAYERS
    with tempfile.TemporaryDirectory() as checkpoint:
        from safetensors.torch import save_file

        state = empty_model(cut, "cpu", torch.float32).state_dict()  # tied weights: none in Llama-3.1-8B
        save_file({name: t.contiguous() for name, t in state.items()}, str(Path(checkpoint) / "model.safetensors"))
        del state
        torch.cuda.reset_peak_memory_stats()
        loaded = build_model(cut, None, device, dtype, model_dir=Path(checkpoint))
        planned = load_bytes(causal_lm_weights(ModelArgs.from_hf_config(cut), dtype), device)
        measured = torch.cuda.max_memory_allocated()
        row(f"streamed load, {LOAD_LAYERS} layers, float32 file (load peak)", planned, measured)
        del loaded

    torch.cuda.reset_peak_memory_stats()
    target = build_model(hf, None, device, dtype)
    weights = causal_lm_weights(args, dtype)
    row("target weights", weights.bytes, torch.cuda.memory_allocated())

    kv = kv_cache_plan(args, dtype, CONTEXT, 8, 32, 16.0, "eagle3")
    before = torch.cuda.memory_allocated()
    runner = make_runner(target, CONTEXT, kv.num_slots, slack=9, num_blocks=kv.num_blocks, block_size=kv.block_size)
    row(f"target KV cache ({kv.num_blocks} blocks of {kv.block_size})", kv.bytes, torch.cuda.memory_allocated() - before)

    head_hf = json.loads((DATA / "eagle3-llama3.1-instruct-8b" / "config.json").read_text())
    head_config = eagle_config_from_hf(head_hf, args.num_layers, args.hidden_size)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    head = build_head(head_config).to(device=device, dtype=dtype)
    attach_target(head, target, has_own_embedding=False)
    planned_head = eagle_head_weights(head_config, dtype)
    placeholder = args.vocab_size * args.hidden_size * dtype.itemsize
    row("eagle3 head: load (with its placeholder embedding)", planned_head.bytes + placeholder,
        torch.cuda.max_memory_allocated() - before)
    row("eagle3 head weights", planned_head.bytes, torch.cuda.memory_allocated() - before)

    runner.kv.allocate("s")
    runner.kv.set_cached_len("s", CONTEXT - CHUNK)  # the last chunk of a long prompt: it sees every key
    tokens = torch.randint(0, args.vocab_size, (CHUNK,)).tolist()
    aux = head_config.aux_layers
    estimate = forward_activations(args, dtype, CHUNK, CONTEXT, logit_rows=1, feature_size=head_config.feature_size)
    # the default backend runs a fused kernel here (no scores held): compare with the estimate without them
    for backend, context, planned in (("default SDPA", None, estimate.without_scores),
                                      ("math SDPA", SDPBackend.MATH, estimate.total)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode(), (sdpa_kernel(context) if context is not None else contextlib.nullcontext()):
            (hidden, features), _ = runner.forward_hidden(["s"], [tokens], packed=True, aux_layers=aux)
            logits = target.logits(hidden[-1:])
            torch.cuda.synchronize()
        row(f"prefill {CHUNK} x {CONTEXT} keys, {backend}", planned, torch.cuda.max_memory_allocated() - base)
        del hidden, features, logits
        runner.kv.set_cached_len("s", CONTEXT - CHUNK)
    print("estimate terms:", {k: round(v / 1e9, 3) for k, v in vars(estimate).items()
                               if k not in ("tokens", "kv_len", "logit_rows")})


if __name__ == "__main__":
    main()
