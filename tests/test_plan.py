"""`rayspec plan` and rayspec.memory: the planner's figures are the engine's own (real engines on
SmolLM2-135M-Instruct), and `rayspec plan configs/llama3_eagle3.yaml` runs offline against the
published Llama-3.1-8B-Instruct and EAGLE-3 head configs (tests/data) served by the localhost hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_utils import cached_model, make_engine
from hub_server import FakeHub, use_hub
from deployments.plan import draft_shape, parse_size, target_args
from rayspec.cli import main
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.memory import GB, GiB, causal_lm_weights, eagle_head_weights, engine_plan, kv_cache_plan

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
HEAD = str(REPO / "heads" / "smollm2-135m-eagle3")
MAX_LEN = 256


def held_bytes(module: torch.nn.Module, besides: torch.nn.Module | None = None) -> tuple[int, int]:
    """(parameter count, bytes of parameters and buffers) a module holds, each storage once,
    leaving out tensors it shares with `besides` (an EAGLE head's embedding is the target's)."""
    shared = set()
    if besides is not None:
        shared = {t.data_ptr() for t in (*besides.parameters(), *besides.buffers())}
    seen, params, size = set(), 0, 0
    for tensors, counted in ((module.parameters(), True), (module.buffers(), False)):
        for t in tensors:
            if t.data_ptr() in seen or t.data_ptr() in shared:
                continue
            seen.add(t.data_ptr())
            params += t.numel() if counted else 0
            size += t.numel() * t.element_size()
    return params, size


def cache_bytes(runner) -> int:
    return runner.cache.k.numel() * runner.cache.k.element_size() * 2


def plan_for(engine) -> object:
    """The planner's figures for an engine's config, from the config files alone (device: the engine's)."""
    config = engine.config
    target = target_args(config.model)
    draft = draft_shape(config.speculative, config.model, target)
    return engine_plan(config, target, engine.device.type, draft)


@pytest.fixture(scope="module")
def smol(smollm2):
    return cached_model(smollm2)


@pytest.mark.parametrize("budget_gb", [0.05, 2.0])  # fewer slots than max_num_seqs / max_num_seqs
def test_target_figures_are_the_engines(smollm2, smol, budget_gb):
    engine = make_engine(smollm2, "ngram", k=5, loaded=smol, max_model_len=MAX_LEN, max_num_seqs=8,
                         kv_cache_memory_gb=budget_gb)
    plan = plan_for(engine)
    assert plan.kv.num_slots == engine.num_slots == (4 if budget_gb < 1 else 8)
    assert plan.kv.capacity == engine.runner.cache.capacity
    assert plan.kv.bytes == cache_bytes(engine.runner)
    weights = causal_lm_weights(engine.model.args, engine.dtype)
    assert (weights.num_params, weights.bytes) == held_bytes(engine.model)
    assert weights.num_params == 134_515_008  # SmolLM2-135M: tied embedding
    item = {i.name: i.bytes for i in plan.items}
    assert item["target weights"] == weights.bytes and item["target KV cache"] == plan.kv.bytes


def test_eagle3_head_figures_are_the_engines(smollm2, smol):
    engine = make_engine(smollm2, "eagle3", k=8, loaded=smol, max_model_len=MAX_LEN, max_num_seqs=4,
                         draft_model=HEAD, eagle_topk=4, num_steps=5)
    plan = plan_for(engine)
    head = engine.proposer.head
    assert plan.kv.num_slots == engine.num_slots
    assert plan.draft_kv.capacity == engine.proposer.runner.cache.capacity == MAX_LEN + 4 * 5 + 8 + 2
    assert plan.draft_kv.bytes == cache_bytes(engine.proposer.runner)
    weights = eagle_head_weights(head.config, engine.dtype)
    assert (weights.num_params, weights.bytes) == held_bytes(head, besides=engine.model)  # embedding shared
    assert {i.name: i.bytes for i in plan.items}["eagle3 head weights"] == weights.bytes
    assert plan.activations.features > 0  # the target hands its feature layers over


def test_draft_model_figures_are_the_engines(smollm2, smol):
    engine = make_engine(smollm2, "draft_model", k=4, loaded=smol, max_model_len=MAX_LEN, max_num_seqs=8,
                         kv_cache_memory_gb=0.1, draft_model=smollm2, draft_num_layers=8)
    plan = plan_for(engine)
    draft = engine.proposer.runner
    assert plan.kv.num_slots == engine.num_slots == 4  # the budget pays for a draft cache as large as the target's
    assert plan.draft_kv.bytes == cache_bytes(draft) and plan.draft_kv.num_slots == draft.cache.num_slots
    weights = causal_lm_weights(draft.model.args, engine.dtype)
    assert (weights.num_params, weights.bytes) == held_bytes(draft.model)
    assert {i.name: i.bytes for i in plan.items}["draft model weights"] == weights.bytes


def test_too_small_a_budget_is_refused_alike(smollm2, smol):
    args = smol[0].args
    with pytest.raises(ValueError) as planned:
        kv_cache_plan(args, torch.float32, MAX_LEN, 4, 8, 1e-4, "ngram")
    with pytest.raises(ValueError) as engine:
        make_engine(smollm2, "ngram", k=4, loaded=smol, max_model_len=MAX_LEN, kv_cache_memory_gb=1e-4)
    assert str(planned.value) == str(engine.value) and "cannot hold one sequence" in str(engine.value)


def test_config_dtype_and_chunk_reach_the_plan(smol):
    args = smol[0].args
    config = EngineConfig(model="x", dtype=None, max_model_len=4096, max_num_seqs=8,
                          speculative=SpeculativeConfig(method="none"))
    on_gpu, on_cpu = engine_plan(config, args, "cuda"), engine_plan(config, args, "cpu")
    assert (on_gpu.dtype, on_cpu.dtype) == (torch.bfloat16, torch.float32)  # loader.parse_dtype's defaults
    assert on_gpu.kv.bytes_per_token == 30 * 3 * 64 * 2 * 2
    assert not any("oneDNN" in i.name for i in on_gpu.items) and any("oneDNN" in i.name for i in on_cpu.items)
    assert on_gpu.activations.tokens == 2048 and on_gpu.activations.kv_len == 4096 + 1
    unchunked = engine_plan(EngineConfig(model="x", max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=None,
                                         speculative=SpeculativeConfig(method="none")), args, "cuda")
    assert unchunked.activations.tokens == 8 * 4096  # every slot's prompt in one padded forward
    assert unchunked.activations.total > 10 * on_gpu.activations.total


@pytest.mark.parametrize("text,size", [("80GB", 80 * GB), ("80GiB", 80 * GiB), ("24G", 24 * GB), ("141 gb", 141 * GB),
                                       ("1.5TB", 1500 * GB), ("512MiB", 512 * 2**20), ("16", 16 * GB)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "80 GX", "-1GB", "eighty"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="cannot read the size"):
        parse_size(text)


def test_cli_on_the_default_config(smollm2, capsys):
    assert main(["plan", str(REPO / "configs" / "default.yaml"), "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "Verifier: 1 replica, no num_gpus: cpu, float32 (host memory; no GPU)" in out
    assert "eagle3 head KV cache" in out and "verdict" not in out  # no GPU deployment, no GPU verdict


def test_cli_refuses_unknown_app_and_size(capsys):
    assert main(["plan", str(REPO / "configs" / "default.yaml"), "--app", "nope"]) == 2
    assert "no rayspec application" in capsys.readouterr().err
    assert main(["plan", str(REPO / "configs" / "default.yaml"), "--gpu-memory", "lots"]) == 2
    assert "cannot read the size" in capsys.readouterr().err


# ---- Llama-3.1-8B-Instruct + EAGLE-3 through the localhost hub --------------------------------

LLAMA_PARAMS = 8_030_261_248  # Llama-3.1-8B: 32 x 218,112,000 per layer + 2 x 128,256 x 4096 + 4096


@pytest.fixture
def llama_hub(tmp_path, monkeypatch):
    hub = FakeHub()
    hub.add_repo("meta-llama/Llama-3.1-8B-Instruct", DATA / "llama-3.1-8b-instruct")
    hub.add_repo("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", DATA / "eagle3-llama3.1-instruct-8b")
    with hub:
        use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        yield hub


def run_plan(capsys, *argv) -> tuple[int, str]:
    rc = main(["plan", str(REPO / "configs" / "llama3_eagle3.yaml"), *argv])
    return rc, capsys.readouterr().out


def test_llama3_eagle3_plan_offline(llama_hub, monkeypatch, capsys):
    rc, out = run_plan(capsys, "--gpu-memory", "80GB", "--json")
    assert rc == 0
    (app,) = json.loads(out)
    (verifier,) = app["deployments"]
    items = {i["name"]: i["bytes"] for i in verifier["items"]}
    assert (verifier["device"], verifier["dtype"], verifier["num_gpus"]) == ("cuda", "bfloat16", 1)
    assert items["target weights"] == 2 * LLAMA_PARAMS + 64 * 4  # bfloat16 + the float32 rotary buffer
    assert round(items["target weights"] / GB, 2) == 16.06
    kv = verifier["kv_cache"]
    assert kv["bytes_per_token"] == 32 * 8 * 128 * 2 * 2 == 131072
    # 16 GiB of 8192 + 9 positions per slot: 15 slots, fewer than max_num_seqs 32
    assert (kv["num_slots"], kv["capacity"]) == (15, 8192 + 9) and kv["bytes"] == 15 * 8201 * 131072
    # the head: fc 12288 x 4096, one layer with a 2 x 4096-wide attention input, LM head over 32,000
    head = 4096 * 12288 + (8192 * (4096 + 2 * 1024) + 4096 * 4096) + 3 * 4096 * 14336 + 3 * 4096 + 4096 + 32000 * 4096
    assert items["eagle3 head weights"] == 2 * head + 32000 * 8 + 128256 + 64 * 4  # + d2t, t2d, rotary
    assert verifier["proposer_kv_cache"]["bytes"] == 15 * (8192 + 4 * 5 + 8 + 2) * (1 * 8 * 128 * 2 * 2)
    assert verifier["activations"]["tokens"] == 2048 and verifier["fits"] and app["fits"]
    # loading: the target's float32 build (4 x params) passes; then the head arrives with an embedding
    # of its own (128,256 x 4096 bfloat16) before it takes the target's
    placeholder = 128256 * 4096 * 2
    assert verifier["load_peak"] == items["target weights"] + kv["bytes"] + items["eagle3 head weights"] + placeholder
    assert verifier["load_peak"] > 4 * LLAMA_PARAMS
    fetched = llama_hub.downloads()
    assert sorted(fetched) == ["meta-llama/Llama-3.1-8B-Instruct/config.json",
                               "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B/config.json"]  # no weights

    rc, out = run_plan(capsys, "--gpu-memory", "80GB")
    assert rc == 0 and "verdict: fits in 80.00 GB per GPU" in out
    assert "target weights                   16.06 GB  8,030,261,248 params, bfloat16" in out

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # from the cache now, the hub unasked
    llama_hub.clear_log()
    rc, out = run_plan(capsys, "--gpu-memory", "16GB")
    assert rc == 1 and "verdict: does not fit in 16.00 GB per GPU" in out and not llama_hub.log
    assert "per replica: does not fit" in out and " short" in out
