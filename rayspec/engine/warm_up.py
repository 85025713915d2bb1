"""What an engine does once, before its first request: compile the step's common shapes (with the
compiled step), check paged attention against the gather, and seed the draft planner's cost fit.
Each function runs dummy sequences through the engine's own target forward."""

from __future__ import annotations

import logging
import time

import torch

from rayspec.device_io import to_host
from rayspec.engine.drafting import MeasuredCosts
from rayspec.model.compiled import MAX_ROWS, bucket, verify_rows
from rayspec.sampling.sampler import argmax

logger = logging.getLogger(__name__)


def calibrate_costs(engine, costs: MeasuredCosts, context: int = 32, repeats: int = 3) -> None:
    """Seed the planner's verification cost fit: a dummy sequence of `context` tokens verifies 1,
    2 and 1 + num_speculative_tokens rows (forward and logits, the median of `repeats` each).
    The engine's own steps refine the fit from then on."""
    seq_id, kv = "__calibrate_costs", engine.kv
    if kv.num_free_slots == 0:
        return
    kv.allocate(seq_id)
    try:
        with torch.inference_mode():
            engine._target_forward([seq_id], [[0] * context], packed=True)
            for rows in (1, 2, 1 + engine.max_k, 1):
                times = []
                for _ in range(repeats):
                    kv.set_cached_len(seq_id, context)
                    started = time.perf_counter()
                    hidden, _ = engine._target_forward([seq_id], [[0] * rows], packed=True, static=True)
                    to_host(argmax(engine.model.logits(hidden)))
                    times.append(time.perf_counter() - started)
                costs.observe_verify(1, rows, rows * (context + rows), sorted(times)[repeats // 2], warm=True)
    finally:
        kv.free(seq_id)


def keep_compiled_step(engine) -> bool:
    """Where `compile` was left to its default: time a decode forward eager and compiled, and keep
    the compiled step only if it is the faster here (it measured 3.4x faster for SmolLM2's shapes on
    an H200 and 0.76x for Llama-3.1-8B's). Turned off, the proposer follows the target."""
    eager_s, compiled_s = engine._time_decode(False), engine._time_decode(True)
    engine.compile_timings = {"eager_s": eager_s, "compiled_s": compiled_s}
    if compiled_s < eager_s:
        return True
    logger.info("compiled step off: a decode forward took %.2f ms compiled, %.2f ms eager",
                compiled_s * 1e3, eager_s * 1e3)
    engine.runner.compiled, engine.compile = None, False
    engine.proposer.set_compile(False)
    return False


def verification_rows(max_num_seqs: int, max_k: int) -> int:
    """The compiled step's most padded rows: every batch bucket up to max_num_seqs at the verification's
    rows (1 + max_k, bucketed), and never fewer than rayspec.model.compiled.MAX_ROWS."""
    return max(MAX_ROWS, bucket(max_num_seqs) * bucket(1 + max_k))


def compile_buckets(engine) -> list[tuple[int, int]]:
    """Compile (and on CUDA capture) every batch bucket up to max_num_seqs at 1 row (decoding) and
    at the verification's rows (1 + num_speculative_tokens, bucketed), and where a shorter verification
    is not padded to those (rayspec.model.compiled.verify_rows: a batch past PAD_ROWS) at each smaller
    row bucket too: no graph is left to compile mid-serving. Returns the (batch, rows) done."""
    runner, kv, done = engine.runner, engine.kv, []
    top = bucket(1 + engine.max_k)
    for rows in [1 << i for i in range(top.bit_length())]:  # 1, 2, 4, ..., top
        b = 1
        while b <= bucket(engine.config.max_num_seqs) and runner.compiled.fits(b, rows):
            if verify_rows(b, rows, runner.min_verify_rows) != rows:  # padded to a bucket done already
                b *= 2
                continue
            ids = [f"__warm_up_{i}" for i in range(min(b, kv.num_free_slots))]
            if len(ids) < b:
                break
            try:
                for i in ids:
                    kv.allocate(i)
                engine._target_forward(ids, [[0] * rows for _ in ids], packed=True, static=True)
                done.append((b, rows))
            finally:
                for i in ids:
                    kv.free(i)
            b *= 2
    sync(engine.device)
    return done


def paged_attention_agrees(runner, contexts: tuple[int, ...] = (40, 77, 13), tolerance: float = 0.02) -> bool:
    """Paged attention's self-check (EngineConfig.paged_attention): forwards of dummy sequences through
    the compiled step with attention gathering the keys and reading the pool in place: a decode of one
    sequence, a decode of a batch of sequences of different contexts (blocks and partial blocks), and a
    verification of token trees over that batch (issue #50 (f): on an H100 the batch > 1 kernel once
    failed where batch 1 passed). Each must agree to `tolerance` of the hidden states' largest magnitude
    (bfloat16 kernels differ in their last bits, a wrong mask by far more). Where one does not, paged
    attention is turned off with an error in the log, so a kernel fault costs speed, not correctness."""
    from rayspec.model.batch_layout import TreeQuery

    n = min(len(contexts), runner.kv.num_free_slots)
    ids = [f"__paged_check_{i}" for i in range(n)]
    vocab = runner.model.args.vocab_size
    trees = [TreeQuery([-1, 0, 0, 1]), TreeQuery([-1, 0]), TreeQuery([-1, 0, 1])][:n]
    forwards = [(ids[:1], [[5]], None), (ids, [[5 + i] for i in range(n)], None),
                (ids, [[(11 * i + 3 * j) % vocab for j in range(t.num_nodes)] for i, t in enumerate(trees)], trees)]
    outputs: list[list[torch.Tensor]] = [[], []]
    for i in ids:
        runner.kv.allocate(i)
    try:
        for i, context in zip(ids, contexts):
            runner.forward_hidden([i], [[(7 * j + 3 + len(i)) % vocab for j in range(context)]])
        for paged in (False, True):
            runner.paged_attention = paged
            for seq_ids, tokens, tree in forwards:
                for i, context in zip(ids, contexts):
                    runner.kv.set_cached_len(i, context)
                outputs[paged].append(runner.forward_hidden(seq_ids, tokens, trees=tree, packed=True,
                                                            static=True)[0].float())
    finally:
        runner.paged_attention = True
        for i in ids:
            runner.kv.free(i)
    for name, gather, paged in zip(("a decode", f"a decode of {n}", f"trees of {n}"), *outputs):
        diff, scale = (paged - gather).abs().max().item(), gather.abs().max().item()
        if not diff <= tolerance * max(scale, 1e-6):  # (NaN fails too)
            logger.error("paged attention off: %s differs from the gather's by %.4g (hidden states up to %.4g); "
                         "please report this GPU and torch version", name, diff, scale)
            return False
    logger.info("paged attention on: agrees with the gather (a decode, a batch, trees)")
    return True


def time_decode(engine, static: bool, repeats: int = 10) -> float:
    """Seconds per one-token forward of a dummy sequence (the first calls, which compile, untimed)."""
    seq_id = "__time_decode"
    engine.kv.allocate(seq_id)
    try:
        for _ in range(2):
            engine._target_forward([seq_id], [[0]], packed=True, static=static)
        sync(engine.device)
        started = time.perf_counter()
        for _ in range(repeats):
            engine._target_forward([seq_id], [[0]], packed=True, static=static)
        sync(engine.device)
        return (time.perf_counter() - started) / repeats
    finally:
        engine.kv.free(seq_id)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
