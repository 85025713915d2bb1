"""Proposer registry, built from rayspec.methods (the methods by name, as data): adding a method is one new
file plus one line there."""

from __future__ import annotations

from rayspec.methods import METHODS, proposer_class
from rayspec.proposers.base import Draft, Proposer, ProposeRequest

PROPOSERS: dict[str, type[Proposer]] = {method: proposer_class(method) for method in METHODS}


def build_proposer(config, context) -> Proposer:
    try:
        cls = PROPOSERS[config.method]
    except KeyError:
        raise ValueError(f"unknown speculative method {config.method!r}; choose from {sorted(PROPOSERS)}") from None
    return cls.create(config, context)


__all__ = ["PROPOSERS", "Draft", "Proposer", "ProposeRequest", "build_proposer"]
