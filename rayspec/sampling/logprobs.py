"""Log-probabilities of output tokens under the target model.

Speculation does not change them: every emitted token, drafted or not, comes out of a target
forward (prefill, or the verification forward that accepted it), so its logprob is read from the
row of target logits that predicted it. The values are the target's raw distribution
(log-softmax of its logits, before temperature, top-k and top-p), as vLLM returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token's text on its own ("" without a tokenizer)
    logprob: float | None  # None only for a prompt's first token (nothing predicts it)
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob), most likely first


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def compute_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int, tokenizer,
                     texts: dict[int, str] | None = None) -> list[TokenLogprob]:
    """logits: [N, vocab], row i predicting token_ids[i] -> N TokenLogprobs with `num_top` alternatives.
    texts: token id -> its text, decoded so far (shared by calls for one prompt's chunks)."""
    import torch

    logprobs = logits.float().log_softmax(-1)  # [N, vocab]
    index = torch.tensor(token_ids, device=logits.device)
    chosen = logprobs.gather(-1, index[:, None])[:, 0].tolist()  # [N]
    tops: list[list[tuple[int, str, float]]] = [[] for _ in token_ids]
    texts = {} if texts is None else texts  # each distinct id decoded once: rows share most of their alternatives

    def text(t: int) -> str:
        found = texts.get(t)
        if found is None:
            found = texts[t] = token_text(tokenizer, t)
        return found

    if num_top:
        values, ids = logprobs.topk(num_top, dim=-1)  # [N, num_top]
        tops = [[(t, text(t), v) for t, v in zip(row_ids, row_values)]
                for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, text(t), lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def prompt_logprobs_rows(model, tokenizer, prompt_ids: list[int], hidden: torch.Tensor, start: int, num_top: int,
                         chunk: int = 256) -> list[TokenLogprob]:
    """The prompt logprobs a prefill chunk gives: hidden [n, H] holds the rows of prompt positions
    start .. start + n - 1 (row r predicts token r + 1). Returns the entries of prompt tokens
    start + 1 .. (past the prompt's end: none), preceded, for the chunk at 0, by the first token's
    (no logprob: nothing predicts it). The chunks of one prompt, in order, give one entry per token."""
    out = [TokenLogprob(prompt_ids[0], token_text(tokenizer, prompt_ids[0]), None)] if start == 0 else []
    rows = max(0, min(len(hidden), len(prompt_ids) - 1 - start))
    texts: dict[int, str] = {}
    for lo in range(0, rows, chunk):  # sub-chunks: [rows, vocab] float32 logits are large
        hi = min(lo + chunk, rows)
        logits = model.logits(hidden[lo:hi])
        out += compute_logprobs(logits, prompt_ids[start + lo + 1: start + hi + 1], num_top, tokenizer, texts)
    return out
