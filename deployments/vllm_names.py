"""vLLM's names for app args, translated onto ours (`translate_vllm_args`, run by
deployments.config.AppArgs' `mode="before"` validator, which passes its models' field names: this
module imports nothing of deployments, so there is no import circle). What is taken and refused:
deployments.dialects' docstring.
"""

from __future__ import annotations

import json
from typing import Any

# vLLM speculative methods -> our proposers ("[ngram]": vLLM's older spelling)
VLLM_METHODS = {"ngram": "ngram", "[ngram]": "ngram", "eagle3": "eagle3", "eagle": "eagle",
                "draft_model": "draft_model"}
VLLM_SPEC_RENAMES = {"model": "draft_model", "quantization": "draft_quantization"}  # vLLM key -> ours; the other vLLM keys below are ours already
VLLM_SPEC_KEYS = ("method", "model", "quantization", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                  "draft_tensor_parallel_size", "disable_by_batch_size")
GIB = 1 << 30



def _fields(model) -> set[str]:
    return set(model.model_fields)


def _unknown(where: str, keys, accepted) -> ValueError:
    return ValueError(f"{where}: unknown key(s) {sorted(keys)}; accepted: {sorted(accepted)}")


def _as_object(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object (a mapping), got {type(value).__name__}")
    return dict(value)


def infer_vllm_method(model: str) -> str:
    """vLLM's rule when speculative_config names a model but no method."""
    name = model.lower()
    if name in ("ngram", "[ngram]"):
        return "ngram"
    if "eagle3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"


def translate_speculative_config(spec: Any, spec_fields: set[str]) -> dict:
    """vLLM's speculative_config (a mapping or its JSON) -> our `speculative` keys (`spec_fields`:
    rayspec.config.SpeculativeConfig's fields)."""
    from rayspec.methods import METHODS

    spec = _as_object(spec, "speculative_config")
    ours = set(spec_fields)
    accepted = set(VLLM_SPEC_KEYS) | ours
    unknown = set(spec) - accepted
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)}; vLLM's keys taken: "
                         f"{list(VLLM_SPEC_KEYS)}, and rayspec's own speculative keys: "
                         f"{sorted(ours - set(VLLM_SPEC_KEYS))}")
    out: dict[str, Any] = {}
    for key, value in spec.items():
        name = VLLM_SPEC_RENAMES.get(key, key)
        if name in out:
            raise ValueError(f"speculative_config: give `{key}` (vLLM's name) or `{name}`, not both")
        out[name] = value
    method, model = out.get("method"), out.get("draft_model")
    if method is None:
        if not model:
            raise ValueError("speculative_config needs a `method` (vLLM's ngram, eagle3, eagle, draft_model) "
                             "or a `model` to infer it from")
        method = infer_vllm_method(str(model))
    elif method in VLLM_METHODS:
        method = VLLM_METHODS[method]
    elif method not in METHODS:
        raise ValueError(f"speculative_config: method {method!r} has no rayspec proposer; vLLM's methods taken: "
                         f"{sorted(VLLM_METHODS)} (rayspec's: {sorted(METHODS)})")
    out["method"] = method
    if method == "ngram":
        if isinstance(model, str) and model.lower() in ("ngram", "[ngram]"):
            del out["draft_model"]  # vLLM's old way to ask for n-gram: model "[ngram]"
        # vLLM: one bound given, the other equals it (neither: rayspec's defaults, 2..5)
        lo, hi = out.get("prompt_lookup_min"), out.get("prompt_lookup_max")
        if lo is None and hi is not None:
            out["prompt_lookup_min"] = hi
        elif hi is None and lo is not None:
            out["prompt_lookup_max"] = lo
    return out


GPU_MEMORY_UTILIZATION = (
    "gpu_memory_utilization (vLLM's fraction of the GPU for weights + KV cache) has no rayspec equivalent: "
    "rayspec sizes the KV cache in absolute terms, engine.kv_cache_memory_gb (GiB, target + draft caches; "
    "vLLM's kv_cache_memory_bytes is taken too). `rayspec plan CONFIG --gpu-memory 80GB` shows what fits a GPU")

VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's aliases; the rest are ours already


def translate_vllm_engine(engine: dict, where: str) -> dict:
    """vLLM engine keys -> ours, in place of the same mapping (renames, units, refusals)."""
    if "gpu_memory_utilization" in engine:
        raise ValueError(f"{where}: {GPU_MEMORY_UTILIZATION}")
    if "kv_cache_memory_bytes" in engine:
        if "kv_cache_memory_gb" in engine:
            raise ValueError(f"{where}: give kv_cache_memory_bytes (vLLM's) or kv_cache_memory_gb, not both")
        value = engine.pop("kv_cache_memory_bytes")
        engine["kv_cache_memory_gb"] = value / GIB if isinstance(value, (int, float)) else value
    if isinstance(engine.get("dtype"), str) and engine["dtype"] in VLLM_DTYPES:
        engine["dtype"] = VLLM_DTYPES[engine["dtype"]]
    return engine


def translate_vllm_args(data: Any, *, app_fields: set[str], engine_fields: set[str], spec_fields: set[str]) -> Any:
    """App args that may use vLLM's names -> rayspec's (AppArgs' before-validator, which passes the
    field names of AppArgs, EngineSettings and SpeculativeConfig). Anything else is left to AppArgs, whose
    unknown-key errors then name what is left."""

    if not isinstance(data, dict):
        return data
    data = dict(data)
    if "speculative_config" in data:
        spec = data.pop("speculative_config")
        if "speculative" in data:
            raise ValueError("give `speculative` (rayspec's keys) or `speculative_config` (vLLM's), not both")
        # vLLM: speculative_config null = no speculation
        data["speculative"] = {"method": "none"} if spec is None else translate_speculative_config(spec, spec_fields)
    names = data.get("served_model_name")
    if isinstance(names, (list, tuple)):  # vLLM's --served-model-name takes several; we serve one
        if len(names) != 1:
            raise ValueError(f"served_model_name: one name, got {list(names)}")
        data["served_model_name"] = names[0]
    top = {k: data.pop(k) for k in list(data)
           if k not in app_fields and (k in engine_fields or k in ("gpu_memory_utilization",
                                                                           "kv_cache_memory_bytes"))}
    engine = data.get("engine")
    if isinstance(engine, dict):
        engine = translate_vllm_engine(dict(engine), "engine")
    if top:
        top = translate_vllm_engine(top, "args")
        if engine is None:
            engine = {}
        elif not isinstance(engine, dict):
            raise ValueError("give engine keys at the top level (vLLM's way) or under `engine`, not both")
        both = set(top) & set(engine)
        if both:
            raise ValueError(f"{sorted(both)} given both at the top level (vLLM's way) and under `engine`")
        engine = {**engine, **top}
    if engine is not None:
        data["engine"] = engine
    return data
