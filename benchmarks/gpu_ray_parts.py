"""Ray Serve's wheels for the GPU machine, in parts that each fit one call's transfer (issue #50 item 4).

The GPU machine has no network; each call carries the repository's working tree plus named ignored
folders, 64 MiB in all, and Ray 2.60's wheel alone is 76 MiB for CPython 3.12. So: download Ray[serve]
and what it needs that the GPU image lacks (`pip download` for the GPU's platform and Python, with this
repository's constraints.txt), cut the large wheels into chunks, and pack everything into parts of at
most --part-mib each (the tree's tracked files take ~23 MiB of the 64). Each part carries the same
`stage.sh`: it copies its files to /tmp/rayspec-wheels on the GPU machine and, once every file of the
plan is there, joins the chunks (sha256-checked) and installs all wheels into /tmp/site (pip --no-index
--no-deps --target). Nothing persists past the machine's loan, and a warm H200 goes back 30 s after a
call ends: the calls must follow each other at once, the last one installing and running in one
command. A part `base` (pydantic and its needs: what `import rayspec` needs beyond the GPU image) is
small and can travel with any call, gpu_engine.py's included.

    python benchmarks/gpu_ray_parts.py                      # -> .gpu-wheels/part1, part2, ..., base
    python benchmarks/gpu_ray_parts.py --python-version 3.12 --part-mib 36 --out .gpu-wheels

Then (the folder is ignored by git: the script adds it to .git/info/exclude), in the session whose
checkout the device tool sends, one call per part, back to back:

    run(carry=[".gpu-wheels/part1"], command="bash .gpu-wheels/part1/stage.sh")
    run(carry=[".gpu-wheels/part2", ".gpu-wheels/base"],
        command="bash .gpu-wheels/part2/stage.sh && export PYTHONPATH=/tmp/site:$PWD && python3 benchmarks/...")

stage.sh prints what is still missing when called before the last part. The plan (parts, files, sizes,
sha256) is written to <out>/plan.json; the commands for the calls are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the GPU image's platform tags (manylinux on x86-64; pip matches each tag exactly)
PLATFORMS = ["manylinux_2_%d_x86_64" % n for n in (17, 24, 27, 28, 31, 34, 35)] + \
            ["manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64", "manylinux_2_12_x86_64"]
# what `import rayspec` needs beyond the GPU image (/work/.library/device/KINDS.md lists no pydantic)
BASE = {"pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions"}
# installed on the GPU image (KINDS.md, "Python packages already there", read 2026-11-17): not carried
GPU_HAS = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama filelock frozenlist fsspec grpcio h11 httpcore httpx idna jinja2
markupsafe msgpack multidict numpy packaging pandas prometheus-client propcache protobuf psutil pyarrow pyyaml
requests six typing-inspect urllib3 uvloop yarl""".split())
STAGE = r"""#!/bin/bash
# Stage this part's chunk on the GPU machine; once every part's chunk is there, join them (sha256-checked),
# unpack the wheels and install them into /tmp/site.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
stage=/tmp/rayspec-wheels
mkdir -p "$stage"
cp "$here"/* "$stage"/
cp "$here"/../base/*.whl "$stage"/ 2>/dev/null || true  # the base wheels, where carried in the same call
python3 - "$stage" <<'EOF'
import hashlib, json, subprocess, sys, tarfile
from pathlib import Path
stage = Path(sys.argv[1])
plan = json.loads((stage / "plan.json").read_text())
missing = [c for c in plan["chunks"] if not (stage / c).exists()]
if missing:
    print(f"staged; still to come: {missing}")
    sys.exit(0)
joined = stage / "wheels.tar"
with joined.open("wb") as w:
    for c in plan["chunks"]:
        w.write((stage / c).read_bytes())
digest = hashlib.sha256(joined.read_bytes()).hexdigest()
if digest != plan["sha256"]:
    sys.exit(f"wheels.tar: sha256 {digest} != {plan['sha256']}")
with tarfile.open(joined) as tar:
    tar.extractall(stage / "wheels")
wheels = sorted(str(p) for p in (stage / "wheels").glob("*.whl")) + sorted(str(p) for p in stage.glob("*.whl"))
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels], check=True)
print(f"installed {len(wheels)} wheels into /tmp/site: export PYTHONPATH=/tmp/site")
EOF
"""


def project(wheel: str) -> str:
    """A wheel file's project name, normalized (PEP 503, underscores)."""
    return re.sub(r"[-_.]+", "_", wheel.split("-")[0]).lower()


def download(dest: Path, python_version: str, requirement: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python_version,
           "--implementation", "cp", "-c", str(REPO / "constraints.txt"), "-d", str(dest), requirement]
    for tag in PLATFORMS:
        cmd += ["--platform", tag]
    subprocess.run(cmd, check=True)


def pack(wheels: list[Path], dest: Path) -> Path:
    """The wheels in one uncompressed tar (they are zip files already): one stream to cut into parts."""
    import tarfile

    with tarfile.open(dest, "w") as tar:
        for w in wheels:
            tar.add(w, arcname=w.name)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (KINDS.md: 3.12.3)")
    parser.add_argument("--ray-requirement", default=None, help="default: ray[serve]==<constraints.txt's ray>")
    parser.add_argument("--out", default=".gpu-wheels")
    parser.add_argument("--part-mib", type=float, default=36.0,
                        help="bytes per part: 64 MiB less the tracked tree (~23 MiB) less a margin")
    parser.add_argument("--download-dir", default=None, help="wheels already downloaded (default: <out>/download)")
    a = parser.parse_args()
    out = (REPO / a.out).resolve()
    pinned = re.search(r"^ray==(\S+)", (REPO / "constraints.txt").read_text(), re.M)
    requirement = a.ray_requirement or f"ray[serve]=={pinned.group(1) if pinned else '2.60.0'}"
    downloads = Path(a.download_dir) if a.download_dir else out / "download"
    downloads.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    download(downloads, a.python_version, requirement)
    download(downloads, a.python_version, "pydantic")
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else REPO / exclude
    line = f"/{out.relative_to(REPO).as_posix()}/"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if line not in (exclude.read_text().splitlines() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write(line + "\n")
    wheels = list({project(w.name): w for w in sorted(downloads.glob("*.whl"))}.values())  # one per project
    have = {project(n) for n in GPU_HAS}
    carried = [w for w in wheels if project(w.name) not in have]
    base = [w for w in carried if project(w.name) in BASE]
    rest = [w for w in carried if project(w.name) not in BASE]
    for old in list(out.glob("part*")) + [out / "base"]:
        shutil.rmtree(old, ignore_errors=True)
    stream = pack(rest, out / "wheels.tar").read_bytes()
    (out / "wheels.tar").unlink()
    part_bytes = int(a.part_mib * 2**20)
    n = -(-len(stream) // part_bytes)
    each = -(-len(stream) // n)  # equal chunks: the fewest calls, each as light as it can be
    chunks = [f"wheels.tar.{i + 1}of{n}" for i in range(n)]
    plan = {"requirement": requirement, "python_version": a.python_version, "chunks": chunks,
            "sha256": hashlib.sha256(stream).hexdigest(), "carried": [w.name for w in rest],
            "base": [w.name for w in base], "not_carried": sorted(w.name for w in wheels if project(w.name) in have)}
    parts = []
    for i, name in enumerate(chunks):
        d = out / f"part{i + 1}"
        d.mkdir(parents=True)
        (d / name).write_bytes(stream[i * each: (i + 1) * each])
        parts.append(d)
    (out / "base").mkdir()
    for w in base:
        shutil.copyfile(w, out / "base" / w.name)
    for d in parts + [out / "base"]:
        (d / "plan.json").write_text(json.dumps(plan, indent=1))
        (d / "stage.sh").write_text(STAGE)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    rel = out.relative_to(REPO).as_posix()
    print(f"{len(wheels)} wheels for {requirement} (cp{a.python_version.replace('.', '')}); "
          f"{len(plan['not_carried'])} on the GPU image already, not carried")
    for d in parts + [out / "base"]:
        mib = sum(f.stat().st_size for f in d.iterdir()) / 2**20
        print(f"  {rel}/{d.name}: {mib:.1f} MiB")
    print(f"{len(parts)} calls, back to back (a warm H200 goes back 30 s after a call):")
    for i, d in enumerate(parts):
        last = i == len(parts) - 1
        carry = [f"{rel}/{d.name}"] + ([f"{rel}/base"] if last else [])
        tail = " && export PYTHONPATH=/tmp/site:$PWD && <the run>" if last else ""
        print(f"  run(carry={json.dumps(carry)}, command=\"bash {rel}/{d.name}/stage.sh{tail}\")")
    print(f"import rayspec alone (gpu_engine.py): carry {rel}/base and start the command with\n"
          f"  python3 -c 'import pydantic' 2>/dev/null || {{ python3 -m pip install -q --no-index --no-deps "
          f"--target /tmp/site {rel}/base/*.whl && export PYTHONPATH=/tmp/site:$PWD; }};")
    return 0


if __name__ == "__main__":
    sys.exit(main())
