"""Our users' config dialects, translated onto ours (deployments.config.AppArgs).

vLLM's (`translate_vllm_args`, run by AppArgs' `mode="before"` validator, so every reader of app
args takes it: build_app, the replicas, `rayspec plan`, `rayspec kuberay`):
  - `speculative_config` (vLLM's SpeculativeConfig keys) instead of `speculative`: `method`
    (ngram, eagle3, eagle, draft_model; without it, inferred from `model` as vLLM does), `model` (our
    `draft_model`), `quantization` (our `draft_quantization`: `int8` only), and `num_speculative_tokens`, `prompt_lookup_min` / `prompt_lookup_max`,
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

from pathlib import Path
from typing import Any

from deployments.config import AppArgs, DeploymentArgs
from deployments.vllm_names import _as_object, _fields, _unknown
from rayspec.config import EngineSettings, field_names

APP_IMPORT_PATH = "deployments.app:build_app"
LLM_APP_IMPORT_PATH = "deployments.app:build_llm_app"
APP_IMPORT_PATHS = (APP_IMPORT_PATH, LLM_APP_IMPORT_PATH)


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
    options = _as_object(options, where)
    unknown = set(options) - _fields(DeploymentArgs)
    if unknown:
        raise _unknown(where, unknown, _fields(DeploymentArgs))
    return options


# Ray Serve LLM's prefix-affinity router's kwargs -> our prefix_routing keys (deployments.replicas.prefix_router)
PREFIX_ROUTER_KWARGS = {"imbalanced_threshold": "imbalance_threshold", "match_rate_threshold": "min_match_ratio"}


def _prefix_routing(router: Any) -> dict:
    """deployment_config.request_router_config -> our `prefix_routing`: Ray Serve LLM's
    PrefixCacheAffinityRouter becomes ours (its thresholds translated), Serve's default
    power-of-two-choices router turns prefix routing off; another router class is refused."""
    router = _as_object(router, "request_router_config")
    unknown = set(router) - {"request_router_class", "request_router_kwargs"}
    if unknown:
        raise _unknown("request_router_config", unknown, ("request_router_class", "request_router_kwargs"))
    name = str(router.get("request_router_class") or "").rsplit(".", 1)[-1].rsplit(":", 1)[-1]
    if name in ("PowerOfTwoChoicesRequestRouter", ""):
        return {"enabled": False}
    if name not in ("PrefixCacheAffinityRouter", "PrefixAwareRouter"):
        raise ValueError(f"request_router_config.request_router_class {router.get('request_router_class')!r}: "
                         "rayspec routes by prefix (PrefixCacheAffinityRouter) or by load "
                         "(PowerOfTwoChoicesRequestRouter)")
    kwargs = _as_object(router.get("request_router_kwargs") or {}, "request_router_kwargs")
    out = {"enabled": True}
    for key, value in kwargs.items():
        ours = PREFIX_ROUTER_KWARGS.get(key, key)
        if ours not in ("imbalance_threshold", "min_match_ratio", "block_size", "max_entries"):
            raise _unknown("request_router_kwargs", {key}, set(PREFIX_ROUTER_KWARGS) | {"block_size", "max_entries"})
        out[ours] = value
    return out


def translate_llm_app_args(args: Any) -> dict:
    """`ray.serve.llm:build_openai_app`-shaped args (one LLMConfig) -> our app args (a dict AppArgs
    validates, in the vLLM dialect for engine_kwargs). rayspec's own AppArgs keys are taken beside
    `llm_configs` (topology, proposer, api_key, ...) where not set by the translation."""
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
    # log_engine_metrics: rayspec's replicas always export their metrics (deployments/replicas/metrics.py)

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
    accepted = field_names(EngineSettings) | {"speculative_config", "kv_cache_memory_bytes", "gpu_memory_utilization"}
    unknown = set(engine) - accepted
    if unknown:
        raise _unknown("engine_kwargs", unknown, accepted)
    for key, value in engine.items():
        put(key, value)

    deployment_config = dict(_as_object(cfg.get("deployment_config") or {}, "deployment_config"))
    router = deployment_config.pop("request_router_config", None)
    if router is not None:
        put("prefix_routing", _prefix_routing(router))
    verifier = _deployment(deployment_config, "deployment_config")
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
