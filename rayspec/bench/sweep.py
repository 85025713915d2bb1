"""`rayspec bench sweep`: speculative methods x draft lengths (x concurrency) against the target
alone, in-process, as TensorRT-LLM's guide has users tune `max_draft_len` by hand ("experiment
with 1, 2, 3, 4, 8 and monitor token acceptance rates").

One target model is loaded and shared by every engine: a baseline engine (target only) and one
engine per method, built with num_speculative_tokens = the largest k of the sweep. A run at k caps
its requests' drafts at k (SamplingParams.num_speculative_tokens, the cap a served request sets
with `num_speculative_tokens`), so each method's k values run on one engine, its draft weights
and cache loaded once. With cost-aware drafting on (the default, as `bench offline`; rayspec.engine.drafting)
k is the most a step drafts; `--no-adaptive` drafts exactly k (fewer only near max_tokens).

Prefix caching is off in these engines unless `--enable-prefix-caching` is given: a method's k values
run the same prompts on one engine, and later runs would find them cached (prefills the baseline pays).

Interleaved: per concurrency, for every batch of `concurrency` prompts, the baseline and every
(method, k) run the same batch in turn (who goes first rotating from batch to batch), so machine
noise hits all of them alike; with `--rounds R` the whole set of batches runs R times, and each
round's ratios are kept beside the pooled one (`speedup_by_round`): their spread is the noise.
Throughput is output tokens / wall time of the runs.

Per (method, k, concurrency): tok/s, speedup, acceptance length (1 + accepted / drafts: tokens per
drafting step), acceptance rate (accepted / drafted), acceptance by draft position (vLLM's
per-position rate: drafts whose token j was accepted / drafts; with trees, the accepted path's
j-th node), greedy match with the baseline (at temperature 0), seeded match (at temperature > 0 with
seeds: a seeded request draws coupled, rayspec.sampling.sampler, so the speculative run must emit the
baseline's tokens exactly; None unseeded, where the runs sample different streams).

Memory per method and k, `memory`: the proposer's weights and KV cache as `rayspec plan` sizes
them (rayspec.memory.plan.engine_plan for this engine config: what the engine allocates, not a
measurement), and the target KV cache beside them (a draft model's budget halves the target's
blocks); plus `rss_delta_bytes` per method, measured: the process's resident memory after
building the method's engine minus before (weights as loaded, prepacked copies and the caches'
pages; the caches are zero-filled so their pages count).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rayspec.bench.environment import environment
from rayspec.bench.offline import SystemRun, _run_engine, build_engine, chat_prompts, load_target
from rayspec.config import DEFAULT_MODEL, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.progress import progress_bar
from rayspec.proposers import PROPOSERS

METHODS = tuple(m for m in PROPOSERS if m != "none")  # every proposer (the target alone is the baseline)
_EAGLE = ("eagle3", "eagle")
# SpeculativeConfig fields only some methods read: a sweep gives each to those methods' engines, the others
# keep the dataclass's default (draft_quantization, for one, is refused for any method but draft_model)
METHOD_FIELDS = {"draft_num_layers": ("draft_model",), "draft_quantization": ("draft_model",),
                 "draft_tensor_parallel_size": ("draft_model",), "draft_dtype": ("draft_model", *_EAGLE),
                 "eagle_topk": _EAGLE, "num_steps": _EAGLE, "eagle_stop_prob": _EAGLE, "eagle_prompt_lookup": _EAGLE,
                 "tree_max_batch": _EAGLE}


@dataclasses.dataclass
class MethodOptions:
    """Per-method draft options (the flags of `bench sweep`): SpeculativeConfig fields by name, for every
    method's engine but those of METHOD_FIELDS (method and num_speculative_tokens are the sweep's)."""

    eagle_head: str | None = None  # eagle3 / eagle: the head (default: the shipped SmolLM2 head for SmolLM2)
    # draft_model among them: method draft_model's draft LM (default: the target itself, a self-draft)
    speculative: dict = dataclasses.field(default_factory=dict)


def parse_list(text: str | list, kind=int) -> list:
    """'1,2,4' -> [1, 2, 4] (deduplicated, order kept)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    values = [kind(x.strip()) if isinstance(x, str) else kind(x) for x in items if str(x).strip()]
    if not values:
        raise ValueError(f"an empty list: {text!r}")
    return list(dict.fromkeys(values))


def default_eagle_head(model: str) -> str | None:
    from rayspec.assets import assets_root

    head = assets_root() / "heads" / "smollm2-135m-eagle3"
    return str(head) if model == DEFAULT_MODEL and head.is_dir() else None


def spec_config(method: str, k: int, model: str, opts: MethodOptions) -> SpeculativeConfig:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
    given = dict(opts.speculative)
    draft = given.pop("draft_model", None)
    if method in _EAGLE:
        draft = opts.eagle_head or default_eagle_head(model)
        if draft is None:
            raise ValueError(f"{method} needs --eagle-head (a head trained for {model})")
    elif method == "draft_model":
        draft = draft or model
    else:
        draft = None
    taken = {name: value for name, value in given.items() if method in METHOD_FIELDS.get(name, (method,))}
    return SpeculativeConfig(**{**taken, "method": method, "num_speculative_tokens": k, "draft_model": draft})


def _rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _stats(engine: LLMEngine) -> dict:
    return engine.stats.as_dict()


def _stats_delta(before: dict, after: dict, k: int) -> dict:
    """The counters one run added (accepted tokens per draft position: the first k)."""
    per_before = before["num_accepted_tokens_per_pos"]
    per_pos = [n - (per_before[j] if j < len(per_before) else 0)
               for j, n in enumerate(after["num_accepted_tokens_per_pos"])]
    return {"num_drafts": after["num_drafts"] - before["num_drafts"],
            "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "num_accepted_tokens": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "num_accepted_tokens_per_pos": (per_pos + [0] * k)[:k]}


def run_sweep(model: str, methods: list[str], ks: list[int], prompts_file: str, num_prompts: int,
              max_tokens: int, concurrency: list[int] = (1,), opts: MethodOptions | None = None,
              temperature: float = 0.0, device: str = "cpu", dtype: str | None = None,
              engine_overrides: dict | None = None, progress: bool = True, log=None, seeded: bool = True,
              planned_memory=None, rounds: int = 1) -> dict:
    """rounds: every concurrency's batches run this many times over, each round interleaved as one
    (ratios per round in `speedup_by_round`). planned_memory(engine, k) -> dict: the proposer's memory at draft length k as `rayspec plan` sizes it
    (the CLI passes rayspec_cli.bench.planned_memory, which reads the planner in deployments/); None: the
    result's memory has the measured RSS only."""
    opts = opts or MethodOptions()
    methods, ks, concurrency = list(methods), sorted(ks), sorted(concurrency)
    if any(k < 1 for k in ks) or any(c < 1 for c in concurrency) or rounds < 1:
        raise ValueError("every k and concurrency, and rounds, must be >= 1")
    specs = {m: spec_config(m, max(ks), model, opts) for m in methods}  # refuses a bad method before loading
    target, tokenizer, eos, _ = load_target(model, device, dtype)
    # every k of a method runs the same prompts on one engine: with prefix caching the later runs would
    # find them cached and skip prefills the baseline pays; off unless asked for (--enable-prefix-caching)
    overrides = {"enable_prefix_caching": False, **(engine_overrides or {})}
    max_c = max(concurrency)

    def engine(spec: SpeculativeConfig) -> LLMEngine:
        return build_engine(model, target, tokenizer, eos, spec, max_c, device, dtype, overrides)

    baseline = engine(SpeculativeConfig(method="none", num_speculative_tokens=0))
    engines, rss = {}, {}
    for m in methods:
        before = _rss_bytes()
        engines[m] = engine(specs[m])
        after = _rss_bytes()
        rss[m] = after - before if before is not None and after is not None else None
    prompt_ids = chat_prompts(baseline, prompts_file, num_prompts)

    # warm-up (allocations, kernel selection) outside the timed runs
    for eng in (baseline, *engines.values()):
        _run_engine(eng, prompt_ids[:1], 8, SystemRun())

    combos = [(m, k) for m in methods for k in ks]
    base_runs = {c: SystemRun() for c in concurrency}
    runs = {(m, k, c): SystemRun() for m, k in combos for c in concurrency}
    by_round = {key: [SystemRun() for _ in range(rounds)] for key in [*base_runs, *runs]}
    deltas: dict[tuple, list[dict]] = {key: [] for key in runs}
    bar = progress_bar(enabled=progress, total=len(prompt_ids) * len(concurrency) * rounds, desc="bench sweep",
                       unit="prompt")
    turn = 0
    for c in concurrency:
        for r in range(rounds):
            for first in range(0, len(prompt_ids), c):
                batch = prompt_ids[first: first + c]
                order = [None, *combos]  # None: the baseline; who goes first rotates from batch to batch
                shift = turn % len(order)
                turn += 1
                for combo in order[shift:] + order[:shift]:
                    if combo is None:
                        _run_into(baseline, batch, max_tokens, (base_runs[c], by_round[c][r]), temperature, first,
                                  seeded=seeded)
                        continue
                    m, k = combo
                    eng = engines[m]
                    before = _stats(eng)
                    _run_into(eng, batch, max_tokens, (runs[(m, k, c)], by_round[(m, k, c)][r]), temperature, first,
                              num_speculative_tokens=k, seeded=seeded)
                    deltas[(m, k, c)].append((before, _stats(eng)))
                bar.update(len(batch))
    bar.close()

    memory = {m: {"rss_delta_bytes": rss[m], "by_k": {str(k): planned_memory(engines[m], k) for k in ks} if planned_memory else {}}
              for m in methods}
    results = []
    for c in concurrency:
        base = base_runs[c]
        for m, k in combos:
            run = runs[(m, k, c)]
            total = _sum_deltas([_stats_delta(b, a, k) for b, a in deltas[(m, k, c)]], k)
            results.append({
                "method": m, "num_speculative_tokens": k, "concurrency": c,
                "output_throughput": run.throughput, "baseline_output_throughput": base.throughput,
                "speedup": run.throughput / base.throughput if base.throughput else None,
                # each round's own ratio (its runs against the baseline's of the same round): the spread
                # shows the machine's noise; the speedup above pools the rounds
                "speedup_by_round": [a.throughput / b.throughput if b.throughput else None
                                     for a, b in zip(by_round[(m, k, c)], by_round[c])],
                "total_output_tokens": run.tokens, "seconds": run.seconds, "step_ms": run.step_ms,
                **total,
                "greedy_match": run.outputs == base.outputs if temperature == 0 else None,
                "seeded_match": run.outputs == base.outputs if temperature > 0 and seeded else None,
                **{key: memory[m]["by_k"][str(k)].get(key)
                   for key in ("proposer_weights_bytes", "proposer_kv_bytes", "target_kv_bytes")},
            })
    return {
        "config": {"model": model, "methods": methods, "num_speculative_tokens": ks, "concurrency": concurrency,
                   "prompts": prompts_file, "num_prompts": len(prompt_ids), "max_tokens": max_tokens,
                   "rounds": rounds,
                   "temperature": temperature, "seeded": seeded if temperature > 0 else None, "mode": "offline",
                   # how a step sizes its drafts with `adaptive` (rayspec.engine.drafting)
                   "drafting": "cost-aware" if specs[methods[0]].adaptive else "fixed", "device": str(baseline.device),
                   "dtype": str(baseline.dtype).removeprefix("torch."),
                   "options": {"eagle_head": opts.eagle_head, **opts.speculative},
                   "draft_models": {m: specs[m].draft_model for m in methods},
                   "engine": {"compile": baseline.compile, "max_model_len": baseline.config.max_model_len,
                              "max_num_seqs": baseline.config.max_num_seqs,
                              "kv_cache_memory_gb": baseline.config.kv_cache_memory_gb, **overrides}},
        "baseline": [{"concurrency": c, "output_throughput": base_runs[c].throughput,
                      "total_output_tokens": base_runs[c].tokens, "seconds": base_runs[c].seconds,
                      "step_ms": base_runs[c].step_ms} for c in concurrency],
        "memory": memory,
        "memory_note": "proposer_*_bytes and target_kv_bytes: as `rayspec plan` sizes them for the engine "
                       "config (rayspec.memory.plan.engine_plan); rss_delta_bytes: resident memory measured "
                       "around building the method's engine",
        "results": results,
        "cpu_kernels": target.cpu_kernels.describe() if getattr(target, "cpu_kernels", None) else None,
        "environment": environment(),
    }


def _run_into(engine, batch: list[list[int]], max_tokens: int, into: tuple[SystemRun, ...], *args, **kwargs) -> None:
    """One timed run of the batch, added to each of `into` (the pooled run and its round's)."""
    once = SystemRun()
    _run_engine(engine, batch, max_tokens, once, *args, **kwargs)
    for run in into:
        run.seconds += once.seconds
        run.steps += once.steps
        run.tokens += once.tokens
        run.outputs.extend(once.outputs)


def _sum_deltas(parts: list[dict], k: int) -> dict:
    drafts = sum(p["num_drafts"] for p in parts)
    drafted = sum(p["num_draft_tokens"] for p in parts)
    accepted = sum(p["num_accepted_tokens"] for p in parts)
    per_pos = [sum(p["num_accepted_tokens_per_pos"][j] for p in parts) for j in range(k)]
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_by_position": [n / drafts for n in per_pos] if drafts else [None] * k}


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(result: dict) -> str:
    """One line per (method, k, concurrency)."""
    head = (f"{'method':<12} {'k':>2} {'conc':>4} {'tok/s':>8} {'base':>8} {'speedup':>7} {'acc_len':>7} "
            f"{'acc_rate':>8} {'match':>6} {'prop MB':>8}  acceptance by position")
    lines = [head, "-" * len(head)]
    for r in result["results"]:
        mb = None
        if r["proposer_weights_bytes"] is not None:
            mb = (r["proposer_weights_bytes"] + (r["proposer_kv_bytes"] or 0)) / 1e6
        match = r["greedy_match"] if r["greedy_match"] is not None else r.get("seeded_match")
        greedy = "-" if match is None else ("yes" if match else "NO")
        pos = " ".join(_fmt(x) for x in r["acceptance_by_position"])
        lines.append(f"{r['method']:<12} {r['num_speculative_tokens']:>2} {r['concurrency']:>4} "
                     f"{_fmt(r['output_throughput'], '.1f'):>8} {_fmt(r['baseline_output_throughput'], '.1f'):>8} "
                     f"{_fmt(r['speedup']):>7} {_fmt(r['acceptance_length']):>7} {_fmt(r['acceptance_rate']):>8} "
                     f"{greedy:>6} {_fmt(mb, '.1f'):>8}  {pos}")
    env = result["environment"]
    cfg = result["config"]
    lines.append(f"({cfg['model']}, {cfg['prompts']} x {cfg['num_prompts']}, max_tokens {cfg['max_tokens']}, "
                 f"temperature {cfg['temperature']}; {env.get('gpu_model') or env.get('cpu_model')}, "
                 f"{env.get('torch_threads')} torch threads; prop MB: the proposer's weights + KV cache as "
                 f"`rayspec plan` sizes them)")
    return "\n".join(lines)


def write_plot(result: dict, path: str | Path) -> None:
    """One PNG, four panels: output tok/s vs k (the baseline dashed), speedup vs k, acceptance
    length vs k (one line per method and concurrency), acceptance by draft position at the largest k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    ks, conc = cfg["num_speculative_tokens"], cfg["concurrency"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_tps, ax_speed), (ax_len, ax_pos) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for mi, m in enumerate(cfg["methods"]):
        for ci, c in enumerate(conc):
            rows = sorted((r for r in result["results"] if r["method"] == m and r["concurrency"] == c),
                          key=lambda r: r["num_speculative_tokens"])
            label = m if len(conc) == 1 else f"{m}, c={c}"
            style = dict(color=colors[mi % len(colors)], linestyle=styles[ci % len(styles)], marker="o", label=label)
            x = [r["num_speculative_tokens"] for r in rows]
            ax_tps.plot(x, [r["output_throughput"] for r in rows], **style)
            ax_speed.plot(x, [r["speedup"] for r in rows], **style)
            ax_len.plot(x, [r["acceptance_length"] for r in rows], **style)
            last = rows[-1]["acceptance_by_position"] if rows else []
            pos = [(j + 1, v) for j, v in enumerate(last) if v is not None]
            if pos:
                ax_pos.plot([p for p, _ in pos], [v for _, v in pos], **style)
    for ci, b in enumerate(result["baseline"]):
        ax_tps.axhline(b["output_throughput"], color="gray", linestyle=styles[ci % len(styles)], linewidth=1,
                       label="baseline" if len(conc) == 1 else f"baseline, c={b['concurrency']}")
    ax_speed.axhline(1.0, color="gray", linewidth=1)
    for ax, title, ylabel in ((ax_tps, "Output throughput", "output tokens/s"),
                              (ax_speed, "Speedup over the target alone", "x baseline tok/s"),
                              (ax_len, "Acceptance length", "tokens per drafting step")):
        ax.set_xticks(ks)
        ax.set_xlabel("num_speculative_tokens (k)")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    ax_pos.set_title(f"Acceptance by draft position (k = {max(ks)})")
    ax_pos.set_xlabel("draft position")
    ax_pos.set_ylabel("drafts accepted up to it / drafts")
    ax_pos.set_xticks(range(1, max(ks) + 1))
    ax_pos.set_ylim(0, 1.05)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    env = result["environment"]
    fig.suptitle(f"{cfg['model']}: {cfg['prompts']} x {cfg['num_prompts']}, max_tokens {cfg['max_tokens']}, "
                 f"temperature {cfg['temperature']} ({env.get('gpu_model') or env.get('cpu_model')}, "
                 f"{env.get('torch_threads')} threads)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")

