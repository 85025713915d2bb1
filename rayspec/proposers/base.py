"""The one proposer interface. The engine asks; a proposer answers with draft tokens.

A proposer may keep per-sequence state (a draft model's KV cache); it finds out what was
accepted by comparing the tokens it is given with those it saw last time, so the contract
stays two plain dataclasses that also travel between Ray actors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class ProposeRequest:
    seq_id: str
    token_ids: list[int]  # prompt + output so far (the last one has no KV in the target yet)
    num_tokens: int  # draft at most this many
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), vocab] probabilities the tokens were sampled from; None for a point mass
    # (deterministic proposers, and every proposer at temperature 0)
    probs: torch.Tensor | None = None


class Proposer(ABC):
    name: str = ""

    @classmethod
    def create(cls, config, context) -> "Proposer":
        """Build from a SpeculativeConfig and a ProposerContext (see rayspec.config)."""
        return cls()

    @abstractmethod
    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        """Draft for every request in one batched call."""

    def release(self, seq_id: str) -> None:
        """Forget a finished or aborted sequence."""
