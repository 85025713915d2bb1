"""Our users' dialects (deployments/dialects.py): vLLM's `speculative_config` and top-level engine keys
in app args, Ray Serve LLM's `llm_configs` through deployments.app:build_llm_app, and `rayspec serve`'s
arguments: translation unit tests (served: tests/serve/test_dialect_config_served.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

import ray.serve  # noqa: F401 - a hard dependency: missing means an error, not a skip
from pydantic import ValidationError

from serve_utils import free_port, tiny_args  # noqa: E402

from deployments.app import build_app, build_llm_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.dialects import app_args_of, translate_llm_app_args  # noqa: E402
from rayspec_cli.main import build_parser  # noqa: E402
from rayspec_cli.serve import serve_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def spec_of(speculative_config, **args) -> dict:
    return dataclasses.asdict(AppArgs.model_validate({"speculative_config": speculative_config, **args}).speculative)


# ---- vLLM's speculative_config --------------------------------------------------------------------

@pytest.mark.parametrize("vllm,ours", [
    ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 3}),
    ({"method": "[ngram]"}, {"method": "ngram"}),
    ({"model": "[ngram]", "prompt_lookup_max": 4}, {"method": "ngram", "draft_model": None}),
    ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 7},
     {"prompt_lookup_min": 1, "prompt_lookup_max": 7}),
    # one bound given: the other equals it (vLLM); neither: ours (2..5)
    ({"method": "ngram", "prompt_lookup_max": 3}, {"prompt_lookup_min": 3, "prompt_lookup_max": 3}),
    ({"method": "ngram", "prompt_lookup_min": 7}, {"prompt_lookup_min": 7, "prompt_lookup_max": 7}),
    ({"method": "ngram"}, {"prompt_lookup_min": 2, "prompt_lookup_max": 5}),
    ({"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4},
     {"method": "eagle3", "draft_model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4}),
    ({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, {"method": "eagle"}),
    ({"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct"},
     {"method": "draft_model", "draft_model": "meta-llama/Llama-3.2-1B-Instruct"}),
    # no method: inferred from the model's name, as vLLM does
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, {"method": "eagle3"}),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, {"method": "eagle"}),
    ({"model": "meta-llama/Llama-3.2-1B-Instruct"}, {"method": "draft_model"}),
    ({"method": "ngram", "disable_by_batch_size": 4}, {"disable_by_batch_size": 4}),
    # rayspec's own speculative keys are taken there too
    ({"method": "ngram", "adaptive": False, "num_speculative_tokens": 2}, {"adaptive": False}),
    ('{"method": "ngram", "num_speculative_tokens": 6}', {"method": "ngram", "num_speculative_tokens": 6}),
    (None, {"method": "none"}),  # vLLM: no speculative_config, no speculation
])
def test_speculative_config_translated(vllm, ours):
    spec = spec_of(vllm)
    assert {k: spec[k] for k in ours} == ours


def test_draft_tensor_parallel_size_translated():
    cfg = AppArgs.model_validate({"tensor_parallel_size": 2, "speculative_config": {
        "method": "draft_model", "model": "d", "draft_tensor_parallel_size": 2}})
    assert cfg.speculative.draft_tensor_parallel_size == 2 and cfg.engine.tensor_parallel_size == 2
    assert cfg.engine_config().speculative.draft_tensor_parallel_size == 2


def test_vllm_dialect_equals_ours():
    """The same app in both dialects validates to the same AppArgs (one model of the truth)."""
    vllm = {"model": "m", "served_model_name": ["m-name"], "max_model_len": 1024, "max_num_seqs": 4, "dtype": "half",
            "kv_cache_memory_bytes": 512 * 2**20, "tensor_parallel_size": 1, "max_num_batched_tokens": 256,
            "speculative_config": {"method": "draft_model", "model": "d", "num_speculative_tokens": 3,
                                   "disable_by_batch_size": 8}}
    ours = {"model": "m", "served_model_name": "m-name",
            "engine": {"max_model_len": 1024, "max_num_seqs": 4, "dtype": "float16", "kv_cache_memory_gb": 0.5,
                       "tensor_parallel_size": 1, "max_num_batched_tokens": 256},
            "speculative": {"method": "draft_model", "draft_model": "d", "num_speculative_tokens": 3,
                            "disable_by_batch_size": 8}}
    assert AppArgs.model_validate(vllm) == AppArgs.model_validate(ours)
    # both ways mixed: top-level keys join what `engine` gives
    mixed = AppArgs.model_validate({"max_num_seqs": 4, "engine": {"max_model_len": 512}})
    assert (mixed.engine.max_num_seqs, mixed.engine.max_model_len) == (4, 512)


@pytest.mark.parametrize("args,match", [
    ({"speculative": {"method": "ngram"}, "speculative_config": {"method": "ngram"}}, "not both"),
    ({"speculative_config": {"model": "a", "draft_model": "b", "method": "draft_model"}}, "not both"),
    ({"max_num_seqs": 4, "engine": {"max_num_seqs": 8}}, r"\['max_num_seqs'\] given both"),
    ({"kv_cache_memory_bytes": 2**30, "kv_cache_memory_gb": 1}, "not both"),
    ({"speculative_config": {"method": "ngram", "acceptance_method": "typical_acceptance_sampler"}},
     r"unknown key\(s\) \['acceptance_method'\]"),
    # vLLM's draft `quantization` is our draft_quantization: int8 only, for a draft_model
    ({"speculative_config": {"method": "draft_model", "model": "m", "quantization": "fp8"}}, "'int8'"),
    ({"speculative_config": {"method": "ngram", "quantization": "int8"}}, "draft_quantization is for method draft_model"),
    ({"speculative_config": {"method": "medusa", "model": "x"}}, "method 'medusa' has no rayspec proposer"),
    ({"speculative_config": {"num_speculative_tokens": 3}}, "needs a `method`"),
    ({"speculative_config": "{not json"}, "not JSON"),
    ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 6, "prompt_lookup_max": 3}}, "prompt_lookup_min"),
    ({"speculative_config": {"method": "eagle3"}}, "draft_model"),  # our checks run on the translation
    ({"gpu_memory_utilization": 0.9}, "kv_cache_memory_gb"),
    ({"engine": {"gpu_memory_utilization": 0.9}}, "kv_cache_memory_gb"),
    ({"trust_remote_code": True}, "trust_remote_code"),
    ({"served_model_name": ["a", "b"]}, "one name"),
])
def test_vllm_dialect_errors(args, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs.model_validate(args)
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        AppArgs.model_validate(args)


# ---- Ray Serve LLM's llm_configs ----------------------------------------------------------------

LLM_ARGS = {"llm_configs": [{
    "model_loading_config": {"model_id": "qwen", "model_source": "Qwen/Qwen2.5-0.5B-Instruct"},
    "engine_kwargs": {"max_model_len": 4096, "max_num_seqs": 8, "tensor_parallel_size": 2, "dtype": "bfloat16",
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                          "max_ongoing_requests": 48},
    "accelerator_type": "A10G",
    "runtime_env": {"env_vars": {"X": "1"}},
    "llm_engine": "vLLM",
    "log_engine_metrics": True,
}], "ingress_deployment_config": {"num_replicas": 2}}


def test_llm_configs_translated():
    cfg = AppArgs.model_validate(translate_llm_app_args(copy.deepcopy(LLM_ARGS)))
    assert (cfg.model, cfg.served_model_name, cfg.model_name) == ("Qwen/Qwen2.5-0.5B-Instruct", "qwen", "qwen")
    assert (cfg.engine.max_model_len, cfg.engine.max_num_seqs, cfg.engine.tensor_parallel_size, cfg.engine.dtype) \
        == (4096, 8, 2, "bfloat16")
    assert (cfg.speculative.method, cfg.speculative.num_speculative_tokens) == ("ngram", 4)
    opts = cfg.verifier_options()
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3}
    assert opts["max_ongoing_requests"] == 48
    actor = opts["ray_actor_options"]
    # accelerator_type: a GPU per replica on a node of that type (Ray's accelerator_type resource),
    # in every tensor-parallel rank's bundle too
    assert actor["num_gpus"] == 1 and actor["resources"] == {"accelerator_type:A10G": 0.001}
    assert actor["runtime_env"] == {"env_vars": {"X": "1"}}
    assert opts["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0, "accelerator_type:A10G": 0.001}] * 2
    assert cfg.ingress_options()["num_replicas"] == 2
    build_llm_app(copy.deepcopy(LLM_ARGS))  # binds the graph (no cluster needed)


def test_llm_configs_details(tmp_path):
    # model_source defaults to model_id; placement_group_config; rayspec's own keys beside llm_configs;
    # an LLMConfig given as a YAML file's path, as Ray Serve LLM allows
    entry = {"model_loading_config": {"model_id": "smollm2-135m-instruct"},
             "placement_group_config": {"bundles": [{"CPU": 2, "GPU": 1}], "strategy": "PACK"},
             "deployment_config": {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1}}}
    path = tmp_path / "llm.yaml"
    path.write_text(yaml.safe_dump(entry))
    cfg = AppArgs.model_validate(translate_llm_app_args({"llm_configs": [str(path)], "topology": "disaggregated",
                                                         "proposer": {"num_replicas": 2}}))
    assert cfg.model == cfg.served_model_name == "smollm2-135m-instruct"
    assert cfg.topology == "disaggregated" and cfg.proposer_options()["num_replicas"] == 2
    opts = cfg.verifier_options()
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}] and opts["placement_group_strategy"] == "PACK"


def test_llm_configs_request_router():
    """Ray Serve LLM's prefix-affinity router (its thresholds renamed) is our prefix routing; Serve's
    default router turns it off."""
    def with_router(router):
        args = copy.deepcopy(LLM_ARGS)
        args["llm_configs"][0].setdefault("deployment_config", {})["request_router_config"] = router
        return AppArgs.model_validate(translate_llm_app_args(args))

    cfg = with_router({"request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
                       "request_router_kwargs": {"imbalanced_threshold": 3, "match_rate_threshold": 0.2}})
    kwargs = cfg.verifier_options()["request_router_config"]["request_router_kwargs"]
    assert cfg.prefix_routing_enabled and (kwargs["imbalance_threshold"], kwargs["min_match_ratio"]) == (3, 0.2)
    off = with_router({"request_router_class": "ray.serve.request_router.PowerOfTwoChoicesRequestRouter"})
    assert not off.prefix_routing_enabled and "request_router_config" not in off.verifier_options()
    with pytest.raises(ValueError, match="PrefixCacheAffinityRouter"):
        with_router({"request_router_class": "my.Router"})
    with pytest.raises(ValueError, match="request_router_kwargs"):
        with_router({"request_router_class": "PrefixCacheAffinityRouter", "request_router_kwargs": {"tree_size": 1}})


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(llm_configs=[]), "one LLMConfig"),
    (lambda a: a["llm_configs"].append(a["llm_configs"][0]), "one LLMConfig"),
    (lambda a: a.update(extra_app_key=1), r"args: unknown key\(s\) \['extra_app_key'\]"),
    (lambda a: a["llm_configs"][0].update(lora_config={}), r"llm_configs\[0\]: unknown key\(s\) \['lora_config'\]"),
    (lambda a: a["llm_configs"][0]["model_loading_config"].update(tokenizer_source="t"),
     r"model_loading_config: unknown key\(s\) \['tokenizer_source'\]"),
    (lambda a: a["llm_configs"][0]["model_loading_config"].update(model_source={"bucket_uri": "s3://b"}), "bucket_uri"),
    (lambda a: a["llm_configs"][0]["model_loading_config"].pop("model_id"), "model_id is required"),
    (lambda a: a["llm_configs"][0]["engine_kwargs"].update(enforce_eager=True),
     r"engine_kwargs: unknown key\(s\) \['enforce_eager'\]"),
    (lambda a: a["llm_configs"][0]["engine_kwargs"].update(gpu_memory_utilization=0.9), "kv_cache_memory_gb"),
    (lambda a: a["llm_configs"][0]["deployment_config"].update(user_config={}),
     r"deployment_config: unknown key\(s\) \['user_config'\]"),
    (lambda a: a["llm_configs"][0].update(placement_group_config={"bundle": []}), "placement_group_config"),
    (lambda a: a["llm_configs"][0].update(llm_engine="SGLang"), "llm_engine"),
    (lambda a: a.update(served_model_name="x"), "served_model_name: set by llm_configs"),
    (lambda a: a.update(ingress={}), "ingress_deployment_config or ingress"),
    (lambda a: a["llm_configs"][0]["engine_kwargs"]["speculative_config"].update(method="mtp"), "mtp"),
])
def test_llm_configs_errors(mutate, match):
    args = copy.deepcopy(LLM_ARGS)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        AppArgs.model_validate(translate_llm_app_args(args))


# ---- the two YAML dialects as shipped ---------------------------------------------------------

def yaml_app(name: str) -> dict:
    doc = yaml.safe_load((CONFIGS / name).read_text())
    (app,) = doc["applications"]
    assert app["name"] == "rayspec" and app["route_prefix"] == "/"
    return app


NATIVE_NGRAM = {"model": "smollm2-135m-instruct", "served_model_name": "smollm2-135m-instruct",
                "speculative": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                "prompt_lookup_max": 5},
                "engine": {"max_model_len": 2048, "max_num_seqs": 8, "kv_cache_memory_gb": 1.0},
                "ingress": {"ray_actor_options": {"num_cpus": 0.5}},
                "verifier": {"max_ongoing_requests": 32, "ray_actor_options": {"num_cpus": 1}}}


def test_shipped_dialect_configs_are_the_native_app():
    vllm = yaml_app("vllm_style.yaml")
    assert vllm["import_path"] == "deployments.app:build_app" and "speculative_config" in vllm["args"]
    assert AppArgs.model_validate(app_args_of(vllm)) == AppArgs.model_validate(NATIVE_NGRAM)
    llm = yaml_app("ray_serve_llm_style.yaml")
    assert llm["import_path"] == "deployments.app:build_llm_app"
    native = copy.deepcopy(NATIVE_NGRAM)
    native["verifier"]["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 1}
    assert AppArgs.model_validate(app_args_of(llm)) == AppArgs.model_validate(native)


# ---- rayspec serve: its arguments -> AppArgs ----------------------------------------------------

def parse_serve(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


def test_rayspec_serve_args_equal_the_yaml():
    """`rayspec serve MODEL --speculative-config JSON ...` builds the AppArgs the equivalent YAML does."""
    cfg, host, port = parse_serve("smollm2-135m-instruct", "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                                  '"prompt_lookup_max": 5}', "--max-model-len", "2048", "--max-num-seqs", "8")
    assert (host, port) == ("127.0.0.1", 8000)  # this machine only unless asked
    want = AppArgs.model_validate({"model": "smollm2-135m-instruct",
                                   "engine": {"max_model_len": 2048, "max_num_seqs": 8},
                                   "speculative_config": {"method": "ngram", "num_speculative_tokens": 5}})
    assert cfg == want
    for name in ("vllm_style.yaml", "ray_serve_llm_style.yaml"):  # --config: the YAML's app, its http_options
        cfg, host, port = parse_serve("--config", str(CONFIGS / name))
        assert cfg == AppArgs.model_validate(app_args_of(yaml_app(name))) and (host, port) == ("127.0.0.1", 8000)


def test_rayspec_serve_flags_override_the_config(tmp_path):
    cfg, host, port = parse_serve("other/model", "--config", str(CONFIGS / "default.yaml"), "--port", "9001",
                                  "--host", "127.0.0.1", "--speculative-config", '{"method": "ngram"}',
                                  "--max-num-seqs", "2", "--dtype", "bfloat16", "--served-model-name", "x",
                                  "--api-key", "k")
    base = AppArgs.model_validate(yaml_app("default.yaml")["args"])
    assert (host, port) == ("127.0.0.1", 9001)
    assert (cfg.model, cfg.model_name, cfg.speculative.method) == ("other/model", "x", "ngram")
    assert (cfg.engine.max_num_seqs, cfg.engine.dtype) == (2, "bfloat16")
    assert cfg.engine.max_model_len == base.engine.max_model_len and cfg.verifier == base.verifier
    assert cfg.api_key.get_secret_value() == "k"
    # another MODEL drops the config's served name (it was its model's)
    assert parse_serve("other/model", "--config", str(CONFIGS / "default.yaml"))[0].model_name == "other/model"
    # a config whose engine keys are at the top level (vLLM's way): the flag still wins
    assert parse_serve("--config", str(CONFIGS / "vllm_style.yaml"), "--max-model-len", "512")[0].engine.max_model_len \
        == 512
    # a flat YAML of args, vLLM's --config style (dashes or underscores)
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: m\nmax-num-seqs: 3\nport: 8123\nspeculative_config: {method: ngram}\n")
    cfg, host, port = parse_serve("--config", str(flat))
    assert (cfg.model, cfg.engine.max_num_seqs, port, cfg.speculative.method) == ("m", 3, 8123, "ngram")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        flat.write_text("gpu_memory_utilization: 0.9\n")
        parse_serve("m", "--config", str(flat))


def test_rayspec_serve_engine_flags_come_from_the_engine_config():
    """One list of engine settings: every scalar EngineConfig field is a `rayspec serve` flag and a key
    of the serve app's engine args, and a flag reaches the engine args."""
    from rayspec.config import EngineSettings, field_names
    from rayspec_cli.flags import engine_flag_fields

    names = {name for name, _, _ in engine_flag_fields()}
    assert {"max_model_len", "max_num_seqs", "kv_cache_memory_gb", "block_size", "enable_prefix_caching",
            "max_num_batched_tokens", "tensor_parallel_size", "dtype"} <= names
    assert names <= field_names(EngineSettings), names - field_names(EngineSettings)
    cfg = parse_serve("m", "--kv-cache-memory-gb", "0.5", "--block-size", "32", "--no-enable-prefix-caching",
                      "--max-num-batched-tokens", "512")[0]
    assert (cfg.engine.kv_cache_memory_gb, cfg.engine.block_size, cfg.engine.enable_prefix_caching,
            cfg.engine.max_num_batched_tokens) == (0.5, 32, False, 512)
    assert parse_serve("m")[0].engine.enable_prefix_caching is True  # an absent flag leaves the config's


def test_rayspec_serve_bad_args_exit_2(tmp_path, capsys):
    from rayspec_cli.main import main

    assert main(["serve", "m", "--speculative-config", '{"method": "medusa"}']) == 2
    assert "medusa" in capsys.readouterr().err
