"""What passes between the phases of an engine step: propose -> verify -> commit of a decode
(Proposal, Verdict), a prefill's forward -> commit (Prefilled). Data only; rayspec.engine.llm_engine runs the
phases. Propose and verify change no sequence; commit reads these and is the one place state changes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rayspec.engine.sequence import Sequence
from rayspec.proposers import Draft


@dataclass
class Proposal:
    """propose -> verify: what a decode step sends the target, per sequence."""
    seqs: list[Sequence]
    drafts: list[Draft]  # a chain, or a tree (parents); empty where nothing was drafted
    draft_lens: list[int]  # the budget the proposer was asked for (0: not asked)
    tree: bool  # the proposer was asked for trees (a small batch), else chains
    pending: list[list[int]]  # the tokens without target KV yet (normally the last one), before the draft
    propose_s: float  # seconds in the proposer
    catch_up: int = 0  # tokens the proposer ran through first for the sequences drafted (catch_up_tokens)
    # EAGLE: target feature rows each sequence handed the proposer (dropped from it at commit)
    features_sent: list[int] | None = None

    @property
    def inputs(self) -> list[list[int]]:
        """Each sequence's verification row: its pending tokens, then its draft."""
        return [p + d.tokens for p, d in zip(self.pending, self.drafts)]

    @property
    def has_tree(self) -> bool:
        return any(not d.is_chain for d in self.drafts)  # (after verify: deferred drafts are read by then)


@dataclass
class Verdict:
    """verify -> commit: what a decode step keeps, per sequence (rayspec.sampling.rejection.verify)."""
    emitted: list[list[int]]  # the accepted drafts, then the recovered or bonus token
    kept_rows: list[list[int]]  # the verification rows whose KV stays (pending, then accepted drafts)
    raw_logits: torch.Tensor  # [N, vocab] the target's unprocessed logits over the packed rows (logprobs)
    features: torch.Tensor | None  # [N, F] the target features of those rows (EAGLE heads), else None
    starts: list[int]  # sequence i's rows begin at starts[i]
    row_context: int  # sum over rows of the context each attends to (the planner's cost fit)


def cut_draft(draft: Draft, n: int) -> Draft:
    """The first n tokens of a draft (a tree's first n nodes are a tree: parents come first)."""
    return replace(draft, tokens=draft.tokens[:n], probs=None if draft.probs is None else draft.probs[:n],
                   parents=None if draft.parents is None else draft.parents[:n])


def draft_depth(draft: Draft) -> int:
    """The deepest token of a draft (a chain's length; a tree's longest path)."""
    if draft.is_chain:
        return len(draft.tokens)
    depth: list[int] = []
    for p in draft.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


@dataclass
class Prefilled:
    """A prefill forward's result, before its commit."""
    starts: list[int]  # each chunk's first position (its sequence's cached length before)
    offsets: list[int]  # chunk i's rows are hidden[offsets[i]: offsets[i] + n]
    hidden: torch.Tensor  # [N, H] packed
    features: torch.Tensor | None  # [N, F] packed (EAGLE heads), else None
    complete: list[int]  # the chunks whose prompt ends here
    last: torch.Tensor | None  # [len(complete), vocab] their last rows' logits


def features_of(seq: Sequence) -> tuple[torch.Tensor | None, int]:
    """The target features the sequence holds for its proposer, [m, F] from features_start (they
    leave it at commit)."""
    if not seq.features:
        return None, seq.features_start
    return (torch.cat(seq.features) if len(seq.features) > 1 else seq.features[0]), seq.features_start
