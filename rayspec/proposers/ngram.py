from __future__ import annotations

import numpy as np

from rayspec.proposers.base import Draft, Proposer, ProposeRequest


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: match the last n tokens (longest n first) earlier in the sequence and
    return up to k tokens that followed the most recent match.

    Every earlier match ends at an earlier occurrence of the last token: those positions (one
    comparison over the sequence) are extended backwards together while they agree with the
    suffix, up to max_n tokens, and the latest of the longest wins (a window scan per n, as this
    once was, cost ~4x more per sequence and step: the engine looks up every sequence each step)."""
    total = len(tokens)
    top = min(max_n, total - 1)
    if top < min_n or k <= 0:
        return []
    ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1])  # the suffix itself left out
    if not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int64)  # each candidate's agreeing tokens, backwards
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, top):
        at = ends - j
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[total - 1 - j]
        if not alive.any():
            break
        length += alive
    longest = int(length.max())
    if longest < min_n:
        return []
    end = int(ends[np.flatnonzero(length >= longest)[-1]])
    return tokens[end + 1:end + 1 + k].tolist()


class NgramProposer(Proposer):
    """Drafts by looking up the sequence's own recent n-gram earlier in its tokens."""

    name = "ngram"

    @classmethod
    def create(cls, config, context) -> "NgramProposer":
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # per sequence, the last lookup ((length, last token) of the tokens looked up, k, continuation):
        # draftable() looks up before the step's plan, propose() then reuses it
        self._looked_up: dict[str, tuple[tuple[int, int], int, list[int]]] = {}

    def _lookup(self, seq_id: str, token_ids: list[int], k: int) -> list[int]:
        key = (len(token_ids), token_ids[-1] if token_ids else -1)
        last = self._looked_up.get(seq_id)
        if last is not None and last[0] == key and last[1] >= k:
            return last[2][:k]
        found = find_ngram_continuation(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, k)
        self._looked_up[seq_id] = (key, k, found)
        return found

    def draftable(self, seq_id: str, token_ids: list[int], k: int) -> int:
        return len(self._lookup(seq_id, token_ids, k)) if k > 0 else 0

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        return [Draft(self._lookup(req.seq_id, req.token_ids, req.num_tokens) if req.num_tokens > 0 else [])
                for req in requests]

    def release(self, seq_id: str) -> None:
        self._looked_up.pop(seq_id, None)
