"""A Llama config read as transformers' LlamaConfig reads it, without importing transformers' config
classes.

Importing any of them (configuration_utils, whose validators import transformers.activations, whose
chain reaches torch.distributed.tensor and sympy) took 0.9-1.1 of the ~3.6 CPU-seconds a process
spends to start and load SmolLM2-135M (AMD EPYC, 2026-12-05): in every Serve replica, tensor-parallel
rank and CLI that loads a model, for a handful of numbers read from config.json. AutoTokenizer loads
the config too unless it is handed one (`tokenizer_kwargs`), and its module scans every model's files
(`load_tokenizer` builds the tokenizers backend directly where AutoTokenizer would build it).

Only a plain Llama config is read here: model_type "llama", no quantization, no custom code, rope of
the default type. Anything else returns None and goes through transformers (`load_hf_config`). Where
a field the native model reads is missing, LlamaConfig's default is taken (DEFAULTS);
tests/unit/test_plain_config.py checks every field against LlamaConfig for configs with and without
each of them, so a transformers release that changes a default fails there, not in a served model.
"""

from __future__ import annotations

import json
from pathlib import Path

# read as given; without them the config goes through transformers
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# LlamaConfig's defaults (transformers 5) for the other fields the native model and the EAGLE heads read
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
DEFAULT_ROPE_THETA = 10000.0
# config.json keys that make a config more than plain Llama
NOT_PLAIN = ("quantization_config", "auto_map", "rope_scaling")


class PlainConfig:
    """A config's fields as attributes (a missing one raises AttributeError, so `getattr(config, name,
    default)` reads as with a transformers config), and `to_dict()`."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__!r})"


def _rope_parameters(fields: dict) -> dict | None:
    rope = fields.get("rope_parameters")
    if rope is None:
        theta = fields.get("rope_theta", DEFAULT_ROPE_THETA)
        return {"rope_theta": float(theta), "rope_type": "default"}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" \
            or set(rope) - {"rope_type", "rope_theta"}:
        return None
    return {"rope_theta": float(rope.get("rope_theta", fields.get("rope_theta", DEFAULT_ROPE_THETA))),
            "rope_type": "default"}


def plain_llama_config(fields: dict) -> PlainConfig | None:
    """The config LlamaConfig(**fields) would give, as far as rayspec reads it, or None where these
    fields are not plain Llama's (then transformers reads them)."""
    if fields.get("model_type") != "llama" or any(fields.get(key) is not None for key in NOT_PLAIN):
        return None
    if any(not isinstance(fields.get(key), int) or isinstance(fields.get(key), bool) for key in REQUIRED):
        return None
    if any(key in fields and fields[key] is None for key in DEFAULTS):
        return None
    rope = _rope_parameters(fields)
    if rope is None:
        return None
    out = {**DEFAULTS, **fields}
    out.pop("rope_theta", None)  # transformers 5 keeps it in rope_parameters only
    heads = fields["num_attention_heads"]
    out["num_key_value_heads"] = fields.get("num_key_value_heads") or heads
    out["head_dim"] = fields.get("head_dim") or fields["hidden_size"] // heads
    out["rope_parameters"] = rope
    return PlainConfig(out)


def llama_config(fields: dict):
    """The plain config where the fields allow, else transformers' LlamaConfig(**fields)."""
    plain = plain_llama_config(fields)
    if plain is not None:
        return plain
    from transformers import LlamaConfig

    return LlamaConfig(**fields)


def read_plain_config(model_dir: Path) -> PlainConfig | None:
    """model_dir's config.json read plainly, or None (no such file, or not plain Llama)."""
    path = Path(model_dir) / "config.json"
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    plain = plain_llama_config(fields) if isinstance(fields, dict) else None
    if plain is not None:  # as AutoConfig.from_pretrained sets it (AutoTokenizer matches it against known ids)
        plain._name_or_path = str(model_dir)
    return plain


# tokenizer classes that are transformers' tokenizers-library backend itself: AutoTokenizer builds that
# class for them whatever the model type (its other classes add per-family rules)
BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: Path, config):
    """model_dir's tokenizer as AutoTokenizer.from_pretrained(model_dir) builds it. With a plain config
    and a tokenizer.json whose tokenizer_config.json names the backend class (SmolLM2's, Llama 3's),
    that class is built directly: AutoTokenizer's module imports transformers.models, whose scan of
    every model's files took 0.3 CPU-s more of each load (tests/engine/test_loader.py compares the two)."""
    model_dir = Path(model_dir)
    fields = _tokenizer_config(model_dir)
    if isinstance(config, PlainConfig) and fields.get("tokenizer_class") in BACKEND_CLASSES \
            and "auto_map" not in fields and (model_dir / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, **tokenizer_kwargs(model_dir, config))


def _tokenizer_config(model_dir: Path) -> dict:
    try:
        fields = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def tokenizer_kwargs(model_dir: Path, config) -> dict:
    """AutoTokenizer.from_pretrained's extra arguments for model_dir: the config already read, where it
    is plain and the tokenizer names its class (AutoTokenizer then reads no config of its own; without
    a named class it picks one by the config's class, which only transformers' own config has)."""
    if not isinstance(config, PlainConfig):
        return {}
    return {"config": config} if _tokenizer_config(model_dir).get("tokenizer_class") else {}
