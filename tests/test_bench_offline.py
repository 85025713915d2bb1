"""`rayspec bench offline` on a tiny random model: the CLI runs end to end, the speculative
outputs match the baseline's, and `--disable-by-batch-size` really turns drafting off."""

from __future__ import annotations

import json

import tests.engine_utils  # noqa: F401  (one torch thread for the tiny models)
from rayspec.cli import main


def _prompts_file(path):
    lines = [{"question_id": i, "category": "t", "turns": [f"Repeat after me: {w} {w} {w} {w}."]}
             for i, w in enumerate(["alpha beta", "one two three", "red green", "up down"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _bench(model_dir, prompts, out, *extra):
    rc = main(["bench", "offline", "--model", str(model_dir), "--method", "ngram", "--num-speculative-tokens", "4",
               "--prompts", str(prompts), "--num-prompts", "4", "--max-tokens", "24", "--concurrency", "2",
               "--no-hf", "--output-json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_offline_cli(tiny_model_dir, tmp_path):
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    drafting = _bench(tiny_model_dir, prompts, tmp_path / "on.json")
    assert drafting["greedy_match"] is True
    assert drafting["num_prompts"] == 4 and drafting["concurrency"] == 2
    assert drafting["total_output_tokens"] > 0 and drafting["output_throughput"] > 0
    assert drafting["spec_decode_num_drafts"] > 0  # the sharpened tiny model repeats: n-gram drafts

    # drafting off from batch size 1: no step drafts, the outputs stay the same
    off = _bench(tiny_model_dir, prompts, tmp_path / "off.json", "--disable-by-batch-size", "1")
    assert off["disable_by_batch_size"] == 1
    assert off["spec_decode_num_drafts"] == 0 and off["spec_decode_acceptance_length"] == 1.0
    assert off["greedy_match"] is True
