"""Our step against the memory roofline, on one GPU, in one process (no network, no Ray, random weights).

Measures, in this order (each section written to the JSON as soon as it is done, so a run cut short
still leaves its figures):
1. the GPU's memory bandwidth: a device-to-device copy and a read-only reduction of a 2 GiB buffer
   (the roofline: the time to read the weights once at that rate);
2. our decode step for Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 / 8 heads, vocabulary
   128,256, bfloat16) at batch 1, 8 and 32 at a 1k context, eager and compiled (CUDA graphs): the
   target forward through `ModelRunner` (as the engine's step runs it: host-built indices, paged
   cache), the LM head and the greedy choice, per step;
3. verification of an 8-node EAGLE-3 tree (the pending token and 7 drafts under a tree mask) and of an
   8-token chain (9 rows), batch 1, compiled, beside the decode step;
4. an EAGLE-3 head's step (one decoder layer at these widths, a 32k draft vocabulary), compiled;
5. the peer: transformers' own decode of the same shapes with a static cache, compiled, per token;
6. the attention candidates for batch > 1 over the paged cache (one layer, decode, sequences' blocks
   scattered over the pool): today's gather of each sequence's keys through its block table plus a
   dense mask and SDPA, against FlexAttention reading the pool in place through a BlockMask built
   from the block tables (compiled), with their largest difference: the measurement that decides
   which one the step should use on this GPU.

It prints one table and writes JSON and a plot (if matplotlib is there). From the measured times it
states the EAGLE-3 tokens per second they imply at a given acceptance length (--acceptance-length).

    python benchmarks/gpu_roofline.py --json benchmarks/results/gpu_roofline_h100.json
    python benchmarks/gpu_roofline.py --dry-run      # tiny shapes on CPU (CI): the same code runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayspec.bench.environment import environment  # noqa: E402
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.families import ModelArgs  # noqa: E402
from rayspec.model.kv_cache import KVCache  # noqa: E402
from rayspec.model.native import CausalLM  # noqa: E402
from rayspec.model.runner import ModelRunner, make_runner  # noqa: E402

SHAPES = {  # vocab, hidden, intermediate, layers, heads, kv heads, head_dim, rope theta
    "llama3.1-8b": (128256, 4096, 14336, 32, 32, 8, 128, 500000.0),
    "tiny": (512, 64, 128, 2, 4, 2, 16, 10000.0),
}
# EAGLE-3's published acceptance length for LLaMA-3.1-8B-Instruct on MT-bench (temperature 0, the
# paper's dynamic tree), the figure the implied tokens per second use unless told otherwise
EAGLE3_ACCEPTANCE_LENGTH = 6.1
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4]  # the pending token, then 7 drafts: top-2 branching, depth 4
RESULTS: dict = {}


class Clock:
    """Wall time of a device's work: synchronize before and after (CUDA), or plain wall time (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, iters: int, warmup: int = 5) -> float:
        """Median seconds per call over 3 rounds of `iters` calls, after `warmup` calls."""
        for _ in range(warmup):
            fn()
        rounds = []
        for _ in range(3):
            self.sync()
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            self.sync()
            rounds.append((time.perf_counter() - t) / iters)
        return statistics.median(rounds)


def record(out: Path | None, section: str, row: dict) -> None:
    RESULTS.setdefault(section, []).append(row)
    print(json.dumps({section: row}), flush=True)
    if out is not None:
        out.write_text(json.dumps(RESULTS, indent=1))


def bandwidth(device, clock: Clock, gib: float) -> dict:
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = clock.time(lambda: dst.copy_(src), iters=10)
    read_s = clock.time(lambda: src.sum(dtype=torch.float32), iters=10)
    nbytes = src.numel() * 2
    del src, dst
    return {"buffer_gib": gib, "copy_gb_s": round(2 * nbytes / copy_s / 1e9, 1),
            "read_gb_s": round(nbytes / read_s / 1e9, 1)}


@torch.inference_mode(False)  # (packing for the CPU keeps the weights' version counters)
def build_ours(shape: str, device, dtype, num_layers: int | None = None, vocab: int | None = None,
               prepare=None) -> CausalLM:
    """A random model of `shape` (weights N(0, 0.02), norms 1). `prepare(model)`: run on the weights before
    they are packed (gpu_engine.py's decisive target)."""
    v, h, i, layers, heads, kv, hd, theta = SHAPES[shape]
    args = ModelArgs(vocab_size=vocab or v, hidden_size=h, intermediate_size=i, num_layers=num_layers or layers,
                     num_heads=heads, num_kv_heads=kv, head_dim=hd, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     max_position_embeddings=8192)
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    with torch.device("meta"):
        model = CausalLM(args, inv_freq)
    model = model.to_empty(device=device).to(dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.inv_freq = inv_freq.to(device)
    if prepare is not None:
        prepare(model)
    return model.eval().pack_for_cpu()  # off the CPU: q/k/v and gate/up fused


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def runner_with_context(model, batch: int, context: int, compile: bool, extra_rows: int = 16) -> ModelRunner:
    runner = make_runner(model, max_model_len=context + extra_rows + 64, num_slots=batch, slack=0, compile=compile)
    vocab = model.args.vocab_size
    for b in range(batch):
        runner.kv.allocate(f"s{b}")
        runner.forward_hidden([f"s{b}"], [[(7 * i + b) % (vocab - 3) + 3 for i in range(context)]])
    return runner


def decode_step(runner: ModelRunner, model, batch: int, context: int):
    ids = [f"s{b}" for b in range(batch)]
    for s in ids:
        runner.kv.set_cached_len(s, context)  # every step decodes position `context` again

    def step():
        for s in ids:
            runner.kv.set_cached_len(s, context)
        hidden, _ = runner.forward_hidden(ids, [[5]] * batch, packed=True, static=True)
        return model.logits(hidden).argmax(-1)

    return step


def verify_step(runner: ModelRunner, model, context: int, tree: bool):
    def step():
        runner.kv.set_cached_len("s0", context)
        if tree:
            toks = [5 + j for j in range(len(TREE_PARENTS))]
            hidden, _ = runner.forward_hidden(["s0"], [toks], trees=[TreeQuery(parents=list(TREE_PARENTS))],
                                              packed=True, static=True)
        else:
            hidden, _ = runner.forward_hidden(["s0"], [[5 + j for j in range(9)]], packed=True, static=True)
        return model.logits(hidden).argmax(-1)

    return step


def ours(a, device, dtype, clock: Clock, out) -> dict:
    """Decode at each batch, eager and compiled; verification; returns {name: seconds}."""
    model = build_ours(a.shape, device, dtype)
    wbytes = weight_bytes(model)
    times = {}
    for compile in ([False, True] if not a.compiled_only else [True]):
        for batch in a.batches:
            try:
                runner = runner_with_context(model, batch, a.context, compile)
                t = clock.time(decode_step(runner, model, batch, a.context), iters=a.iters)
                times[(batch, compile)] = t
                record(out, "decode", {"shape": a.shape, "batch": batch, "compiled": compile, "context": a.context,
                                       "ms_per_step": round(t * 1e3, 3), "tok_s": round(batch / t, 1),
                                       "weight_gb": round(wbytes / 1e9, 2)})
                if batch == 1 and compile:
                    for tree in (True, False):
                        tv = clock.time(verify_step(runner, model, a.context, tree), iters=a.iters)
                        times[("tree" if tree else "chain", compile)] = tv
                        record(out, "verify", {"shape": a.shape, "what": "8-node tree" if tree else "8-token chain",
                                               "rows": len(TREE_PARENTS) if tree else 9, "compiled": compile,
                                               "ms": round(tv * 1e3, 3), "vs_decode": round(tv / t, 3)})
                del runner
            except Exception as err:  # noqa: BLE001 (one case failing must not lose the others)
                record(out, "errors", {"case": f"ours batch {batch} compiled {compile}", "error": repr(err),
                                       "trace": traceback.format_exc()[-2000:]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del model
    return times, wbytes


def head_step(a, device, dtype, clock: Clock, out) -> float | None:
    """One decoder layer at the target's widths with a 32k draft vocabulary: an EAGLE-3 head's draft step."""
    try:
        head = build_ours(a.shape, device, dtype, num_layers=1, vocab=min(32000, SHAPES[a.shape][0]))
        runner = runner_with_context(head, 1, a.context, True)
        t = clock.time(decode_step(runner, head, 1, a.context), iters=a.iters)
        record(out, "head", {"shape": a.shape, "what": "1 layer + 32k vocabulary, compiled", "ms": round(t * 1e3, 3)})
        return t
    except Exception as err:  # noqa: BLE001
        record(out, "errors", {"case": "head", "error": repr(err), "trace": traceback.format_exc()[-2000:]})
        return None


def transformers_peer(a, device, dtype, clock: Clock, out) -> float | None:
    """transformers' static-cache decode, compiled: seconds per token at batch 1 from two generation
    lengths (the prefill cancels out)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        v, h, i, layers, heads, kv, hd, theta = SHAPES[a.shape]
        config = LlamaConfig(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                             max_position_embeddings=8192, rope_theta=theta, tie_word_embeddings=False)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in the compute dtype on the device (no float32 copy)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)
        prompt = torch.randint(3, v, (1, a.context), device=device)

        def gen(n):
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  cache_implementation="static", pad_token_id=0)

        short, long_ = 8, 8 + a.peer_tokens
        with torch.inference_mode():
            for n in (short, long_):  # compile and capture
                gen(n)
            ts = clock.time(lambda: gen(short), iters=1, warmup=1)
            tl = clock.time(lambda: gen(long_), iters=1, warmup=0)
        per_token = (tl - ts) / a.peer_tokens
        row = {"what": "transformers static cache, compiled", "batch": 1, "context": a.context,
               "ms_per_token": round(per_token * 1e3, 3), "tok_s": round(1 / per_token, 1) if per_token > 0 else None}
        if per_token <= 0:  # two runs' difference within their noise (a dry run's 4 tokens): no figure
            row["note"] = f"the longer run was not slower: noise; give more --peer-tokens (had {a.peer_tokens})"
        record(out, "peer", row)
        del model
        return per_token if per_token > 0 else None
    except Exception as err:  # noqa: BLE001
        record(out, "errors", {"case": "transformers peer", "error": repr(err), "trace": traceback.format_exc()[-2000:]})
        return None


def attention_candidates(a, device, dtype, clock: Clock, out) -> None:
    """One decoder layer's decode attention at batch B over a paged pool, two ways (see the module doc)."""
    from rayspec.model.paged_attention import PagedLayout, chain_tail, inverse_tables

    v, h, i, layers, heads, kv_heads, hd, theta = SHAPES[a.shape]
    bs = 16
    for batch in a.batches:
        if batch == 1:
            continue
        try:
            blocks_per_seq = -(-a.context // bs)
            num_blocks = batch * blocks_per_seq + 8
            gen = torch.Generator().manual_seed(batch)
            perm = torch.randperm(num_blocks, generator=gen)  # the sequences' blocks scattered over the pool
            tables = perm[: batch * blocks_per_seq].view(batch, blocks_per_seq)
            pool_k = torch.randn(num_blocks * bs, kv_heads, hd, device=device, dtype=dtype)
            pool_v = torch.randn_like(pool_k)
            q = torch.randn(batch, heads, 1, hd, device=device, dtype=dtype)
            lengths = torch.tensor([a.context - 7 * b for b in range(batch)], device=device)  # keys per sequence
            kv_len = a.context
            rows = (tables[:, :, None] * bs + torch.arange(bs)).view(batch, -1)[:, :kv_len].to(device)

            def gathered():
                k = pool_k.index_select(0, rows.reshape(-1)).view(batch, kv_len, kv_heads, hd).transpose(1, 2)
                vv = pool_v.index_select(0, rows.reshape(-1)).view(batch, kv_len, kv_heads, hd).transpose(1, 2)
                visible = torch.arange(kv_len, device=device)[None] < lengths[:, None]
                mask = torch.zeros(batch, 1, 1, kv_len, device=device, dtype=dtype).masked_fill_(
                    ~visible[:, None, None], float("-inf"))
                return torch.nn.functional.scaled_dot_product_attention(q, k, vv, attn_mask=mask, enable_gqa=True)

            # the query at position length - 1 sees keys 0..length-1: context length - 1, its own key in the tail
            table, context = tables.to(device), lengths - 1
            tail = torch.from_numpy(chain_tail(1)).to(device).expand(batch, 1, 1).contiguous()
            logical = inverse_tables(table, num_blocks)
            attend = torch.compile(lambda q_, k_, v_, t_, c_, tl_, lg_: PagedLayout(t_, c_, tl_, bs, lg_).attend(
                q_, k_, v_), dynamic=False)

            def paged():
                return attend(q, pool_k, pool_v, table, context, tail, logical)

            diff = (gathered().float() - paged().float()).abs().max().item()
            tg = clock.time(gathered, iters=a.iters)
            tp = clock.time(paged, iters=a.iters)
            record(out, "attention", {"shape": a.shape, "batch": batch, "context": a.context, "block_size": bs,
                                      "gather_sdpa_ms_per_layer": round(tg * 1e3, 4),
                                      "flex_paged_ms_per_layer": round(tp * 1e3, 4),
                                      "per_step_ms_gather": round(tg * layers * 1e3, 3),
                                      "per_step_ms_flex": round(tp * layers * 1e3, 3), "max_abs_diff": diff})
        except Exception as err:  # noqa: BLE001
            record(out, "errors", {"case": f"attention batch {batch}", "error": repr(err)[:2000],
                                   "trace": traceback.format_exc()[-2000:]})


def paged_step(a, device, dtype, clock: Clock, out) -> None:
    """The compiled decode step (and the 8-node tree verification at batch 1) with attention gathering
    the keys (today's default) and reading the pool in place (rayspec.model.paged_attention), side by side
    in one process, with the largest difference of their final hidden states."""
    model = build_ours(a.shape, device, dtype)
    cases = [(b, False) for b in a.paged_batches] + ([(1, True)] if a.paged_tree else [])
    for batch, tree in cases:
        try:
            hiddens, times = {}, {}
            for paged in (False, True):
                runner = runner_with_context(model, batch, a.context, True)
                runner.paged_attention = paged
                step = verify_step(runner, model, a.context, tree=True) if tree else decode_step(runner, model, batch,
                                                                                                  a.context)
                times[paged] = clock.time(step, iters=a.iters)
                ids = [f"s{b}" for b in range(batch)]
                for s_ in ids:
                    runner.kv.set_cached_len(s_, a.context)
                if tree:
                    toks = [[5 + j for j in range(len(TREE_PARENTS))]]
                    hiddens[paged], _ = runner.forward_hidden(["s0"], toks, trees=[TreeQuery(parents=list(TREE_PARENTS))],
                                                              packed=True, static=True)
                else:
                    hiddens[paged], _ = runner.forward_hidden(ids, [[5]] * batch, packed=True, static=True)
                hiddens[paged] = hiddens[paged].float().clone()
                del runner
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            diff = (hiddens[False] - hiddens[True]).abs().max().item()
            record(out, "paged", {"shape": a.shape, "what": "8-node tree" if tree else "decode", "batch": batch,
                                  "context": a.context, "gather_ms": round(times[False] * 1e3, 3),
                                  "paged_ms": round(times[True] * 1e3, 3),
                                  "paged_over_gather": round(times[True] / times[False], 3),
                                  "max_abs_diff_hidden": diff})
        except Exception as err:  # noqa: BLE001
            record(out, "errors", {"case": f"paged batch {batch} tree {tree}", "error": repr(err)[:2000],
                                   "trace": traceback.format_exc()[-2000:]})
    del model


def _top_p_by_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The GPU's top-p before the bisection (issue #50, 2g): the whole row sorted, float64 masses."""
    values, index = logits.topk(logits.shape[-1], dim=-1)
    probs = (values.double() - logits.double().logsumexp(-1, keepdim=True)).exp()
    keep = probs.cumsum(-1) - probs < top_p
    keep[:, 0] = True
    return torch.full_like(logits, float("-inf")).scatter_(-1, index, values.masked_fill(~keep, float("-inf"))).softmax(-1)


def top_p_step(a, device, clock: Clock, out) -> None:
    """Top-p (0.9, T = 1, no top-k) over the shape's vocabulary: the whole row sorted (as before) against
    rayspec.sampling.sampler's bisection (33 masked sums, no sort, no host read), eager; rows whose
    kept sets differ (float32 rounding at the cut) counted."""
    from rayspec.sampling import sampler

    vocab = SHAPES[a.shape][0]
    for batch in a.batches:
        logits = torch.randn(batch, vocab, device=device, generator=torch.Generator(device).manual_seed(batch)) * 3
        sort_s = clock.time(lambda: _top_p_by_sort(logits, 0.9), iters=a.iters)
        keep = lambda: sampler._top_p_keep(logits, 0.9)  # noqa: E731
        bisect_s = clock.time(keep, iters=a.iters)
        differ = int(((_top_p_by_sort(logits, 0.9) > 0) != keep()).any(-1).sum())
        record(out, "top_p", {"batch": batch, "vocab": vocab, "sort_ms": round(sort_s * 1e3, 4),
                              "bisection_ms": round(bisect_s * 1e3, 4), "rows_differing": differ})


def summary(a, bw: dict, times: dict, wbytes: int, head_s, peer_s) -> dict:
    gbs = max(bw["copy_gb_s"], bw["read_gb_s"]) * 1e9
    roof = wbytes / gbs
    s = {"gpu": environment().get("gpu_model"), "weights_read_ms": round(roof * 1e3, 3), "bandwidth_gb_s": round(gbs / 1e9, 1)}
    for (what, compiled), t in times.items():
        if isinstance(what, int):
            s[f"decode_b{what}_{'compiled' if compiled else 'eager'}_vs_roofline"] = round(t / roof, 3)
    d1 = times.get((1, True))
    if d1:
        for what in ("tree", "chain"):
            if (what, True) in times:
                s[f"{what}_vs_decode"] = round(times[(what, True)] / d1, 3)
        if peer_s:
            s["ours_vs_transformers_b1"] = round(peer_s / d1, 3)  # > 1: ours faster
        if ("tree", True) in times and head_s:
            depth = 4  # TREE_PARENTS' depth: the head drafts that many steps
            cycle = times[("tree", True)] + depth * head_s
            s["eagle3_cycle_ms"] = round(cycle * 1e3, 3)
            # a tree `depth` drafts deep emits at most depth + 1 tokens per cycle, whatever the head
            reachable = min(a.acceptance_length, depth + 1)
            s["eagle3_implied_tok_s"] = round(reachable / cycle, 1)
            s["acceptance_length"] = reachable
            s["eagle3_implied_note"] = ("forward only: the tree's verification + its head steps, no scheduling, "
                                        "reads or host work; not an end-to-end figure (benchmarks/gpu_engine.py)")
    return s


def plot(path: Path, results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib absent: no plot")
        return
    s = results["summary"]
    labels, values = [], []
    for row in results.get("decode", []):
        labels.append(f"b{row['batch']} {'comp' if row['compiled'] else 'eager'}")
        values.append(row["ms_per_step"])
    for row in results.get("verify", []):
        labels.append(row["what"])
        values.append(row["ms"])
    for row in results.get("peer", []):
        labels.append("HF static")
        values.append(row["ms_per_token"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, values, color="tab:blue")
    ax.axhline(s["weights_read_ms"], color="tab:red", linestyle="--", label=f"weights read ({s['weights_read_ms']} ms)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{results['args']['shape']} on {s.get('gpu') or 'CPU'}")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peer-tokens", type=int, default=64)
    parser.add_argument("--bandwidth-gib", type=float, default=2.0)
    parser.add_argument("--acceptance-length", type=float, default=EAGLE3_ACCEPTANCE_LENGTH)
    parser.add_argument("--compiled-only", action="store_true", help="skip the eager decode runs")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, few iterations (CI)")
    parser.add_argument("--sections", default="bandwidth,ours,head,peer,paged,attention,top_p",
                        help="which to run, of bandwidth,ours,head,peer,paged,attention,top_p")
    parser.add_argument("--paged-batches", default="8,32", help="batches of the paged-attention step comparison")
    parser.add_argument("--no-paged-tree", dest="paged_tree", action="store_false")
    a = parser.parse_args()
    if a.dry_run:
        a.shape, a.batches, a.context, a.iters, a.peer_tokens, a.bandwidth_gib = "tiny", "1,2", 48, 2, 4, 0.01
    if a.dry_run:
        a.paged_batches = "2"
        # the compiled step as traced (torch.compile's aot_eager backend), without inductor's C++ builds:
        # half of this dry run's time in CI, and no figure of a dry run is read
        from rayspec.model.compiled import CompiledForward
        CompiledForward.backend = "aot_eager"
    a.batches = [int(b) for b in str(a.batches).split(",")]
    a.paged_batches = [int(b) for b in str(a.paged_batches).split(",") if b]
    sections = set(a.sections.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # two threads beside any other busy process stall at OpenMP's barriers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(a.json) if a.json else None
    RESULTS["args"] = {k: v for k, v in vars(a).items()}
    RESULTS["environment"] = environment()
    clock = Clock(device)
    started = time.perf_counter()
    bw = bandwidth(device, clock, a.bandwidth_gib)
    record(out, "bandwidth", bw)
    times, wbytes, head_s, peer_s = {}, weight_bytes(build_ours(a.shape, "meta", dtype)), None, None
    with torch.inference_mode():
        if "ours" in sections:
            times, wbytes = ours(a, device, dtype, clock, out)
        if "head" in sections:
            head_s = head_step(a, device, dtype, clock, out)
    if "peer" in sections and not a.no_peer:
        peer_s = transformers_peer(a, device, dtype, clock, out)
    with torch.inference_mode():
        if "paged" in sections and a.paged_batches:
            if device.type == "cpu":  # inductor's CPU FlexAttention is wrong here (rayspec.model.compiled): the traced step
                from rayspec.model.compiled import CompiledForward
                CompiledForward.backend = "aot_eager"
            paged_step(a, device, dtype, clock, out)
        if "attention" in sections:
            attention_candidates(a, device, dtype, clock, out)
        if "top_p" in sections:
            top_p_step(a, device, clock, out)
    RESULTS["summary"] = summary(a, bw, times, wbytes, head_s, peer_s)
    RESULTS["summary"]["wall_s"] = round(time.perf_counter() - started, 1)
    if out is not None:
        out.write_text(json.dumps(RESULTS, indent=1))
    print("\n" + f"{'case':<34} {'ms':>10} {'x weights read':>15}")
    roof_ms = RESULTS["summary"]["weights_read_ms"]
    for row in RESULTS.get("decode", []):
        name = f"decode b={row['batch']} {'compiled' if row['compiled'] else 'eager'}"
        print(f"{name:<34} {row['ms_per_step']:>10} {row['ms_per_step'] / roof_ms:>15.2f}")
    for row in RESULTS.get("verify", []):
        print(f"{row['what'] + ' (b=1, compiled)':<34} {row['ms']:>10} {row['ms'] / roof_ms:>15.2f}")
    for row in RESULTS.get("head", []):
        print(f"{'EAGLE-3 head step':<34} {row['ms']:>10} {row['ms'] / roof_ms:>15.2f}")
    for row in RESULTS.get("peer", []):
        print(f"{'transformers static, compiled':<34} {row['ms_per_token']:>10} {row['ms_per_token'] / roof_ms:>15.2f}")
    for row in RESULTS.get("paged", []):
        for way in ("gather", "paged"):
            name = f"{row['what']} b={row['batch']} {way}"
            print(f"{name:<34} {row[f'{way}_ms']:>10} {row[f'{way}_ms'] / roof_ms:>15.2f}")
    for row in RESULTS.get("attention", []):
        for way in ("gather", "flex"):
            name = f"attention b={row['batch']} {way} (x layers)"
            print(f"{name:<34} {row[f'per_step_ms_{way}']:>10} {row[f'per_step_ms_{way}'] / roof_ms:>15.2f}")
    for row in RESULTS.get("top_p", []):
        for way in ("sort", "bisection"):
            name = f"top-p b={row['batch']} {way}"
            print(f"{name:<34} {row[f'{way}_ms']:>10} {row[f'{way}_ms'] / roof_ms:>15.2f}")
    print(json.dumps(RESULTS["summary"], indent=1))
    if RESULTS.get("errors"):
        print(f"{len(RESULTS['errors'])} case(s) failed: see 'errors' in the JSON")
    if out is not None or a.plot:
        plot(Path(a.plot) if a.plot else out.with_suffix(".png"), RESULTS)
    if a.dry_run and RESULTS.get("errors"):
        sys.exit(1)


if __name__ == "__main__":
    main()
