"""Prompt lookup (n-gram) drafting: the continuation of the sequence's last n tokens where they
occurred before. The engine looks up every sequence at every step, so each sequence keeps an index
of where each n-gram ended (NgramIndex), grown by the tokens it takes: a lookup costs the number of
earlier occurrences of the last min_n tokens, not a scan of the whole context."""

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


class NgramIndex:
    """One sequence's tokens and, per min_n-gram, the positions it ended at (ascending): the same
    continuation as find_ngram_continuation, found from the occurrences of the last min_n tokens.

    `sync` takes the sequence's tokens as they are now: they only grow, except their last TAIL ones,
    which may differ from those seen last time (a pre-drafter's hypothesised tokens, then the verified
    ones); only a changed or new tail is (re)indexed, so a step costs what it appends."""

    TAIL = 64  # the most trailing tokens that may change between two calls (hypotheses: a draft's depth)

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def sync(self, token_ids: list[int]) -> None:
        old, new = self.tokens, token_ids
        keep = min(len(old), len(new))
        lo = max(0, keep - self.TAIL)
        if keep and old[lo] != new[lo]:  # changed further back than a tail: index it all again
            keep = 0
        else:
            keep = next((i for i in range(lo, keep) if old[i] != new[i]), keep)
        m = self.min_n
        for e in range(len(old) - 1, max(keep, m - 1) - 1, -1):  # forget the positions past keep
            self._ends[tuple(old[e - m + 1: e + 1])].pop()
        del old[keep:]
        old.extend(new[keep:])
        for e in range(max(keep, m - 1), len(old)):
            self._ends.setdefault(tuple(old[e - m + 1: e + 1]), []).append(e)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest of the longest earlier matches of the suffix."""
        tokens, m = self.tokens, self.min_n
        total = len(tokens)
        top = min(self.max_n, total - 1)
        if top < m or k <= 0:
            return []
        ends = self._ends.get(tuple(tokens[total - m:]), ())
        best, best_end = 0, -1
        for i in range(len(ends) - 2, -1, -1):  # the latest first; the last is the suffix itself
            e, n = ends[i], m
            while n < top and e - n >= 0 and tokens[e - n] == tokens[total - 1 - n]:
                n += 1
            if n > best:
                best, best_end = n, e
                if n == top:  # none earlier can be longer
                    break
        return tokens[best_end + 1: best_end + 1 + k] if best else []


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
        self._indexes: dict[str, NgramIndex] = {}

    def _lookup(self, seq_id: str, token_ids: list[int], k: int) -> list[int]:
        key = (len(token_ids), token_ids[-1] if token_ids else -1)
        last = self._looked_up.get(seq_id)
        if last is not None and last[0] == key and last[1] >= k:
            return last[2][:k]
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        index.sync(token_ids)
        found = index.lookup(k)
        self._looked_up[seq_id] = (key, k, found)
        return found

    def draftable(self, seq_id: str, token_ids: list[int], k: int) -> int:
        return len(self._lookup(seq_id, token_ids, k)) if k > 0 else 0

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        return [Draft(self._lookup(req.seq_id, req.token_ids, req.num_tokens) if req.num_tokens > 0 else [])
                for req in requests]

    def release(self, seq_id: str) -> None:
        self._looked_up.pop(seq_id, None)
        self._indexes.pop(seq_id, None)
