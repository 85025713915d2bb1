"""Which checkpoints the native model runs (NATIVE_MODEL_TYPES: Llama 2/3/3.1/3.3 and SmolLM, Mistral,
Qwen2/2.5, Qwen3, gpt-oss) and the shapes it reads from their transformers configs (ModelArgs): one small
registry of what differs per family (attention biases, q/k norms, sliding windows, attention sinks,
mixture-of-experts MLPs)."""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedArchitectureError(ValueError):
    """A checkpoint this model implementation does not compute exactly (model_type not in
    NATIVE_MODEL_TYPES, or a feature of it that is not implemented here)."""


# rope types whose frequencies transformers recomputes from the sequence length during a forward:
# one static inv_freq (what CausalLM.rope uses) would differ from them past the original context
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _llama_family(config) -> dict:
    """Llama (2, 3, 3.1, 3.3, SmolLM): `attention_bias` on q/k/v and o_proj alike, `mlp_bias`."""
    bias = bool(getattr(config, "attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def _mistral_family(config) -> dict:
    """Mistral: no biases; with `sliding_window` set, every layer attends within it."""
    window = getattr(config, "sliding_window", None)
    return dict(sliding_window=window, sliding_layers=tuple(range(config.num_hidden_layers)) if window else ())


def _layer_type_windows(config) -> dict:
    """Qwen2/Qwen3: the layers whose `layer_types` entry is "sliding_attention" (the config
    derives them from use_sliding_window and max_window_layers when not given) attend within
    `sliding_window`, which the config sets to None unless use_sliding_window."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ()
    sliding = tuple(i for i, t in enumerate(types[: config.num_hidden_layers]) if t == "sliding_attention")
    return dict(sliding_window=window, sliding_layers=sliding if window else ())


def _qwen2_family(config) -> dict:
    """Qwen2 / Qwen2.5: biases on q/k/v always (the config has no switch), none on o_proj."""
    return dict(attention_bias=True, o_proj_bias=False, **_layer_type_windows(config))


def _qwen3_family(config) -> dict:
    """Qwen3: per-head RMSNorm on q and k before rope; `attention_bias` on q/k/v and o_proj alike."""
    bias = bool(getattr(config, "attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, **_layer_type_windows(config))


def _gpt_oss_family(config) -> dict:
    """gpt-oss: `attention_bias` on q/k/v and o_proj alike, a learned sink logit per head, layer_types
    alternating sliding and full attention, and a mixture-of-experts MLP (rayspec.model.moe: top-k
    routing, the clamped SwiGLU, biases). Experts kept as MXFP4 codes when the checkpoint has them."""
    from rayspec.model.formats import MXFP4, quantization_of_config

    quantization = getattr(config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    mxfp4 = quantization is not None and quantization_of_config({"quantization_config": quantization}).algo == MXFP4
    bias = bool(getattr(config, "attention_bias", True))
    return dict(attention_bias=bias, o_proj_bias=bias, attention_sinks=True, **_layer_type_windows(config),
                num_experts=config.num_local_experts, experts_per_token=config.num_experts_per_tok,
                swiglu_alpha=float(config.swiglu_alpha), swiglu_limit=float(config.swiglu_limit),
                mxfp4_experts=mxfp4)


# config.model_type -> the ModelArgs fields particular to that family (the shapes are read alike)
NATIVE_MODEL_TYPES = {
    "llama": _llama_family,
    "mistral": _mistral_family,
    "qwen2": _qwen2_family,
    "qwen3": _qwen3_family,
    "gpt_oss": _gpt_oss_family,
}


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q_proj, k_proj, v_proj
    mlp_bias: bool = False
    max_position_embeddings: int = 8192
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3)
    # layers in sliding_layers see, at position p, only the keys at positions p - sliding_window + 1 .. p
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # a learned logit per head in each softmax, its probability dropped (gpt-oss)
    # a mixture-of-experts MLP where num_experts > 0 (rayspec.model.moe): experts_per_token routed per
    # token, each expert intermediate_size wide with the clamped SwiGLU (gpt-oss); mxfp4_experts: kept as
    # the checkpoint's MXFP4 codes and scales, dequantized per expert when used
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4_experts: bool = False

    def __post_init__(self):
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers without a sliding_window")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} of {self.num_experts} experts")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None where it attends to every position."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        model_type = getattr(config, "model_type", None)
        family = NATIVE_MODEL_TYPES.get(model_type)
        if family is None:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} has no native implementation (native: {', '.join(NATIVE_MODEL_TYPES)})")
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedArchitectureError(f"rope type {rope_type!r} (frequencies that change with the "
                                               "sequence length) has no native implementation")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":  # MLP computes silu(gate) * up
            raise UnsupportedArchitectureError(f"hidden_act {act!r} has no native implementation (silu only)")
        num_heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            **family(config),
        )
