"""benchmarks/RESULTS.md is what benchmarks/results/*.json give: `benchmarks/results_page.py --check`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "results_page.py"


def load_script():
    spec = importlib.util.spec_from_file_location("results_page", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_is_up_to_date():
    """Fails when a result JSON was added or changed without regenerating the page:
    run `python benchmarks/results_page.py` and commit benchmarks/RESULTS.md and its plots."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def roofline_json() -> dict:
    """The layout benchmarks/gpu_roofline.py writes (its sections, then "summary")."""
    return {
        "args": {"shape": "llama3.1-8b"},
        "environment": {"cpu_model": "Test CPU", "cpu_features": ["avx2"], "cpu_count": 16, "gpu_model": "Test GPU",
                        "gpu_count": 1, "torch": "2.11.0+cu130"},
        "bandwidth": [{"buffer_gib": 2.0, "copy_gb_s": 3000.0, "read_gb_s": 3100.0}],
        "decode": [{"shape": "llama3.1-8b", "batch": 1, "compiled": False, "context": 1024, "ms_per_step": 12.0,
                    "tok_s": 83.3, "weight_gb": 16.1},
                   {"shape": "llama3.1-8b", "batch": 1, "compiled": True, "context": 1024, "ms_per_step": 6.0,
                    "tok_s": 166.7, "weight_gb": 16.1}],
        "verify": [{"shape": "llama3.1-8b", "what": "8-node tree", "rows": 8, "compiled": True, "ms": 6.5,
                    "vs_decode": 1.083}],
        "head": [{"shape": "llama3.1-8b", "what": "1 layer + 32k vocabulary, compiled", "ms": 0.4}],
        "peer": [{"what": "transformers static cache, compiled", "batch": 1, "context": 1024, "ms_per_token": 7.0,
                  "tok_s": 142.9}],
        "summary": {"gpu": "Test GPU", "weights_read_ms": 5.2, "bandwidth_gb_s": 3100.0,
                    "decode_b1_compiled_vs_roofline": 1.154, "tree_vs_decode": 1.083, "wall_s": 100.0},
    }


def test_page_from_a_results_dir(tmp_path):
    """A results directory with a served run, an offline run and a GPU roofline: the page holds their
    figures, is stable, and --check notices an edit (the roofline section appears only with its JSON)."""
    module = load_script()
    results = tmp_path / "results"
    results.mkdir()
    for name in ["served_eagle3_async_vs_sync_c1_mt_bench.json", "served_eagle3_async_vs_sync_c1_stats.json",
                 "offline_eagle3_mt_bench.json"]:
        shutil.copy(ROOT / "benchmarks" / "results" / name, results / name)
    page = tmp_path / "RESULTS.md"
    without = module.Page(module.load_all(results), results).build()
    assert "No `gpu_roofline*.json` yet" in without
    (results / "gpu_roofline_test.json").write_text(json.dumps(roofline_json()))
    built = module.Page(module.load_all(results), results)
    text = built.build()
    assert text == module.Page(module.load_all(results), results).build()  # deterministic
    assert "Roofline: `gpu_roofline_test` (Test GPU)" in text and "decode b=1 compiled | 6.000 | 1.15" in text
    assert "acceptance_by_position.png" in built.plots and "gpu_roofline_test.png" in built.plots
    assert "| `served_eagle3_async_vs_sync_c1` | 1 | mt_bench |" in text
    page.write_text(text)
    argv = ["--results", str(results), "--page", str(page)]
    assert module.main(argv + ["--check"]) == 1  # plots missing
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib absent: plots not drawn")
    assert module.main(argv) == 0
    assert sorted(p.name for p in (results / "plots").glob("*.png")) == sorted(built.plots)
    assert module.main(argv + ["--check"]) == 0
    page.write_text(text.replace("Test GPU", "Other GPU"))
    assert module.main(argv + ["--check"]) == 1
