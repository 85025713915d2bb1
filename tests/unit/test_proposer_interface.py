"""Proposers are used through what `Proposer` declares (rayspec.proposers.base), nothing else:
no getattr/hasattr on a proposer anywhere in the code, and every attribute the engine, the
scheduler, warm-up and the serving layer read of a proposer is declared on the interface (so a new
proposer that implements the interface runs everywhere, and a caller cannot lean on one method's
extra attributes). Read from the source with ast; no model is loaded."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rayspec.proposers.base import PreDraftable, Proposer

ROOT = Path(__file__).resolve().parents[2]
CODE = [p for pkg in ("rayspec", "deployments", "rayspec_cli") for p in sorted((ROOT / pkg).rglob("*.py"))]
# where the engine's proposer is read: expressions ending in `.proposer` / `._proposer` there are Proposers
USERS = ["rayspec/engine/llm_engine.py", "rayspec/engine/scheduler.py", "rayspec/engine/warm_up.py", "deployments/replicas/engine_loop.py",
         "deployments/replicas/proposer.py", "deployments/replicas/pairing.py", "deployments/replicas/verifier.py"]
# a first argument naming a proposer: proposer, self.proposer, engine.proposer, inner, ...
_PROPOSER_ARG = re.compile(r"\b(has|get)attr\(\s*[\w.]*(proposer|inner)\b\s*,", re.IGNORECASE)


def _user_paths() -> list[Path]:
    paths = []
    for rel in USERS:
        # (the layout may group modules in subpackages: find the file by name under its package)
        pkg, name = rel.split("/", 1)[0], rel.rsplit("/", 1)[1]
        found = [p for p in (ROOT / pkg).rglob(name)] if not (ROOT / rel).exists() else [ROOT / rel]
        paths += found
    return paths


def test_no_getattr_on_proposers():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in CODE
            for i, line in enumerate(p.read_text().splitlines(), 1) if _PROPOSER_ARG.search(line)]
    assert not hits, "duck-typed proposer access (declare it on Proposer instead):\n" + "\n".join(hits)


def test_the_pattern_catches_duck_typing():
    """The check above is not vacuous: the shapes it has to catch match."""
    for line in ['flush = getattr(engine.proposer, "flush", None)', 'getattr(self.proposer, "runner", None)',
                 'hasattr(proposer, "should_stop")', 'getattr(getattr(proposer, "runner", None), "model")']:
        assert _PROPOSER_ARG.search(line), line
    assert not _PROPOSER_ARG.search('getattr(self.config, "proposer")')


def _proposer_attributes(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) for every `<...>.proposer.<attribute>` read in the module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in ("proposer", "_proposer"):
            found.append((node.lineno, node.attr))
    return found


def test_every_proposer_attribute_used_is_declared():
    declared = set(dir(Proposer))
    paths = _user_paths()
    assert len(paths) >= 5, paths  # the modules were found (moved ones too)
    used, undeclared = 0, []
    for path in paths:
        for line, attr in _proposer_attributes(path):
            used += 1
            if attr not in declared:
                undeclared.append(f"{path.relative_to(ROOT)}:{line}: .proposer.{attr}")
    assert used >= 10  # the engine's proposer calls were seen
    assert not undeclared, "attributes of a proposer that Proposer does not declare:\n" + "\n".join(undeclared)


def test_pre_drafting_asks_for_its_interface():
    """Asynchronous drafting drives PreDraftable proposers only, and says so for others."""
    import pytest

    from rayspec.proposers.ngram import NgramProposer
    from rayspec.proposers.pre_draft import PreDrafter

    with pytest.raises(ValueError, match="cannot pre-draft"):
        PreDrafter(NgramProposer(), num_hypotheses=2, max_model_len=64)
    assert {"num_candidates", "candidates", "should_stop"} <= set(vars(_Minimal()))


class _Minimal(PreDraftable):
    def propose(self, requests):
        return []
