"""Proposer registry, built from rayspec.methods (the methods by name, as data): adding a method is one new
file plus one line there."""

from __future__ import annotations

from rayspec.methods import METHODS, check_method, proposer_class
from rayspec.proposers.base import Draft, Proposer, ProposeRequest

PROPOSERS: dict[str, type[Proposer]] = {method: proposer_class(method) for method in METHODS}


def build_proposer(config, context) -> Proposer:
    check_method(config.method)
    return PROPOSERS[config.method].create(config, context)


__all__ = ["PROPOSERS", "Draft", "Proposer", "ProposeRequest", "build_proposer"]
