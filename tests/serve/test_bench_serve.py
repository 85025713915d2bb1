"""`rayspec bench serve` against a real Serve app on the tiny random model."""

from __future__ import annotations

import json

import pytest

import matplotlib  # noqa: F401 - a hard dependency: missing means an error, not a skip

from ray_utils import serving
from serve_utils import free_port, tiny_args  # noqa: E402

from deployments.app import build_app  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402
from rayspec_cli.main import main  # noqa: E402

VLLM_FIELDS = ["completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "duration", "max_concurrency", "request_rate",
               "burstiness"] + [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                                for stat in ("mean", "median", "std", "p99")]

# prompts whose greedy chat answers (tiny random model) repeat within 32 tokens: n-gram drafts get accepted
PROMPTS = ["Say hello hello hello", "la la la"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve_url):
    # adaptive off: a greedy request drafts what the in-process engine drafts (see `reference`)
    with serving(("rayspec", build_app(tiny_args(tiny_model_dir, speculative={"adaptive": False})), "/")):
        yield serve_url


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """prompt -> what the served engine's counters move by for its greedy chat request (an
    in-process engine with the app's speculative settings): output tokens, drafting steps,
    drafted and accepted tokens."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4,
                                    kv_cache_memory_gb=0.25,
                                    speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                  adaptive=False)))

    def counts(prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
        drafts = engine.stats.num_drafts
        out = engine.generate([engine.encode_chat([{"role": "user", "content": prompt}])],
                              SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        return {"output_tokens": out.num_output_tokens, "num_drafts": engine.stats.num_drafts - drafts,
                "num_draft_tokens": out.num_draft_tokens, "num_accepted_tokens": out.num_accepted_tokens}
    return counts


def _summed(counts: list[dict]) -> dict:
    return {k: sum(c[k] for c in counts) for k in counts[0]}


def _check_acceptance(r: dict, want: dict) -> None:
    """A level's usage-reported and /v1/stats-reported counts: exactly its requests' drafts."""
    assert want["num_accepted_tokens"] > 0  # speculation paid on these prompts: the counts are not all 0
    assert r["total_output_tokens"] == want["output_tokens"]
    ua = r["usage_acceptance"]
    assert ua["accepted_tokens"] == want["num_accepted_tokens"]
    assert ua["rejected_tokens"] == want["num_draft_tokens"] - want["num_accepted_tokens"]
    assert ua["acceptance_rate"] == pytest.approx(want["num_accepted_tokens"] / want["num_draft_tokens"])
    ss = r["server_stats"]
    assert ss["method"] == "ngram"
    assert {k: ss[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} == \
        {k: want[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert ss["acceptance_rate"] == pytest.approx(ua["acceptance_rate"])
    assert ss["mean_acceptance_length"] == pytest.approx(1 + want["num_accepted_tokens"] / want["num_drafts"])


def test_bench_serve_cli(server, reference, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAYSPEC_NO_PROGRESS", raising=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "turns": [t]}) for i, t in enumerate(PROMPTS)) + "\n")
    want = _summed([reference(p) for p in PROMPTS])
    out_json, out_png = tmp_path / "res.json", tmp_path / "plot.png"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every request is an error, not a crash
    rc = main(["bench", "serve", "--endpoint", server, "--endpoint", server + "/v1", "--endpoint", dead,
               "--label", "A", "--label", "B", "--label", "dead", "--model", "tiny", "--prompts", str(prompts),
               "--num-prompts", "2", "--max-tokens", str(MAX_TOKENS), "--concurrency", "1,2", "--warmup", "1",
               "--timeout", "60", "--output-json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    captured = capsys.readouterr()
    table = captured.out
    assert "tok/s" in table and "error [dead @ 1]" in table
    assert "12/12" in captured.err  # the progress bar: 3 endpoints x (2 + 2) requests, on stderr

    result = json.loads(out_json.read_text())
    env = result["environment"]  # the machine and versions the figures depend on
    assert env["cpu_model"] and env["python"] and env["torch"] and env["transformers"] and env["ray"]
    assert env["rayspec"] and "gpu_model" in env
    assert result["config"]["concurrency"] == [1, 2] and result["config"]["labels"] == ["A", "B", "dead"]
    # interleaved: A@1, B@1, dead@1, A@2, B@2, dead@2
    assert [(r["label"], r["concurrency"]) for r in result["results"]] == [
        ("A", 1), ("B", 1), ("dead", 1), ("A", 2), ("B", 2), ("dead", 2)]
    for r in result["results"]:
        assert r["num_requests"] == 2 and r["model_id"] == "tiny" and r["request_rate"] == "inf"
        if r["label"] == "dead":
            assert r["failed"] == 2 and r["completed"] == 0 and r["errors"]
            assert r["output_throughput"] == 0 and r["mean_ttft_ms"] is None and r["server_stats"] is None
            continue
        assert set(VLLM_FIELDS) <= set(r)  # vLLM's bench serve names, flat
        assert r["failed"] == 0 and r["completed"] == 2
        assert r["output_throughput"] > 0 and r["request_throughput"] > 0
        assert r["total_input_tokens"] > 0  # from usage.prompt_tokens
        assert r["total_token_throughput"] == pytest.approx(
            (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
        for name in ("ttft", "tpot", "itl", "e2el"):  # every answer has many tokens: all are timed
            assert 0 < r[f"median_{name}_ms"] <= r[f"p90_{name}_ms"] <= r[f"p99_{name}_ms"]
            assert r[f"mean_{name}_ms"] > 0 and r[f"std_{name}_ms"] >= 0
        assert r["p99_ttft_ms"] <= r["p99_e2el_ms"]
        _check_acceptance(r, want)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000


def test_bench_serve_rounds_sum_tokens_and_time(server, reference, tmp_path):
    """--rounds R repeats each level R times with endpoints taking turns; the level's numbers are
    over all rounds (tokens, time and server counters summed), and the per-round throughputs are kept."""
    from rayspec.bench.serve import run_serve_benchmark

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": [PROMPTS[1]]}) + "\n")  # its drafts are accepted
    want = _summed([reference(PROMPTS[1])] * 3)
    order = []
    result = run_serve_benchmark([server, server + "/v1"], ["A", "B"], model="tiny", prompts_file=str(prompts),
                                 max_tokens=MAX_TOKENS, concurrency=[1], warmup=0, rounds=3, log=order.append)
    assert [m.split("]")[0] for m in order] == ["[A", "[B", "[B", "[A", "[A", "[B"]  # turns, order rotating
    assert result["config"]["rounds"] == 3
    for r in result["results"]:
        assert r["num_rounds"] == 3 and r["num_requests"] == 3 and r["completed"] == 3
        assert len(r["round_output_throughput"]) == 3
        assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
        assert min(r["round_output_throughput"]) <= r["output_throughput"] <= max(r["round_output_throughput"])
        _check_acceptance(r, want)  # three rounds' counts


def test_bench_serve_waves_keep_a_level_at_its_concurrency(server, tmp_path):
    """--waves W sends at least W x concurrency requests per level (prompts repeated in order);
    mean_in_flight reports the concurrency the level really had."""
    from rayspec.bench.serve import level_prompts, run_serve_benchmark

    assert level_prompts(["a", "b", "c"], 1, 2) == ["a", "b", "c"]  # never fewer than the prompts
    assert level_prompts(["a", "b", "c"], 4, 2) == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert level_prompts(["a", "b"], 8, 0) == ["a", "b"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": ["Say hello twice."]}) + "\n")
    result = run_serve_benchmark([server], ["A"], model="tiny", prompts_file=str(prompts), max_tokens=6,
                                 concurrency=[1, 3], warmup=0, waves=2, log=lambda m: None)
    assert result["config"]["waves"] == 2
    one, three = result["results"]
    assert one["num_requests"] == 2 and three["num_requests"] == 6
    assert three["completed"] == 6
    assert 0 < one["mean_in_flight"] <= 1.0 + 1e-6
    assert 1.0 < three["mean_in_flight"] <= 3.0 + 1e-6  # three at a time for most of the level


def test_bench_serve_extra_body(server, tmp_path):
    """--extra-body reaches the server: a one-choice grammar ends every answer after its few tokens."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": ["Say hello twice."]}) + "\n")
    tokens = {}
    for name, extra in (("plain", []), ("choice", ["--extra-body", '{"guided_choice": ["yes"]}'])):
        out_json = tmp_path / f"{name}.json"
        assert main(["bench", "serve", "--endpoint", server, "--model", "tiny", "--prompts", str(prompts),
                     "--max-tokens", "9", "--concurrency", "1", "--warmup", "0", "--output-json", str(out_json),
                     "--ignore-eos", *extra]) == 0
        result = json.loads(out_json.read_text())
        tokens[name] = result["results"][0]["total_output_tokens"]
    assert result["config"]["extra_body"] == {"guided_choice": ["yes"]}
    assert tokens["plain"] == 9 and tokens["choice"] < 9


def test_bench_serve_model_per_endpoint(server, tmp_path):
    """--model once per --endpoint, in order: each endpoint is sent its own name (here the second
    one is unknown to the server, so only its requests fail); one --model applies to all."""
    from rayspec.bench.serve import endpoint_models

    assert endpoint_models(["a"], 3) == ["a", "a", "a"] and endpoint_models("a", 2) == ["a", "a"]
    assert endpoint_models(["a", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="2 --model for 3 --endpoint"):
        endpoint_models(["a", "b"], 3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 0, "turns": ["Say hello twice."]}) + "\n")
    out_json = tmp_path / "res.json"
    assert main(["bench", "serve", "--endpoint", server, "--endpoint", server + "/v1", "--label", "ours",
                 "--label", "peer", "--model", "tiny", "--model", "not-served", "--prompts", str(prompts),
                 "--max-tokens", "4", "--concurrency", "1", "--warmup", "0", "--output-json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["config"]["models"] == ["tiny", "not-served"]
    ours, peer = result["results"]
    assert (ours["model_id"], ours["completed"], ours["failed"]) == ("tiny", 1, 0)
    assert (peer["model_id"], peer["completed"], peer["failed"]) == ("not-served", 0, 1)
    assert "404" in peer["errors"][0]
    assert main(["bench", "serve", "--endpoint", server, "--endpoint", server, "--model", "a", "--model", "b",
                 "--model", "c", "--prompts", str(prompts)]) == 2


def test_arrival_times_poisson_and_burstiness():
    """vLLM's arrival process: the first request at 0, gaps gamma(shape=burstiness, mean=1/rate);
    burstiness 1 is Poisson (exponential gaps, CV 1), lower is burstier; inf sends all at once."""
    import numpy as np

    from rayspec.bench.serve import arrival_times

    assert arrival_times(4, float("inf")) == [0.0] * 4
    times = arrival_times(4000, 5.0, 1.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)
    bursty = np.diff(arrival_times(4000, 5.0, 0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.2, rel=0.1) and bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)
    assert arrival_times(5, 3.0, 1.0, seed=7) == arrival_times(5, 3.0, 1.0, seed=7)  # seeded


def test_bench_serve_request_rate(server, tmp_path):
    """--request-rate R: requests are sent at their arrival times (capped by the level's concurrency),
    the same times for every endpoint; a level lasts at least until its last arrival."""
    from rayspec.bench.serve import arrival_times, level_seed

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "turns": [t]}) for i, t in enumerate(PROMPTS)) + "\n")
    out_json = tmp_path / "res.json"
    assert main(["bench", "serve", "--endpoint", server, "--model", "tiny", "--prompts", str(prompts),
                 "--max-tokens", "4", "--concurrency", "2", "--warmup", "0", "--waves", "2",
                 "--request-rate", "4", "--burstiness", "0.5", "--seed", "3", "--output-json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert (result["config"]["request_rate"], result["config"]["burstiness"]) == (4.0, 0.5)
    (r,) = result["results"]
    assert (r["request_rate"], r["burstiness"], r["max_concurrency"]) == (4.0, 0.5, 2)
    assert r["num_requests"] == 4 and r["completed"] == 4
    last_arrival = arrival_times(4, 4.0, 0.5, level_seed(3, 0, 2))[-1]
    assert last_arrival > 0.1 and r["duration"] >= last_arrival
    assert main(["bench", "serve", "--endpoint", server, "--prompts", str(prompts), "--request-rate", "0"]) == 2
