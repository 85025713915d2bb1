"""The engine end to end on one GPU (issue #50 item 1): tokens out of `LLMEngine`, not a forward alone.

(Over 500 lines: one prepared GPU run, its oracle proposer, per-step timing and profiling, table and plot
in one file, so the device machine runs one script.)

One process, no network, no Ray, random bfloat16 weights of Llama-3.1-8B's shapes (built from the shape
table of benchmarks/gpu_roofline.py, no download). 1k-token prompts, 256 output tokens, batch 1, 8 and 32.
Phases, in this order (each printed with its elapsed seconds; each result written to the JSON as soon as
it is measured; --budget-s stops starting new phases):
1. target alone, eager: every batch (the eager reference outputs);
2. target alone, compiled (CUDA graphs): warm-up, every batch (the compiled reference outputs, which the
   oracle drafts from), then the forward-only step of gpu_roofline.py (`decode_step`: the compiled target
   forward + LM head + argmax, no token read back) on this engine's own runner and graphs, at each batch
   with a 1k context: the reference the end-to-end figures are divided by; with overlap scheduling on (the
   default on CUDA, rayspec.engine.overlap) the compiled target runs every batch again with it off
   (section no_overlap), so its effect on tok/s and GPU idle share is read in one run;
3. EAGLE-3 with an oracle head, compiled: every acceptance length of the sweep at every batch; then
   (section oracle_t1) at --eager-acceptance's length with temperature 1, unseeded (rejection sampling:
   its host reads per cycle and tok/s; the spine is the greedy continuation, so fewer nodes are accepted);
4. EAGLE-3 with the oracle head, eager, at one acceptance length (its outputs checked too).

The target (--target decisive, the default) is made decisive (`make_decisive`): its greedy continuation of
token x is perm[x] by a wide margin, so it is the same whatever the computation's shape and rounding (with
plain random bfloat16 weights it is not: the first H200 runs, results/gpu_engine_h200_run{1,2,3}.json, where
the oracle's recorded continuation was left within ~8 tokens and nothing was accepted). Every greedy run is
checked against that known continuation (=succ), and the oracle needs no reference run: its phases can run in
a call of their own (--sections oracle,oracle_t1). What =succ checks is the tokens and positions fed, not
attention's values (the continuation does not depend on them; benchmarks/gpu_checks.py checks those).

The oracle head (`OracleEagle`) is the real proposer (rayspec.proposers.eagle.EagleProposer) over a real
EAGLE-3 head of the real head's shapes (one decoder layer fed the inputs of 3 target layers, a 32k draft
vocabulary, random weights): it catches up, runs its depth forwards, top-k and one read, so its draft time
is what a real head's is. It then replaces the draft's tokens: a fixed tree of the same node count (a spine
of `depth` nodes, the other nodes siblings along it), the spine's node at depth d is the target's own
greedy continuation (from phase 2) with probability p given the nodes above it are, siblings never are.
(With the decisive target the continuation is perm's chain from the last token; with --target random, the
compiled target's recorded output.) The expected tokens per cycle (acceptance length) is then 1 + p + p^2 + ... + p^depth; p is solved for each
target length and the achieved one is printed beside it (shorter near max_tokens, where drafts shrink).

Per run: output tok/s of steady decode (and end to end with prefill), ms per cycle (one engine step with
every sequence) split into draft (the proposer's call), verify (the target's forward, logits and verdict:
LLMEngine._verify; in a step queued by overlap scheduling, the queueing of its forward and draws, which on
CUDA returns before the device has run them) and host (the rest of the step, a queued step's wait for the
step before it included), GPU idle share over a window of steps under
torch.profiler (CUDA only: the union of kernel and copy intervals against the window's wall time), host
reads per cycle (rayspec.device_io.count_host_reads), and whether the greedy outputs equal target-only's
(compiled and eager). JSON + table + plot (matplotlib, else a note).

Budget, measured on an H200 (2026-12-04, host Intel Xeon, 16 cores): model build 5-7 s; target eager at
batches 1, 8, 32: 80 s; the compiled target's warm-up: 204 s for batches 1, 8, 32 (30 s for batch 1 alone, the
inductor cache warm), its runs 9 s per section, forward-only 2.5 s; the oracle's compiled warm-up 153 s at
batch 1 alone; each oracle run at batch 1 8-19 s. The whole default run does not fit one 8-minute call: run it
as two, back to back on the warm machine (the second needs no reference from the first):

    python benchmarks/gpu_engine.py --sections eager,compiled,no_overlap,forward --json $OUT/gpu_engine_target.json
    python benchmarks/gpu_engine.py --sections oracle,oracle_t1 --json $OUT/gpu_engine_oracle.json

    python benchmarks/gpu_engine.py --json benchmarks/results/gpu_engine_h200.json
    python benchmarks/gpu_engine.py --dry-run        # tiny shapes on CPU (CI), the same flow
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_roofline import SHAPES, Clock, build_ours, decode_step  # noqa: E402

from rayspec.bench.environment import environment  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.device_io import count_host_reads  # noqa: E402
from rayspec.eagle.head import Eagle3Head, EagleConfig, attach_target, default_aux_layers  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.model.native import CausalLM  # noqa: E402
from rayspec.proposers.base import Draft, ProposeRequest  # noqa: E402
from rayspec.proposers.eagle import EagleProposer  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

ACCEPTANCE_LENGTHS = (2.0, 3.5, 5.4, 6.5)  # 5.4: SGLang's measured MT-bench figure for EAGLE-3 on Llama-3.1-8B
RESULTS: dict = {}


# ---- the oracle head ---------------------------------------------------------------------------
def spine_p(acceptance_length: float, depth: int) -> float:
    """p such that 1 + p + ... + p^depth = acceptance_length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 + sum(mid ** d for d in range(1, depth + 1)) < acceptance_length else (lo, mid)
    return (lo + hi) / 2


def make_decisive(model: CausalLM, residual_ratio: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Makes a random target's greedy continuation a fixed function of the last token, decided by a wide
    margin: the LM head's row perm[x] is token x's embedding, and the layers' writes to the residual stream
    (o_proj, down_proj) are drawn small enough that the residual stays near the last token's embedding
    (their sum estimated at `residual_ratio` times the embedding's size). Token x is then followed by
    perm[x], its logit ~hidden_size/sqrt(hidden_size) = sqrt(hidden_size) standard deviations above the
    others' (64 at Llama-3.1-8B's widths), so no rounding flips it. Why: with plain random weights the top
    two logits of a 128k vocabulary are often closer than bfloat16's rounding, so the greedy continuation
    changes with the computation's shape (a 17-row verification against a 1-row decode; eager against
    compiled; runs 1-3 of results/gpu_engine_h200_*.json), and an oracle proposing the recorded
    continuation is soon off the path the engine is on (achieved acceptance length 1.02 against 5.4).
    The price: the continuation no longer depends on the context, so outputs equal between engines checks
    the tokens and positions fed, not attention's values (benchmarks/gpu_checks.py checks those, in float32).
    The forwards cost the same (the same dense shapes, no zero weights). Returns perm."""
    a = model.args
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(a.vocab_size, generator=g)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(embed[torch.argsort(perm).to(embed.device)])  # row perm[x] = embedding x
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                # a sublayer's write ~ scale * sqrt(fan_in) * its input's size (~ std * sqrt(hidden)); 2L of them
                fan_in = p.shape[1]
                p.normal_(0.0, residual_ratio / (2 * a.num_layers * fan_in * a.hidden_size) ** 0.5)
    return perm


def build_head(target: CausalLM, draft_vocab: int) -> Eagle3Head:
    """A random EAGLE-3 head of the real one's shapes for this target: one decoder layer of the target's
    widths fed the inputs of 3 target layers, `draft_vocab` draft tokens, the target's embedding."""
    a = target.args
    import dataclasses

    config = EagleConfig("eagle3", dataclasses.replace(a, num_layers=1), min(draft_vocab, a.vocab_size),
                         a.hidden_size, default_aux_layers(a.num_layers))
    param = next(target.parameters())
    with torch.device("meta"):
        head = Eagle3Head(config, target.inv_freq.detach().cpu().float())
    head = head.to_empty(device=param.device).to(param.dtype)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
        head.d2t.zero_()  # draft id = target id
        head.t2d.fill_(False)
    head.inv_freq = target.inv_freq.detach().float().to(param.device)
    attach_target(head, target, has_own_embedding=False)
    return head.eval().pack_for_cpu()


class OracleEagle(EagleProposer):
    """The real EAGLE-3 proposer's work, then the tokens replaced by the target's own continuation with
    probability `p` per spine node (see the module doc). `references[request id]`: prompt + the target's
    greedy output."""

    name = "oracle_eagle3"

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.p, self.seed = 1.0, seed
        self.references: dict[str, list[int]] = {}
        self.successor: list[int] | None = None  # a decisive target's perm: its continuation, no reference needed

    def propose(self, requests: list[ProposeRequest], standins=None) -> list[Draft]:
        drafts = super().propose(requests, standins)  # catch-up, the depth forwards, top-k, one read or none
        out = [d if (d.deferred.num_nodes if d.deferred is not None else len(d.tokens)) == 0
               else self._oracle(r, d.deferred.num_nodes if d.deferred is not None else len(d.tokens),
                                 d.deferred.sees is None if d.deferred is not None else d.is_chain)
               for r, d in zip(requests, drafts)]
        deferred = [i for i, d in enumerate(drafts) if d.deferred is not None and d.deferred.num_nodes]
        if deferred:  # drafts left on the device (rayspec.proposers.deferred): the oracle's go there instead
            out = self._on_device(out, deferred, drafts[deferred[0]].deferred.tokens.device)
        return out

    def _oracle(self, req: ProposeRequest, n: int, chain: bool) -> Draft:
        """The oracle's draft of n nodes for this request (a chain, or the fixed tree: see the module doc)."""
        spine = n if chain else min(self.depth, n)
        # the spine (node j at depth j + 1), then siblings along it (sibling k at depth k % spine + 1)
        depths = [j + 1 for j in range(spine)] + [k % spine + 1 for k in range(n - spine)]
        parents = [d - 2 for d in depths]  # the spine node one level up (-1: the root)
        ref, L = self.references.get(req.seq_id), len(req.token_ids)
        if self.successor is not None:  # the decisive target: token x is followed by successor[x]
            ref = list(req.token_ids)
            for _ in range(n):
                ref.append(self.successor[ref[-1]])
        aligned = ref is not None and len(ref) >= L and ref[L - 1] == req.token_ids[-1]
        rng = random.Random(f"{self.seed}:{req.seq_id}:{L}")
        vocab = self.head.args.vocab_size
        tokens, right = [], True
        for j, d in enumerate(depths):
            want = ref[L + d - 1] if aligned and L + d - 1 < len(ref) else None
            wrong = ((want or 0) + 1 + j) % vocab  # distinct among siblings, never the continuation
            if j < spine:
                right = right and want is not None and rng.random() < self.p
                tokens.append(want if right else wrong)
            else:
                tokens.append(wrong)
        return Draft(tokens, None, None if chain else parents)

    @staticmethod
    def _on_device(drafts: list[Draft], rows: list[int], device) -> list[Draft]:
        """The host drafts at `rows` as deferred ones (tokens, depths and ancestry sent without a wait),
        read back with the engine's verdict as the real head's are; the head's own are never read."""
        import numpy as np

        from rayspec.device_io import to_device
        from rayspec.proposers.deferred import DeferredBatch, DeferredRow

        K = max(len(drafts[i].tokens) for i in rows)
        tok, par = np.zeros((len(rows), K), np.int64), np.full((len(rows), K), -1, np.int64)
        kept, depth = np.zeros((len(rows), K), bool), np.ones((len(rows), K), np.int64)
        sees = np.zeros((len(rows), K, K), bool)
        for r, i in enumerate(rows):
            d = drafts[i]
            n = len(d.tokens)
            parents = d.parents if d.parents is not None else list(range(-1, n - 1))
            tok[r, :n], par[r, :n], kept[r, :n] = d.tokens, parents, True
            for j, p in enumerate(parents):
                depth[r, j] = 1 if p < 0 else depth[r, p] + 1
                sees[r, j] = sees[r, p] if p >= 0 else False
                sees[r, j, j] = True
        tok_d, par_d, kept_d, depth_d, sees_d = to_device(tok, par, kept, depth, sees, device=device)
        host = [drafts[i] for i in rows]
        batch = DeferredBatch([tok_d, par_d, kept_d], lambda arrays: host)
        out = list(drafts)
        for r, i in enumerate(rows):
            n, chain = len(drafts[i].tokens), drafts[i].parents is None
            out[i] = Draft([], deferred=DeferredRow(batch, r, n, tok_d[r, :n], None if chain else depth_d[r, :n],
                                                    None if chain else sees_d[r, :n, :n],
                                                    None if chain else par_d[r, :n], None if chain else kept_d[r, :n]))
        return out


# ---- measuring one run ---------------------------------------------------------------------------
def gpu_idle_share(prof) -> dict:
    """From a torch.profiler trace: the window's wall time and the share of it no kernel or copy ran."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not events:
        return {"gpu_idle_share": None, "note": "no events"}
    lo = min(e["ts"] for e in events)
    hi = max(e["ts"] + e.get("dur", 0) for e in events)
    busy, end = 0.0, float("-inf")
    for s, t in device:  # the union of the device's intervals
        if t > end:
            busy += t - max(s, end)
            end = t
    if not device:
        return {"gpu_idle_share": None, "window_ms": round((hi - lo) / 1e3, 3), "note": "no device events (CPU)"}
    return {"gpu_idle_share": round(1 - busy / (hi - lo), 4), "window_ms": round((hi - lo) / 1e3, 3),
            "device_busy_ms": round(busy / 1e3, 3)}


class ProfileWindow:
    """torch.profiler over a few engine steps (CUDA activity where there is a GPU)."""

    def __init__(self, cuda: bool):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        self.result: dict | None = None

    def start(self) -> None:
        self.prof.__enter__()

    def stop(self) -> None:
        self.prof.__exit__(None, None, None)
        try:
            self.result = gpu_idle_share(self.prof)
        except Exception as err:  # noqa: BLE001 (a trace that cannot be read costs the figure only)
            self.result = {"gpu_idle_share": None, "note": f"trace unreadable: {err!r}"[:300]}


def cuda_syncs(step) -> tuple:
    """(step(), the synchronizing CUDA calls it made): torch.cuda.set_sync_debug_mode's warnings,
    which catch a read that bypasses rayspec.device_io.to_host (an .item(), a nonzero, a blocking copy)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out, sum("synchroniz" in str(w.message) for w in caught)


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str, profile_steps: int,
              cuda: bool, temperature: float = 0.0) -> tuple[dict, list[list[int]]]:
    """Prefill then decode `prompts` to max_tokens each; per-step timings of the decode steps (every
    sequence past its prefill), but for a window of `profile_steps` steps under torch.profiler (from the
    4th decode step), left out of the timings. Returns (the run's row, each prompt's output tokens).
    temperature > 0: unseeded (what an OpenAI client sends), verified by rejection sampling."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    verify_s = [0.0]
    verify = engine._verify

    def timed_verify(proposal):  # (its last act is the verdict's read: the device is done by then)
        t = time.perf_counter()
        try:
            return verify(proposal)
        finally:
            verify_s[0] += time.perf_counter() - t

    engine._verify = timed_verify
    launch = engine.overlap._launch

    def timed_launch(*args, **kwargs):  # a queued step's verify: its forward and draws queued (overlap scheduling)
        t = time.perf_counter()
        try:
            return launch(*args, **kwargs)
        finally:
            verify_s[0] += time.perf_counter() - t

    engine.overlap._launch = timed_launch
    counts = {i: 0 for i in ids}
    outputs: dict[str, list[int]] = {}
    steps, window = [], ProfileWindow(cuda) if profile_steps else None
    stats0 = engine.stats.as_dict()
    syncs = None
    started = time.perf_counter()
    try:
        while len(outputs) < len(ids):
            decoding = all(c > 0 for c in counts.values())  # every prefill done: a decode cycle
            profiled = window is not None and decoding and 3 <= len(steps) < 3 + profile_steps
            if profiled and len(steps) == 3:
                window.start()
            draft0, verify0 = engine.stats.propose_seconds, verify_s[0]
            t = time.perf_counter()
            audited = cuda and decoding and len(steps) == 1 and syncs is None  # (one step, left out of the timings)
            with count_host_reads() as reads:
                if audited:
                    outs, syncs = cuda_syncs(engine.step)
                else:
                    outs = engine.step()
            wall = time.perf_counter() - t
            emitted = 0
            for o in outs:
                emitted += o.num_output_tokens - counts[o.request_id]
                counts[o.request_id] = o.num_output_tokens
                if o.finished:
                    outputs[o.request_id] = list(o.token_ids)
            if decoding:
                steps.append({"wall": wall, "draft": engine.stats.propose_seconds - draft0, "profiled": profiled or audited,
                              "verify": verify_s[0] - verify0, "tokens": emitted, "reads": reads.count})
            if profiled and (len(steps) == 3 + profile_steps or len(outputs) == len(ids)):
                window.stop()
    finally:
        engine._verify = verify
        engine.overlap._launch = launch
    total = time.perf_counter() - started
    timed = [s for s in steps if not s["profiled"]] or steps
    wall, n = sum(s["wall"] for s in timed), max(len(timed), 1)
    stats = engine.stats.as_dict()
    drafts = stats["num_drafts"] - stats0["num_drafts"]
    accepted = stats["num_accepted_tokens"] - stats0["num_accepted_tokens"]
    row = {"batch": len(prompts), "decode_steps": len(steps),
           "tok_s": round(sum(s["tokens"] for s in timed) / wall, 1) if wall else None,
           "tok_s_e2e": round(len(prompts) * max_tokens / total, 1),
           "ms_per_cycle": round(wall / n * 1e3, 3),
           # the spread of the steps (a mean over 256 may hide a few slow ones: a compile, a block's growth)
           **{f"ms_per_cycle_{q}": round(statistics.quantiles([s["wall"] for s in timed], n=10)[i] * 1e3, 3)
              if len(timed) >= 2 else None for q, i in (("p10", 0), ("median", 4), ("p90", 8))},
           "ms_per_cycle_max": round(max((s["wall"] for s in timed), default=0) * 1e3, 3),
           "draft_ms": round(sum(s["draft"] for s in timed) / n * 1e3, 3),
           "verify_ms": round(sum(s["verify"] for s in timed) / n * 1e3, 3),
           "host_ms": round(sum(s["wall"] - s["draft"] - s["verify"] for s in timed) / n * 1e3, 3),
           "host_reads_per_cycle": round(sum(s["reads"] for s in timed) / n, 2),
           "host_reads_max": max((s["reads"] for s in timed), default=0),
           "cuda_syncs_in_a_cycle": syncs,  # every sync CUDA saw in one decode step (hidden ones too)
           "acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0}
    row.update(window.result if window is not None and window.result else {"gpu_idle_share": None, "note": "not profiled"})
    return row, [outputs[i] for i in ids]


def equal(outs: list[list[int]], ref: list[list[int]] | None) -> dict:
    """Whether each output equals the reference's, and the first position where any differs."""
    if ref is None:
        return {"outputs_equal": None}
    same = sum(a == b for a, b in zip(outs, ref))
    first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(outs, ref)]
    return {"outputs_equal": f"{same}/{len(ref)}", "first_difference": min((f for f in first if f is not None), default=None)}


# ---- the flow ------------------------------------------------------------------------------------
def record(out: Path | None, section: str, row: dict) -> None:
    RESULTS.setdefault(section, []).append(row)
    print(json.dumps({section: row}), flush=True)
    if out is not None:
        out.write_text(json.dumps(RESULTS, indent=1))


class Phases:
    def __init__(self, budget_s: float, out: Path | None):
        self.started, self.budget_s, self.out = time.perf_counter(), budget_s, out

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @contextmanager
    def phase(self, name: str):
        """Runs the block unless the budget is spent; records its seconds (and its error: the next phases go on)."""
        if self.elapsed() > self.budget_s:
            record(self.out, "phases", {"phase": name, "skipped": f"budget of {self.budget_s} s spent"})
            yield False
            return
        t = time.perf_counter()
        print(f"--- {name} (at {self.elapsed():.1f} s)", flush=True)
        try:
            yield True
            record(self.out, "phases", {"phase": name, "seconds": round(time.perf_counter() - t, 1)})
        except Exception as err:  # noqa: BLE001 (one phase failing must not lose the others)
            record(self.out, "phases", {"phase": name, "seconds": round(time.perf_counter() - t, 1), "error": repr(err)[:2000]})
            record(self.out, "errors", {"case": name, "error": repr(err)[:2000], "trace": traceback.format_exc()[-3000:]})
        gc.collect()  # (an engine dropped by the phase: its KV pool and graphs go before the next is built)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_config(a, compile: bool, spec: SpeculativeConfig) -> EngineConfig:
    return EngineConfig(model="random", device=a.device, dtype=a.dtype_name, max_model_len=a.prompt_len + a.max_tokens + 64,
                        max_num_seqs=max(a.batches), kv_cache_memory_gb=a.kv_gb, compile=compile,
                        enable_prefix_caching=False, max_num_batched_tokens=a.chunk, speculative=spec,
                        defer_draft_reads={"auto": None, "on": True, "off": False}[a.defer_draft_reads],
                        overlap_scheduling={"auto": None, "on": True, "off": False}[a.overlap])


def oracle_engine(a, model: CausalLM, compile: bool) -> LLMEngine:
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=a.nodes, eagle_topk=a.topk, num_steps=a.depth,
                             adaptive=False, tree_max_batch=a.tree_max_batch, eagle_stop_prob=0.0)
    config = engine_config(a, compile, spec)
    head = build_head(model, a.draft_vocab)
    proposer = OracleEagle(head, config.max_model_len, config.max_num_seqs, a.nodes, topk=a.topk, depth=a.depth)
    proposer.runner.max_chunk_tokens = a.chunk
    # compiled: the tree's depth loop as one graph (rayspec.proposers.tree_graph), or each depth from Python
    proposer.captured_trees = getattr(a, "captured_trees", "on") == "on"
    proposer.set_compile(compile)
    return LLMEngine(config, model=model, tokenizer=None, proposer=proposer)


def chain(successor: list[int], token: int, n: int) -> list[int]:
    """The decisive target's greedy continuation of `token`: n tokens."""
    out = []
    for _ in range(n):
        token = successor[token]
        out.append(token)
    return out


def tag_of(label: str, batch: int) -> str:
    """The request ids' prefix of one run (the oracle finds its references by them)."""
    return f"{label}-b{batch}".replace(" ", "_")


def warm(a, engine: LLMEngine, prompts, label: str) -> None:
    """A short untimed run at every batch: the shapes a run takes are compiled (the head's depth forwards
    compile when first seen) and their kernels loaded before any timing."""
    for b in a.batches:
        t = time.perf_counter()
        run_batch(engine, prompts[:b], a.warm_tokens, tag_of(f"warm {label}", b), 0, False)
        # which compiled shapes (batch x rows buckets) the warm-up left, and its seconds per batch: where a
        # warm-up's minutes go (each 8B graph ~25 s on the H200)
        shapes = {name: sorted(c.shapes) for name, c in (("target", engine.runner.compiled),
                                                          ("proposer", getattr(getattr(engine.proposer, "runner", None),
                                                                               "compiled", None))) if c is not None}
        graph = getattr(engine.proposer, "tree_graph", None)
        if graph is not None:  # the captured depth loops: (batch bucket, width, depth)
            shapes["tree_graph"] = sorted(graph.shapes)
        RESULTS.setdefault("warm_ups", []).append({"engine": label, "batch": b, "seconds": round(time.perf_counter() - t, 1),
                                                   "compiled_shapes": shapes})


def run_engine(a, engine: LLMEngine, prompts, label: str, refs: dict, out, extra=None, temperature: float = 0.0) -> dict:
    """Every batch through one engine; returns {batch: outputs}. refs: {"compiled"/"eager": {batch:
    outputs}} of the target alone, which the outputs are compared with."""
    got = {}
    for b in a.batches:
        row, outs = run_batch(engine, prompts[:b], a.max_tokens, tag_of(label, b), a.profile_steps, a.device == "cuda",
                              temperature)
        got[b] = outs
        config = label.split(" al")[0]  # (an oracle run's label carries its acceptance length)
        row = {"config": config, **(extra or {}), **row}
        for kind, ref in refs.items():
            row.update({f"{k}_vs_{kind}": v for k, v in equal(outs, ref.get(b)).items()})
        record(out, "runs", row)
    return got


def forward_only(a, engine: LLMEngine, prompts, clock: Clock, out) -> None:
    """gpu_roofline.py's forward-only step on this engine's runner (its compiled graphs, its pool)."""
    runner, kv = engine.runner, engine.kv
    for b in a.batches:
        ids = [f"s{i}" for i in range(b)]
        try:
            for i, s in enumerate(ids):
                kv.allocate(s)
                runner.forward_hidden([s], [prompts[i]])
            t = clock.time(decode_step(runner, engine.model, b, a.prompt_len), iters=a.iters)
            record(out, "forward_only", {"batch": b, "context": a.prompt_len, "ms_per_step": round(t * 1e3, 3),
                                         "tok_s": round(b / t, 1), "note": "forward + LM head + argmax, no read back"})
        finally:
            for s in ids:
                if kv.has(s):
                    kv.free(s)


def summary(a) -> dict:
    fwd = {r["batch"]: r for r in RESULTS.get("forward_only", [])}
    s = {"gpu": environment().get("gpu_model")}
    for r in RESULTS.get("runs", []):
        key = f"{r['config'].replace(' ', '_')}_al{r.get('acceptance_target', '')}_b{r['batch']}"
        s[key + "_tok_s"] = r["tok_s"]
        if r["config"] == "target compiled" and r["batch"] in fwd:
            s[f"target_b{r['batch']}_ms_over_forward_only"] = round(r["ms_per_cycle"] / fwd[r["batch"]]["ms_per_step"], 3)
    return s


def plot(path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib absent: no plot")
        RESULTS["plot"] = "matplotlib absent: no plot"
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    runs = RESULTS.get("runs", [])
    for b in sorted({r["batch"] for r in runs}):
        pts = sorted((r["acceptance_length"], r["tok_s"]) for r in runs if r["batch"] == b and r["config"] == "eagle3 oracle compiled")
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"EAGLE-3 oracle, batch {b}")
        for r in runs:
            if r["batch"] == b and r["config"] == "target compiled":
                ax.axhline(r["tok_s"], linestyle="--", color=ax.lines[-1].get_color() if ax.lines else None,
                           label=f"target alone, batch {b}")
        for r in RESULTS.get("forward_only", []):
            if r["batch"] == b:
                ax.axhline(r["tok_s"], linestyle=":", color=ax.lines[-1].get_color() if ax.lines else None,
                           label=f"forward-only step, batch {b}")
    ax.set_xlabel("achieved acceptance length (tokens per cycle)")
    ax.set_ylabel("output tok/s (steady decode)")
    ax.set_yscale("log")
    ax.set_title(f"LLMEngine end to end, {RESULTS['args']['shape']} on {RESULTS['summary'].get('gpu') or 'CPU'}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def table() -> None:
    print(f"\n{'config':<26}{'AL':>6}{'b':>4}{'tok/s':>9}{'ms/cyc':>9}{'median':>8}{'p90':>8}{'draft':>8}{'verify':>8}{'host':>8}"
          f"{'idle':>7}{'reads':>7}{'=comp':>9}{'=eager':>9}{'=succ':>9}")
    for r in RESULTS.get("runs", []):
        idle = r.get("gpu_idle_share")
        print(f"{r['config']:<26}{r['acceptance_length']:>6.2f}{r['batch']:>4}{r['tok_s'] or 0:>9.1f}"
              f"{r['ms_per_cycle']:>9.2f}{r.get('ms_per_cycle_median') or 0:>8.2f}{r.get('ms_per_cycle_p90') or 0:>8.2f}"
              f"{r['draft_ms']:>8.2f}{r['verify_ms']:>8.2f}{r['host_ms']:>8.2f}"
              f"{'-' if idle is None else f'{idle:.2f}':>7}{r['host_reads_per_cycle']:>7}"
              f"{str(r.get('outputs_equal_vs_compiled')):>9}{str(r.get('outputs_equal_vs_eager')):>9}"
              f"{str(r.get('outputs_equal_vs_successor')):>9}")
    for r in RESULTS.get("forward_only", []):
        print(f"{'forward only (compiled)':<26}{'':>6}{r['batch']:>4}{r['tok_s']:>9.1f}{r['ms_per_step']:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--acceptance-lengths", default=",".join(map(str, ACCEPTANCE_LENGTHS)))
    parser.add_argument("--eager-acceptance", type=float, default=5.4, help="the eager EAGLE run's length (0: none)")
    parser.add_argument("--nodes", type=int, default=16, help="tree nodes verified per cycle (num_speculative_tokens)")
    parser.add_argument("--depth", type=int, default=8, help="the head's depth forwards (num_steps): the spine's length")
    parser.add_argument("--topk", type=int, default=4, help="the head's branching (eagle_topk)")
    parser.add_argument("--tree-max-batch", type=int, default=32, help="trees up to this batch, chains past it")
    parser.add_argument("--defer-draft-reads", default="auto", choices=("auto", "on", "off"),
                        help="EAGLE drafts read with the verdict (one read a cycle); auto: on CUDA")
    parser.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                        help="overlap_scheduling of the engines (auto: on for CUDA); section no_overlap runs the "
                             "compiled target again with it off")
    parser.add_argument("--captured-trees", default="on", choices=("on", "off"),
                        help="compiled EAGLE: a tree's whole depth loop as one graph (CUDA graph), or a compiled "
                             "head forward per depth from Python (the path before it)")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--kv-gb", type=float, default=8.0)
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--warm-tokens", type=int, default=24, help="output tokens of each engine's untimed runs")
    parser.add_argument("--iters", type=int, default=20, help="forward-only timing iterations")
    parser.add_argument("--profile-steps", type=int, default=8, help="decode steps per run under torch.profiler")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no phase past this many seconds")
    parser.add_argument("--sections", default="eager,compiled,no_overlap,forward,oracle,oracle_t1,oracle_eager",
                        help="oracle_t1: the compiled oracle again at --eager-acceptance's length, temperature 1 "
                             "unseeded (rejection sampling: one read a cycle with deferred drafts too)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    parser.add_argument("--target", default="decisive", choices=("decisive", "random"),
                        help="decisive: the target's greedy continuation decided by a wide margin (make_decisive), "
                             "so the oracle's recorded continuation is the one the engine follows in bfloat16")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="auto: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, the whole flow (CI)")
    a = parser.parse_args()
    if a.dry_run:
        a.shape, a.batches, a.prompt_len, a.max_tokens, a.iters = "tiny", "1,2", 40, 24, 2
        a.nodes, a.depth, a.topk, a.draft_vocab, a.kv_gb, a.profile_steps, a.warm_tokens = 6, 4, 2, 256, 0.05, 2, 8
        if a.defer_draft_reads == "auto":  # the path a GPU takes (deferred drafts), on the CPU
            a.defer_draft_reads = "on"
        if a.overlap == "auto":  # (likewise: overlap scheduling)
            a.overlap = "on"
    a.batches = [int(b) for b in str(a.batches).split(",")]
    lengths = [float(x) for x in str(a.acceptance_lengths).split(",") if x]
    sections = set(a.sections.split(","))
    a.device = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    if a.device == "cpu":
        torch.set_num_threads(1)
        from rayspec.model.compiled import CompiledForward
        CompiledForward.backend = "aot_eager"  # the traced step without inductor's minutes of C++ compiles
    a.dtype_name = a.dtype if a.dtype != "auto" else "bfloat16" if a.device == "cuda" else "float32"
    dtype = getattr(torch, a.dtype_name)
    out = Path(a.json) if a.json else None
    RESULTS["args"] = {k: v for k, v in vars(a).items()}
    RESULTS["environment"] = environment()
    phases, clock = Phases(a.budget_s, out), Clock(torch.device(a.device))
    rng = random.Random(0)
    vocab = SHAPES[a.shape][0]
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(max(a.batches))]
    refs: dict[str, dict] = {}
    perm: dict[str, torch.Tensor] = {}
    with phases.phase("build the model") as go:
        model = build_ours(a.shape, torch.device(a.device), dtype,
                           prepare=(lambda m: perm.setdefault("p", make_decisive(m))) if a.target == "decisive" else None)
    successor = perm["p"].tolist() if perm else None
    if successor is not None:  # the decisive target's greedy output is known: every run is checked against it
        refs["successor"] = {b: [chain(successor, p[-1], a.max_tokens) for p in prompts[:b]] for b in a.batches}
    engine = None
    if "eager" in sections:
        with phases.phase("target alone, eager") as go:
            if go:
                engine = LLMEngine(engine_config(a, False, SpeculativeConfig(method="none")), model=model, tokenizer=None)
                warm(a, engine, prompts, "target eager")
                refs["eager"] = run_engine(a, engine, prompts, "target eager",
                                           {k: v for k, v in refs.items() if k == "successor"}, out)
                engine = None
    with phases.phase("target alone, compiled: warm-up") as go:
        if go and sections & {"compiled", "no_overlap", "forward"}:
            engine = LLMEngine(engine_config(a, True, SpeculativeConfig(method="none")), model=model, tokenizer=None)
            warm(a, engine, prompts, "target compiled")
    if "compiled" in sections:
        with phases.phase("target alone, compiled") as go:
            if go:
                refs["compiled"] = run_engine(a, engine, prompts, "target compiled",
                                              {k: v for k, v in refs.items() if k in ("eager", "successor")}, out)
    if "no_overlap" in sections and engine is not None and engine.overlap.enabled():
        with phases.phase("target alone, compiled, overlap scheduling off") as go:
            if go:
                engine.config.overlap_scheduling = False
                run_engine(a, engine, prompts, "target compiled no-overlap",
                           {k: v for k, v in refs.items() if k in ("eager", "compiled", "successor")}, out)
                engine.config.overlap_scheduling = {"auto": None, "on": True, "off": False}[a.overlap]
    if "forward" in sections:
        with phases.phase("forward-only step (gpu_roofline.decode_step)") as go:
            if go and engine is not None:
                with torch.inference_mode():
                    forward_only(a, engine, prompts, clock, out)
    engine = None
    reference = refs.get("compiled") or refs.get("eager") or {}  # what the oracle drafts from
    for compiled, label, wanted in ((True, "eagle3 oracle compiled", lengths),
                                    (False, "eagle3 oracle eager", [a.eager_acceptance] if a.eager_acceptance else [])):
        if ("oracle" if compiled else "oracle_eager") not in sections or not wanted:
            continue
        with phases.phase(f"{label}: warm-up") as go:
            if go:
                engine = oracle_engine(a, model, compiled)
                engine.proposer.p, engine.proposer.successor = 0.5, successor
                warm(a, engine, prompts, label)
        for length in wanted:
            with phases.phase(f"{label}, acceptance length {length}") as go:
                if go and engine is not None:
                    p = spine_p(length, min(a.depth, a.nodes))
                    run_label = f"{label} al{length}"
                    engine.proposer.p = p
                    engine.proposer.references = {f"{tag_of(run_label, b)}-{i}": prompts[i] + outs[i]
                                                  for b, outs in reference.items() for i in range(b)}
                    run_engine(a, engine, prompts, run_label, refs, out,
                               extra={"acceptance_target": length, "p_per_node": round(p, 4),
                                      "reachable": length <= 1 + min(a.depth, a.nodes)})
        if compiled and "oracle_t1" in sections and a.eager_acceptance:
            with phases.phase(f"{label}, acceptance length {a.eager_acceptance}, temperature 1") as go:
                if go and engine is not None:
                    # the spine is the greedy continuation: at T = 1 a node is accepted with the target's
                    # probability of it, so the achieved length is lower than the target's (printed)
                    p = spine_p(a.eager_acceptance, min(a.depth, a.nodes))
                    run_label = f"{label} t1 al{a.eager_acceptance}"
                    engine.proposer.p = p
                    engine.proposer.references = {f"{tag_of(run_label, b)}-{i}": prompts[i] + outs[i]
                                                  for b, outs in reference.items() for i in range(b)}
                    run_engine(a, engine, prompts, run_label, {}, out, temperature=1.0,
                               extra={"temperature": 1.0, "acceptance_target": a.eager_acceptance,
                                      "p_per_node": round(p, 4)})
        engine = None
    RESULTS["summary"] = summary(a)
    RESULTS["summary"]["wall_s"] = round(phases.elapsed(), 1)
    table()
    print(json.dumps(RESULTS["summary"], indent=1))
    if out is not None or a.plot:
        plot(Path(a.plot) if a.plot else out.with_suffix(".png"))
    if out is not None:
        out.write_text(json.dumps(RESULTS, indent=1))
    if RESULTS.get("errors"):
        print(f"{len(RESULTS['errors'])} phase(s) failed: see 'errors' in the JSON")
        if a.dry_run:
            sys.exit(1)


if __name__ == "__main__":
    main()
