"""Proposer registry: adding a method is one new file plus one line here."""

from __future__ import annotations

from rayspec.proposers.base import Draft, Proposer, ProposeRequest
from rayspec.proposers.draft_model import DraftModelProposer
from rayspec.proposers.eagle import Eagle1Proposer, EagleProposer
from rayspec.proposers.ngram import NgramProposer
from rayspec.proposers.none import NoProposer

PROPOSERS: dict[str, type[Proposer]] = {
    NoProposer.name: NoProposer,
    NgramProposer.name: NgramProposer,
    DraftModelProposer.name: DraftModelProposer,
    EagleProposer.name: EagleProposer,
    Eagle1Proposer.name: Eagle1Proposer,
}


def build_proposer(config, context) -> Proposer:
    try:
        cls = PROPOSERS[config.method]
    except KeyError:
        raise ValueError(f"unknown speculative method {config.method!r}; choose from {sorted(PROPOSERS)}") from None
    return cls.create(config, context)


__all__ = ["PROPOSERS", "Draft", "Proposer", "ProposeRequest", "build_proposer"]
