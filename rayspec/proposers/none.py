from __future__ import annotations

from rayspec.proposers.base import Draft, Proposer, ProposeRequest


class NoProposer(Proposer):
    """Target-only decoding through the same engine: the baseline."""

    name = "none"

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        return [Draft([]) for _ in requests]
