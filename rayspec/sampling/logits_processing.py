"""Logit bias and repetition / frequency / presence penalties: the target distribution a request
asks for, before temperature, top-k and top-p.

Order and meaning follow vLLM and OpenAI: `logit_bias` is added first; `repetition_penalty`
(Hugging Face semantics) divides positive and multiplies negative logits of every token seen in the
prompt or the output; `frequency_penalty` subtracts penalty x count and `presence_penalty` a flat
penalty for every token already in the *output*.

Speculation stays lossless with them because each verification row is processed with exactly the
tokens that precede it on its own path: the committed output plus, for a chain, the drafts before
that row, for a tree, the row's ancestors. A row's processed distribution is then the one
target-only decoding would use at that point; drafts may come from unprocessed draft
distributions (rejection sampling only needs to know what they were sampled from).
"""

from __future__ import annotations

import numpy as np
import torch

from rayspec.device_io import to_device
from rayspec.proposers.base import Draft
from rayspec.sampling.sampler import SamplingParams


def _ids(values, device=None):
    """Token ids or row numbers from the host: an int64 array, or on `device` without a blocking copy."""
    ids = np.asarray(list(values), dtype=np.int64)
    return ids if device is None else to_device(ids, device=device)[0]


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.frequency_penalty or params.presence_penalty
                or params.repetition_penalty != 1.0 or params.structured is not None or params.min_tokens)


def process_rows(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                 row_extra: list[list[int]], grammar=None, eos_token_ids=()) -> torch.Tensor:
    """logits: [R, vocab], row r predicting the token after prompt + output + row_extra[r]
    -> processed logits [R, vocab] (float32, a new tensor). `grammar` (rayspec.sampling.structured.GrammarState,
    at the committed tokens) masks each row to what the grammar allows there; with min_tokens, rows
    before that many output tokens cannot end the output (`eos_token_ids`, stop token ids)."""
    rows, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    if params.logit_bias:
        ids, bias = to_device(_ids(params.logit_bias), np.asarray(list(params.logit_bias.values()), np.float32),
                              device=device)
        out[:, ids] += bias
    # counts[r, t]: occurrences of t in the output before row r's prediction
    counts = torch.zeros(rows, vocab, device=device)
    if output_ids:
        counts += torch.bincount(_ids(output_ids, device), minlength=vocab).float()
    for r, extra in enumerate(row_extra):
        if extra:
            counts[r].index_add_(0, _ids(extra, device), torch.ones(len(extra), device=device))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, _ids(prompt_ids, device)] = True
        penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, penalized, out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).float()
    if params.min_tokens:
        enders = sorted(set(eos_token_ids) | set(params.stop_token_ids))
        early = [r for r, extra in enumerate(row_extra) if len(output_ids) + len(extra) < params.min_tokens]
        if enders and early:
            out[_ids(early, device)[:, None], _ids(enders, device)] = float("-inf")
    if grammar is not None:
        out.masked_fill_(~grammar.allowed_rows(row_extra, device), float("-inf"))
    return out


def verification_row_extra(num_pending: int, draft_tokens: list[int], parents: list[int] | None) -> list[list[int]]:
    """For the rows of one sequence's verification input (pending tokens, then the drafts): the
    draft tokens each row comes after. Rows before the last pending one never emit and get []."""
    extra: list[list[int]] = [[] for _ in range(num_pending)]
    paths: list[list[int]] = []
    for j, tok in enumerate(draft_tokens):
        parent = j - 1 if parents is None else parents[j]
        paths.append((paths[parent] if parent >= 0 else []) + [tok])
    return extra + paths


def process_verification_logits(raw: torch.Tensor, seqs, pending, drafts, starts, lengths) -> torch.Tensor:
    """raw: [N, vocab] packed target logits of a verification forward (sequence i's rows at
    starts[i]: starts[i] + lengths[i]: its pending tokens, then its draft) -> the same with the rows of
    every sequence that asks for processing done in their own path's context (raw itself if none)."""
    logits = raw
    for i, seq in enumerate(seqs):
        if not needs_processing(seq.params):
            continue
        logits = logits.clone() if logits is raw else logits
        extra = verification_row_extra(len(pending[i]), drafts[i].tokens, drafts[i].parents)
        rows = slice(starts[i], starts[i] + lengths[i])
        logits[rows] = process_rows(raw[rows], seq.params, seq.prompt_token_ids, seq.output_token_ids, extra,
                                    seq.grammar, seq.eos_token_ids)
    return logits


def grammar_draft(grammar, draft: Draft, budget: int) -> Draft:
    """A chain draft made to follow the grammar (rayspec.sampling.structured.GrammarState.fix_draft): tokens
    the grammar forces go in (the masked target must pick them, so they are accepted), the proposer's
    tokens while they still line up and are allowed, nothing past the first forbidden one."""
    if not draft.is_chain:
        tokens, parents = grammar.fix_tree(draft.tokens, draft.parents, budget)
        return Draft(tokens, None, parents)  # trees are greedy drafts (no probabilities)
    tokens = grammar.fix_draft(draft.tokens, budget)
    if tokens == draft.tokens[: len(tokens)]:
        return Draft(tokens, None if draft.probs is None else draft.probs[: len(tokens)])
    # forced tokens replaced some: verify as point masses (lossless for any draft the target's
    # randomness did not choose; the proposer's probabilities no longer describe these tokens)
    return Draft(tokens)
