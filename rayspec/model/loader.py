"""A model built from a spec: its transformers config read (rayspec.model.weights.hub), rayspec's own
model (rayspec.model.native) allocated at its dtype on its device and filled from the checkpoint
(rayspec.model.weights.checkpoint), or transformers' modeling code where the architecture is not native
(rayspec.model.generic). Also the dtype a device gets by default."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rayspec.model.families import NATIVE_MODEL_TYPES, ModelArgs, UnsupportedArchitectureError
from rayspec.model.native import CausalLM
from rayspec.model.weights.checkpoint import load_checkpoint, load_state
from rayspec.model.weights.hub import load_hf_config, resolve_model_dir
from rayspec.model.weights.plain_config import load_tokenizer

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def auto_dtype(device: torch.device) -> torch.dtype:
    """`dtype: auto`: bfloat16 on CUDA, and on CPUs whose oneDNN runs bfloat16 matmuls natively
    (AMX, AVX512-BF16), where it is faster than float32 (1.5x measured on a 2-core Xeon with AMX);
    float32 on other CPUs, which would emulate bfloat16 (slower than float32)."""
    from rayspec.model.linear import cpu_bf16_fast

    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        chosen = torch.bfloat16 if cpu_bf16_fast() else torch.float32
        logger.info("dtype auto: %s (%s)", chosen, "this CPU runs bfloat16 matmuls natively" if chosen == torch.bfloat16
                    else "no native bfloat16 matmuls on this CPU (no AMX / AVX512-BF16)")
        return chosen
    return default_dtype(device)


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None: float32 on CPU (exact, the same on every CPU), bfloat16 on CUDA; "auto": the faster
    of the two on this device (auto_dtype)."""
    if name == "auto":
        return auto_dtype(device)
    if name is None:
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(table)}")
    return table[name]


def rope_from_config(config) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling for any static rope type transformers knows (default, linear,
    llama3, yarn, ...), read from transformers 5's `config.rope_parameters` (rope_theta, rope_type
    and its scaling fields; older configs' rope_theta / rope_scaling are converted into it when the
    config loads). Llama's rotary embedding serves every native family: Mistral's, Qwen2's and
    Qwen3's compute the same from the same config (tests/engine/test_families.py compares each). The
    length-dependent types (dynamic, longrope) are refused by ModelArgs.from_hf_config.

    As LlamaRotaryEmbedding computes them, without importing Llama's modeling module (0.85 s of
    every process's start, for one formula): the default type here, the others by transformers'
    own ROPE_INIT_FUNCTIONS (tests/engine/test_families.py compares with LlamaRotaryEmbedding)."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.clone(), float(scaling)


def empty_model(config, device, dtype, tp=None, dequantize_experts: bool = False,
                checkpoint_names=None) -> CausalLM:
    """A CausalLM for `config` with its parameters allocated at `dtype` on `device` and not yet
    filled (tied embeddings shared, the rotary buffer float32 and computed). Built on the meta
    device and cast there, so no float32 copy of a bfloat16 model ever exists. A parameter's
    `tp_shard` (see `load_checkpoint`), set at construction, is kept. tp: this rank's
    rayspec.model.parallel.TPGroup (the model is then its shard; its layers' slices become `tp_shard`s).
    dequantize_experts: float experts where the checkpoint's are MXFP4 (which the model keeps 4-bit otherwise).
    checkpoint_names: the checkpoint's tensor names, to keep its 4-bit projections 4-bit (FP4Linear,
    rayspec.model.fp4_linear; None: every projection float, 4-bit ones then dequantized as they load)."""
    from dataclasses import replace

    from rayspec.model.parallel import NO_TP, tag_shards

    args = ModelArgs.from_hf_config(config)
    if dequantize_experts:
        args = replace(args, mxfp4_experts=False)
    inv_freq, scaling = rope_from_config(config)
    with torch.device("meta"):
        model = CausalLM(args, inv_freq, scaling, tp=tp or NO_TP)
    model.to(dtype)  # on meta: only the dtypes change (inv_freq stays float32: Float32Rotary)
    if checkpoint_names is not None:
        _keep_4bit(model, checkpoint_names, args.tie_word_embeddings)
    shards = {name: p.tp_shard for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    # new Parameter objects (as Module.to_empty makes them, whose empty_like of a meta tensor goes through
    # torch's Python references and imports sympy: 0.2 s): their attributes are lost, tied weights come apart
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for name, shard in shards.items():
        model.get_parameter(name).tp_shard = shard
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    tag_shards(model)
    model.inv_freq = inv_freq.to(device)
    return model


def _keep_4bit(model: CausalLM, checkpoint_names, tied: bool) -> None:
    from rayspec.model.fp4_linear import checkpoint_fp4_modules, keep_4bit
    from rayspec.model.linear import Linear

    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)} - ({"lm_head"} if tied else set())
    keep_4bit(model, checkpoint_fp4_modules(checkpoint_names, linears))


def build_model(config, state_dict: dict | None = None, device="cpu", dtype=torch.float32,
                model_dir: Path | None = None, tp=None, quantization: str | None = None,
                dequantize_experts: bool = False, quantized_weights: str = "keep") -> CausalLM:
    """A ready model (eval mode, packed for the CPU): weights streamed from the checkpoint in
    `model_dir` (`load_checkpoint`), or copied from `state_dict`, or left uninitialized when
    neither is given (only the sizes matter: memory checks, tests that fill weights themselves).
    quantization: "int8" makes every projection and the LM head weight-only int8 (rayspec.model.quantize).
    dequantize_experts: MXFP4 experts (gpt-oss) dequantized at load rather than kept 4-bit.
    quantized_weights: "keep" holds a checkpoint's 4-bit projections 4-bit (rayspec.model.fp4_linear),
    "dequantize" at the model's dtype (and its MXFP4 experts too)."""
    from rayspec.model.fp4_linear import check_mode
    from rayspec.model.parallel import NO_TP, zero_row_biases
    from rayspec.model.weights.files import weight_names

    dequantize_experts = dequantize_experts or check_mode(quantized_weights) == "dequantize"
    if model_dir is not None and not dequantize_experts:
        dequantize_experts = _experts_stored_float(config, model_dir)
    names = weight_names(model_dir) if model_dir is not None and quantized_weights == "keep" else None
    if names is not None and quantization is not None:  # int8 requantizes float weights
        names = None
    model = empty_model(config, device, dtype, tp, dequantize_experts, names)
    if model_dir is not None:
        load_checkpoint(model, model_dir)
    elif state_dict is not None:
        load_state(model, state_dict)
    zero_row_biases(model, tp or NO_TP)
    if quantization is not None:
        from rayspec.model.quantize import check_scheme, quantize_int8

        check_scheme(quantization)
        if tp is not None and tp.size > 1:
            raise ValueError("draft_quantization needs a draft on one device (not split over tensor-parallel ranks)")
        quantize_int8(model)
    return model.eval().pack_for_cpu()


def _experts_stored_float(config, model_dir: Path) -> bool:
    """Whether a config that says MXFP4 experts comes with float ones (a dequantized export that kept its
    quantization_config): no `<proj>_blocks` tensor among the checkpoint's names."""
    from rayspec.model.weights.files import weight_names

    if not ModelArgs.from_hf_config(config).mxfp4_experts:
        return False
    names = weight_names(model_dir)
    return names is not None and not any(n.endswith("_blocks") for n in names)


def is_native(config) -> bool:
    """Whether rayspec's own model (rayspec/model/native.py) runs this transformers config; the others run
    on the generic path. Native: the families of NATIVE_MODEL_TYPES, with the rope types and
    activations the one model implements (ModelArgs.from_hf_config says which not)."""
    try:
        ModelArgs.from_hf_config(config)
    except UnsupportedArchitectureError:
        return False
    return True


def load_model(spec: str, device=None, dtype=None, num_layers: int | None = None, tp=None, tokenizer: bool = True,
               quantization: str | None = None, dequantize_experts: bool = False, quantized_weights: str = "keep"):
    """Load (model, tokenizer). num_layers keeps only the first layers (a cheap self-draft).
    tp: a rayspec.model.parallel.TPGroup: load this rank's shard only. tokenizer=False: (model, None).
    quantization: "int8" for weight-only int8 linears (a draft's precision; rayspec.model.quantize).
    dequantize_experts: a native gpt-oss's MXFP4 experts dequantized at load (else kept 4-bit).
    quantized_weights: "keep" (a checkpoint's NVFP4 / MXFP4 weights stay 4-bit) or "dequantize" (at `dtype`)."""
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype, device)
    model_dir = resolve_model_dir(spec)
    config = load_hf_config(model_dir)
    if is_native(config):
        if num_layers is not None:
            config.num_hidden_layers = num_layers  # the later layers' tensors are then never read
        model = build_model(config, None, device, dtype, model_dir=model_dir, tp=tp, quantization=quantization,
                            dequantize_experts=dequantize_experts, quantized_weights=quantized_weights)
    else:  # transformers' own modeling code over our KV cache (rayspec/model/generic.py)
        from rayspec.model.generic import load_generic_model

        if quantization is not None:
            raise ValueError(f"draft_quantization needs a natively supported architecture "
                             f"({sorted(NATIVE_MODEL_TYPES)}); {getattr(config, 'model_type', '?')!r} is not")
        if tp is not None and tp.size > 1:
            raise ValueError(f"tensor parallelism needs a natively supported architecture ({sorted(NATIVE_MODEL_TYPES)}); "
                             f"{getattr(config, 'model_type', '?')!r} runs on the generic path, on one device")
        logger.info("%s (%s) runs on the generic transformers path", spec, getattr(config, "model_type", "?"))
        model = load_generic_model(model_dir, config, device, dtype, num_layers=num_layers)
    # a checkpoint without tokenizer files serves token ids only (tokenizer None)
    has_tokenizer = tokenizer and (any(model_dir.glob("tokenizer*")) or (model_dir / "vocab.json").exists())
    tokenizer = load_tokenizer(model_dir, config) if has_tokenizer else None
    return model, tokenizer
