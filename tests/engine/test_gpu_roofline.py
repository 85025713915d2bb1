"""The prepared GPU scripts run unchanged on CPU (their --dry-run, tiny shapes): benchmarks/gpu_never_loses.py,
and those of the roofline issue:
benchmarks/gpu_roofline.py (bandwidth, our decode eager and compiled, tree and chain verification,
an EAGLE-3 head step, transformers' static-cache compiled decode, the compiled step with paged attention
against the gather, FlexAttention over the paged pool against gather + SDPA; JSON, table, plot) and
benchmarks/compiled_pool.py (the compiled step's time against the pool's size), and benchmarks/fp4_gpu.py (issue #52: 4-bit linears and a 4-bit model's decode), and benchmarks/gpu_engine.py
(issue #50: LLMEngine end to end, target alone and EAGLE-3 with an oracle head, against the forward-only step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--dry-run", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_gpu_roofline_dry_run(tmp_path):
    out = tmp_path / "roofline.json"
    proc = _run("gpu_roofline.py", "--json", str(out))
    results = json.loads(out.read_text())
    assert not results.get("errors"), results.get("errors")
    assert results["bandwidth"][0]["copy_gb_s"] > 0
    decode = {(r["batch"], r["compiled"]) for r in results["decode"]}
    assert decode == {(1, False), (2, False), (1, True), (2, True)}
    assert {r["what"] for r in results["verify"]} == {"8-node tree", "8-token chain"}
    # the peer's figure is a difference of two timed runs: in a dry run's 4 tokens it may be noise
    # (then no tok/s and a note), but it is measured
    peer = results["peer"][0]
    assert results["head"] and isinstance(peer["ms_per_token"], float) and (peer["tok_s"] is None) == (peer["ms_per_token"] <= 0)
    paged = {(r["what"], r["batch"]): r for r in results["paged"]}  # the step with paged attention == gather
    assert set(paged) == {("decode", 2), ("8-node tree", 1)}
    assert all(r["max_abs_diff_hidden"] < 1e-4 and r["paged_ms"] > 0 for r in paged.values()), paged
    (attention,) = results["attention"]  # batch 2: FlexAttention over the paged pool == gather + SDPA
    assert attention["max_abs_diff"] < 1e-4 and attention["flex_paged_ms_per_layer"] > 0
    top_p = {r["batch"]: r for r in results["top_p"]}  # the row sorted vs the bisection: the same tokens kept
    assert set(top_p) == {1, 2} and all(r["rows_differing"] == 0 and r["bisection_ms"] > 0 for r in top_p.values())
    summary = results["summary"]
    for key in ("weights_read_ms", "decode_b1_compiled_vs_roofline", "tree_vs_decode", "chain_vs_decode",
                "ours_vs_transformers_b1", "eagle3_implied_tok_s"):
        assert summary[key] > 0, key
    assert "decode b=1 compiled" in proc.stdout  # the table
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


def test_compiled_pool_dry_run(tmp_path):
    out = tmp_path / "pool.json"
    _run("compiled_pool.py", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["compiled"]) for r in rows} == {False, True} and len({r["pool_mb"] for r in rows}) == 2
    assert all(r["ms_per_step_median"] > 0 for r in rows)


def test_gpu_never_loses_dry_run(tmp_path):
    """benchmarks/gpu_never_loses.py (cost-aware drafting on a GPU, issue 34) on CPU: every proposer at
    concurrency 1 and 2, greedy and seeded temperature 1, adaptive and fixed beside the target alone,
    outputs equal to the target's (greedy: the same tokens; seeded: coupled draws), the fits recorded."""
    out = tmp_path / "never_loses.json"
    proc = _run("gpu_never_loses.py", "--json", str(out), "--targets", "plain")
    results = json.loads(out.read_text())
    cells = results["cells"]
    assert not [c for c in cells if "error" in c or "skipped" in c], cells
    assert {(c["temperature"], c["concurrency"], c["proposer"]) for c in cells} == {
        (t, c, p) for t in (0.0, 1.0) for c in (1, 2) for p in ("ngram", "draft_model", "draft_model_other", "eagle3")}
    for c in cells:
        n = 1 if c["concurrency"] == 1 else 2
        assert c["adaptive_equal"] == c["fixed_equal"] == f"{n}/{n}", c
        assert c["base_tok_s"] > 0 and c["adaptive_speedup"] > 0 and c["fixed_drafted"] > 0, c
    fits = {r["engine"]: r["fitted"] for r in results["costs"]}
    assert set(fits) == {"base", "ngram adaptive", "draft_model adaptive", "draft_model_other adaptive", "eagle3 adaptive"}
    assert fits["draft_model adaptive"]["verify"][0] > 0  # ms per step
    assert "| plain | 0 | 1 | ngram |" in proc.stdout  # the table


def test_fp4_gpu_dry_run(tmp_path):
    """benchmarks/fp4_gpu.py (issue #52's GPU script) runs on CPU with tiny shapes: the 4-bit linear (here the
    exact torch path) timed and checked against F.linear on its dequantized weight at every shape and row
    count, a whole 4-bit model's decode steps, and fp4_gpu_check.py's folded checks."""
    out = tmp_path / "fp4.json"
    _run("fp4_gpu.py", "--json", str(out))
    results = json.loads(out.read_text())
    assert results["dry_run"] and results["copy_gb_s"] > 0
    linear = results["linear"]
    assert {(r["projection"], r["rows"]) for r in linear} == {(p, n) for p in ("q", "down", "expert") for n in (1, 4, 64)}
    assert all(r["ms_4bit"] > 0 and r["ms_bf16"] > 0 and r["read_ms_4bit"] > 0 for r in linear)
    assert all(r["max_rel_err"] < 1e-5 for r in linear), [r["max_rel_err"] for r in linear]
    decode = results["decode"]
    assert [s["batch"] for s in decode["steps"]] == [1, 8] and all(s.get("ms_per_step", 0) > 0 for s in decode["steps"])
    assert decode["held_bytes"] > 0 and decode["read_ms"] > 0
    assert results["nvfp4_load"]["bit_mismatches"] == 0 and results["nvfp4_load"]["quantized_weights_checked"] > 0
    assert results["mxfp4_expert_layer"]["tokens_1"]["same_output"]


def test_gpu_engine_dry_run(tmp_path):
    """benchmarks/gpu_engine.py on CPU: the target alone eager and compiled (with overlap scheduling, and the
    compiled one again without), the forward-only step on the
    compiled engine's runner, EAGLE-3 with the oracle head swept over acceptance lengths (compiled) and at
    one (eager, and compiled at temperature 1: one read a cycle); every run's outputs equal the target's, acceptance grows with the oracle's p, and each
    row splits its cycle into draft, verify and host with the host reads counted."""
    out = tmp_path / "engine.json"
    proc = _run("gpu_engine.py", "--json", str(out))
    results = json.loads(out.read_text())
    assert not results.get("errors"), results.get("errors")
    assert all(p.get("seconds", -1) >= 0 and "skipped" not in p for p in results["phases"]), results["phases"]
    runs = results["runs"]
    cells = {(r["config"], r.get("acceptance_target"), r["batch"]) for r in runs}
    assert cells == ({("target eager", None, b) for b in (1, 2)} | {("target compiled", None, b) for b in (1, 2)}
                     | {("target compiled no-overlap", None, b) for b in (1, 2)}
                     | {("eagle3 oracle compiled", x, b) for x in (2.0, 3.5, 5.4, 6.5) for b in (1, 2)}
                     | {("eagle3 oracle compiled t1", 5.4, b) for b in (1, 2)}
                     | {("eagle3 oracle eager", 5.4, b) for b in (1, 2)}), cells
    for r in runs:
        n = f"{r['batch']}/{r['batch']}"
        assert r.get("outputs_equal_vs_eager", n) == n and r.get("outputs_equal_vs_compiled", n) == n, r
        if r.get("temperature") is None:  # greedy: the decisive target's known continuation (make_decisive)
            assert r["outputs_equal_vs_successor"] == n, r
        # (with overlap scheduling, on in the dry run as on CUDA, a step that queues the first of a run reads
        # nothing: the target's runs average just under one read a step)
        assert r["tok_s"] > 0 and r["ms_per_cycle"] > 0 and r["verify_ms"] > 0 and r["host_reads_max"] >= 1, r
        assert "gpu_idle_share" in r  # None on CPU (no device events), measured on CUDA
        if r["config"].startswith("eagle3"):
            assert r["draft_ms"] > 0 and 0 < r["p_per_node"] <= 1, r  # (5.4 and 6.5 are past a dry run's depth 4: p 1)
    # temperature 1 unseeded, deferred drafts (as on CUDA): the verdicts come in the cycle's one read
    assert all(r["host_reads_max"] == 1 for r in runs if r["config"] == "eagle3 oracle compiled t1"), runs
    oracle = sorted((r["acceptance_target"], r["acceptance_length"]) for r in runs
                    if r["config"] == "eagle3 oracle compiled" and r["batch"] == 1)
    assert oracle[0][1] < oracle[1][1] < oracle[-1][1], oracle  # the oracle's p sets the acceptance
    assert {r["batch"] for r in results["forward_only"]} == {1, 2}
    assert results["summary"]["target_b1_ms_over_forward_only"] > 0
    assert "eagle3 oracle compiled" in proc.stdout  # the table
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


def test_gpu_engine_decisive_target_survives_rounding():
    """gpu_engine.py's oracle proposes the target's recorded greedy continuation; with random bfloat16 weights
    the top two logits are often closer than rounding (the H200's runs: the continuation changed with the
    computation's shape and nothing was accepted). make_decisive makes token x followed by perm[x] by a wide
    margin: every position's argmax is perm[x] with the top two logits many standard deviations apart,
    where the plain random model's closest pair is within a small fraction of one."""
    import torch

    sys.path[:0] = [str(REPO / "benchmarks")]
    try:
        import gpu_engine
        from gpu_roofline import SHAPES, build_ours, make_runner
    finally:
        del sys.path[:1]
    SHAPES["decisive-test"] = (8192, 256, 768, 4, 4, 2, 64, 10000.0)
    try:
        ids = torch.randint(3, 8192, (96,), generator=torch.Generator().manual_seed(1)).tolist()
        margins = {}
        for decisive in (False, True):
            perm = {}
            model = build_ours("decisive-test", torch.device("cpu"), torch.bfloat16,
                               prepare=(lambda m: perm.setdefault("p", gpu_engine.make_decisive(m))) if decisive else None)
            runner = make_runner(model, max_model_len=128, num_slots=1, slack=0, compile=False)
            runner.kv.allocate("s")
            with torch.inference_mode():
                hidden, _ = runner.forward_hidden(["s"], [ids])
                logits = model.logits(hidden).float().reshape(len(ids), -1)
            top = logits.topk(2, -1)
            margins[decisive] = float(((top.values[:, 0] - top.values[:, 1]) / logits.std(-1)).min())
            if decisive:
                assert top.indices[:, 0].tolist() == perm["p"][torch.tensor(ids)].tolist()
        assert margins[True] > 5.0 and margins[False] < 0.5, margins
    finally:
        del SHAPES["decisive-test"]


def test_gpu_engine_oracle_alone(tmp_path):
    """The oracle's phases in a call of their own (a GPU lease runs the target's and the oracle's phases as two
    calls): no target run before it, the decisive target's known continuation is what it drafts and what its
    greedy outputs equal, and its p still sets the acceptance."""
    out = tmp_path / "oracle.json"
    _run("gpu_engine.py", "--sections", "oracle", "--acceptance-lengths", "1.5,3.0", "--json", str(out))
    results = json.loads(out.read_text())
    assert not results.get("errors"), results.get("errors")
    assert not any(p["phase"].startswith("target") and p.get("seconds", 0) > 1 for p in results["phases"]), results["phases"]
    runs = results["runs"]
    assert {r["config"] for r in runs} == {"eagle3 oracle compiled"}, runs
    assert all(r["outputs_equal_vs_successor"] == f"{r['batch']}/{r['batch']}" for r in runs), runs
    for b in (1, 2):
        low, high = (next(r["acceptance_length"] for r in runs if r["batch"] == b and r["acceptance_target"] == t)
                     for t in (1.5, 3.0))
        assert 1.2 < low < high, (low, high)
