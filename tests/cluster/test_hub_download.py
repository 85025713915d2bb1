"""Hub ids against a Hugging Face hub on localhost (tests/hub_server.py): no internet; Ray only in
the last test (a config naming hub ids, served on Ray Serve from an empty cache, then offline).

The repos are laid out as the published ones, with tiny random weights:
- `org/target`: a Llama as Meta ships Llama-3.1 (2 safetensors shards + model.safetensors.index.json,
  config/generation config/tokenizer files, README/LICENSE, and `original/` with a consolidated
  .pth that must never be fetched)
- `org/eagle3-head`: an EAGLE-3 head as `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B` (config.json +
  pytorch_model.bin only)
- `org/both` (safetensors and pytorch_model.bin: only safetensors fetched), `org/no-weights`,
  `org/missing-shard` (the index names a shard the repo lacks), `org/gated`, `org/private`,
  `org/revs` (revisions `main` and `v2` with different weights)
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_model_dir
from hub_server import FakeHub
from rayspec.model import loader
from rayspec.model.weights import hub as weights_hub
from rayspec.model.weights.files import ModelNotFoundError

HIDDEN, LAYERS, VOCAB, DRAFT_VOCAB = 64, 4, 64, 32
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TARGET_FETCHED = {"config.json", "generation_config.json", "model.safetensors.index.json", *SHARDS,
                  "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}


# ---- repos on disk ---------------------------------------------------------------------------

def _write_tokenizer(path: Path) -> None:
    """A tiny word-level tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "hello world the a of and to in is it".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3} | {w: 4 + i for i, w in enumerate(words)}
    vocab |= {f"w{i}": i for i in range(len(vocab), VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    if not (path / "special_tokens_map.json").exists():
        (path / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def _write_junk(path: Path) -> None:
    """What the published repos also hold and a load never needs."""
    (path / "README.md").write_text("---\nlicense: other\n---\n# a model\n")
    (path / "LICENSE").write_text("license text\n")
    (path / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")


def _shard(model_dir: Path, names=SHARDS) -> dict[str, torch.Tensor]:
    """Split model.safetensors into shards + model.safetensors.index.json, as transformers writes them."""
    state = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    keys = sorted(state)
    parts = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for name, part in zip(names, parts):
        save_file({k: state[k] for k in part}, str(model_dir / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in part}
    total = sum(v.numel() * v.element_size() for v in state.values())
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return state


def _make_target(path: Path, seed: int = 0) -> Path:
    make_tiny_model_dir(path, seed=seed, num_layers=LAYERS, hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)
    _shard(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3]}))
    _write_tokenizer(path)
    _write_junk(path)
    (path / "original").mkdir()
    (path / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)  # 16 GB in Llama-3.1-8B
    (path / "original" / "params.json").write_text(json.dumps({"dim": HIDDEN}))
    (path / "original" / "tokenizer.model").write_bytes(b"junk")
    return path


def _make_eagle3_head(path: Path, target_dir: Path) -> Path:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B layout: config.json + pytorch_model.bin (float16, no embedding)."""
    from rayspec.eagle.checkpoint import new_eagle_config
    from rayspec.eagle.head import build_head

    config = new_eagle_config("eagle3", target_dir, LAYERS, HIDDEN, draft_vocab_size=DRAFT_VOCAB)
    torch.manual_seed(5)
    state = {}
    for key, value in build_head(config).state_dict().items():
        if key.startswith(("embed_tokens.", "target_lm_head.")):
            continue
        state[key] = (torch.randn(value.shape) * 0.1).half() if value.is_floating_point() else value.clone()
    draft_ids = torch.tensor(sorted(random.Random(7).sample(range(VOCAB), DRAFT_VOCAB)))
    state["d2t"] = draft_ids - torch.arange(DRAFT_VOCAB)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    state["t2d"][draft_ids] = True
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config.hf_config, indent=2))
    torch.save(state, path / "pytorch_model.bin")
    _write_junk(path)
    return path


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("hub-repos")
    target = _make_target(root / "target")
    out = {"org/target": {"main": target},
           "org/eagle3-head": {"main": _make_eagle3_head(root / "eagle3-head", target)}}

    both = make_tiny_model_dir(root / "both", seed=2, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                               with_tokenizer=False)
    torch.save(load_file(str(both / "model.safetensors")), both / "pytorch_model.bin")
    out["org/both"] = {"main": both}

    no_weights = root / "no-weights"
    (no_weights / "original").mkdir(parents=True)
    (no_weights / "config.json").write_text((target / "config.json").read_text())
    (no_weights / "original" / "consolidated.00.pth").write_bytes(b"\0" * 64)  # in a subfolder: not weights
    _write_junk(no_weights)
    out["org/no-weights"] = {"main": no_weights}

    missing = make_tiny_model_dir(root / "missing-shard", seed=3, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                                  with_tokenizer=False)
    _shard(missing)
    (missing / SHARDS[1]).unlink()
    out["org/missing-shard"] = {"main": missing}

    gated = make_tiny_model_dir(root / "gated", seed=4, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                                with_tokenizer=False)
    out["org/gated"] = {"main": gated}
    out["org/private"] = {"main": gated}

    out["org/revs"] = {
        "main": make_tiny_model_dir(root / "revs-main", seed=10, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                                    with_tokenizer=False),
        "v2": make_tiny_model_dir(root / "revs-v2", seed=11, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                                  with_tokenizer=False),
    }
    return out


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    """A running hub with every repo, huggingface_hub pointed at it with an empty cache and no token."""
    import huggingface_hub.constants as constants

    server = FakeHub(token="hf_testtoken_1234567890")
    for repo_id, revisions in repos.items():
        server.add_repo(repo_id, revisions, gated=repo_id == "org/gated", private=repo_id == "org/private")
    server.start()
    home, cache = tmp_path / "hf-home", tmp_path / "hf-home" / "hub"
    # huggingface_hub reads these at import: the environment for what reads it at call time
    # (rayspec's loader, huggingface_hub's token lookup), the constants for the rest (the cache,
    # and huggingface_hub's own side requests such as /api/agent-harnesses: never the internet)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # not the developer's login
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield server
    server.stop()


def _state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same_weights(model, files_state: dict[str, torch.Tensor]) -> None:
    state = _state_of(model)
    for key, value in files_state.items():
        assert torch.equal(state[key], value.to(state[key].dtype)), key


def _files_state(repo_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(repo_dir.glob("*.safetensors")):
        state |= load_file(str(f))
    return state


# ---- tests -----------------------------------------------------------------------------------

def test_target_and_eagle3_head_by_hub_id_then_offline(hub, repos, monkeypatch):
    from rayspec.eagle.checkpoint import load_eagle_head, read_eagle_head

    target_dir = repos["org/target"]["main"]
    model, tokenizer = loader.load_model("org/target", device="cpu")
    _assert_same_weights(model, _files_state(target_dir))
    assert model.args.num_layers == LAYERS and model.args.vocab_size == VOCAB
    assert tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False)) == "hello world"
    assert weights_hub.generation_eos_ids("org/target") == {2, 3}  # generation_config.json came along
    # exactly the files a load needs: the shards the index names, no original/, no README
    assert set(hub.downloads("org/target")) == TARGET_FETCHED
    assert not any("original/" in p for p in hub.log)

    head_file = torch.load(repos["org/eagle3-head"]["main"] / "pytorch_model.bin", weights_only=True)
    head, has_embedding = read_eagle_head("org/eagle3-head", model, kind="eagle3")
    assert not has_embedding and head.config.draft_vocab_size == DRAFT_VOCAB
    modules = dict(head.named_parameters()) | dict(head.named_buffers())
    for key, value in head_file.items():
        assert torch.equal(modules[key], value.to(modules[key].dtype)), key
    assert set(hub.downloads("org/eagle3-head")) == {"config.json", "pytorch_model.bin"}
    attached = load_eagle_head("org/eagle3-head", model, kind="eagle3")
    assert attached.embed_tokens.weight is model.model.embed_tokens.weight

    # from the cache: offline, and with the hub gone (unreachable, not flagged offline)
    hub.stop()
    for offline in ("1", None):
        if offline:
            monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        else:
            monkeypatch.delenv("HF_HUB_OFFLINE")
        again, tok = loader.load_model("org/target", device="cpu")
        _assert_same_weights(again, _files_state(target_dir))
        assert tok.encode("hello world", add_special_tokens=False) == tokenizer.encode("hello world",
                                                                                      add_special_tokens=False)
        head, _ = read_eagle_head("org/eagle3-head", again, kind="eagle3")
        modules = dict(head.named_parameters()) | dict(head.named_buffers())
        assert all(torch.equal(modules[k], v.to(modules[k].dtype)) for k, v in head_file.items())
        with pytest.raises(ModelNotFoundError, match="org/both"):  # never downloaded: not in the cache
            weights_hub.resolve_model_dir("org/both")

    # a shard gone from the cache: the offline check names it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = weights_hub.resolve_model_dir("org/target")
    (snapshot / SHARDS[1]).unlink()
    with pytest.raises(ModelNotFoundError, match=SHARDS[1]):
        weights_hub.resolve_model_dir("org/target")


def test_safetensors_preferred_over_bin(hub, repos):
    model, tokenizer = loader.load_model("org/both", device="cpu")
    assert tokenizer is None
    _assert_same_weights(model, _files_state(repos["org/both"]["main"]))
    assert sorted(hub.downloads("org/both")) == ["config.json", "model.safetensors"]
    assert not any("pytorch_model.bin" in p for p in hub.log)  # not even asked about


def test_repo_without_weights_fails_clearly(hub):
    with pytest.raises(ModelNotFoundError) as err:
        weights_hub.resolve_model_dir("org/no-weights")
    message = str(err.value)
    assert "org/no-weights has no weights" in message and "pytorch_model*.bin" in message and "*.safetensors" in message
    assert "original/consolidated.00.pth" in message and "README.md" in message  # what the repo has
    assert hub.downloads() == []  # decided from the listing: nothing fetched


def test_index_naming_a_missing_shard_fails_clearly(hub):
    with pytest.raises(ModelNotFoundError, match=f"names shard {SHARDS[1]}, which the repo does not have"):
        weights_hub.resolve_model_dir("org/missing-shard")
    assert SHARDS[0] not in hub.downloads("org/missing-shard")  # found out before the shards were fetched


def test_gated_and_private_repos_want_hf_token(hub, repos, monkeypatch):
    for repo_id in ("org/gated", "org/private"):
        with pytest.raises(ModelNotFoundError, match="HF_TOKEN") as err:
            weights_hub.resolve_model_dir(repo_id)
        assert repo_id in str(err.value) and "none is set" in str(err.value)
    assert "gated" in str(pytest.raises(ModelNotFoundError, weights_hub.resolve_model_dir, "org/gated").value)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_abcdef")
    with pytest.raises(ModelNotFoundError, match="HF_TOKEN") as err:
        weights_hub.resolve_model_dir("org/gated")
    assert "hf_wrong_token_abcdef" not in str(err.value)  # the token is never shown
    monkeypatch.setenv("HF_TOKEN", hub.token)
    for repo_id in ("org/gated", "org/private"):
        model, _ = loader.load_model(repo_id, device="cpu")
        _assert_same_weights(model, _files_state(repos[repo_id]["main"]))
    assert "model.safetensors" in hub.downloads("org/gated")


def test_revisions(hub, repos):
    main, v2 = (_files_state(repos["org/revs"][rev]) for rev in ("main", "v2"))
    assert not torch.equal(main["lm_head.weight"], v2["lm_head.weight"])
    model, _ = loader.load_model("org/revs@v2", device="cpu")
    _assert_same_weights(model, v2)
    model, _ = loader.load_model("org/revs", device="cpu")
    _assert_same_weights(model, main)
    sha = FakeHub.commit("org/revs", "v2")
    path = weights_hub.resolve_model_dir(f"org/revs@{sha}")  # a commit
    assert path.name == sha
    _assert_same_weights(loader.load_model(f"org/revs@{sha}", device="cpu")[0], v2)
    with pytest.raises(ModelNotFoundError, match="has no revision 'v3'"):
        weights_hub.resolve_model_dir("org/revs@v3")


def test_revision_offline_from_cache(hub, repos, monkeypatch):
    weights_hub.resolve_model_dir("org/revs@v2")
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _assert_same_weights(loader.load_model("org/revs@v2", device="cpu")[0], _files_state(repos["org/revs"]["v2"]))
    with pytest.raises(ModelNotFoundError, match="org/revs"):  # main was never downloaded
        weights_hub.resolve_model_dir("org/revs")


def test_hub_spec_parsing():
    assert weights_hub.split_revision("org/name@v2") == ("org/name", "v2")
    assert weights_hub.split_revision("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert weights_hub.split_revision("org/name") == ("org/name", None)
    assert weights_hub._is_hub_id("org/name@refs/pr/1") and weights_hub._is_hub_id("org/name")
    assert not weights_hub._is_hub_id("org/name@") and not weights_hub._is_hub_id("a/b/c") and not weights_hub._is_hub_id("/abs")


def test_local_sharded_pytorch_bin_loads(tmp_path):
    """A local checkpoint as pytorch_model-0000N-of-0000M.bin + pytorch_model.bin.index.json."""
    path = make_tiny_model_dir(tmp_path / "m", seed=6, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                               with_tokenizer=False)
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(state)
    names = ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    weight_map = {}
    for name, part in zip(names, (keys[:5], keys[5:])):
        torch.save({k: state[k] for k in part}, path / name)
        weight_map |= {k: name for k in part}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, _ = loader.load_model(str(path), device="cpu")
    _assert_same_weights(model, state)
    shutil.move(path / names[1], tmp_path / names[1])
    with pytest.raises(ModelNotFoundError, match=names[1]):
        loader.load_model(str(path), device="cpu")


def test_legacy_pytorch_bin_loads_without_mmap(tmp_path):
    """A pytorch_model.bin in the pre-zip format (cannot be memory-mapped) still loads."""
    path = make_tiny_model_dir(tmp_path / "m", seed=7, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                               with_tokenizer=False)
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    _assert_same_weights(loader.load_model(str(path), device="cpu")[0], state)


def test_config_naming_hub_ids_served_from_empty_cache_then_offline(repos, tmp_path, monkeypatch, own_cluster):
    """A config naming hub ids (the target and its EAGLE-3 head) is served on Ray Serve from an empty
    cache: the replicas download what a load needs from the hub (reached through the runtime_env's
    env_vars alone) and serve the target's own greedy text. Then again, offline from that cache, with
    the hub down."""
    import httpx
    import ray
    from ray import serve
    from serve_utils import free_port, tiny_args

    from deployments.app import build_app
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    server = FakeHub()
    for repo_id in ("org/target", "org/eagle3-head"):
        server.add_repo(repo_id, repos[repo_id])
    server.start()
    endpoint = server.url
    home = tmp_path / "hf-home"
    cache = home / "hub"
    # nothing from the driver's environment: the replicas get the hub and the cache from the runtime_env
    for name in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN",
                 "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    args = tiny_args("org/target", speculative={"method": "eagle3", "draft_model": "org/eagle3-head",
                                                "num_speculative_tokens": 3, "adaptive": False})
    prompt = "hello world the a of and to in is it"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}

    def serve_once(offline: str) -> tuple[str, dict]:
        """(the served greedy text, the app's stats) with HF_HUB_OFFLINE=offline in the replicas."""
        env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": offline}
        ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(args), name="hub", route_prefix="/hub")
            resp = httpx.post(f"http://127.0.0.1:{port}/hub/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            stats = serve.get_app_handle("hub").stats.remote().result(timeout_s=60)
            return resp.json()["choices"][0]["text"], stats
        finally:
            serve.shutdown()
            ray.shutdown()

    try:
        assert not cache.exists()
        text, stats = serve_once("0")
        # the replicas downloaded exactly what a load needs: the target's shards (no original/) and the
        # head's pytorch_model.bin
        assert set(server.downloads("org/target")) == TARGET_FETCHED
        assert set(server.downloads("org/eagle3-head")) == {"config.json", "pytorch_model.bin"}
        assert not any("original/" in p for p in server.log)
        assert stats["method"] == "eagle3" and stats["num_draft_tokens"] > 0  # the head drafted
        snapshot = cache / "models--org--target" / "snapshots" / FakeHub.commit("org/target", "main")
        assert all((snapshot / f).is_file() for f in TARGET_FETCHED)
        ref = LLMEngine(EngineConfig(model=str(snapshot), device="cpu", max_model_len=1024, max_num_seqs=1,
                                     kv_cache_memory_gb=0.25, num_threads=1,
                                     speculative=SpeculativeConfig(method="none"))).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        assert text == ref.text and ref.num_output_tokens == 16 and text.strip()

        server.stop()  # the hub is down: offline from the cache
        logged = len(server.log)
        text_offline, stats = serve_once("1")
        assert text_offline == ref.text and stats["num_draft_tokens"] > 0
        assert len(server.log) == logged
    finally:
        server.stop()


def test_chat_template_jinja_comes_along(hub, tmp_path):
    """transformers 5 saves the chat template as chat_template.jinja beside tokenizer_config.json: a
    snapshot must fetch it (`_META_PATTERNS`), or the tokenizer has no template."""
    path = make_tiny_model_dir(tmp_path / "chat", seed=12, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                               with_tokenizer=False)
    _write_tokenizer(path)
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    (path / "chat_template.jinja").write_text(template)
    hub.add_repo("org/chat", {"main": path})
    _, tokenizer = loader.load_model("org/chat", device="cpu")
    assert "chat_template.jinja" in hub.downloads("org/chat")
    assert tokenizer.chat_template == template


def test_one_pinned_revision_per_deployment(hub, repos, monkeypatch):
    """build_app resolves a hub id's revision to its commit once (pin_revision) and hands every
    replica the same `org/name@<sha>`: a branch that moves while replicas start cannot give them
    different files. A commit, or a local path, is left as it is; offline, the cached commit is used."""
    from deployments.app import build_app
    from deployments.config import AppArgs
    from serve_utils import app_deployments, tiny_args

    main, v2 = FakeHub.commit("org/revs", "main"), FakeHub.commit("org/revs", "v2")
    assert weights_hub.pin_revision("org/revs") == f"org/revs@{main}"
    assert weights_hub.pin_revision("org/revs@v2") == f"org/revs@{v2}"
    assert weights_hub.pin_revision(f"org/revs@{v2}") == f"org/revs@{v2}"
    assert weights_hub.pin_revision(str(repos["org/revs"]["main"])) == str(repos["org/revs"]["main"])

    app = build_app(tiny_args("org/revs"))
    args = [AppArgs.model_validate(d.init_args[0]) for d in app_deployments(app).values()]
    assert {a.model for a in args} == {f"org/revs@{main}"} and {a.model_name for a in args} == {"tiny"}
    unnamed = {k: v for k, v in tiny_args("org/revs@v2").items() if k != "served_model_name"}
    (first, *_) = [AppArgs.model_validate(d.init_args[0]) for d in app_deployments(build_app(unnamed)).values()]
    assert first.model == f"org/revs@{v2}" and first.model_name == "org/revs@v2"  # what clients send still answers

    weights_hub.resolve_model_dir("org/revs@v2")  # in the cache now
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert weights_hub.pin_revision("org/revs@v2") == f"org/revs@{v2}"
    assert weights_hub.pin_revision("org/unknown") == "org/unknown"  # nothing to pin it to: as it was

