"""benchmarks/gpu.sh, the GPU serving benchmark: its CPU dry run end to end (SmolLM2-135M, both
servers, every prompt set), its refusal without a GPU, and the summary's merge of a peer's runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import smollm2_dir, strict
from serve_utils import free_port

REPO = Path(__file__).resolve().parents[2]
GPU_SH = REPO / "benchmarks" / "gpu.sh"
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_summary  # noqa: E402

# one of the three (the others differ only in their prompt files; the summary's merge of several sets:
# test_summary_merges_a_peer_per_level): ~15 s less in CI than two, ~30 s less than three
SETS = ("mt_bench",)
OURS = ("rayspec-eagle3", "rayspec-baseline")
# `rayspec bench serve`'s per-level fields under vLLM's names (tests/serve/test_bench_serve.py checks them all)
FIELDS = ("completed", "failed", "output_throughput", "request_throughput", "duration", "mean_ttft_ms",
          "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "server_stats")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DRY_RUN_TIMEOUT_S = 840  # 3 min on a 2-core machine at load 7-9, 7.5 min at load 16-20; under pytest-timeout's 900


def prompts_available() -> bool:
    return any((REPO / d / "mt_bench.jsonl").exists() for d in ("data/prompts", "rayspec/data/prompts",
                                                                 "../shared/data/prompts"))


def run_script(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """gpu.sh in its own process group; on timeout it gets SIGTERM (its trap stops its servers)."""
    env = {"PYTHON": sys.executable, **(os.environ if env is None else env)}  # this run's Python, venv or not
    proc = subprocess.Popen(["bash", str(GPU_SH), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"gpu.sh ran past {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path, own_cluster):  # gpu.sh starts a Ray cluster of its own (tier cluster)
    smollm2_dir()  # the model, or a skip (a failure in strict mode)
    if not prompts_available():
        if strict():
            pytest.fail("no MT-bench/HumanEval/GSM8K prompt files (data/prompts or ../shared/data/prompts)")
        pytest.skip("no prompt files")
    out, port = tmp_path / "results", free_port()
    # --vllm skip: a vLLM importable here would make the dry run depend on vLLM's CPU build.
    # --layout together: both apps in one server, benched level by level (what 2+ GPUs get; one
    # server start instead of two, ~20 s less here); the one-GPU default, one app after the other,
    # differs only in calling the same serve-and-bench function twice
    proc = run_script(["--dry-run", "--results-dir", str(out), "--port", str(port), "--vllm", "skip",
                       "--layout", "together", "--sets", ",".join(SETS)], DRY_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert port_is_free(port), "a server started by gpu.sh still holds its port"

    for set_name in SETS:
        result = json.loads((out / f"{set_name}.json").read_text())
        assert sorted(result["config"]["labels"]) == sorted(OURS)
        assert result["config"]["concurrency"] == [1, 2]
        rows = {(r["label"], r["concurrency"]): r for r in result["results"]}
        assert set(rows) == {(label, c) for label in OURS for c in (1, 2)}
        for (label, c), row in rows.items():
            assert all(f in row for f in FIELDS), [f for f in FIELDS if f not in row]
            assert row["completed"] == 2 and row["failed"] == 0, row["errors"]
            assert row["output_throughput"] > 0 and row["mean_ttft_ms"] > 0
        for c in (1, 2):
            stats = rows["rayspec-eagle3", c]["server_stats"]
            assert stats["num_drafts"] > 0 and stats["acceptance_rate"] is not None
            assert rows["rayspec-baseline", c]["server_stats"]["num_drafts"] == 0
        assert (out / f"{set_name}.png").read_bytes()[:8] == PNG_MAGIC
        # the server phase's own run and plot (both apps in it)
        assert (out / "runs" / f"{set_name}_rayspec.png").read_bytes()[:8] == PNG_MAGIC
        assert sorted(json.loads((out / "runs" / f"{set_name}_rayspec.json").read_text())["config"]["labels"]) \
            == sorted(OURS)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["missing"] == []
    assert len(summary["rows"]) == len(SETS) * 2 * len(OURS)
    for row in summary["rows"]:
        assert row["speedup_vs_baseline"] > 0
        if row["system"] == "rayspec-baseline":
            assert row["speedup_vs_baseline"] == pytest.approx(1.0)
    assert "speedup vs rayspec-baseline" in (out / "summary.md").read_text()
    assert "| mt_bench | 1 | rayspec-eagle3 |" in proc.stdout  # the table printed at the end
    run = json.loads((out / "run.json").read_text())
    assert run["dry_run"] is True and run["layout"] == "together" and run["vllm"] == "skipped"


def test_refuses_without_a_gpu(tmp_path):
    """Not a dry run: a machine whose nvidia-smi finds no GPU gets a clear error before anything starts."""
    if not prompts_available():
        pytest.skip("no prompt files") if not strict() else pytest.fail("no prompt files")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = run_script(["--results-dir", str(tmp_path / "r"), "--port", str(free_port())], 60, env)
    assert proc.returncode == 2
    assert "nvidia-smi finds no GPU" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_bad_prompts_dir(tmp_path):
    proc = run_script(["--dry-run", "--prompts-dir", str(tmp_path)], 60)
    assert proc.returncode == 2 and f"no prompt set {tmp_path}/mt_bench.jsonl" in proc.stderr


def _row(label: str, c: int, tok_s: float, server_stats=None) -> dict:
    return {"label": label, "endpoint": f"http://127.0.0.1:1/{label}", "model_id": "m", "concurrency": c,
            "completed": 4, "failed": 0, "errors": [], "output_throughput": tok_s, "mean_ttft_ms": 10.0,
            "mean_tpot_ms": 5.0, "usage_acceptance": None, "server_stats": server_stats}


def _run(labels: list[str], conc: list[int], rows: list[dict]) -> dict:
    return {"config": {"labels": labels, "concurrency": conc, "model": "m", "num_prompts": 4, "max_tokens": 8,
                       "temperature": 0.0, "request_rate": "inf", "endpoints": []}, "results": rows}


def _prom(drafts: int, drafted: int, accepted: int) -> str:
    # two engines' label sets: summed
    return ("# HELP vllm:spec_decode_num_drafts_total drafts\n# TYPE vllm:spec_decode_num_drafts_total counter\n"
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts - 1}\n'
            f'vllm:spec_decode_num_drafts_total{{engine="1",model_name="m"}} 1.0\n'
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {drafted}.0\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}.0\n'
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} 99.0\n')


def test_summary_merges_a_peer_per_level(tmp_path):
    """Our servers' runs hold every level; a peer's come one per level with its /metrics read around
    each: merged per set, the peer's acceptance from the counter deltas, speedups over our baseline."""
    runs = tmp_path / "runs"
    runs.mkdir()
    ours = {"num_drafts": 10, "num_draft_tokens": 80, "num_accepted_tokens": 20, "acceptance_rate": 0.25,
            "mean_acceptance_length": 3.0, "method": "eagle3"}
    # two prompt sets (the GPU run's three differ only in their files; the dry run end to end serves one),
    # the second's our servers' numbers halved: each set is merged from its own files
    for set_name, scale in (("gsm8k", 1.0), ("mt_bench", 0.5)):
        (runs / f"{set_name}_rayspec-eagle3.json").write_text(json.dumps(_run(
            ["rayspec-eagle3"], [1, 4], [_row("rayspec-eagle3", 1, 30.0 * scale, ours),
                                         _row("rayspec-eagle3", 4, 80.0 * scale, ours)])))
        (runs / f"{set_name}_rayspec-baseline.json").write_text(json.dumps(_run(
            ["rayspec-baseline"], [1, 4], [_row("rayspec-baseline", 1, 20.0), _row("rayspec-baseline", 4, 100.0)])))
        for c, tok_s in ((1, 40.0), (4, 90.0)):
            stem = f"{set_name}_vllm-eagle3_c{c}"
            (runs / f"{stem}.json").write_text(json.dumps(_run(["vllm-eagle3"], [c], [_row("vllm-eagle3", c, tok_s)])))
            (runs / f"{stem}_before.prom").write_text(_prom(5, 15, 6))
            (runs / f"{stem}_after.prom").write_text(_prom(5 + 4 * c, 15 + 12 * c, 6 + 6 * c))

    code = gpu_summary.main([str(tmp_path), "--sets", "gsm8k,mt_bench", "--expect",
                             "rayspec-eagle3,rayspec-baseline,vllm-eagle3", "--concurrency", "1,4"])
    assert code == 0
    for set_name in ("gsm8k", "mt_bench"):
        merged = json.loads((tmp_path / f"{set_name}.json").read_text())
        assert merged["config"]["concurrency"] == [1, 4] and merged["config"]["prompt_set"] == set_name
        assert sorted(merged["config"]["labels"]) == ["rayspec-baseline", "rayspec-eagle3", "vllm-eagle3"]
        assert (tmp_path / f"{set_name}.png").read_bytes()[:8] == PNG_MAGIC
    every = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert len(every) == 2 * 3 * 2  # sets x systems x levels
    (halved,) = [r for r in every if (r["set"], r["system"], r["concurrency"]) == ("mt_bench", "rayspec-eagle3", 1)]
    assert halved["speedup_vs_baseline"] == pytest.approx(0.75)
    rows = {(r["system"], r["concurrency"]): r for r in every if r["set"] == "gsm8k"}
    assert rows["rayspec-eagle3", 1]["speedup_vs_baseline"] == pytest.approx(1.5)
    assert rows["vllm-eagle3", 4]["speedup_vs_baseline"] == pytest.approx(0.9)
    for c in (1, 4):
        peer = rows["vllm-eagle3", c]
        assert peer["acceptance_rate"] == pytest.approx(0.5)  # 6c accepted of 12c drafted
        assert peer["mean_acceptance_length"] == pytest.approx(1 + 6 * c / (4 * c))
    assert rows["rayspec-baseline", 4]["acceptance_rate"] is None

    # a level with nothing completed counts as missing, and fails the summary
    (runs / "gsm8k_vllm-eagle3_c4.json").write_text(json.dumps(_run(["vllm-eagle3"], [4], [
        {**_row("vllm-eagle3", 4, 0.0), "completed": 0, "failed": 4}])))
    assert gpu_summary.main([str(tmp_path), "--sets", "gsm8k", "--expect", "vllm-eagle3", "--concurrency", "1,4"]) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["missing"] == ["gsm8k vllm-eagle3 c=4"]

