"""Bytes of one forward's activations (an upper bound) and how many tokens the largest forward of an
engine runs (a prefill chunk or a verification of every slot). rayspec.memory.plan adds them to a process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayspec.config import EngineConfig
from rayspec.memory.weight_memory import FLOAT32
from rayspec.model.families import ModelArgs
from rayspec.model.parallel import TPGroup, splits_vocab


@dataclass(frozen=True)
class ActivationPlan:
    """An upper-bound estimate of one forward's activations (see `forward_activations`)."""

    tokens: int  # new tokens in the forward
    kv_len: int  # keys each of them may attend to
    logit_rows: int
    hidden: int
    qkv: int
    scores: int
    mask: int
    mlp: int
    logits: int
    features: int = 0

    @property
    def total(self) -> int:
        return self.hidden + self.qkv + self.scores + self.mask + self.mlp + self.logits + self.features

    @property
    def without_scores(self) -> int:
        """The estimate where SDPA runs a fused kernel (flash / memory-efficient), which holds no scores."""
        return self.total - self.scores


def forward_activations(args: ModelArgs, dtype: torch.dtype, tokens: int, kv_len: int, logit_rows: int,
                        feature_size: int = 0, held_feature_rows: int = 0, tp_size: int = 1,
                        rank: int = 0) -> ActivationPlan:
    """An upper-bound estimate of the memory one forward of `tokens` new tokens, each attending to
    at most `kv_len` keys, allocates beyond the weights and the KV cache. T = tokens, H = hidden,
    I = intermediate, itemsize of the model dtype unless said:

      hidden:   4 x [T, H]: the residual stream, its normed copy, the attention or MLP output, the sum
      qkv:      2 x [T, (heads + 2 kv_heads) x head_dim]: the projections and their rotated copies
      scores:   2 x [heads, T, kv_len] float32 (the scores and their softmax), the same in bool
                (the math path's test for fully masked rows), and K and V repeated to every query
                head in float32: what SDPA's math path materializes, the worst case. The fused
                kernels hold none of it (`without_scores`); the math one runs where they cannot
      mask:     [T, kv_len]: the additive mask in the model dtype, and the boolean one it came from
      mlp:      4 x [T, I]: gate, up, silu(gate) and their product
      logits:   [logit_rows, vocab]: the LM head's output, its float32 copy and a processed copy
      features: EAGLE feature layers' inputs [T, F] and their concatenation, plus
                `held_feature_rows` rows of F a sequence keeps until its first draft

    With tensor parallelism (`rank` of `tp_size`), a rank computes its heads and its slice of the
    intermediate width (qkv, scores, mlp over 1/tp_size); the hidden states are whole on every
    rank. Logits over a split vocabulary: each rank projects its slice ([rows, vocab / N] in the
    dtype, then float32), and all_gather_last gives every rank the N parts and their concatenation
    (2 x [rows, vocab] float32); rank 0 alone processes them. An unsplit vocabulary: rank 0 alone
    computes them, as at tp_size 1. Features: rank 0 alone (the proposer's).

    The terms are summed, though the attention and MLP ones are never live at once; allocator
    rounding and the CUDA context (about 0.5 GB per process) are not counted. Measured on an H100
    (benchmarks/plan_memory_check.py, Llama-3.1-8B, 2048 tokens x 8192 keys): 5.46 GB with the math
    backend against 5.61 GB here, 0.42 GB with the default (fused) one against 0.50 without scores."""
    size = dtype.itemsize
    h, i = args.hidden_size, args.intermediate_size // tp_size
    heads, kv_heads = args.num_heads // tp_size, args.num_kv_heads // tp_size
    qkv_width = (heads + 2 * kv_heads) * args.head_dim
    scores = (heads * tokens * kv_len * (2 * FLOAT32 + torch.bool.itemsize)
              + 2 * heads * kv_len * args.head_dim * FLOAT32)
    v = args.vocab_size
    if splits_vocab(TPGroup(rank=rank, size=tp_size), v):
        logits = logit_rows * (v // tp_size * (size + FLOAT32) + 2 * v * FLOAT32 + (v * FLOAT32 if rank == 0 else 0))
    else:
        logits = logit_rows * v * (size + 2 * FLOAT32) if rank == 0 else 0
    if rank != 0:
        feature_size = held_feature_rows = 0
    return ActivationPlan(
        tokens=tokens, kv_len=kv_len, logit_rows=logit_rows,
        hidden=4 * tokens * h * size,
        qkv=2 * tokens * qkv_width * size,
        scores=scores,
        mask=tokens * kv_len * (size + torch.bool.itemsize),
        mlp=4 * tokens * i * size,
        logits=logits,
        features=(2 * tokens + held_feature_rows) * feature_size * size,
    )


def forward_tokens(config: EngineConfig, max_model_len: int, num_slots: int) -> int:
    """The most tokens one target forward takes: a prefill chunk (max_num_batched_tokens, padding
    included) or a verification of every slot's pending token and k drafts, whichever is more.
    Unchunked (None), every slot's prompt may be prefilled in one padded forward."""
    verify = num_slots * (config.speculative.num_speculative_tokens + 1)
    chunk = config.max_num_batched_tokens
    prefill = num_slots * max_model_len if chunk is None else min(chunk, num_slots * max_model_len)
    return max(prefill, verify)
