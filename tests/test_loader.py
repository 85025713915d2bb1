"""Model loading: local directories, hub ids offline, the default model, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from rayspec import loader
from rayspec.config import EngineConfig
from rayspec.loader import ModelNotFoundError
from rayspec.model import CausalLM


def test_local_dir_loads(tiny_model_dir):
    model, tokenizer = loader.load_model(str(tiny_model_dir), device="cpu")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert isinstance(model, CausalLM)
    assert model.args.vocab_size == config["vocab_size"] and model.args.num_layers == config["num_hidden_layers"]
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer is not None and tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert loader.generation_eos_ids(str(tiny_model_dir)) == {2}


def test_num_layers_and_dtype(tiny_model_dir):
    model, _ = loader.load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", num_layers=1)
    assert model.args.num_layers == 1 and len(model.model.layers) == 1
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loader.load_model(str(tiny_model_dir), dtype="int3")


def test_dir_without_tokenizer_loads_token_ids_only(tmp_path):
    from conftest import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "m", vocab_size=16, with_tokenizer=False)
    model, tokenizer = loader.load_model(str(path))
    assert tokenizer is None and model.args.vocab_size == 16


@pytest.mark.parametrize("setup,match", [
    ("no_config", "config.json"),
    ("no_weights", "safetensors"),
    ("not_a_spec", "not a local directory"),
])
def test_bad_local_specs(tmp_path, tiny_model_dir, setup, match):
    if setup == "no_config":
        spec = tmp_path / "empty"
        spec.mkdir()
    elif setup == "no_weights":
        spec = tmp_path / "noweights"
        spec.mkdir()
        (spec / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    else:
        spec = tmp_path / "does" / "not" / "exist"
    with pytest.raises(ModelNotFoundError, match=match):
        loader.load_model(str(spec))


def test_uncached_hub_id_offline(monkeypatch, tmp_path):
    # set after huggingface_hub was imported (as in a running server): must still be honoured
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="rayspec-test/not-cached-model") as err:
        loader.resolve_model_dir("rayspec-test/not-cached-model")
    assert "disabled" in str(err.value)  # refused offline, not a failed connection attempt
    with pytest.raises(ModelNotFoundError):
        loader.load_model("rayspec-test/not-cached-model")


def test_default_model_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "empty-cache"))
    for spec in (loader.DEFAULT_MODEL, "default"):
        with pytest.raises(ModelNotFoundError, match="rayspec fetch-model"):
            loader.resolve_model_dir(spec)
    from rayspec.engine import LLMEngine

    with pytest.raises(ModelNotFoundError, match="rayspec fetch-model"):
        LLMEngine(EngineConfig())  # the default config names the default model


def test_default_model_resolves_in_cache(monkeypatch, tmp_path, tiny_model_dir):
    import shutil

    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    shutil.copytree(tiny_model_dir, target)
    assert loader.resolve_model_dir(loader.DEFAULT_MODEL) == target


@pytest.mark.slow
def test_smollm2_loads(smollm2):
    from engine_utils import cached_model

    model, tokenizer = cached_model(smollm2)
    assert model.args.num_layers == 30 and model.args.vocab_size == 49152
    assert model.args.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template
