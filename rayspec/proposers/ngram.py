from __future__ import annotations

import numpy as np

from rayspec.proposers.base import Draft, Proposer, ProposeRequest


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: match the last n tokens (longest n first) earlier in the sequence and
    return up to k tokens that followed the most recent match."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # windows over tokens[:-1] so the suffix cannot match itself: [total - n, n]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


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

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        drafts = []
        for req in requests:
            if req.num_tokens <= 0:
                drafts.append(Draft([]))
                continue
            tokens = np.asarray(req.token_ids, dtype=np.int64)
            drafts.append(Draft(find_ngram_continuation(tokens, self.min_n, self.max_n, req.num_tokens)))
        return drafts
