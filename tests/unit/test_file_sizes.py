"""File sizes: no .py file under rayspec/ or deployments/ runs past 700 lines, and one past 500
says why in its module docstring, as a line "(Over 500 lines: <reason>)" near the top (see
rayspec/engine/llm_engine.py, rayspec/engine/drafting.py). A module that grows past 500 lines either holds one
thing that reads best whole, which the note says, or is due a split; past 700 it is split.

Read from the source alone (line counts and ast's module docstring), so a unit-tier test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rayspec", "deployments")
MAX_LINES = 700
NOTE_ABOVE = 500
# "(Over 500 lines: " and a reason: at least one word after the colon
NOTE = re.compile(r"\(Over 500 lines:\s*\S")


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                  if "__pycache__" not in p.parts)


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def states_its_reason(path: Path) -> bool:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return bool(docstring and NOTE.search(docstring))


def test_the_walk_finds_both_packages():
    found = {p.relative_to(ROOT).as_posix() for p in modules()}
    assert "rayspec/engine/llm_engine.py" in found and "deployments/app.py" in found, sorted(found)[:10]


def test_no_module_over_700_lines():
    too_long = {p.relative_to(ROOT).as_posix(): n for p in modules() if (n := line_count(p)) > MAX_LINES}
    assert not too_long, (f"over {MAX_LINES} lines (split them): "
                          + ", ".join(f"{path} ({n})" for path, n in sorted(too_long.items())))


def test_modules_over_500_lines_say_why():
    silent = {p.relative_to(ROOT).as_posix(): n for p in modules()
              if (n := line_count(p)) > NOTE_ABOVE and not states_its_reason(p)}
    assert not silent, (f"over {NOTE_ABOVE} lines without '(Over {NOTE_ABOVE} lines: <reason>)' in the module "
                        "docstring: " + ", ".join(f"{path} ({n})" for path, n in sorted(silent.items())))
