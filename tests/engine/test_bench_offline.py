"""`rayspec bench offline` on a tiny random model: the CLI runs end to end, the speculative
outputs match the baseline's, and `--disable-by-batch-size` really turns drafting off."""

from __future__ import annotations

import json

from engine_utils import bench_prompts_file  # (and one torch thread for the tiny models)
from rayspec_cli.main import main


def _bench(model_dir, prompts, out, *extra):
    rc = main(["bench", "offline", "--model", str(model_dir), "--method", "ngram", "--num-speculative-tokens", "4",
               "--prompts", str(prompts), "--num-prompts", "4", "--max-tokens", "24", "--concurrency", "2",
               "--no-hf", "--output-json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_offline_cli(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAYSPEC_NO_PROGRESS", raising=False)
    prompts = bench_prompts_file(tmp_path / "prompts.jsonl")
    # a fixed draft length: with measured costs the planner may rightly draft nothing for a tiny model
    drafting = _bench(tiny_model_dir, prompts, tmp_path / "on.json", "--no-adaptive")
    assert "4/4" in capsys.readouterr().err  # the progress bar, per prompt, on stderr
    env = drafting["environment"]  # the machine and versions the figures depend on
    assert env["cpu_model"] and env["cpu_count"] >= 1 and env["torch_threads"] >= 1
    assert env["torch"] and env["transformers"] and env["python"] and env["rayspec"]
    assert "ray" in env and env["gpu_model"] is None and env["gpu_count"] == 0  # the test runs on the CPU
    assert drafting["greedy_match"] is True
    assert drafting["num_prompts"] == 4 and drafting["concurrency"] == 2
    assert drafting["total_output_tokens"] > 0 and drafting["output_throughput"] > 0
    assert drafting["spec_decode_num_drafts"] > 0  # the sharpened tiny model repeats: n-gram drafts

    # drafting off from batch size 1: no step drafts, the outputs stay the same
    off = _bench(tiny_model_dir, prompts, tmp_path / "off.json", "--disable-by-batch-size", "1")
    assert off["disable_by_batch_size"] == 1
    assert off["spec_decode_num_drafts"] == 0 and off["spec_decode_acceptance_length"] == 1.0
    assert off["greedy_match"] is True


def test_bundled_prompt_sets(tmp_path):
    """`--prompts mt_bench` names a set shipped in the package (80 prompts each, with a NOTICE of
    their sources); a path is read as a file; anything else is an error naming the sets."""
    import pytest

    from rayspec.bench.prompts import PROMPT_SETS_DIR, load_prompts, prompt_sets, prompts_path

    assert prompt_sets() == ["gsm8k", "humaneval", "long_documents", "mt_bench", "unguessable"]
    sizes = {"long_documents": 40}  # (scripts/make_long_document_prompts.py: 1,400-1,800 tokens each)
    for name in prompt_sets():
        assert len(load_prompts(name)) == sizes.get(name, 80) and load_prompts(f"{name}.jsonl", 3) == load_prompts(name)[:3]
    notice = (PROMPT_SETS_DIR.parent / "NOTICE.md").read_text()
    assert all(f"prompts/{name}.jsonl" in notice for name in prompt_sets()) and "Apache-2.0" in notice
    mine = bench_prompts_file(tmp_path / "mt_bench.jsonl")  # a file of that name wins over the bundled set
    assert prompts_path(mine) == mine and load_prompts(mine)[0].startswith("Repeat after me")
    with pytest.raises(FileNotFoundError, match="gsm8k, humaneval, long_documents, mt_bench, unguessable"):
        load_prompts("no_such_set")
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing" / "mt_bench.jsonl")  # a path is never swapped for a bundled set


def test_bench_offline_takes_the_engine_flags(tiny_model_dir, tmp_path):
    """`bench offline` takes the engine settings `rayspec serve` takes (--compile, --kv-cache-memory-gb,
    --max-model-len, ...), applies them to every engine it builds and records them."""
    from rayspec_cli.bench import bench_engine_overrides
    from rayspec_cli.main import build_parser

    args = build_parser().parse_args(["bench", "offline", "--prompts", "x", "--compile", "--kv-cache-memory-gb", "0.25",
                                      "--max-model-len", "300", "--no-enable-prefix-caching"])
    assert bench_engine_overrides(args) == {"compile": True, "kv_cache_memory_gb": 0.25, "max_model_len": 300,
                                            "enable_prefix_caching": False}
    prompts = bench_prompts_file(tmp_path / "prompts.jsonl")
    result = _bench(tiny_model_dir, prompts, tmp_path / "flags.json", "--max-model-len", "200",
                    "--kv-cache-memory-gb", "0.125")
    assert result["engine"]["max_model_len"] == 200 and result["engine"]["kv_cache_memory_gb"] == 0.125
    assert result["greedy_match"] is True
