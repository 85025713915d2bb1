"""The speculative methods by name, as data: which proposer class serves each, and which draft from the
target's hidden states.

A config names its method; checking the name (rayspec.config, deployments.config, the vLLM dialect)
needs neither torch nor the proposers, so a Serve ingress replica validates its app's config without
importing them. rayspec.proposers.PROPOSERS is built from this table (tests/unit/test_imports.py checks
that each class's `name` is its key). Adding a method: its proposer module, and one line here.
"""

from __future__ import annotations

import importlib

# method -> "module:class" of its proposer
METHODS: dict[str, str] = {
    "none": "rayspec.proposers.none:NoProposer",
    "ngram": "rayspec.proposers.ngram:NgramProposer",
    "draft_model": "rayspec.proposers.draft_model:DraftModelProposer",
    "eagle3": "rayspec.proposers.eagle:EagleProposer",
    "eagle": "rayspec.proposers.eagle:Eagle1Proposer",
}

# methods whose proposer drafts from the target's hidden states, handed over every step (EAGLE heads:
# subclasses of rayspec.proposers.eagle.EagleProposer)
FEATURE_METHODS = frozenset({"eagle3", "eagle"})


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; registered: {sorted(METHODS)}")


def proposer_class(method: str) -> type:
    """The proposer class of `method` (importing its module, and so torch)."""
    check_method(method)
    module, _, name = METHODS[method].partition(":")
    return getattr(importlib.import_module(module), name)
