"""What an EAGLE tree draft records for a pre-drafter (rayspec.proposers.pre_draft): per sequence the
tree's best path, the head states along it and each state's top candidates. The host part per
sequence (`tree_path`), the device part in one gather for the whole batch (`gather_states`: it was
a concatenation, an index placed on the device and a gather per sequence)."""

from __future__ import annotations

import math

import numpy as np
import torch

from rayspec.device_io import to_device


def tree_path(keep: list[int], number: dict[int, int], tok_h, score_h, parent_h, fed_h, ctok_h, clogp_h,
              num_candidates: int) -> tuple[list[int], list[int], list[tuple[list[int], list[float]]]]:
    """(path tokens, state rows, candidates) of one tree draft, from host data: the raw nodes (tok_h,
    score_h, parent_h [N]), number (raw node -> index among the nodes the draft chose from), keep (those
    it chose), the fed frontier (fed_h [F] raw nodes), and each state's top tokens and log-probabilities
    (ctok_h, clogp_h [1 + F, c]: the root's, then each fed node's). The path: from the root, the head's
    likeliest child among the nodes sent, while there is one. State row i predicted path token i (row 0
    is the root's); one row more, with the candidates after the path, where its last node was fed. A
    state's candidates leave out its node's children in the tree: a bonus is never one of them (the
    verifier would have accepted it; a verdict down another branch is not hypothesised)."""
    kept = set(keep)
    children: dict[int, list[int]] = {}
    for n, j in number.items():
        if j in kept:
            children.setdefault(parent_h[n], []).append(n)
    fed_at = {n: 1 + i for i, n in enumerate(fed_h)}  # raw node -> its state row
    path, path_nodes, rows, node = [], [], [0], -1
    while (nxt := max(children.get(node, []), key=score_h.__getitem__, default=None)) is not None:
        path.append(tok_h[nxt])
        path_nodes.append(nxt)
        node = nxt
        if node not in fed_at:  # never fed: no state after it
            break
        rows.append(fed_at[node])
    ends = [-1] + path_nodes  # the node each state predicts the children of
    cands = []
    for r, end in zip(rows, ends):
        taken = {tok_h[n] for n in children.get(end, [])}
        top = [(t, math.exp(x)) for t, x in zip(ctok_h[r], clogp_h[r]) if t not in taken][:num_candidates]
        cands.append(([t for t, _ in top], [q for _, q in top]))
    return path, rows, cands


def gather_states(last: torch.Tensor, fed: torch.Tensor | None, picks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """last [B, H] (the root states), fed [B, F, H] or None (the fed nodes' head outputs); picks: (batch
    row, state rows) -> per pick its states [len(rows), H] (state 0 is last[b], state i >= 1 is
    fed[b, i - 1]), gathered at once."""
    states = last[:, None] if fed is None else torch.cat([last[:, None], fed], 1)  # [B, 1 + F, H]
    width = states.shape[1]
    flat = np.asarray([b * width + r for b, rows in picks for r in rows], dtype=np.int64)
    (index,) = to_device(flat, device=last.device)
    return list(states.reshape(-1, states.shape[-1]).index_select(0, index).split([len(rows) for _, rows in picks]))
