"""Shared fixtures: tiny random Llama models built on the fly, and the real SmolLM2-135M.

Strict mode (`CI` or `RAYSPEC_TEST_STRICT` set; scripts/test sets it): a missing model is an
error, not a skip, and a run with any skipped test fails. Every test here is of the core or the
serving layer, so a green strict run is a run where all of them ran. Outside strict mode a
developer without the model gets skips, listed with their reasons at the end of the run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rayspec.loader import DEFAULT_MODEL, ModelNotFoundError, resolve_model_dir

# Every model load in the tests (here and in Ray workers, which inherit the environment) takes the
# same CPU matmul path, so that models loaded in different processes compute the same bits: the
# measured choice (rayspec.cpu_kernels) may differ between loads. tests/test_cpu_kernels.py
# measures.
os.environ.setdefault("RAYSPEC_CPU_KERNELS", "onednn_pad4")  # the path of sessions 8-15


def make_tiny_model_dir(path: Path, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                        vocab_size: int | None = None, with_tokenizer: bool = True) -> Path:
    """Write a random Llama checkpoint (config.json + model.safetensors [+ SmolLM2 tokenizer])."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = None
    if with_tokenizer:
        tokenizer_dir = smollm2_dir()
        vocab_size = vocab_size or 49152
    config = LlamaConfig(vocab_size=vocab_size or 256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits: fewer near-ties, more repetition (n-gram hits)
        model.lm_head.weight.mul_(8.0)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, path / f.name)
    return path


def strict() -> bool:
    return any(os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
               for name in ("CI", "RAYSPEC_TEST_STRICT"))


def smollm2_dir() -> Path:
    try:
        return resolve_model_dir(DEFAULT_MODEL)
    except ModelNotFoundError as err:
        missing = str(err)
    if strict():
        pytest.fail(f"{missing} (a strict test run: run scripts/setup, or `rayspec fetch-model`)", pytrace=False)
    pytest.skip(missing)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """In strict mode a skipped test fails the run (after pytest's own -rs listing of reasons)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if strict() and skipped:
        terminalreporter.write_sep("=", f"strict run: {len(skipped)} skipped test(s), which fails the run", red=True)
        for report in skipped:
            terminalreporter.write_line(f"SKIPPED {report.nodeid}: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr}")


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if strict() and skipped and exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """Same vocabulary and tokenizer as tiny_model_dir, different weights."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-draft") / "model", seed=1, num_layers=1)


@pytest.fixture(scope="session")
def smollm2() -> str:
    smollm2_dir()
    return DEFAULT_MODEL
