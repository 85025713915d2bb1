"""`rayspec plan` and rayspec.memory.plan: the planner's figures are the engine's own (real engines on
SmolLM2-135M-Instruct; tensor-parallel shards and caches of a tiny model, built per rank without a
process group; a tiny gpt_oss on the generic path), and `rayspec plan` runs offline on
configs/llama3_eagle3.yaml, llama70b_draft8b_tp4.yaml and qwen3_eagle3.yaml against the published
model configs in tests/data served by the localhost hub, checked against arithmetic written out here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine_utils import cached_model, make_engine
from hub_server import FakeHub, use_hub
from deployments.operations.plan import cpu_only_configs, draft_shape, model_shape, parse_size, read_serve_config, shape_of
from deployments.operations.resources import Machine, resource_lines, resource_plan
from deployments.config import load_app_args
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.memory.plan import GB, GiB, engine_plan, kv_cache_plan
from rayspec.memory.weight_memory import causal_lm_weights, eagle_head_weights
from rayspec.model.families import ModelArgs
from rayspec.model.kv_cache import KVCache
from rayspec.model.loader import empty_model
from rayspec.model.parallel import TPGroup
from rayspec.model.weights.checkpoint import READ_CHUNK_BYTES
from rayspec_cli.main import main

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
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
    return runner.cache.nbytes


def plan_for(engine) -> object:
    """The planner's figures for an engine's config, from the config files alone (device: the engine's)."""
    config = engine.config
    target = model_shape(config.model)
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
    assert plan.kv.num_slots == engine.num_slots == 8 and plan.kv.num_blocks == engine.num_blocks
    assert plan.kv.sequences_of(plan.kv.capacity) == (4 if budget_gb < 1 else 8)  # of max_model_len at once
    assert plan.kv.capacity == engine.kv.capacity
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
    assert plan.draft_kv.capacity == engine.proposer.runner.kv.capacity == MAX_LEN + 4 * 5 + 8 + 2
    assert plan.draft_kv.num_blocks == engine.proposer.runner.kv.num_blocks
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
    # the budget pays for the self-draft's cache at its real size, 8 of the target's 30 layers per
    # token (counted as large as the target's it held 4 sequences: rayspec.memory.plan.draft_kv_fraction)
    assert plan.kv.num_blocks == engine.num_blocks and plan.kv.sequences_of(plan.kv.capacity) == 6
    assert plan.kv.bytes + plan.draft_kv.bytes <= 0.1 * GiB * 1.02
    assert plan.draft_kv.bytes == cache_bytes(draft) and plan.draft_kv.num_blocks == draft.kv.num_blocks
    weights = causal_lm_weights(draft.model.args, engine.dtype)
    assert (weights.num_params, weights.bytes) == held_bytes(draft.model)
    assert {i.name: i.bytes for i in plan.items}["draft model weights"] == weights.bytes


def test_a_separate_draft_checkpoint_is_budgeted_at_its_own_size(tiny_model_dir, tiny_draft_dir, tmp_path):
    """A draft other than the target's checkpoint (as Llama-3.2-1B drafts for 8B) pays for its KV
    cache at its own size per token, read from its config file: tiny_draft_dir has 1 layer of the
    target's 2 (half), in bfloat16 a quarter; an unreadable config is counted as large as the target's."""
    from rayspec.memory.plan import draft_kv_fraction

    target = model_shape(str(tiny_model_dir)).args
    spec = SpeculativeConfig(method="draft_model", draft_model=str(tiny_draft_dir), num_speculative_tokens=4)
    assert draft_kv_fraction(spec, str(tiny_model_dir), target, torch.float32) == 0.5
    half = dataclasses.replace(spec, draft_dtype="bfloat16")
    assert draft_kv_fraction(half, str(tiny_model_dir), target, torch.float32) == 0.25
    assert draft_kv_fraction(dataclasses.replace(spec, draft_model=str(tmp_path / "nothing")), str(tiny_model_dir),
                             target, torch.float32) == 1.0
    assert draft_kv_fraction(SpeculativeConfig(method="ngram"), str(tiny_model_dir), target) == 1.0
    # the engine sizes its pool so: more blocks than a draft counted as large leaves it
    budget = 2 * 1024 ** 2 / GiB
    engine = make_engine(tiny_model_dir, "draft_model", k=4, max_model_len=2048, max_num_seqs=8,
                         kv_cache_memory_gb=budget, draft_model=str(tiny_draft_dir))
    as_large = kv_cache_plan(target, torch.float32, 2048, 4, 8, budget, "draft_model")
    own_size = kv_cache_plan(target, torch.float32, 2048, 4, 8, budget, "draft_model", draft_fraction=0.5)
    assert engine.num_blocks == own_size.num_blocks > as_large.num_blocks
    # both caches within the budget (the draft's: the target's blocks and its slack per sequence)
    assert cache_bytes(engine.runner) + cache_bytes(engine.proposer.runner) <= budget * GiB * 1.05


def test_too_small_a_budget_is_refused_alike(smollm2, smol):
    args = smol[0].args
    with pytest.raises(ValueError) as planned:
        kv_cache_plan(args, torch.float32, MAX_LEN, 4, 8, 1e-4, "ngram")
    with pytest.raises(ValueError) as engine:
        make_engine(smollm2, "ngram", k=4, loaded=smol, max_model_len=MAX_LEN, kv_cache_memory_gb=1e-4)
    assert str(planned.value) == str(engine.value) and "cannot hold one token" in str(engine.value)


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
    assert "  Verifier: 1 replica x 1 CPU, 0 GPUs" in out and "to start: 1.5 CPUs, 0 GPUs; this machine has" in out


CPU_MACHINE = Machine(cpus=2, gpus=0)  # this project's CI machine: 2 cores, no GPU


def test_every_cpu_only_config_starts_on_two_cpus():
    """Issue 37, item 7: `serve run` of each CPU-only config in configs/ gets its replicas placed on a
    2-CPU machine with Ray's detected resources: the CPUs its deployments ask for (Ray's count, from
    the options build_app gives Serve) sum to at most 2. Above that a replica waits to be scheduled
    forever (configs/eagle3_async.yaml asked for 2.5)."""
    configs = cpu_only_configs(REPO / "configs")
    assert {"default.yaml", "baseline.yaml", "eagle3_async.yaml", "draft_async.yaml",
            "eagle3_async_paired.yaml"} <= {p.name for p in configs}
    for path in configs:
        for name, args in read_serve_config(path):
            plan = resource_plan(load_app_args(args))
            assert plan.fits(CPU_MACHINE), (path.name, plan.cpus())
            assert resource_lines(plan, CPU_MACHINE)[-1 if plan.cpus(True) == plan.cpus() else -2].endswith("fits")


def test_check_configs_script_lists_what_it_would_serve():
    """scripts/check_configs.py (serves each CPU-only config with `serve run`, checks /health and a
    completion; its results: benchmarks/results/config_health.json): --dry-run lists exactly the
    CPU-only configs with their CPU count against this machine, and a GPU config is refused by name."""
    import subprocess
    import sys

    script = str(REPO / "scripts" / "check_configs.py")
    proc = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO)
    configs, machine = cpu_only_configs(REPO / "configs"), Machine.detected()
    fits = [all(resource_plan(load_app_args(a)).fits(machine) for _, a in read_serve_config(p)) for p in configs]
    assert proc.returncode == (0 if all(fits) else 1), proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [p.name for p in configs]
    assert [line.endswith(": fits") for line in lines] == fits, lines  # on 2 CPUs (CI's): all of them
    proc = subprocess.run([sys.executable, script, "--dry-run", "llama3_eagle3"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "llama3_eagle3.yaml" in proc.stderr


def test_resource_count_per_deployment_and_what_the_machine_lacks():
    """The count follows the options Serve gets: defaults (ingress 0.5, verifier 1, proposer 1), a
    pool proposer, a paired proposer's bundle in the verifier's placement group, GPUs per bundle, autoscaling's
    start and max; a machine without them is told so, by how much."""
    pool = resource_plan(load_app_args({"topology": "disaggregated", "speculative": {"method": "draft_model"}}))
    assert [(d.name, d.replicas, d.cpus, d.gpus) for d in pool.deployments] == [
        ("OpenAIIngress", 1, 0.5, 0), ("Verifier", 1, 1, 0), ("Proposer", 1, 1, 0)]
    assert pool.cpus() == 2.5 and not pool.fits(CPU_MACHINE)
    lines = resource_lines(pool, CPU_MACHINE)
    assert "to start: 2.5 CPUs, 0 GPUs; this machine has 2 CPUs and 0 GPUs: does not fit (0.5 CPUs short)" in lines[-1]
    paired = resource_plan(load_app_args({
        "topology": "disaggregated", "proposer_placement": "paired", "speculative": {"method": "draft_model"},
        "engine": {"tensor_parallel_size": 2},
        "verifier": {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1}},
        "proposer": {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0.5}}}))
    (_, verifier) = paired.deployments  # no Proposer deployment: its bundle is the verifier's last
    assert (verifier.bundles, verifier.cpus, verifier.gpus) == (3, 5, 2.5)
    assert not paired.fits(Machine(cpus=16, gpus=2)) and paired.fits(Machine(cpus=16, gpus=3))
    assert "0.5 GPUs short" in resource_lines(paired, Machine(cpus=16, gpus=2))[-1]
    scaled = resource_plan(load_app_args({"verifier": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}}))
    assert (scaled.cpus(), scaled.cpus(at_max=True)) == (1.5, 3.5)
    assert scaled.fits(CPU_MACHINE) and not scaled.fits(CPU_MACHINE, at_max=True)
    assert "another node" in resource_lines(scaled, CPU_MACHINE)[-1]


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
    # 16 GiB in blocks of 16 positions (one scratch block): 8,191 blocks, 15 sequences of 8192 + 9
    # positions at once (513 blocks each), fewer than max_num_seqs 32
    assert (kv["num_slots"], kv["capacity"], kv["num_blocks"]) == (32, 8192 + 9, 8191) and kv["bytes"] == 16 * GiB
    assert 8191 // 513 == 15
    # the head: fc 12288 x 4096, one layer with a 2 x 4096-wide attention input, LM head over 32,000
    head = 4096 * 12288 + (8192 * (4096 + 2 * 1024) + 4096 * 4096) + 3 * 4096 * 14336 + 3 * 4096 + 4096 + 32000 * 4096
    assert items["eagle3 head weights"] == 2 * head + 32000 * 8 + 128256 + 64 * 4  # + d2t, t2d, rotary
    # the head's pool: the target's blocks and its 30 slack positions (2 blocks) per sequence, + scratch
    assert verifier["proposer_kv_cache"]["bytes"] == (8191 + 32 * 2 + 1) * 16 * (1 * 8 * 128 * 2 * 2)
    assert verifier["activations"]["tokens"] == 2048 and verifier["fits"] and app["fits"]
    assert not app["generic"] and verifier["tensor_parallel_size"] == 1 and verifier["followers"] is None
    # loading: the target streams in at its dtype (no float32 copy on the GPU), its KV cache is
    # allocated, then the head arrives with an embedding of its own (128,256 x 4096 bfloat16) before
    # it takes the target's
    placeholder = 128256 * 4096 * 2
    assert verifier["load_peak"] == items["target weights"] + kv["bytes"] + items["eagle3 head weights"] + placeholder
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


# ---- tensor parallelism: the planner's per-rank figures are the shards' --------------------------

def tiny_llama_config(vocab: int, tied: bool = False, bias: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias)


@pytest.mark.parametrize("vocab,tied,bias", [(256, False, False), (256, True, True), (255, False, True)])
def test_tp_rank_figures_are_the_shards(vocab, tied, bias):
    """Each rank's shard as rayspec.model.loader builds it (no process group needed to build one) holds
    what causal_lm_weights(..., tp_size=2) says; each rank's cache is the KV heads' half. 255 does
    not divide by 2: the embedding and LM head stay whole on both ranks."""
    hf = tiny_llama_config(vocab, tied, bias)
    args = ModelArgs.from_hf_config(hf)
    config = EngineConfig(model="x", dtype="bfloat16", max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=1.0,
                          tensor_parallel_size=2, speculative=SpeculativeConfig(method="ngram"))
    planned = causal_lm_weights(args, torch.bfloat16, tp_size=2)
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2)
        shard = empty_model(hf, "cpu", torch.bfloat16, tp=tp)
        assert (planned.num_params, planned.bytes) == held_bytes(shard)
        plan = engine_plan(config, args, "cpu", rank=rank)
        assert {i.name: i.bytes for i in plan.items}["target weights"] == planned.bytes
        # rank 0's new_cache would tell the (absent) other ranks: build its KVCache directly
        cache = shard.new_cache(plan.kv.num_blocks + 1, plan.kv.block_size) if rank else \
            KVCache(args, plan.kv.num_blocks + 1, plan.kv.block_size, torch.bfloat16, "cpu", tp)
        assert plan.kv.bytes == cache.nbytes
        assert plan.kv.num_slots == 4 and plan.tp_size == 2 and plan.rank == rank
    whole = causal_lm_weights(args, torch.bfloat16)
    embedding = vocab * 64 * (1 if tied else 2)
    split = embedding // 2 if vocab % 2 == 0 else embedding
    # the layers' projections halve; norms, the rotary buffer and row-parallel biases (o_proj has
    # none, down_proj's 64) stay whole
    layer_linear = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 96
    layer_bias = (64 + 2 * 32 + 2 * 96 + 64) if bias else 0
    halved = 3 * (layer_linear + layer_bias - (64 if bias else 0)) // 2 + (embedding - split)
    assert whole.num_params - planned.num_params == halved


def test_tp_sizes_the_model_cannot_take_are_refused():
    args = ModelArgs.from_hf_config(tiny_llama_config(256))
    with pytest.raises(ValueError, match="num_attention_heads .4. is not divisible by tensor_parallel_size 3"):
        causal_lm_weights(args, torch.bfloat16, tp_size=3)


# ---- gpt-oss: a mixture of experts on the native path ---------------------------------------------

def test_gpt_oss_weights_are_the_native_models(tmp_path):
    """A tiny gpt_oss (mixture of experts, attention sinks) runs on the native path: the native formula
    counts transformers' parameters (experts, router, sinks, biases), what the native model holds with
    float experts and with MXFP4 experts kept 4-bit, and at TP 2 one rank's half of the experts."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from rayspec.model.loader import load_model

    H, heads, kv_heads, hd, E, I, V, L = 64, 4, 2, 16, 4, 64, 128, 2
    hf = GptOssConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hd, num_hidden_layers=L, num_local_experts=E,
                      num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                      max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=1, eos_token_id=None,
                      pad_token_id=0)
    attention = heads + (H * heads * hd + heads * hd) + 2 * (H * kv_heads * hd + kv_heads * hd) + (heads * hd * H + H)
    experts = (E * H + E) + (E * H * 2 * I + E * 2 * I) + (E * I * H + E * H)  # router, gate_up, down (with biases)
    params = 2 * V * H + L * (attention + experts + 2 * H) + H
    shape = shape_of(hf)
    assert shape.generic is None
    assert causal_lm_weights(shape.args, torch.float32).num_params == params

    config = EngineConfig(model="x", dtype="float32", max_model_len=64, max_num_seqs=2, kv_cache_memory_gb=0.01,
                          speculative=SpeculativeConfig(method="ngram"))
    plan = engine_plan(config, shape, "cpu")
    items = {i.name: (i.bytes, i.detail) for i in plan.items}
    assert items["target weights"][1].startswith(f"{params:,} params")
    assert items["oneDNN prepacked projections"][0] == 0  # no MLP to choose CPU kernels on: nothing prepacked

    torch.manual_seed(0)
    GptOssForCausalLM(hf).save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), device="cpu", dtype="float32", tokenizer=False)
    assert held_bytes(loaded) == (params, items["target weights"][0])
    # MXFP4 experts kept 4-bit: 17 bytes per 32 weights
    packed = dataclasses.replace(shape.args, mxfp4_experts=True)
    expert_weights = L * E * 3 * H * I
    assert causal_lm_weights(packed, torch.float32).bytes == items["target weights"][0] - 4 * expert_weights \
        + expert_weights * 17 // 32
    quantized = GptOssConfig(**hf.to_dict())
    quantized.quantization_config = {"quant_method": "mxfp4"}
    assert ModelArgs.from_hf_config(quantized).mxfp4_experts
    # TP 2: each rank half the vocabulary, heads (and sinks) and experts; o_proj's bias and the router whole
    q, kv = heads // 2 * hd, kv_heads // 2 * hd
    rank_attention = heads // 2 + (H * q + q) + 2 * (H * kv + kv) + (q * H + H)
    rank_experts = (E * H + E) + E // 2 * (H * 2 * I + 2 * I + I * H + H)
    rank = V * H + L * (rank_attention + rank_experts + 2 * H) + H
    assert causal_lm_weights(shape.args, torch.float32, tp_size=2).num_params == rank


# ---- Llama-3.3-70B over 4 GPUs, and Qwen3-8B + EAGLE-3, through the localhost hub ------------------

# Llama-3.3-70B, one of 4 ranks: a layer's q/o 8192 x (64/4 x 128), k/v 8192 x (8/4 x 128), gate/up/down
# 8192 x 28672/4, its two norms whole; the embedding and LM head 128,256/4 rows each; the final norm
LLAMA70B_RANK_PARAMS = (80 * (2 * 8192 * 2048 + 2 * 8192 * 256 + 3 * 8192 * 7168 + 2 * 8192)
                        + 2 * 32064 * 8192 + 8192)
LLAMA70B_KV_PER_TOKEN = 80 * 8 * 128 * 2 * 2  # K and V, every layer, bfloat16: 320 KiB
QWEN3_PARAMS = 36 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128) \
    + 2 * 151936 * 4096 + 4096  # q/k norms: 128 each per layer


@pytest.fixture
def big_hub(tmp_path, monkeypatch):
    hub = FakeHub()
    for repo, folder in (("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b-instruct"),
                         ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct"),
                         ("Qwen/Qwen3-8B", "qwen3-8b"), ("Tengyunw/qwen3_8b_eagle3", "qwen3-8b-eagle3")):
        hub.add_repo(repo, DATA / folder)
    with hub:
        use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        yield hub


def plan_json(capsys, config: str, gpu: str) -> tuple[int, dict]:
    rc = main(["plan", str(REPO / "configs" / config), "--gpu-memory", gpu, "--json"])
    (app,) = json.loads(capsys.readouterr().out)
    return rc, app


def test_llama70b_tp4_plan_offline(big_hub, capsys):
    rc, app = plan_json(capsys, "llama70b_draft8b_tp4.yaml", "80GB")
    assert rc == 0 and app["fits"]
    verifier, proposer = app["deployments"]
    assert (verifier["tensor_parallel_size"], verifier["gpus_per_replica"]) == (4, 4)
    assert verifier["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    assert LLAMA70B_RANK_PARAMS == 17_639_415_808  # a quarter of 70,553,706,496, less 3/4 of the norms
    followers = verifier["followers"]
    for rank in (verifier, followers):
        items = {i["name"]: i["bytes"] for i in rank["items"]}
        assert items["target weights"] == 2 * LLAMA70B_RANK_PARAMS + 64 * 4  # + the float32 rotary buffer
        assert round(items["target weights"] / GB, 2) == 35.28
        # the engine's blocks from the 96 GiB budget over the whole model: the draft is disaggregated, so
        # its cache is not in this budget: 96 GiB // (320 KiB x 8197) = 38 sequences, capped by
        # max_num_seqs 32 (of 513 blocks of 16 each, + the scratch block)
        kv = rank["kv_cache"]
        assert 96 * GiB // (LLAMA70B_KV_PER_TOKEN * 8197) == 38
        assert (kv["num_slots"], kv["capacity"]) == (32, 8197)
        assert kv["num_blocks"] == 32 * 513
        assert items["target KV cache"] == (32 * 513 + 1) * 16 * LLAMA70B_KV_PER_TOKEN // 4  # its 2 of the 8 KV heads
        assert round((items["target weights"] + items["target KV cache"]) / GB, 1) == 56.8
        assert "draft model weights" not in items  # disaggregated: the draft is the proposer's
    # logits of 32 x 5 verified rows over 128,256 tokens: each rank's quarter (bfloat16, then float32),
    # the gathered parts and their concatenation (float32) on every rank, rank 0's processed copy
    rows, vocab = 32 * 5, 128256
    assert verifier["activations"]["logits"] == rows * (vocab // 4 * 6 + 3 * vocab * 4)
    assert followers["activations"]["logits"] == rows * (vocab // 4 * 6 + 2 * vocab * 4)
    assert verifier["activations"]["mlp"] == 4 * 2048 * (28672 // 4) * 2  # its quarter of the intermediate
    assert verifier["total"] < 80 * GB < 2 * verifier["total"]
    items = {i["name"]: i["bytes"] for i in proposer["items"]}
    assert items["draft model weights"] == 2 * LLAMA_PARAMS + 64 * 4
    assert proposer["load_peak"] == items["draft model weights"]  # streamed: no float32 copy on the GPU

    rc, out = run_plan_text(capsys, "llama70b_draft8b_tp4.yaml", "40GB")
    assert rc == 1 and "verdict: does not fit in 40.00 GB per GPU (GPUs of all replicas: 5)" in out
    assert "rank 0 (the replica's process: scheduler, sampling):" in out and "ranks 1-3 (each):" in out
    assert "4 GPUs per replica (placement group STRICT_PACK: 4 x {CPU: 4, GPU: 1})" in out


def run_plan_text(capsys, config: str, gpu: str) -> tuple[int, str]:
    rc = main(["plan", str(REPO / "configs" / config), "--gpu-memory", gpu])
    return rc, capsys.readouterr().out


def test_qwen3_eagle3_plan_offline(big_hub, capsys):
    rc, app = plan_json(capsys, "qwen3_eagle3.yaml", "80GB")
    assert rc == 0 and app["fits"]
    (verifier,) = app["deployments"]
    items = {i["name"]: i["bytes"] for i in verifier["items"]}
    assert QWEN3_PARAMS == 8_190_735_360
    # bfloat16, plus rotary buffers: inv_freq (64 float32) natively, transformers' model (the generic
    # path, while rayspec.model.native has no q/k norms) keeps original_inv_freq too
    assert items["target weights"] - 2 * QWEN3_PARAMS in (64 * 4, 2 * 64 * 4)
    kv = verifier["kv_cache"]
    per_token = 36 * 8 * 128 * 2 * 2  # 144 KiB
    assert kv["bytes_per_token"] == per_token and kv["num_blocks"] == 16 * GiB // (per_token * 16) - 1 == 7280
    assert kv["num_blocks"] // 513 == 14  # sequences of 8192 + 9 positions at once
    # the head: fc over 3 x 4096 features, one layer whose attention reads 2 x 4096, three norms, the
    # final norm, an LM head over the 32,000-token draft vocabulary; + d2t, t2d, rotary buffer
    head = 12288 * 4096 + 8192 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288 + 3 * 4096 + 4096 + 32000 * 4096
    assert items["eagle3 head weights"] == 2 * head + 32000 * 8 + 151936 + 64 * 4
    assert verifier["proposer_kv_cache"]["bytes"] == (7280 + kv["num_slots"] * 2 + 1) * 16 * (8 * 128 * 2 * 2)
    resident = sum(items.values())
    acts = verifier["activations"]
    assert verifier["total"] == resident + acts["total"]
    # at 40 GB the upper bound (SDPA's math path: 32 heads x 2048 x 8201 scores) does not fit, by
    # about 1 GB; with a fused attention kernel (no scores held) it fits with 4 GB to spare
    assert acts["scores"] == 32 * 2048 * 8201 * 9 + 2 * 32 * 8201 * 128 * 4
    assert verifier["total"] - acts["scores"] < 36 * GB < 40 * GB < verifier["total"] < 41.5 * GB
    rc, out = run_plan_text(capsys, "qwen3_eagle3.yaml", "40GB")
    assert rc == 1 and "per replica: does not fit: 41.05 GB of 40.00 GB" in out


def test_tp_colocated_eagle3_rank0_holds_the_head_and_whole_target_io():
    """Llama-3.1-8B over 2 GPUs with its EAGLE-3 head colocated: rank 0 holds the head, a whole copy
    of the target's embedding and LM head for it (its own are vocabulary halves), the head's cache
    and the features; rank 1 none of them."""
    from transformers import LlamaConfig

    from rayspec.eagle.checkpoint import eagle_config_from_hf
    from rayspec.memory.plan import DraftShape

    hf = json.loads((DATA / "llama-3.1-8b-instruct" / "config.json").read_text())
    args = ModelArgs.from_hf_config(LlamaConfig(**hf))
    head = eagle_config_from_hf(json.loads((DATA / "eagle3-llama3.1-instruct-8b" / "config.json").read_text()),
                                args.num_layers, args.hidden_size)
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=8, eagle_topk=4, num_steps=5)
    config = EngineConfig(model="x", dtype="bfloat16", max_model_len=8192, max_num_seqs=32, kv_cache_memory_gb=16.0,
                          tensor_parallel_size=2, speculative=spec)
    rank0, rank1 = (engine_plan(config, args, "cuda", DraftShape(head=head), rank=r) for r in (0, 1))
    items0, items1 = ({i.name: i.bytes for i in p.items} for p in (rank0, rank1))
    assert items0["target embedding + LM head"] == 2 * (2 * 128256 * 4096 + 4096) + 64 * 4
    assert items0["target weights"] == items1["target weights"] == 2 * (LLAMA_PARAMS - 32 * (3 * 4096 * 14336 + (
        4096 + 2 * 1024 + 4096) * 4096) // 2 - 128256 * 4096) + 64 * 4  # halves: layers' projections, embedding, head
    assert "eagle3 head weights" in items0 and set(items1) == {"target weights", "target KV cache"}
    # 15 slots as at TP 1; each rank 4 of the 8 KV heads
    assert items0["target KV cache"] == items1["target KV cache"] == 16 * GiB // 2  # the whole pool; half the heads
    assert rank0.activations.features > 0 and rank1.activations.features == 0
    # rank 0 loads its shard, allocates its cache, then the whole target I/O and the head (with its
    # placeholder embedding)
    assert rank0.load_peak == rank0.resident - items0["eagle3 head KV cache"] + 128256 * 4096 * 2
    # disaggregated: the head runs elsewhere, but the verifier still hands it the feature layers
    remote = engine_plan(dataclasses.replace(config, tensor_parallel_size=1), args, "cuda", DraftShape(head=head),
                         proposer_in_process=False)
    assert remote.activations.features > 0 and "eagle3 head weights" not in {i.name for i in remote.items}


# ---- the FP4 checkpoints of TensorRT-LLM's guide: stored and loaded sizes, fit per GPU ------------

@pytest.fixture
def fp4_hub(tmp_path, monkeypatch):
    hub = FakeHub()
    for repo, folder in (("nvidia/Llama-3.3-70B-Instruct-FP4", "llama-3.3-70b-instruct-fp4"),
                         ("nvidia/Llama-3.1-8B-Instruct-FP4", "llama-3.1-8b-instruct-fp4"),
                         ("openai/gpt-oss-120b", "gpt-oss-120b"), ("nvidia/gpt-oss-120b-Eagle3", "gpt-oss-120b-eagle3")):
        hub.add_repo(repo, DATA / folder)
    with hub:
        use_hub(monkeypatch, hub.url, tmp_path / "hf-home")
        yield hub


def _nvfp4_llama_stored(layers, hidden, kv, inter, vocab) -> int:
    """ModelOpt NVFP4: each decoder Linear a byte per 2 weights + a float8 scale per 16 + 2 float32 scalars;
    embeddings, LM head and norms bfloat16."""
    linears = [hidden * hidden, hidden * kv, hidden * kv, hidden * hidden] + [hidden * inter] * 3
    return layers * sum(n // 2 + n // 16 + 8 for n in linears) + 2 * (2 * vocab * hidden + (2 * layers + 1) * hidden)


def _scratch(hidden, largest_out) -> int:
    """One dequantization scratch (rayspec.model.fp4_linear.DequantScratch): the largest projection's int32
    byte indices, float32 values and bfloat16 weight, 2 + 4 + 2 bytes a weight, and an int32 scale index per 16."""
    return hidden * largest_out * 8 + hidden * largest_out // 16 * 4


def test_fp4_guide_plans_offline(fp4_hub, capsys, tmp_path):
    """`rayspec plan` on the guide's FP4 configs, from config files alone (config.json, ModelOpt's
    hf_quant_config.json): stored and held weight sizes and where each fits. Kept 4-bit (the default), the
    70B target holds its stored bytes (less the input scales it does not read) plus one scratch: 35-48 GB,
    and target + draft fit one H200 and one 128 GB DGX Spark by fractional shares; dequantized at load
    (`quantized_weights: dequantize`) the 70B holds 141 GB and fits no single GPU."""
    rc, app = plan_json(capsys, "llama70b_fp4_draft8b.yaml", "141GB")
    assert rc == 0 and app["fits"]
    target, draft = app["checkpoints"]
    assert (target["algo"], target["source"], draft["algo"]) == ("NVFP4", "hf_quant_config.json", "NVFP4")
    assert target["stored"] == _nvfp4_llama_stored(80, 8192, 1024, 28672, 128256)
    assert draft["stored"] == _nvfp4_llama_stored(32, 4096, 1024, 14336, 128256)
    assert round(target["stored"] / GB, 1) == 42.7
    # held: the stored bytes less the input_scale scalars (4 bytes per Linear), plus the scratch and the
    # rotary buffer (64 float32)
    assert target["loaded"] == target["stored"] - 80 * 7 * 4 + _scratch(8192, 28672) + 64 * 4
    assert draft["loaded"] == draft["stored"] - 32 * 7 * 4 + _scratch(4096, 14336) + 64 * 4
    assert 35 * GB <= target["loaded"] <= 48 * GB and target["kept_quantized"] and draft["kept_quantized"]
    fit = {row["tensor_parallel_size"]: row["fits"] for row in app["fit"]}
    assert fit[1] == {"80 GB (H100, A100 80GB)": False, "128 GB (DGX Spark, unified)": True, "141 GB (H200)": True}
    verifier, proposer = app["deployments"]
    assert (verifier["tensor_parallel_size"], verifier["gpus_per_replica"] + proposer["gpus_per_replica"]) == (1, 1.0)
    rc, out = run_plan_text(capsys, "llama70b_fp4_draft8b.yaml", "128GB")
    assert rc == 0 and "verdict: fits in 128.00 GB per GPU (GPUs of all replicas: 1)" in out
    assert "decoder projections held 4-bit (NVFP4)" in out

    dequantized = tmp_path / "dequantized.yaml"
    text = (REPO / "configs" / "llama70b_fp4_draft8b.yaml").read_text()
    dequantized.write_text(text.replace("quantized_weights: keep", "quantized_weights: dequantize"))
    assert main(["plan", str(dequantized), "--gpu-memory", "141GB", "--json"]) == 1
    (app,) = json.loads(capsys.readouterr().out)
    target, draft = app["checkpoints"]
    assert round(target["loaded"] / GB, 1) == 141.1 and not target["kept_quantized"]
    assert draft["loaded"] == 2 * LLAMA_PARAMS + 64 * 4  # the bf16 model's: dequantized at load
    assert not any(row["fits"]["141 GB (H200)"] for row in app["fit"] if row["tensor_parallel_size"] == 1)

    rc, app = plan_json(capsys, "llama70b_fp4_draft8b_2gpu.yaml", "80GB")  # the draft on a GPU of its own
    assert rc == 0 and app["fits"]
    verifier, proposer = app["deployments"]
    assert (verifier["gpus_per_replica"], proposer["gpus_per_replica"]) == (1, 1)

    rc, out = run_plan_text(capsys, "gpt_oss_eagle3.yaml", "80GB")
    assert rc == 0
    assert "openai/gpt-oss-120b: MXFP4 (config.json quantization_config)" in out
    # the native path keeps the experts 4-bit (4.25 bits a weight), the rest bfloat16
    assert "116.83 B parameters" in out
    assert "stored 65.25 GB, loaded 65.25 GB in bfloat16 (kept 4-bit)" in out
    assert "verdict: fits in 80.00 GB per GPU (GPUs of all replicas: 1)" in out
    tp1 = next(line for line in out.splitlines() if line.strip().startswith("tp 1:"))
    assert "fits 80 GB (H100, A100 80GB)" in tp1 and "does not fit" not in tp1, tp1


def test_plan_quotes_the_measured_gpu_step_for_measured_shapes(tmp_path):
    """`rayspec plan` quotes benchmarks/results/gpu_roofline_*.json for a target of the shapes measured
    there (Llama-3.1-8B's), from the file's own figures, and nothing for other shapes."""
    import json as _json

    from deployments.operations.plan import RESULTS_DIR, measured_step_lines
    from rayspec.model.families import ModelArgs

    llama8b = ModelArgs(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    lines = measured_step_lines(llama8b)
    recorded = _json.loads((RESULTS_DIR / "gpu_roofline_h100.json").read_text())
    b1 = next(r for r in recorded["decode"] if r["batch"] == 1 and r["compiled"])
    text = "\n".join(lines)
    assert "NVIDIA H100" in text and f"batch 1 {b1['ms_per_step']:.2f} ms" in text and "gpu_roofline_h100.json" in text
    assert "forward only" in text and "not an end-to-end figure" in text  # a forward-only tok/s says so
    # an end-to-end run (benchmarks/gpu_engine.py) is quoted as such, before the forward-only step
    measured = tmp_path / "measured"
    measured.mkdir()
    (measured / "gpu_engine_x.json").write_text(_json.dumps({
        "args": {"shape": "llama3.1-8b"}, "summary": {"gpu": "GPU X"},
        "runs": [{"config": "target compiled", "batch": 1, "tok_s": 140.0},
                 {"config": "eagle3 oracle compiled", "acceptance_target": 5.4, "acceptance_length": 5.3, "batch": 1,
                  "tok_s": 510.0}, {"config": "target eager", "batch": 1, "tok_s": 60.0},
                 {"config": "eagle3 oracle compiled", "acceptance_target": 6.5, "acceptance_length": 1.02, "batch": 1,
                  "tok_s": 37.0}]}))
    (measured / "gpu_roofline_x.json").write_text((RESULTS_DIR / "gpu_roofline_h100.json").read_text())
    both = measured_step_lines(llama8b, results_dir=measured)
    assert "measured end to end on GPU X" in both[1] and "target compiled batch 1 140 tok/s" in both[1], both
    assert "(acceptance length 5.3) batch 1 510 tok/s" in both[1] and "eager" not in both[1]
    # an oracle whose drafts were not accepted measured no speculation: left out, and said so
    assert "37 tok/s" not in both[1] and "1 speculative run(s) left out" in both[1], both
    (measured / "gpu_engine_x.json").write_text(_json.dumps({  # outputs unlike the target's: left out too
        "args": {"shape": "llama3.1-8b"}, "summary": {"gpu": "GPU X"},
        "runs": [{"config": "eagle3 oracle compiled", "acceptance_target": 2.0, "acceptance_length": 1.9, "batch": 1,
                  "tok_s": 300.0, "outputs_equal_vs_compiled": "0/1"}]}))
    assert "300 tok/s" not in "\n".join(measured_step_lines(llama8b, results_dir=measured))
    assert "forward only" in both[2]
    other = ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True)
    assert measured_step_lines(other) == []
    assert measured_step_lines(llama8b, results_dir=tmp_path) == []  # installed without the repository: nothing
