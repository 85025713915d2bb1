"""The target's processed next-token distribution, computed without rayspec: the references the
sampled-losslessness tests hold the engine to (not a test module).

- `processed_probs`: temperature, top-k and top-p in numpy float64, written from their
  definitions (vLLM's and the OpenAI API's), not with rayspec.sampling.sampler.logits_to_probs,
  so that a fault there cannot be copied into what the tests expect;
- `penalized`: logit bias, then the repetition penalty (Hugging Face's: divide positive logits,
  multiply negative ones, of every token in the prompt or the output), the frequency and presence
  penalties (OpenAI's: of the output's tokens);
- `cut_margin`: how close a row's top-k / top-p cut comes to a tie (where logits that differ in
  their last bits may keep another set);
- `HFLogits`: transformers' forward of a checkpoint (not the engine's model code), batched over
  contexts, cached.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch


def _as_rows(logits) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().double().cpu().numpy()
    rows = np.asarray(logits, dtype=np.float64)
    return rows[None] if rows.ndim == 1 else rows


def _sorted(rows: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids by decreasing logit, ties by the lower id [N, V]; their logits; the number the
    top-k keeps)."""
    order = np.argsort(-rows, axis=-1, kind="stable")
    values = np.take_along_axis(rows, order, -1)
    return order, values, top_k if 0 < top_k < rows.shape[-1] else rows.shape[-1]


def _softmax(values: np.ndarray) -> np.ndarray:
    finite = np.isfinite(values)
    top = np.max(np.where(finite, values, -np.inf), axis=-1, keepdims=True)
    w = np.where(finite, np.exp(np.where(finite, values, 0.0) - top), 0.0)
    return w / w.sum(-1, keepdims=True)


def processed_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """logits [V] or [N, V] (numpy or torch; -inf: masked) -> float64 probabilities [N, V]: divided
    by the temperature, then the top_k likeliest tokens kept (0 or >= V: all), then of those the
    likeliest until the mass before the next one reaches top_p (the first always; tokens tied with
    the last kept one too), renormalised."""
    rows = _as_rows(logits) / temperature
    if not 0 < top_k < rows.shape[-1] and top_p >= 1.0:  # nothing cut: a softmax
        return _softmax(rows)
    order, values, kept = _sorted(rows, top_k)
    probs = _softmax(values[:, :kept])  # over what top-k keeps
    keep = probs > 0
    if top_p < 1.0:
        keep &= np.cumsum(probs, -1) - probs < top_p  # the mass before each token
        keep[:, 0] = True
        # every token tied with the last kept one stays (the kept set is a threshold on the logit)
        last = np.min(np.where(keep, values[:, :kept], np.inf), axis=-1, keepdims=True)
        keep = (values[:, :kept] >= last) & (probs > 0)
    out = np.zeros_like(rows)
    np.put_along_axis(out, order[:, :kept], np.where(keep, probs, 0.0), -1)
    return out / out.sum(-1, keepdims=True)


def cut_margin(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """[N]: per row, the smallest change of one scaled logit that could move its top-k / top-p cut
    (inf when nothing is cut): the gap at the top-k boundary, and for top-p how far each kept
    candidate's mass-before lies from top_p (a change of x in a logit moves a mass by at most x)."""
    rows = _as_rows(logits) / temperature
    margin = np.full(len(rows), np.inf)
    if not 0 < top_k < rows.shape[-1] and top_p >= 1.0:
        return margin
    order, values, kept = _sorted(rows, top_k)
    if kept < rows.shape[-1]:
        gap = values[:, kept - 1] - values[:, kept]
        margin = np.where(np.isfinite(values[:, kept]), np.minimum(margin, gap), margin)
    if top_p < 1.0 and kept > 1:
        probs = _softmax(values[:, :kept])
        before = (np.cumsum(probs, -1) - probs)[:, 1:]
        far = np.where(probs[:, 1:] > 0, np.abs(before - top_p), np.inf)
        margin = np.minimum(margin, far.min(-1))
        # and the kept set is a threshold on the logit (tokens tied with the last one the mass keeps
        # stay): the gap between that token and the next moves the cut too. A tie there in the
        # reference's logits that the engine's rounding splits (seen on an AMD EPYC with AVX-512: two
        # tokens of a tiny model at exactly one logit) keeps one token fewer, not a different law.
        n = 1 + (before < top_p).sum(-1)  # the mass-before rule keeps a prefix of the sorted row
        rows_cut = np.flatnonzero(n < kept)
        if len(rows_cut):
            gap = values[rows_cut, n[rows_cut] - 1] - values[rows_cut, n[rows_cut]]
            margin[rows_cut] = np.minimum(margin[rows_cut], np.where(np.isfinite(gap), gap, np.inf))
    return margin


def penalized(row, prompt_ids, output_ids, *, logit_bias=None, repetition_penalty: float = 1.0,
              frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> np.ndarray:
    """One row of raw logits [V] predicting the token after prompt + output -> the logits a request
    with these parameters samples from (before temperature / top-k / top-p)."""
    out = _as_rows(row)[0].copy()
    if not (logit_bias or repetition_penalty != 1.0 or frequency_penalty or presence_penalty):
        return out
    for t, b in (logit_bias or {}).items():
        out[int(t)] += b
    counts = Counter(int(t) for t in output_ids)
    if repetition_penalty != 1.0:
        for t in set(int(t) for t in prompt_ids) | set(counts):
            out[t] = out[t] / repetition_penalty if out[t] > 0 else out[t] * repetition_penalty
    for t, c in counts.items():
        out[t] -= frequency_penalty * c + presence_penalty
    return out


class HFLogits:
    """transformers' forward of a Llama checkpoint: the raw next-token logits after any context,
    batched (right padding: causal attention never lets a real token see a pad after it) and cached."""

    def __init__(self, model_dir, dtype=torch.float32, batch_tokens: int = 16384):
        from transformers import LlamaForCausalLM

        self.hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.batch_tokens = batch_tokens
        self._cache: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, context) -> np.ndarray:
        """[V] float64: the logits of the token after `context` (a token tuple)."""
        context = tuple(context)
        if context not in self._cache:
            self.fill([context])
        return self._cache[context]

    def fill(self, contexts) -> None:
        """Compute every context not cached yet, reading each carrier sequence once: a context that
        is a prefix of a longer one asked for is read off that one's forward."""
        need = {tuple(c) for c in contexts} - set(self._cache)
        if not need:
            return
        carriers = sorted(need, key=len, reverse=True)
        covered: dict[tuple[int, ...], list[int]] = {}  # carrier -> the prefix lengths read from it
        prefixes: dict[tuple[int, ...], tuple[int, ...]] = {}
        for c in carriers:
            for n in range(1, len(c) + 1):
                if c[:n] in need and c[:n] not in prefixes:
                    prefixes[c[:n]] = c
                    covered.setdefault(c, []).append(n)
        batch: list[tuple[int, ...]] = []
        for c in sorted(covered, key=len):
            if batch and len(c) * (len(batch) + 1) > self.batch_tokens:
                self._forward(batch, covered)
                batch = []
            batch.append(c)
        if batch:
            self._forward(batch, covered)

    def _forward(self, batch: list[tuple[int, ...]], covered: dict) -> None:
        longest = max(len(c) for c in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        for i, c in enumerate(batch):
            ids[i, :len(c)] = torch.tensor(c)
        rows = [(i, n) for i, c in enumerate(batch) for n in covered[c]]
        with torch.no_grad():
            hidden = self.hf.model(input_ids=ids).last_hidden_state  # [B, L, H]
            picked = hidden[[i for i, _ in rows], [n - 1 for _, n in rows]]
            logits = self.hf.lm_head(picked).double().numpy()
        for (i, n), row in zip(rows, logits):
            self._cache[batch[i][:n]] = row
