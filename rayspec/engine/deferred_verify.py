"""Verification of drafts still on the device (rayspec.proposers.deferred): one host read a cycle.

Where a read waits for the device (CUDA), an EAGLE cycle used to read twice: the proposer its drafts
(to build the verification's token ids and tree layout on the host), then the engine the target's
choices. With `defer_draft_reads` the proposer leaves its drafts on the device; the verification's
input ids get their tokens there (`verification_inputs`), a tree's depths and ancestry stay device
tensors (TreeQuery.sees / depth_add), the sampled (unseeded) sequences' rejection rule is laid out
from the drafts' device tokens, parents and kept nodes (rayspec.sampling.rejection.SampledBatch),
and one read brings the target's choices, the sampled verdicts and the drafts together
(`read_verdict`), after which every later phase sees host drafts as before.

Deferring applies to the requests whose verification needs no host draft before the read: no
logits processing along the draft (penalties, logit_bias, a grammar), on one device, without
batch-invariant rows (their CPU attention takes spans from the host) or sliding windows. Greedy,
sampled and seeded (coupled: the draws' keys made from the tree's depths on the device) verification
then make that one read.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rayspec.device_io import to_device, to_host
from rayspec.model.batch_layout import TreeQuery
from rayspec.sampling.logits_processing import needs_processing
from rayspec.sampling.rejection import num_nodes, verify_tree_parents


def may_defer(engine, seqs) -> bool:
    """Whether this decode step's drafts may stay on the device until the verdict's read."""
    setting = engine.config.defer_draft_reads
    on = setting if setting is not None else engine.device.type != "cpu"
    if not on or not engine.proposer.in_process or engine.ranks is not None or engine.runner.batch_invariant:
        return False
    if engine.model.args.sliding_layers:
        return False
    return all(s.grammar is None and not needs_processing(s.params) for s in seqs)


def row_lengths(proposal) -> list[int]:
    """Each sequence's verification rows: its pending tokens, then its draft's rows."""
    return [len(p) + num_nodes(d) for p, d in zip(proposal.pending, proposal.drafts)]


def verification_inputs(proposal, device) -> tuple[list[list[int]] | torch.Tensor, list[TreeQuery] | None]:
    """(each row's input ids, the rows' trees or None for chains): host lists, or with deferred
    drafts [B, Q] ids on the device (host tokens written on the host, deferred ones placed there: no read)."""
    if not any(d.deferred is not None for d in proposal.drafts):
        if not proposal.has_tree:
            return proposal.inputs, None
        return proposal.inputs, [TreeQuery(verify_tree_parents(len(p), d)) for p, d in zip(proposal.pending,
                                                                                            proposal.drafts)]
    lengths = row_lengths(proposal)
    B, Q = len(lengths), max(lengths)
    ids = np.zeros((B, Q), dtype=np.int64)
    dst, values = [], []
    for b, (p, d) in enumerate(zip(proposal.pending, proposal.drafts)):
        ids[b, : len(p)] = p
        if d.deferred is None:
            ids[b, len(p): lengths[b]] = d.tokens
        elif d.deferred.num_nodes:
            dst.append(b * Q + len(p) + np.arange(d.deferred.num_nodes))
            values.append(d.deferred.tokens)
    t_ids, t_dst = to_device(ids, np.concatenate(dst) if dst else np.zeros(0, dtype=np.int64), device=device)
    if values:
        t_ids.view(-1).index_copy_(0, t_dst, torch.cat(values).to(t_ids.dtype))
    has_tree = any((d.deferred is not None and d.deferred.sees is not None) or not d.is_chain for d in proposal.drafts)
    if not has_tree:
        return t_ids, None
    return t_ids, [_tree(len(p), d, device) for p, d in zip(proposal.pending, proposal.drafts)]


def _tree(num_pending: int, draft, device) -> TreeQuery:
    """A verification row's tree: the pending tokens as a chain, the draft under the last of them."""
    row = draft.deferred
    if row is None:
        return TreeQuery(verify_tree_parents(num_pending, draft))
    if row.sees is None:  # a deferred chain: its shape is known
        return TreeQuery(list(range(-1, num_pending + row.num_nodes - 1)))
    P, n = num_pending, row.num_nodes
    sees = torch.zeros((P + n, P + n), dtype=torch.bool, device=device)
    sees[:P, :P] = torch.ones((P, P), dtype=torch.bool, device=device).tril()
    sees[P:, :P] = True
    sees[P:, P:] = row.sees
    depth_add = torch.cat([torch.zeros(P, dtype=torch.long, device=device), row.depth - 1])
    return TreeQuery(None, depths=list(range(P)) + [P] * n, sees=sees, depth_add=depth_add)


def read_verdict(proposal, tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The cycle's one read: the verification's `tensors` (rayspec.sampling.rejection.Verification:
    the target's choices, the sampled sequences' verdicts) and every deferred draft. The deferred
    Drafts become host drafts in place (the verification's rule holds them). Returns the arrays of
    `tensors`."""
    batches = list({id(d.deferred.batch): d.deferred.batch for d in proposal.drafts if d.deferred is not None}.values())
    arrays = to_host(*tensors, *(t for b in batches for t in b.tensors))
    mine, arrays = arrays[: len(tensors)], arrays[len(tensors):]
    for b in batches:
        b.finish(arrays[: len(b.tensors)])
        arrays = arrays[len(b.tensors):]
    for d in proposal.drafts:
        if d.deferred is not None:
            host = d.deferred.batch.drafts[d.deferred.row]
            for field in dataclasses.fields(host):  # (host.deferred is None)
                setattr(d, field.name, getattr(host, field.name))
    return mine
