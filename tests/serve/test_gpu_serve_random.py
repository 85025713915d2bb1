"""benchmarks/gpu_serve_random.sh --dry-run (issue #50 item 4's served run, tiny shapes on CPU): a random model
written with no download (gpu_serve.py random-model: weights, a word-level tokenizer covering every id, a chat
template), served as the target alone by a Ray of its own, streamed through /v1/chat/completions at
concurrency 1 and 2 by `rayspec bench serve`; every request completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serve_utils import free_port

REPO = Path(__file__).resolve().parents[2]


def test_gpu_serve_random_dry_run(tmp_path):
    env = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "out"), "PORT": str(free_port()),
           "MODEL_DIR": str(tmp_path / "model"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_serve_random.sh"), "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    served = json.loads((tmp_path / "out" / "served.json").read_text())
    rows = {r["max_concurrency"]: r for r in served["results"]}
    assert set(rows) == {1, 2} and all(r["completed"] == 4 and r["failed"] == 0 for r in rows.values()), rows
    assert all(r["output_throughput"] > 0 for r in rows.values())
