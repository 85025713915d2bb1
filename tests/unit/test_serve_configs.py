"""Every serve config in configs/ validates with AppArgs; option computation; the default one served (slow)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import ray.serve  # noqa: F401 - a hard dependency: missing means an error, not a skip

from pydantic import ValidationError  # noqa: E402

from deployments.app import build_app  # noqa: E402
from deployments.config import REPO_ROOT, AppArgs  # noqa: E402
from deployments.dialects import app_args_of  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SERVE_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "cluster.yaml")


def app_args(path: Path) -> dict:
    """Our app args of a config's one application: as written for build_app, translated from Ray Serve
    LLM's shape for build_llm_app (configs/ray_serve_llm_style.yaml)."""
    doc = yaml.safe_load(path.read_text())
    (app,) = doc["applications"]
    assert app["import_path"] in ("deployments.app:build_app", "deployments.app:build_llm_app")
    assert app["name"] == "rayspec" and app["route_prefix"] == "/"
    return app_args_of(app)


def test_expected_configs_exist():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"default.yaml", "baseline.yaml", "draft_model.yaml", "disaggregated.yaml", "fractional_gpu.yaml",
            "autoscaling.yaml", "llama3_eagle3.yaml", "eagle3.yaml", "eagle3_disaggregated.yaml",
            "cluster.yaml", "llama70b_draft8b_tp4.yaml", "qwen3_eagle3.yaml", "vllm_style.yaml",
            "ray_serve_llm_style.yaml", "llama70b_fp4_draft8b.yaml", "gpt_oss_eagle3.yaml"} <= names


def test_fp4_guide_configs():
    """TensorRT-LLM's guide on the guide's hardware (issue #52): the NVFP4 70B target and its NVFP4 8B draft
    (4 drafted tokens) kept 4-bit on one GPU by fractional shares, or the draft on a GPU of its own; and
    gpt-oss-120b with NVIDIA's EAGLE-3 head on one GPU."""
    fp4 = AppArgs.model_validate(app_args(CONFIGS / "llama70b_fp4_draft8b.yaml"))
    engine = fp4.engine_config()
    assert (engine.model, engine.tensor_parallel_size, engine.dtype, engine.quantized_weights) == (
        "nvidia/Llama-3.3-70B-Instruct-FP4", 1, "bfloat16", "keep")
    spec = engine.speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens) == (
        "draft_model", "nvidia/Llama-3.1-8B-Instruct-FP4", 4)
    shares = (fp4.verifier_options()["ray_actor_options"]["num_gpus"], fp4.proposer_options()["ray_actor_options"]["num_gpus"])
    assert shares == (0.75, 0.25)
    two = AppArgs.model_validate(app_args(CONFIGS / "llama70b_fp4_draft8b_2gpu.yaml"))
    assert two.engine_config().tensor_parallel_size == 1 and two.engine_config().speculative.draft_model == spec.draft_model
    assert (two.verifier_options()["ray_actor_options"]["num_gpus"], two.proposer_options()["ray_actor_options"]["num_gpus"]) == (1, 1)
    oss = AppArgs.model_validate(app_args(CONFIGS / "gpt_oss_eagle3.yaml"))
    engine = oss.engine_config()
    assert (engine.model, engine.speculative.method, engine.speculative.draft_model) == (
        "openai/gpt-oss-120b", "eagle3", "nvidia/gpt-oss-120b-Eagle3")
    assert engine.tensor_parallel_size == 1 and oss.verifier_options()["ray_actor_options"]["num_gpus"] == 1


def test_big_target_configs():
    """The 70B target on 4 GPUs (one bundle per rank, STRICT_PACK) with the 8B draft on a GPU of its
    own; the Qwen3 target with its EAGLE-3 head on one GPU."""
    big = AppArgs.model_validate(app_args(CONFIGS / "llama70b_draft8b_tp4.yaml"))
    engine = big.engine_config()
    assert (engine.model, engine.tensor_parallel_size, engine.dtype) == ("meta-llama/Llama-3.3-70B-Instruct", 4,
                                                                       "bfloat16")
    spec = engine.speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens) == (
        "draft_model", "meta-llama/Llama-3.1-8B-Instruct", 4)
    opts = big.verifier_options()
    assert opts["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"]["num_gpus"] == 1  # the replica (rank 0) takes the first bundle
    assert big.topology == "disaggregated" and big.proposer_options()["ray_actor_options"]["num_gpus"] == 1
    assert "placement_group_bundles" not in big.proposer_options()
    qwen = AppArgs.model_validate(app_args(CONFIGS / "qwen3_eagle3.yaml")).engine_config()
    assert (qwen.model, qwen.speculative.method, qwen.speculative.draft_model) == (
        "Qwen/Qwen3-8B", "eagle3", "Tengyunw/qwen3_8b_eagle3")
    assert qwen.tensor_parallel_size == 1
    assert "placement_group_bundles" not in AppArgs.model_validate(app_args(CONFIGS / "default.yaml")).verifier_options()
    # a TP verifier pinned to target nodes: every rank's bundle asks for the node type too
    pinned = AppArgs.model_validate({"engine": {"tensor_parallel_size": 2}, "verifier": {
        "ray_actor_options": {"num_gpus": 1, "resources": {"target_node": 0.01}}}}).verifier_options()
    assert pinned["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0, "target_node": 0.01}] * 2


@pytest.mark.parametrize("args,match", [
    ({"engine": {"tensor_parallel_size": 2}, "speculative": {"method": "draft_model",
                                                            "draft_tensor_parallel_size": 3}}, "draft_tensor_parallel_size"),
    ({"engine": {"tensor_parallel_size": 2}, "topology": "disaggregated",
      "speculative": {"method": "draft_model", "draft_tensor_parallel_size": 2}}, "colocated"),
    ({"engine": {"tensor_parallel_size": 2}, "verifier": {"placement_group_bundles": [{"CPU": 1}]}}, "one per rank"),
    ({"verifier": {"placement_group_strategy": "ANYWHERE"}}, "placement_group_strategy"),
])
def test_tensor_parallel_args_checked(args, match):
    with pytest.raises(Exception, match=match):
        cfg = AppArgs.model_validate(args)
        cfg.engine_config()
        cfg.verifier_options()


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_builds(path):
    cfg = AppArgs.model_validate(app_args(path))
    cfg.engine_config()
    for opts in (cfg.ingress_options(), cfg.verifier_options(), cfg.proposer_options()):
        assert opts["max_ongoing_requests"] >= 1 and "num_cpus" in opts["ray_actor_options"]
    build_app(app_args(path))  # binds the graph (no cluster needed)


def test_placement_options_from_configs():
    frac = AppArgs.model_validate(app_args(CONFIGS / "fractional_gpu.yaml"))
    assert frac.topology == "disaggregated"
    assert frac.proposer_options()["ray_actor_options"]["num_gpus"] == 0.25
    assert frac.verifier_options()["ray_actor_options"]["num_gpus"] == 0.75
    dis = AppArgs.model_validate(app_args(CONFIGS / "disaggregated.yaml"))
    assert dis.proposer_options()["ray_actor_options"]["num_gpus"] == 1
    assert dis.verifier_options()["ray_actor_options"]["num_gpus"] == 1
    auto = AppArgs.model_validate(app_args(CONFIGS / "autoscaling.yaml"))
    opts = auto.verifier_options()
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 2
    assert auto.proposer_num_slots() == 2 * auto.engine.max_num_seqs
    draft = AppArgs.model_validate(app_args(CONFIGS / "draft_model.yaml"))
    assert draft.speculative.draft_num_layers == 8 and draft.topology == "colocated"


def test_eagle_configs():
    head = "heads/smollm2-135m-eagle3"
    for name, topology in (("eagle3.yaml", "colocated"), ("eagle3_disaggregated.yaml", "disaggregated")):
        cfg = AppArgs.model_validate(app_args(CONFIGS / name))
        spec = cfg.engine_config().speculative
        assert cfg.topology == topology and spec.method == "eagle3"
        # the repo-relative head path, made absolute once the head is there
        assert spec.draft_model in (head, str(REPO_ROOT / head))
        assert (spec.num_speculative_tokens, spec.eagle_topk, spec.num_steps) == (8, 4, 5)
    dis = AppArgs.model_validate(app_args(CONFIGS / "eagle3_disaggregated.yaml"))
    assert dis.proposer_options()["ray_actor_options"]["num_gpus"] == 0.25
    assert dis.verifier_options()["ray_actor_options"]["num_gpus"] == 0.75
    assert dis.proposer_options()["num_replicas"] == 1
    llama = AppArgs.model_validate(app_args(CONFIGS / "llama3_eagle3.yaml")).engine_config()
    assert llama.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert llama.speculative.draft_model == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert (llama.speculative.num_speculative_tokens, llama.speculative.eagle_topk, llama.speculative.num_steps) \
        == (8, 4, 5)


def test_relative_paths_resolve_from_cwd_then_repo_root(tmp_path, monkeypatch):
    (tmp_path / "heads" / "h").mkdir(parents=True)
    spec = {"method": "eagle3", "draft_model": "heads/h"}
    monkeypatch.chdir(tmp_path)
    assert AppArgs.model_validate({"speculative": spec}).speculative.draft_model == str(tmp_path / "heads" / "h")
    monkeypatch.chdir(tmp_path / "heads")  # not here: tried from the repo root, else left as is (a hub id)
    assert AppArgs.model_validate({"speculative": spec}).speculative.draft_model == "heads/h"
    assert AppArgs.model_validate({"model": "configs"}).model == str(REPO_ROOT / "configs")
    assert AppArgs.model_validate({"model": "smollm2-135m-instruct"}).model == "smollm2-135m-instruct"


def test_cluster_config():
    doc = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    types = doc["available_node_types"]
    head = types[doc["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert any(t["resources"].get("GPU", 0) >= 1 for t in types.values())


@pytest.mark.parametrize("args,match", [
    ({"topology": "disaggregated", "speculative": {"method": "none"}}, "disaggregated"),
    ({"speculative": {"method": "medusa"}}, "unknown speculative method"),
    ({"speculative": {"num_speculative_tokens": -1}}, "num_speculative_tokens"),
    ({"topology": "sideways"}, "topology"),
    ({"verifier": {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}, "not both"),
    ({"verifier": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas"),
    ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
    ({"engine": {"kv_cache_gb": 1}}, "kv_cache_gb"),
    ({"proposer": {"ray_actor_options": {"num_gpus": -1}}}, "num_gpus"),
    ({"speculative": {"method": "eagle3"}}, "draft_model"),
    ({"speculative": {"method": "eagle", "draft_model": "h", "eagle_topk": 0}}, "eagle_topk"),
    ({"speculative": {"method": "eagle3", "draft_model": "h", "num_steps": 0}}, "num_steps"),
    ({"proposer_call_timeout_s": 0}, "proposer_call_timeout_s"),
    ({"proposer_async_pacing": "always"}, "needs proposer_async_hypotheses"),
    ({"topology": "disaggregated", "speculative": {"method": "ngram"}, "proposer_async_hypotheses": 2,
      "proposer_async_pacing": "sometimes"}, "proposer_async_pacing"),
])
def test_invalid_args(args, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs.model_validate(args)


def test_defaults_and_overrides():
    cfg = AppArgs.model_validate({"verifier": {"ray_actor_options": {"num_gpus": 0.5, "resources": {"x": 1}}}})
    assert cfg.model_name == cfg.model and cfg.topology == "colocated"
    opts = cfg.verifier_options()
    assert opts["num_replicas"] == 1
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0.5, "resources": {"x": 1}}
    assert opts["max_ongoing_requests"] == 4 * cfg.engine.max_num_seqs


def test_async_configs_and_their_colocated_twins():
    """Issue 20's pairs: the asynchronous app and its synchronous twin run the same engine and
    speculative settings, one CPU thread each replica; only the topology and pre-drafting differ."""
    pairs = (("draft_async.yaml", "draft_colocated.yaml"), ("eagle3_async.yaml", "default.yaml"))
    for async_name, twin_name in pairs:
        a = AppArgs.model_validate(app_args(CONFIGS / async_name))
        twin = AppArgs.model_validate(app_args(CONFIGS / twin_name))
        assert a.topology == "disaggregated" and a.proposer_async_hypotheses > 0
        assert twin.topology == "colocated"
        assert a.speculative == twin.speculative, async_name
        assert a.engine.num_threads == 1
        assert dataclasses.replace(a.engine, num_threads=None) == dataclasses.replace(twin.engine, num_threads=None)
    draft = AppArgs.model_validate(app_args(CONFIGS / "draft_async.yaml")).speculative
    assert draft.draft_quantization == "int8" and not draft.adaptive and draft.draft_num_layers is None


def test_draft_costs_from_a_serve_yaml():
    """Issue 34: cost-aware drafting's fixed coefficients (SpeculativeConfig.draft_costs) set in a
    serve config reach the engine (and a disaggregated proposer: the same `speculative`), in our
    `speculative` and in vLLM's `speculative_config`; a wrong key is refused by name."""
    text = """
applications:
  - name: rayspec
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      speculative: {method: ngram, draft_costs: {step_s: 0.02, row_s: 0.001, propose_s: 0.0005}}
"""
    (app,) = yaml.safe_load(text)["applications"]
    cfg = AppArgs.model_validate(app_args_of(app))
    want = {"step_s": 0.02, "row_s": 0.001, "propose_s": 0.0005}
    assert cfg.speculative.draft_costs == want and cfg.engine_config().speculative.draft_costs == want
    build_app(app_args_of(app))
    vllm = AppArgs.model_validate({"speculative_config": {"method": "ngram", "draft_costs": want}})
    assert vllm.engine_config().speculative.draft_costs == want
    with pytest.raises(ValidationError, match="draft_costs: unknown keys .'step'."):
        AppArgs.model_validate({"speculative": {"draft_costs": {"step": 0.02}}})
    with pytest.raises(ValidationError, match="draft_costs"):
        AppArgs.model_validate({"speculative": {"draft_costs": {"step_s": -1}}})


def test_app_args_embed_the_engine_config():
    """One config source: the app's `speculative` and `engine` are rayspec.config's own classes, with
    their defaults and rules (method none drafts nothing; bounds checked where they are defined)."""
    from rayspec.config import EngineConfig, EngineSettings, SpeculativeConfig

    cfg = AppArgs.model_validate({"speculative": {"method": "none"}, "engine": {"max_num_seqs": 3}})
    assert type(cfg.speculative) is SpeculativeConfig and type(cfg.engine) is EngineSettings
    assert cfg.speculative.num_speculative_tokens == 0
    engine = cfg.engine_config()
    assert type(engine) is EngineConfig and engine.max_num_seqs == 3 and engine.speculative == cfg.speculative
    engine.speculative.num_speculative_tokens = 4  # the engine's copy: the app's settings stay
    assert cfg.speculative.num_speculative_tokens == 0
    assert AppArgs().speculative == SpeculativeConfig() and AppArgs().engine == EngineSettings()
    with pytest.raises(ValidationError, match="engine.block_size"):
        AppArgs.model_validate({"engine": {"block_size": 0}})


def test_rayspec_num_threads_overrides_the_configs_threads(monkeypatch):
    """RAYSPEC_NUM_THREADS (scripts/test sets 1) overrides engine.num_threads where an engine sets its
    threads; unset, the config's; a value that is not a positive integer is an error, not ignored."""
    import torch

    from rayspec.config import set_torch_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("RAYSPEC_NUM_THREADS", "1")
        set_torch_threads(2)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("RAYSPEC_NUM_THREADS")
        set_torch_threads(2)
        assert torch.get_num_threads() == 2
        set_torch_threads(None)
        assert torch.get_num_threads() == 2  # nothing asked: left alone
        for bad in ("0", "two", "-1"):
            monkeypatch.setenv("RAYSPEC_NUM_THREADS", bad)
            with pytest.raises(ValueError, match="RAYSPEC_NUM_THREADS"):
                set_torch_threads(2)
    finally:
        torch.set_num_threads(before)
