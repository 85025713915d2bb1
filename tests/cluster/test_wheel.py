"""The built wheel: installed alone (with torch) in a fresh venv, it serves the shipped default config
from a directory outside the checkout; and how shipped configs and heads are found (rayspec.assets).

The wheel test builds from the checkout's tracked and untracked-but-not-ignored files, installs
torch and the wheel's serve extra at constraints.txt's versions, and takes the default model from
the rayspec cache this run uses ($RAYSPEC_CACHE, inherited), so nothing is fetched again.
The install uses uv where scripts/setup installed it (pip otherwise). Measured on the 2-core machine
here in a CI run with pip: 79 s in all.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import venv
from pathlib import Path

import httpx
import pytest

from rayspec.assets import assets_root, config_path, configs_dir
from conftest import smollm2_dir
from serve_utils import free_port

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"


# ---- finding shipped configs and heads ----------------------------------------------------------

def test_assets_in_a_checkout_are_the_checkouts():
    assert assets_root() == REPO and configs_dir() == REPO / "configs"
    assert (assets_root() / "heads" / "smollm2-135m-eagle3" / "config.json").is_file()


def test_config_path_by_name_path_or_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # elsewhere: no configs/ here
    default = REPO / "configs" / "default.yaml"
    assert config_path("default") == config_path("default.yaml") == config_path("configs/default.yaml") == default
    own = tmp_path / "configs" / "default.yaml"  # a file of that path from the working directory wins
    own.parent.mkdir()
    own.write_text("applications: []\n")
    assert config_path("configs/default.yaml").resolve() == own
    with pytest.raises(FileNotFoundError, match="default"):  # the error lists the shipped ones
        config_path("no-such-config")


def test_relative_head_path_resolves_from_anywhere(tmp_path, monkeypatch):
    from deployments.config import resolve_local_path

    monkeypatch.chdir(tmp_path)
    assert resolve_local_path("heads/smollm2-135m-eagle3") == str(REPO / "heads" / "smollm2-135m-eagle3")


def test_constraints_pin_torch_and_leave_out_rayspec():
    pins = [line for line in CONSTRAINTS.read_text().splitlines() if line and not line.startswith("#")]
    assert "torch==2.13.0" in pins and all("==" in pin for pin in pins)
    assert not any(pin.split("==")[0].lower().startswith("rayspec") for pin in pins)


# ---- the wheel in a fresh venv ------------------------------------------------------------------

def _run(cmd: list, timeout: float, **kwargs) -> str:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _source_copy(dest: Path) -> Path:
    """The files a fresh clone of this working tree would hold (git's view), not build/ or .venv/."""
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60, cwd=REPO)
    for name in filter(None, files.split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _installer(python: Path) -> list:
    """The install command for the fresh venv: uv's where scripts/setup installed it beside this run's
    Python (it links from the cache the setup filled: ~10 s against pip's ~50 s of the CI run), pip's
    otherwise (--no-compile: byte-compiling torch and ray up front doubled pip's CPU time; what runs is
    compiled on import). Either is given the local wheel directories pip is configured with."""
    links = []
    found = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                           capture_output=True, text=True).stdout.split()
    for where in os.environ.get("PIP_FIND_LINKS", "").split() + found:
        if Path(where).is_dir():
            links += ["--find-links", where]
    if subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True).returncode == 0:
        return [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", python, *links]
    return [python, "-m", "pip", "install", "--quiet", "--no-compile", *links]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_in_fresh_venv_serves_default_config(tmp_path, own_cluster):
    smollm2_dir()  # the default model in this run's cache (strict runs fail without it)
    timings: dict[str, float] = {}
    start = time.monotonic()
    source = _source_copy(tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", tmp_path / "dist", source], 300)
    (wheel,) = (tmp_path / "dist").glob("rayspec_serve-*.whl")
    timings["build"] = time.monotonic() - start
    import zipfile
    names = set(zipfile.ZipFile(wheel).namelist())  # the package data a user of the wheel reads
    for name in ("rayspec/data/prompts/mt_bench.jsonl", "rayspec/data/NOTICE.md", "rayspec/data/prompt_pools/chat.json",
                 "deployments/grafana/rayspec_dashboard.json", "deployments/kuberay/rayservice.yaml",
                 "rayspec_cli/main.py", "rayspec_cli/__main__.py"):  # the command's package, above the other two
        assert name in names, name

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    venv.create(tmp_path / "venv", with_pip=True)
    bin_dir = tmp_path / "venv" / "bin"
    _run([*_installer(bin_dir / "python"), "-c", CONSTRAINTS, "torch==2.13.0", f"{wheel}[serve]"], 600, env=env)
    timings["install"] = time.monotonic() - start - timings["build"]

    elsewhere = tmp_path / "elsewhere"  # no configs/ nor heads/ here, and the checkout is not on the path
    elsewhere.mkdir()
    where = "import deployments, rayspec, rayspec_cli; print(rayspec.__file__, deployments.__file__, rayspec_cli.__file__)"
    located = _run([bin_dir / "python", "-c", where], 120, cwd=elsewhere, env=env)
    assert str(REPO) not in located and located.count(str(tmp_path / "venv")) == 3, located
    shipped = Path(_run([bin_dir / "rayspec", "configs-dir"], 120, cwd=elsewhere, env=env).strip())
    assert shipped.is_relative_to(tmp_path / "venv") and (shipped / "default.yaml").is_file()
    assert (shipped.parent / "heads" / "smollm2-135m-eagle3" / "model.safetensors").is_file()

    port = free_port()
    proc = subprocess.Popen([bin_dir / "rayspec", "serve", "--config", "default", "--host", "127.0.0.1",
                             "--port", str(port), "--num-cpus", "2"], cwd=elsewhere, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300  # Ray, the app, the model's load and CPU-kernel choice
        while not any("rayspec serve: " in line for line in lines):  # serve.run returned: app running
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-5000:]
            time.sleep(0.5)
        timings["serve up"] = time.monotonic() - start - timings["build"] - timings["install"]
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
                "model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "Write a haiku about GPUs."}]})
        except httpx.HTTPError as err:  # what `rayspec serve` said, with the error
            pytest.fail(f"{err!r}\n{''.join(lines)[-5000:]}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    print(" ".join(f"{k} {v:.0f}s" for k, v in timings.items()), f"total {time.monotonic() - start:.0f}s")
    assert proc.returncode == 0, "".join(lines)[-5000:]
