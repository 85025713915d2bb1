"""The compiled step: the target's decode and verification forwards through torch.compile.

A forward's shapes are padded to buckets, so a handful of graphs serve every step: the batch and
the rows per sequence to powers of two, the keys to a multiple of KV_BUCKET (marked dynamic, so one
graph per batch x rows bucket covers every context length). Padding rows read and write the
scratch block; padded keys are masked. On CUDA the graphs are captured in CUDA graphs
(mode "reduce-overhead": a step replays its kernels in one launch); on CPU inductor's C++ kernels.
Prefill chunks (any length) and tensor-parallel models stay eager. Sliding-window layers get a mask of
their own over every key. A mixture of experts (rayspec.model.moe) is one opaque op in the graph whose
loop reads on the host which experts a forward uses: no CUDA graph can hold that read, so such a model's
step is compiled without CUDA graphs (inductor's kernels, launched one by one).

The default (`EngineConfig.compile` None): off on CPU; on CUDA the engine times a decode forward
eager and compiled when it is built and keeps the faster (LLMEngine.warm_up).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

KV_BUCKET = 64
MAX_ROWS = 64  # by default a forward of more padded rows (batch x rows) runs eager (a prefill's size)
# a verification of fewer rows than the engine's (1 + num_speculative_tokens, bucketed) is padded to it while
# the batch's padded rows stay within this (an 8B forward on an H100 reads its weights for ~4.8 ms and
# computes 64 rows in ~1.5 ms: padding to 64 is nearly free); past it the warm-up compiles each smaller
# row bucket as well (rayspec.engine.warm_up.compile_buckets). Either way no graph is compiled mid-serving.
PAD_ROWS = 64


def verify_rows(batch: int, rows: int, verify_bucket: int) -> int:
    """The padded rows per sequence of a static forward of `rows` rows at `batch` sequences, where the
    engine's verification takes `verify_bucket` rows: a decode (1 row) its own bucket, a shorter
    verification the engine's bucket while bucket(batch) x that is within PAD_ROWS, else its own."""
    own = bucket(rows)
    if rows > 1 and own < verify_bucket and bucket(batch) * verify_bucket <= PAD_ROWS:
        return verify_bucket
    return own

# where the compiled step may be faster than eager (docs/benchmarks-history.md, "Compiled step"). On an
# H200 it measured 3.4-3.9x faster for SmolLM2's shapes (launch-bound) and 0.76-0.83x for
# Llama-3.1-8B's (benchmarks/results/gpu_compiled_h200.json, gpu_fusion_h200.json): so on CUDA the
# default is decided per engine, by timing a decode forward both ways (LLMEngine.warm_up). On CPU
# off: inductor's C++ step measured slower for SmolLM2 and each bucket compiles for 30-300 s.
COMPILE_BY_DEFAULT = {"cpu": False, "cuda": True}


def default_compile(device: torch.device) -> bool:
    return COMPILE_BY_DEFAULT.get(device.type, False)


def bucket(n: int) -> int:
    """The next power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def compilable(model) -> bool:
    """Whether this model's forward may be compiled (one process)."""
    tp = getattr(model, "tp", None)
    return getattr(tp, "size", 1) == 1


class CompiledForward:
    """model(input_ids, cache, batch, **kw) compiled for padded, bucketed shapes."""

    # torch.compile's backend. Tests set "aot_eager" to check the traced step without inductor's
    # kernels: inductor's CPU FlexAttention (torch 2.13) computes wrong outputs for the paged layout
    # (rayspec.model.paged_attention), which is why paged attention is a CUDA feature
    backend = "inductor"

    def __init__(self, model, device: torch.device, max_rows: int = MAX_ROWS):
        """max_rows: the most padded rows (batch x rows) a compiled forward takes; an engine sets it to
        its largest verification, max_num_seqs x (1 + num_speculative_tokens) bucketed (LLMEngine)."""
        import torch._dynamo

        # a graph per batch x rows bucket (and per aux_layers choice): well past the default limit of 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # (a mixture of experts reads on the host inside the step: no CUDA graph, see the module doc)
        self.mode = "reduce-overhead" if device.type == "cuda" and not model.args.num_experts else None
        if self.backend == "inductor":
            self.fn = torch.compile(model, dynamic=False, mode=self.mode)
        else:
            self.mode = None
            self.fn = torch.compile(model, dynamic=False, backend=self.backend)
        self.shapes: set[tuple[int, int]] = set()
        self.max_rows = max_rows

    def fits(self, batch_size: int, rows: int) -> bool:
        return bucket(batch_size) * bucket(rows) <= self.max_rows

    def __call__(self, input_ids, cache, batch, **kwargs):
        if self.mode == "reduce-overhead" and not getattr(cache, "static_address", False):
            # the cache is written in place by every replay: a fixed address CUDA graphs may keep
            for pool in cache.tensors():
                torch._dynamo.mark_static_address(pool)
            cache.static_address = True
        if batch.paged is None:  # one graph for every context length (a paged layout's shapes are static)
            torch._dynamo.mark_dynamic(batch.read_index, 1)
            torch._dynamo.mark_dynamic(batch.mask, 3)
            if batch.sliding_mask is not None and batch.sliding_mask is not batch.mask:
                torch._dynamo.mark_dynamic(batch.sliding_mask, 3)
        key = tuple(input_ids.shape)
        if key not in self.shapes:
            self.shapes.add(key)
            logger.info("compiling the step for batch x rows %s", key)
        out = self.fn(input_ids, cache, batch, **kwargs)
        if self.mode == "reduce-overhead":  # the graph's output buffers are reused by the next replay
            out = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
        return out
