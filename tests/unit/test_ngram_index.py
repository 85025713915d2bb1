"""NgramIndex (rayspec.proposers.ngram): the per-sequence index the engine's n-gram lookups use finds
what a scan of the whole context finds (find_ngram_continuation), as the tokens grow and as their
tail changes (a pre-drafter's hypothesised tokens, then the verified ones)."""

from __future__ import annotations

import random

import numpy as np

from rayspec.proposers.ngram import NgramIndex, find_ngram_continuation


def test_ngram_index_is_the_scan():
    rng = random.Random(0)
    for _ in range(600):
        min_n = rng.randint(1, 3)
        max_n, vocab = rng.randint(min_n, 5), rng.randint(2, 6)
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        for _ in range(12):
            if rng.random() < 0.6:  # grows
                tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            elif len(tokens) > 3:  # its last few tokens change
                cut = rng.randint(max(1, len(tokens) - 6), len(tokens))
                tokens = tokens[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
            index.sync(tokens)
            k = rng.randint(0, 6)
            assert index.tokens == tokens
            assert index.lookup(k) == find_ngram_continuation(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_ngram_index_change_past_its_tail_reindexes():
    index = NgramIndex(1, 3)
    index.sync(list(range(100)) + [5])
    assert index.lookup(2) == [6, 7]
    other = [7] * 100 + [7]  # every token differs: indexed again from the start
    index.sync(other)
    assert index.tokens == other and index.lookup(2) == [7]  # (the latest longest match: one token follows)
