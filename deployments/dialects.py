"""Our users' config dialects, translated onto ours (deployments.config.AppArgs).

vLLM's (`translate_vllm_args`, run by AppArgs' `mode="before"` validator, so every reader of app
args takes it: build_app, the replicas, `rayspec plan`, `rayspec kuberay`):
  - `speculative_config` (vLLM's SpeculativeConfig keys) instead of `speculative`: `method`
    (ngram, eagle3, eagle, draft_model; without it, inferred from `model` as vLLM does), `model` (our
    `draft_model`), and `num_speculative_tokens`, `prompt_lookup_min` / `prompt_lookup_max`,
    `draft_tensor_parallel_size`, `disable_by_batch_size`, which are our names already (our other
    speculative keys are taken there too). A JSON string is read as the object (`--speculative-config`).
  - vLLM's engine keys at the top level of the args instead of under `engine` (`max_model_len`,
    `max_num_seqs`, `dtype`, `tensor_parallel_size`, `max_num_batched_tokens`, ...: the same names),
    `kv_cache_memory_bytes` (-> `kv_cache_memory_gb`), `served_model_name` as a one-name list.
    `gpu_memory_utilization` is refused: we size the KV cache in GiB (`kv_cache_memory_gb`).

Ray Serve LLM's (`translate_llm_app_args`, `import_path: deployments.app:build_llm_app`): the args of
`ray.serve.llm:build_openai_app`, `llm_configs: [LLMConfig]` (one model), onto the same AppArgs:
`model_loading_config.model_id` -> `served_model_name`, `model_source` -> `model`, `engine_kwargs`
-> the vLLM dialect above, `deployment_config` -> `verifier`, `accelerator_type` -> the verifier's
GPU and Ray's `accelerator_type:<type>` resource, `placement_group_config` -> the verifier's
placement group, `runtime_env` -> the verifier's, `ingress_deployment_config` -> `ingress`.

Unknown keys are errors that name them; nothing is dropped silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# vLLM speculative methods -> our proposers ("[ngram]": vLLM's older spelling)
VLLM_METHODS = {"ngram": "ngram", "[ngram]": "ngram", "eagle3": "eagle3", "eagle": "eagle",
                "draft_model": "draft_model"}
VLLM_SPEC_RENAMES = {"model": "draft_model"}  # vLLM key -> ours; the other vLLM keys below are ours already
VLLM_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                  "draft_tensor_parallel_size", "disable_by_batch_size")
GIB = 1 << 30

APP_IMPORT_PATH = "deployments.app:build_app"
LLM_APP_IMPORT_PATH = "deployments.app:build_llm_app"
APP_IMPORT_PATHS = (APP_IMPORT_PATH, LLM_APP_IMPORT_PATH)


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


def translate_speculative_config(spec: Any) -> dict:
    """vLLM's speculative_config (a mapping or its JSON) -> our `speculative` keys (SpeculativeArgs)."""
    from deployments.config import SpeculativeArgs
    from rayspec.proposers import PROPOSERS

    spec = _as_object(spec, "speculative_config")
    ours = _fields(SpeculativeArgs)
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
    elif method not in PROPOSERS:
        raise ValueError(f"speculative_config: method {method!r} has no rayspec proposer; vLLM's methods taken: "
                         f"{sorted(VLLM_METHODS)} (rayspec's: {sorted(PROPOSERS)})")
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


def translate_vllm_args(data: Any) -> Any:
    """App args that may use vLLM's names -> rayspec's (AppArgs' before-validator). Anything else is
    left to AppArgs, whose unknown-key errors then name what is left."""
    from deployments.config import AppArgs, EngineArgs

    if not isinstance(data, dict):
        return data
    data = dict(data)
    if "speculative_config" in data:
        spec = data.pop("speculative_config")
        if "speculative" in data:
            raise ValueError("give `speculative` (rayspec's keys) or `speculative_config` (vLLM's), not both")
        # vLLM: speculative_config null = no speculation
        data["speculative"] = {"method": "none"} if spec is None else translate_speculative_config(spec)
    names = data.get("served_model_name")
    if isinstance(names, (list, tuple)):  # vLLM's --served-model-name takes several; we serve one
        if len(names) != 1:
            raise ValueError(f"served_model_name: one name, got {list(names)}")
        data["served_model_name"] = names[0]
    top = {k: data.pop(k) for k in list(data)
           if k not in _fields(AppArgs) and (k in _fields(EngineArgs) or k in ("gpu_memory_utilization",
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


# ---- Ray Serve LLM ------------------------------------------------------------------------------

LLM_APP_KEYS = ("llm_configs", "ingress_deployment_config")
LLM_CONFIG_KEYS = ("model_loading_config", "engine_kwargs", "deployment_config", "accelerator_type",
                   "runtime_env", "placement_group_config", "llm_engine", "log_engine_metrics")
MODEL_LOADING_KEYS = ("model_id", "model_source")


def _llm_config(entry: Any) -> dict:
    if isinstance(entry, (str, Path)):  # Ray Serve LLM takes a YAML file's path in place of a config
        import yaml

        entry = yaml.safe_load(Path(entry).read_text())
    return _as_object(entry, "llm_configs[0]")


def _deployment(options: Any, where: str) -> dict:
    from deployments.config import DeploymentArgs

    options = _as_object(options, where)
    unknown = set(options) - _fields(DeploymentArgs)
    if unknown:
        raise _unknown(where, unknown, _fields(DeploymentArgs))
    return options


def translate_llm_app_args(args: Any) -> dict:
    """`ray.serve.llm:build_openai_app`-shaped args (one LLMConfig) -> our app args (a dict AppArgs
    validates, in the vLLM dialect for engine_kwargs). rayspec's own AppArgs keys are taken beside
    `llm_configs` (topology, proposer, api_key, ...) where not set by the translation."""
    from deployments.config import AppArgs, EngineArgs

    args = _as_object(args or {}, "args")
    unknown = set(args) - set(LLM_APP_KEYS) - _fields(AppArgs)
    if unknown:
        raise _unknown("args", unknown, set(LLM_APP_KEYS) | _fields(AppArgs))
    configs = args.pop("llm_configs", None)
    if not isinstance(configs, (list, tuple)) or len(configs) != 1:
        raise ValueError("llm_configs: one LLMConfig (a rayspec app serves one target model; "
                         f"give each model an application of its own), got {configs!r}")
    cfg = _llm_config(configs[0])
    unknown = set(cfg) - set(LLM_CONFIG_KEYS)
    if unknown:
        raise _unknown("llm_configs[0]", unknown, LLM_CONFIG_KEYS)
    out: dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        if key in args:
            raise ValueError(f"{key}: set by llm_configs[0] and given beside it too")
        out[key] = value

    engine_name = cfg.get("llm_engine")
    if engine_name is not None and str(engine_name).lower() != "vllm":
        raise ValueError(f"llm_configs[0].llm_engine: {engine_name!r}; rayspec stands in for vLLM (leave it out)")
    # log_engine_metrics: rayspec's replicas always export their metrics (deployments/metrics.py)

    loading = _as_object(cfg.get("model_loading_config") or {}, "model_loading_config")
    unknown = set(loading) - set(MODEL_LOADING_KEYS)
    if unknown:
        raise _unknown("model_loading_config", unknown, MODEL_LOADING_KEYS)
    if not loading.get("model_id"):
        raise ValueError("model_loading_config.model_id is required (the name clients send)")
    source = loading.get("model_source") or loading["model_id"]  # Ray Serve LLM: the id when no source
    if not isinstance(source, str):
        raise ValueError("model_loading_config.model_source: a hub id, a directory or a .gguf file "
                         f"(rayspec loads no bucket_uri), got {source!r}")
    put("model", source)
    put("served_model_name", loading["model_id"])

    engine = _as_object(cfg.get("engine_kwargs") or {}, "engine_kwargs")
    accepted = _fields(EngineArgs) | {"speculative_config", "kv_cache_memory_bytes", "gpu_memory_utilization"}
    unknown = set(engine) - accepted
    if unknown:
        raise _unknown("engine_kwargs", unknown, accepted)
    for key, value in engine.items():
        put(key, value)

    verifier = _deployment(cfg.get("deployment_config") or {}, "deployment_config")
    actor = dict(verifier.get("ray_actor_options") or {})
    if cfg.get("accelerator_type"):
        # as Ray Serve LLM: a GPU per replica (rank) on a node of that accelerator type
        actor.setdefault("num_gpus", 1)
        actor["resources"] = {**(actor.get("resources") or {}), f"accelerator_type:{cfg['accelerator_type']}": 0.001}
    if cfg.get("runtime_env") is not None:
        actor["runtime_env"] = cfg["runtime_env"]
    if actor:
        verifier["ray_actor_options"] = actor
    pg = cfg.get("placement_group_config")
    if pg is not None:
        pg = _as_object(pg, "placement_group_config")
        unknown = set(pg) - {"bundles", "strategy"}
        if unknown:
            raise _unknown("placement_group_config", unknown, ("bundles", "strategy"))
        if "bundles" in pg:
            verifier["placement_group_bundles"] = pg["bundles"]
        if "strategy" in pg:
            verifier["placement_group_strategy"] = pg["strategy"]
    if verifier:
        put("verifier", verifier)
    if args.get("ingress_deployment_config") is not None:
        out["ingress"] = _deployment(args.pop("ingress_deployment_config"), "ingress_deployment_config")
        if "ingress" in args:
            raise ValueError("give ingress_deployment_config or ingress, not both")
    args.pop("ingress_deployment_config", None)
    return {**args, **out}


def app_args_of(app: dict) -> dict | None:
    """The rayspec app args of one `applications:` entry of a serve config (either builder), or None
    when the entry is not a rayspec app."""
    path = app.get("import_path")
    if path == APP_IMPORT_PATH:
        return app.get("args") or {}
    if path == LLM_APP_IMPORT_PATH:
        return translate_llm_app_args(app.get("args") or {})
    return None
