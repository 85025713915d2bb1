"""Another commit's code beside this checkout's, for benchmarks that compare the two on one machine in one sitting:
`module_at` imports one file as of a revision (in this process, interleaved with the current one), `worktree`
checks a revision out whole (for a process of its own)."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def module_at(rev: str, path: str, cwd: Path = REPO):
    """The file `path` (relative to the repository) as of `rev`, imported as a module of its own. Its own
    imports resolve as the current code's (so a module, not a package, and one whose imports still exist)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=cwd, capture_output=True, text=True,
                            check=True).stdout
    name = f"{Path(path).stem}_at_{rev.replace('/', '_').replace('~', '_').replace('^', '_')}"
    file = Path(tempfile.mkdtemp(prefix="revision-")) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def worktree(rev: str, parent: Path, cwd: Path = REPO):
    """A detached git worktree of `rev` under `parent`, removed on exit."""
    path = Path(parent) / git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=cwd)[:12]
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(path), rev], cwd=cwd, check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=cwd, capture_output=True)
