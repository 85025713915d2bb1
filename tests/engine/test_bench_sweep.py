"""`rayspec bench sweep` on tiny random models: n-gram and a draft model at k = 1, 2 over two
prompts, offline; the JSON's fields, greedy outputs equal to the target alone's, the PNG written."""

from __future__ import annotations

import json

import pytest

import tests.engine_utils  # noqa: F401  (one torch thread for the tiny models)
from rayspec_cli.main import main


def _prompts_file(path):
    lines = [{"question_id": i, "category": "t", "turns": [f"Repeat after me: {w} {w} {w} {w}."]}
             for i, w in enumerate(["alpha beta", "one two three"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_bench_sweep_cli(tiny_model_dir, tiny_draft_dir, tmp_path, capsys):
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["bench", "sweep", "--model", str(tiny_model_dir), "--methods", "ngram,draft_model",
               "--draft-model", str(tiny_draft_dir), "--num-speculative-tokens", "1,2", "--concurrency", "1,2",
               "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "16", "--no-adaptive",
               "--output-json", str(out), "--plot", str(plot), "--max-model-len", "256"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "acceptance by position" in table and "draft_model" in table and "ngram" in table
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert cfg["methods"] == ["ngram", "draft_model"] and cfg["num_speculative_tokens"] == [1, 2]
    assert cfg["concurrency"] == [1, 2] and cfg["num_prompts"] == 2 and cfg["temperature"] == 0.0
    assert cfg["draft_models"]["draft_model"] == str(tiny_draft_dir) and cfg["engine"]["max_model_len"] == 256
    assert cfg["engine"]["enable_prefix_caching"] is False  # (later runs of the same prompts would find them cached)
    env = result["environment"]
    assert env["cpu_model"] and env["torch_threads"] >= 1 and env["rayspec"]
    assert [b["concurrency"] for b in result["baseline"]] == [1, 2]
    assert all(b["output_throughput"] > 0 for b in result["baseline"])
    rows = {(r["method"], r["num_speculative_tokens"], r["concurrency"]): r for r in result["results"]}
    assert set(rows) == {(m, k, c) for m in ("ngram", "draft_model") for k in (1, 2) for c in (1, 2)}
    for (m, k, c), r in rows.items():
        assert r["greedy_match"] is True, (m, k, c)
        assert r["output_throughput"] > 0 and r["speedup"] > 0 and r["total_output_tokens"] > 0
        assert r["speedup_by_round"] == [pytest.approx(r["speedup"])]  # one round: the pooled ratio
        assert len(r["acceptance_by_position"]) == len(r["num_accepted_tokens_per_pos"]) == k
        assert r["num_draft_tokens"] <= k * r["num_drafts"]  # k caps every draft
        assert r["acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / max(r["num_drafts"], 1))
        if r["num_drafts"]:
            assert r["acceptance_by_position"][0] >= (r["acceptance_by_position"][-1] or 0)
    assert rows[("draft_model", 2, 1)]["num_drafts"] > 0  # a draft model always drafts
    # memory: as `rayspec plan` sizes it (n-gram holds nothing), and the measured RSS delta per method
    assert rows[("ngram", 1, 1)]["proposer_weights_bytes"] == 0 and rows[("ngram", 1, 1)]["proposer_kv_bytes"] == 0
    dm = rows[("draft_model", 2, 1)]
    assert dm["proposer_weights_bytes"] > 0 and dm["proposer_kv_bytes"] > 0 and dm["target_kv_bytes"] > 0
    assert set(result["memory"]) == {"ngram", "draft_model"} and "rss_delta_bytes" in result["memory"]["ngram"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_bench_sweep_sampled_and_refusals(tiny_model_dir, tmp_path, capsys):
    """At temperature > 0 greedy_match is null and seeded_match true (seeded requests draw coupled:
    the speculative run emits the baseline's tokens); a bad method or list is refused before any model loads."""
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "t1.json"
    assert main(["bench", "sweep", "--model", str(tiny_model_dir), "--methods", "ngram",
                 "--num-speculative-tokens", "2", "--prompts", str(prompts), "--num-prompts", "1",
                 "--max-tokens", "8", "--temperature", "1.0", "--rounds", "3", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["results"]
    assert row["greedy_match"] is None and row["seeded_match"] is True and row["total_output_tokens"] > 0
    # three rounds: three ratios, the one prompt run three times by each system (8 tokens at most each)
    assert result["config"]["rounds"] == 3 and len(row["speedup_by_round"]) == 3
    assert all(r > 0 for r in row["speedup_by_round"]) and 3 <= row["total_output_tokens"] <= 24
    assert result["baseline"][0]["total_output_tokens"] >= 3
    assert main(["bench", "sweep", "--model", str(tiny_model_dir), "--methods", "medusa",
                 "--prompts", str(prompts)]) == 2
    assert main(["bench", "sweep", "--model", str(tiny_model_dir), "--methods", "eagle3",
                 "--prompts", str(prompts)]) == 2  # no head for a model of our own
    assert main(["bench", "sweep", "--model", str(tiny_model_dir), "--num-speculative-tokens", "1,x",
                 "--prompts", str(prompts)]) == 2
    assert main(["bench", "sweep", "--model", str(tiny_model_dir), "--rounds", "0", "--prompts", str(prompts)]) == 2
    assert "medusa" in capsys.readouterr().err
