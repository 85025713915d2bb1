"""The results page: benchmarks/RESULTS.md and its plots, generated from benchmarks/results/*.json.

    python benchmarks/results_page.py            # writes benchmarks/RESULTS.md and benchmarks/results/plots/*.png
    python benchmarks/results_page.py --check    # exit 1 if RESULTS.md is not what the JSONs give (or a plot is missing)

Reads every JSON under benchmarks/results/ except history/ (older runs), plots/ and gpu/<time>/ (the
served GPU comparison's own directories: only their summary.json is read): `rayspec bench offline`
results, `rayspec bench serve` results (served sweeps, asynchronous-drafting runs with their
`<tag>_stats.json`), and the GPU, memory and soak scripts' JSONs. Each table row names the machine
its file recorded (the "environment" record of `rayspec bench`, or the older top-level fields; "not
recorded" for files written before that record existed). The page is deterministic (inputs sorted,
no timestamps, fixed number formats and plot styling), so `--check` can compare it with the
committed file; a test (tests/unit/test_results_page.py) runs `--check`. The PNGs need matplotlib (the
`serve` extra); `--check` only checks that they exist.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "benchmarks" / "RESULTS.md"
PLOTS = RESULTS / "plots"
SETS = ["mt_bench", "humaneval", "gsm8k"]
SKIP_DIRS = {"history", "plots", "gpu"}


# ---------------------------------------------------------------- reading


def load_all(results: Path) -> dict[str, dict]:
    """{path relative to results/: parsed JSON}, sorted by path; history/, plots/ and gpu/ left out."""
    out = {}
    for path in sorted(results.rglob("*.json")):
        rel = path.relative_to(results)
        if rel.parts[0] in SKIP_DIRS:
            continue
        out[rel.as_posix()] = json.loads(path.read_text())
    return out


def set_of(stem: str) -> str | None:
    for s in SETS:
        if stem.endswith("_" + s) or stem == s or f"_{s}_" in stem or stem.startswith(s + "_"):
            return s
    return None


def set_order(s: str | None) -> tuple:
    return (SETS.index(s), "") if s in SETS else (len(SETS), s or "")


def fmt(v, digits: int = 1, suffix: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:.{digits}f}{suffix}"
    return str(v)


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def link(rel: str) -> str:
    return f"[`{rel}`](results/{rel})"


# ---------------------------------------------------------------- machines


class Machines:
    """Distinct machines the files recorded, numbered in the order of the sorted file list."""

    def __init__(self):
        self.ids: dict[str, str] = {}
        self.files: dict[str, list[str]] = {}

    @staticmethod
    def describe(d: dict) -> str:
        env = d.get("environment") if isinstance(d.get("environment"), dict) else d
        gpu = env.get("gpu_model") or env.get("gpu")
        cpu = env.get("cpu_model") or (env.get("cpu") if isinstance(env.get("cpu"), str) else None)
        if not gpu and not cpu:
            return ""
        parts = []
        if gpu:
            count = env.get("gpu_count")
            parts.append(f"GPU {gpu}" + (f" x{count}" if count and count > 1 else ""))
        if cpu:
            feats = env.get("cpu_features")
            extra = []
            if feats is not None:
                extra.append(", ".join(feats) if feats else "no AVX2")
            if env.get("cpu_count"):
                extra.append(f"{env['cpu_count']} cores")
            parts.append(f"CPU {cpu}" + (f" ({'; '.join(extra)})" if extra else ""))
        if env.get("torch"):
            parts.append(f"torch {env['torch']}")
        return ", ".join(parts)

    def of(self, rel: str, d: dict) -> str:
        desc = self.describe(d)
        if not desc:
            return "not recorded"
        if desc not in self.ids:
            self.ids[desc] = f"M{len(self.ids) + 1}"
        self.files.setdefault(desc, []).append(rel)
        return self.ids[desc]


# ---------------------------------------------------------------- classification


def is_offline(d) -> bool:
    return isinstance(d, dict) and "method" in d and "output_throughput" in d and "speedup" in d


def is_serve(d) -> bool:
    return (isinstance(d, dict) and isinstance(d.get("results"), list) and isinstance(d.get("config"), dict)
            and all(isinstance(r, dict) and "label" in r for r in d["results"]))


def is_draft_sweep(d) -> bool:
    """`rayspec bench sweep`'s JSON."""
    return (isinstance(d, dict) and isinstance(d.get("config"), dict) and d["config"].get("mode") == "offline"
            and isinstance(d.get("results"), list) and all("num_speculative_tokens" in r for r in d["results"]))


def sweep_drafting(cfg: dict) -> str:
    """How a sweep's steps sized their drafts, its tree shape and whether sampled requests carried seeds."""
    opts = cfg.get("options") or {}
    if not opts.get("adaptive"):
        text = "exactly k drafted (`--no-adaptive`), "
    elif cfg.get("drafting") == "cost-aware":
        text = "cost-aware drafting (k the most; `rayspec/engine/drafting.py`), "
    else:
        text = "adaptive draft length (k the most), "
    if (opts.get("eagle_topk") or 1) > 1:
        text += (f"EAGLE trees (eagle_topk {opts['eagle_topk']}, num_steps {opts.get('num_steps')}, "
                 f"eagle_stop_prob {opts.get('eagle_stop_prob')}, eagle_prompt_lookup {opts.get('eagle_prompt_lookup')}, "
                 f"disable_by_batch_size {opts.get('disable_by_batch_size')}), ")
    if cfg.get("seeded") is False:
        text += "unseeded requests, "
    return text


def is_stats(rel: str, d) -> bool:
    return rel.endswith("_stats.json") and isinstance(d, dict) and all(
        isinstance(v, dict) and "num_steps" in v for v in d.values())


def serve_metric(r: dict, name: str):
    """A `bench serve` row's mean metric in either layout: flat (`mean_ttft_ms`) or older ({'ttft_ms': {'mean'}})."""
    if f"mean_{name}_ms" in r:
        return r[f"mean_{name}_ms"]
    v = r.get(f"{name}_ms")
    return v.get("mean") if isinstance(v, dict) else v


def acceptance_length(r: dict):
    return (r.get("server_stats") or {}).get("mean_acceptance_length")


# ---------------------------------------------------------------- the page


class Page:
    def __init__(self, data: dict[str, dict], results: Path = RESULTS):
        self.data = data
        self.results = results
        self.m = Machines()
        self.lines: list[str] = []
        self.plots: dict[str, callable] = {}  # file name under plots/ -> function(path) drawing it
        self.used: set[str] = set()

    def add(self, *lines: str):
        self.lines.extend(lines)

    def plot(self, name: str, caption: str, draw):
        self.plots[name] = draw
        self.add(f"![{caption}](results/plots/{name})", "")

    # ---- sections

    def build(self) -> str:
        self.add("# Benchmark results", "",
                 "Generated by `python benchmarks/results_page.py` from `benchmarks/results/*.json`: do not edit by hand",
                 "(`python benchmarks/results_page.py --check`, run by `tests/unit/test_results_page.py`, fails when this page",
                 "is stale). How to run each benchmark: [README.md](README.md). How these figures came about, session by",
                 "session, and older runs: [docs/benchmarks-history.md](../docs/benchmarks-history.md) and",
                 "`benchmarks/results/history/`. Speeds depend on the machine (the same code measured 1.6x HF",
                 "transformers on one CPU and 0.8x on another): every row names its machine (table at the end). On",
                 "the shared 2-core CPU VMs the absolute tok/s drift by 10-30% between sittings; read the ratios,",
                 "which come from systems run interleaved in one sitting.", "")
        self.offline()
        self.never_loses()
        self.draft_length_sweeps()
        self.served_sweeps()
        self.async_runs()
        self.tensor_parallel()
        self.memory_and_soak()
        self.config_health()
        self.gpu()
        self.others()
        self.machines()
        return "\n".join(self.lines).rstrip() + "\n"

    def offline(self):
        rows, speed = [], {}
        refs = [rel for rel in self.data if "_offline_" in Path(rel).stem and is_offline(self.data[rel])]
        for rel, d in self.data.items():
            if not is_offline(d) or rel in refs or d.get("tensor_parallel_size", 1) not in (1, None):
                continue
            self.used.add(rel)
            stem = Path(rel).stem
            s = set_of(stem) or Path(str(d.get("prompts"))).stem
            group = rel[: -len(".json")].replace("_" + s, "") if s else rel[: -len(".json")]
            env = d.get("environment") or {}
            threads = d.get("torch_threads", env.get("torch_threads"))
            k = d.get("num_speculative_tokens")
            rows.append((group, set_order(s), [
                f"`{group}`", d["method"] + (f" k{k}" if k and d["method"] != "none" else ""), s,
                d.get("concurrency"), fmt(d.get("output_throughput")), fmt(d.get("baseline_output_throughput")),
                fmt(d.get("speedup"), 2, "x"), fmt(d.get("spec_decode_acceptance_length"), 2),
                fmt(d.get("greedy_match")), fmt(d.get("baseline_vs_hf"), 2, "x"),
                fmt(d.get("method_vs_hf_assisted"), 2, "x"), fmt(threads, 0), self.m.of(rel, d), link(rel)]))
            if d.get("concurrency") == 1 and d["method"] != "none" and d.get("speedup") is not None:
                speed.setdefault(group, {})[s] = d["speedup"]
        if not rows:
            return
        rows.sort(key=lambda r: (r[0], r[1]))
        self.add("## Offline (`rayspec bench offline`, no Ray)", "",
                 "Speculation and its target-only baseline in one process, interleaved prompt by prompt; greedy.",
                 "`speedup` = method tok/s / baseline tok/s; `vs HF` = baseline / HF `generate()`, method / HF prompt",
                 "lookup (where the run timed HF).", "")
        self.add(*table(["run", "method", "prompt set", "conc", "tok/s", "baseline tok/s", "speedup", "accept len",
                         "greedy match", "baseline vs HF", "method vs HF lookup", "threads", "machine", "file"],
                        [r[2] for r in rows]))
        if speed:
            groups = sorted(speed)
            sets = sorted({s for g in groups for s in speed[g]}, key=set_order)

            def draw(path, groups=groups, sets=sets):
                plt = pyplot()
                fig, ax = plt.subplots(figsize=(9, 4.5))
                width = 0.8 / len(groups)
                for i, g in enumerate(groups):
                    xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(sets))]
                    ax.bar(xs, [speed[g].get(s, 0) for s in sets], width, label=g, color=color(i))
                ax.axhline(1.0, color="black", linewidth=0.8)
                ax.set_xticks(range(len(sets)), sets)
                ax.set_ylabel("speedup over the baseline (x)")
                ax.set_title("Offline speedup by prompt set (concurrency 1)")
                ax.legend(fontsize=7, loc="upper left")
                save(fig, path)

            self.plot("offline_speedup_by_prompt_set.png", "offline speedup by prompt set", draw)

    def never_loses(self):
        """benchmarks/run_never_loses.sh's sweeps (one k per method): one table over all of them, no plots."""
        files = [rel for rel, d in self.data.items() if is_draft_sweep(d) and Path(rel).stem.startswith("never_loses_")]
        if not files:
            return
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import never_loses_table

        self.used.update(files)
        found = never_loses_table.rows([str(self.results / rel) for rel in sorted(files)])
        machines = sorted({self.m.of(rel, self.data[rel]) for rel in files})
        self.add("## Speculation that never loses (`benchmarks/run_never_loses.sh`, no Ray)", "",
                 "Each proposer at its shipped settings against the target alone, interleaved batch by batch, one torch",
                 "thread (`benchmarks/README.md`: the noise, and why temperature 1 is run seeded and concurrency 8 with",
                 "more rounds: a level appears twice where a `_c8` file, 8 rounds, sits beside the 2-round sweep).",
                 f"Files: `results/never_loses_*.json`; machine {', '.join(machines)}.", "",
                 never_loses_table.table(found), "")
        served = sorted(rel for rel, d in self.data.items() if is_serve(d) and Path(rel).stem.startswith("never_loses_served_"))
        if served:
            self.add("### Served (`benchmarks/run_never_loses_served.sh`: each proposer's app beside /base in one Serve"
                     " instance, over HTTP)", "",
                     "Per file its own section below; here the speedups together (output tok/s over /base's at the same"
                     " concurrency; `rounds`: the same per round). The script starts only /base and the measured app, waits"
                     " for `/health`, one request each and settled CPU kernel choices (`rayspec/cpu/kernels.py`: a"
                     " choice measured while other apps loaded beside it ran single rows at half speed). Files written"
                     " before that (2026-11-28, 22:00 UTC: `results/history/never_loses_served_ngram_draft_model_*`)"
                     " are not comparable. Since 2026-11-29 every app of a machine runs one kernel choice (the first"
                     " quiet measurement, kept: apps measured apart had served 15% apart drafting nothing) and"
                     " EAGLE-3 and the draft model are measured in one instance, T=1 seeded"
                     " (`never_loses_served_eagle3_draft_model_*`; their earlier files in `results/history/`). Written"
                     " from 2026-11-29 03:45 UTC, with the prefix cache's relocation of short shared prefixes and the"
                     " EAGLE head's keys-alone catch-up (README, Prefix caching): EAGLE-3 and the draft model greedy on"
                     " long documents, MT-bench and GSM8K (3 rounds), and every n-gram file (T=1 now seeded as well;"
                     " the unseeded ones in `results/history/`). Long documents at concurrency 8 behind EAGLE-3 read"
                     " 0.94x before (twice): each new conversation evicted the previous document's cached blocks.", "",
                     never_loses_table.served_table(never_loses_table.served_rows([str(self.results / rel) for rel in served])),
                     "")

    def draft_length_sweeps(self):
        sweeps = [rel for rel, d in self.data.items()
                  if is_draft_sweep(d) and not Path(rel).stem.startswith("never_loses_")]
        if not sweeps:
            return
        self.add("## Methods x draft lengths (`rayspec bench sweep`, no Ray)", "",
                 "Every (method, k) and the target-only baseline in one process, interleaved batch by batch; `speedup`",
                 "= method tok/s / baseline tok/s; `accept by position`: drafting steps whose j-th draft token was",
                 "accepted / drafting steps; `proposer MB`: its weights + KV cache as `rayspec plan` sizes them.", "")
        for rel in sweeps:
            d = self.data[rel]
            self.used.add(rel)
            cfg = d["config"]
            stem = Path(rel).stem
            self.add(f"### `{stem}`", "",
                     f"{link(rel)}: {cfg['model']}, {cfg['num_prompts']} prompts of {cfg['prompts']}, "
                     f"{cfg['max_tokens']} tokens, temperature {cfg['temperature']}, "
                     + sweep_drafting(cfg)
                     + f"{fmt((d.get('environment') or {}).get('torch_threads'), 0)} threads; machine {self.m.of(rel, d)}.", "")
            rows = []
            for r in d["results"]:
                mb = None
                if r.get("proposer_weights_bytes") is not None:
                    mb = (r["proposer_weights_bytes"] + (r.get("proposer_kv_bytes") or 0)) / 1e6
                rows.append([r["method"], r["num_speculative_tokens"], r["concurrency"], fmt(r["output_throughput"]),
                             fmt(r["baseline_output_throughput"]), fmt(r["speedup"], 2, "x"),
                             fmt(r["acceptance_length"], 2), fmt(r["acceptance_rate"], 2), fmt(r["greedy_match"]),
                             fmt(mb), " ".join(fmt(x, 2) for x in r["acceptance_by_position"])])
            self.add(*table(["method", "k", "conc", "tok/s", "baseline tok/s", "speedup", "accept len", "accept rate",
                             "greedy match", "proposer MB", "accept by position"], rows))

            def draw(path, d=d):
                from rayspec.bench.sweep import write_plot

                write_plot(d, path)

            self.plot(f"{stem}.png", f"{stem}: tok/s, speedup and acceptance against k", draw)

    def served_sweeps(self):
        sweeps = [rel for rel, d in self.data.items() if is_serve(d) and not self.async_tag(rel)]
        if not sweeps:
            return
        self.add("## Served (`rayspec bench serve` over HTTP, Ray Serve)", "",
                 "Endpoints taking turns level by level (`--rounds`: the order rotating), each level at least",
                 "`--waves` x concurrency requests; tok/s is output tokens per second over all requests of a level.", "")
        for rel in sweeps:
            d = self.data[rel]
            self.used.add(rel)
            cfg = d["config"]
            stem = Path(rel).stem
            machine = self.m.of(rel, d)
            labels = list(cfg.get("labels") or sorted({r["label"] for r in d["results"]}))
            self.add(f"### `{stem}`", "",
                     f"{link(rel)}: {cfg.get('num_prompts')} prompts"
                     + (f" of {set_of(stem)}" if set_of(stem) else "")
                     + f", {cfg.get('max_tokens')} tokens, rounds {cfg.get('rounds', '-')}, waves {cfg.get('waves', '-')};"
                     f" machine {machine}.", "")
            base = next((lab for lab in labels if "base" in lab or "transformers" in lab), None)
            by = {(r["label"], r["concurrency"]): r for r in d["results"]}
            concs = sorted({r["concurrency"] for r in d["results"]})
            rows = []
            for c in concs:
                for lab in labels:
                    r = by.get((lab, c))
                    if r is None:
                        continue
                    ref = by.get((base, c))
                    ratio = r["output_throughput"] / ref["output_throughput"] if ref and lab != base else None
                    rows.append([lab, c, fmt(r["output_throughput"]), fmt(ratio, 2, "x"), fmt(r.get("mean_in_flight"), 2),
                                 fmt(serve_metric(r, "ttft"), 0), fmt(serve_metric(r, "tpot"), 1),
                                 fmt(acceptance_length(r), 2)])
            self.add(*table(["endpoint", "conc", "tok/s", f"vs {base}" if base else "ratio", "in flight",
                             "TTFT mean ms", "TPOT mean ms", "accept len"], rows))
            refs = sorted(r for r in self.data if r.startswith(stem + "_offline_") and is_offline(self.data[r]))
            if refs:
                orow = []
                for ref in refs:
                    o = self.data[ref]
                    self.used.add(ref)
                    orow.append([link(ref), o["method"], fmt(o.get("torch_threads"), 0), fmt(o["output_throughput"]),
                                 fmt(o.get("baseline_output_throughput")), fmt(o.get("speedup"), 2, "x")])
                self.add("Offline references in the same sitting (no Ray running):", "")
                self.add(*table(["file", "method", "threads", "tok/s", "baseline tok/s", "speedup"], orow))
            if len(concs) > 1:
                def draw(path, d=d, labels=labels, concs=concs, stem=stem, by=by):
                    plt = pyplot()
                    fig, ax = plt.subplots(figsize=(7, 4))
                    for i, lab in enumerate(labels):
                        cs = [c for c in concs if (lab, c) in by]
                        ax.plot(cs, [by[(lab, c)]["output_throughput"] for c in cs], marker="o", label=lab, color=color(i))
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(concs, [str(c) for c in concs])
                    ax.set_xlabel("concurrency")
                    ax.set_ylabel("output tok/s")
                    ax.set_title(stem)
                    ax.legend(fontsize=8)
                    save(fig, path)

                self.plot(f"{stem}_tok_s.png", f"{stem}: tok/s by concurrency", draw)

    def async_tag(self, rel: str) -> str | None:
        """The run tag of a `bench serve` file that has a `<tag>_stats.json` beside it (benchmarks/run_async.sh)."""
        stem = Path(rel).stem
        s = set_of(stem)
        if not s or not stem.endswith("_" + s):
            return None
        tag = stem[: -len(s) - 1]
        return tag if (Path(rel).parent / f"{tag}_stats.json").as_posix() in self.data else None

    def async_runs(self):
        tags: dict[str, list[str]] = {}
        for rel, d in self.data.items():
            if is_serve(d) and self.async_tag(rel):
                tags.setdefault(self.async_tag(rel), []).append(rel)
        if not tags:
            return
        self.add("## Asynchronous drafting against synchronous (`benchmarks/run_async.sh`)", "",
                 "Each run: served apps taking turns per prompt set, `/sync` the colocated synchronous app, `/async`",
                 "the disaggregated one that pre-drafts while the target verifies (other apps: `/sync2` the colocated",
                 "app at 2 threads, `/disagg` the disaggregated one without pre-drafting). File names:",
                 "`served_<drafter>_async_vs_sync_c<concurrency>_<set>.json` and `..._stats.json`.", "")
        rows, family_points = [], {}
        for tag in sorted(tags, key=lambda t: (re.sub(r"_c\d+$", "", t), int(re.search(r"_c(\d+)$", t).group(1))
                                              if re.search(r"_c(\d+)$", t) else 0)):
            for rel in sorted(tags[tag], key=lambda r: set_order(set_of(Path(r).stem))):
                d = self.data[rel]
                self.used.add(rel)
                s = set_of(Path(rel).stem)
                tok = {r["label"]: r["output_throughput"] for r in d["results"]}
                conc = d["results"][0]["concurrency"] if d["results"] else None
                others = [f"{lab} {tok[lab]:.1f} ({tok[lab] / tok['sync']:.2f}x)" for lab in sorted(tok)
                          if lab not in ("sync", "async") and tok.get("sync")]
                ratio = tok["async"] / tok["sync"] if tok.get("sync") and "async" in tok else None
                rows.append([f"`{tag}`", conc, s, fmt(tok.get("sync")), fmt(tok.get("async")), fmt(ratio, 3, "x"),
                             "; ".join(others) or "-", d["config"].get("rounds", 1), self.m.of(rel, d), link(rel)])
                family = re.sub(r"_c\d+$", "", tag)
                for lab, v in tok.items():
                    family_points.setdefault(family, {}).setdefault((lab, s), []).append((conc, v))
        self.add(*table(["run", "conc", "prompt set", "sync tok/s", "async tok/s", "async / sync", "other apps",
                         "rounds", "machine", "file"], rows))
        srows, positions = [], {}
        for tag in sorted(tags):
            rel = (Path(tags[tag][0]).parent / f"{tag}_stats.json").as_posix()
            st = self.data[rel]
            self.used.add(rel)
            for app in sorted(st, key=lambda a: (a not in ("sync", "async"), a != "sync", a)):
                a = st[app]
                srv = a.get("server") or {}
                hits, misses = srv.get("speculation_cache_hits"), srv.get("speculation_cache_misses")
                hit = hits / (hits + misses) if hits is not None and misses and hits + misses else None
                srows.append([f"`{tag}`", app, a.get("num_steps"), fmt(a.get("step_ms")), fmt(a.get("draft_ms")),
                              fmt(a.get("overlap_bound"), 3) if app == "sync" else "-",
                              fmt(a.get("mean_acceptance_length"), 2), fmt(hit * 100 if hit is not None else None, 1, "%"),
                              link(rel)])
                per_pos, drafts = srv.get("num_accepted_tokens_per_pos"), srv.get("num_drafts")
                if per_pos and drafts:
                    positions[f"{tag} /{app}"] = [n / drafts for n in per_pos]
        self.add("Step breakdown (all sets and warm-ups of a run together; B = step / (step - drafting) of the",
                 "synchronous app, the most overlapping drafting with verification could give):", "")
        self.add(*table(["run", "app", "steps", "step ms", "draft ms", "B", "accept len", "hit rate", "file"], srows))
        if positions:
            depth = max(max((i + 1 for i, v in enumerate(p) if v > 0), default=1) for p in positions.values())
            self.add("### Acceptance by draft position", "",
                     "Share of drafting steps whose draft was accepted at least to position i (the server's",
                     "`num_accepted_tokens_per_pos` / `num_drafts`):", "")
            self.add(*table(["run / app"] + [f"pos {i + 1}" for i in range(depth)],
                            [[name] + [fmt(p[i] if i < len(p) else None, 3) for i in range(depth)]
                             for name, p in sorted(positions.items())]))

            def draw(path, positions=positions, depth=depth):
                plt = pyplot()
                fig, ax = plt.subplots(figsize=(8, 4.5))
                for i, (name, p) in enumerate(sorted(positions.items())):
                    ax.plot(range(1, depth + 1), (p + [0.0] * depth)[:depth], marker="o", label=name, color=color(i),
                            linestyle="-" if name.endswith("/sync") else "--")
                ax.set_xticks(range(1, depth + 1))
                ax.set_xlabel("draft position")
                ax.set_ylabel("accepted share of drafting steps")
                ax.set_ylim(0, 1)
                ax.set_title("Acceptance by draft position (served runs)")
                ax.legend(fontsize=6, ncol=2)
                save(fig, path)

            self.plot("acceptance_by_position.png", "acceptance by draft position", draw)
        for family, points in sorted(family_points.items()):
            concs = sorted({c for pts in points.values() for c, _ in pts})
            if len(concs) < 2:
                continue

            def draw(path, family=family, points=points, concs=concs):
                plt = pyplot()
                sets = sorted({s for _, s in points}, key=set_order)
                fig, axes = plt.subplots(1, len(sets), figsize=(4 * len(sets), 3.8), squeeze=False)
                for ax, s in zip(axes[0], sets):
                    for i, lab in enumerate(sorted({lab for lab, _ in points})):
                        pts = sorted(points.get((lab, s), []))
                        if pts:
                            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=lab, color=color(i))
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(concs, [str(c) for c in concs])
                    ax.set_title(s)
                    ax.set_xlabel("concurrency")
                axes[0][0].set_ylabel("output tok/s")
                axes[0][0].legend(fontsize=8)
                fig.suptitle(family)
                save(fig, path)

            self.plot(f"{family}_tok_s.png", f"{family}: tok/s by concurrency", draw)

    def tensor_parallel(self):
        rows = []
        for rel, d in self.data.items():
            if is_offline(d) and d.get("tensor_parallel_size", 1) not in (1, None):
                self.used.add(rel)
                rows.append([f"`{Path(rel).stem}`", d.get("model") if "/" not in str(d.get("model")) else Path(d["model"]).name,
                             d["method"], d["tensor_parallel_size"], fmt(d["output_throughput"]),
                             fmt(d.get("tp1_output_throughput")), fmt(d.get("tp_vs_tp1"), 2, "x"),
                             fmt(d.get("speedup"), 2, "x"), fmt(d.get("tp1_greedy_match")), self.m.of(rel, d), link(rel)])
        if rows:
            self.add("## Tensor parallelism on CPU (`benchmarks/run_tp.sh`)", "",
                     "Each TP engine beside a TP=1 engine in one process, interleaved; gloo over loopback, one thread",
                     "per rank. On a 2-core CPU TP is slower by construction; the point is exactness.", "")
            self.add(*table(["run", "model", "method", "TP", "tok/s", "TP=1 tok/s", "TP / TP=1", "speedup vs its baseline",
                             "greedy == TP=1", "machine", "file"], rows))

    def memory_and_soak(self):
        d = self.data.get("load_memory.json")
        if d:
            self.used.add("load_memory.json")
            mib = 1 << 20
            self.add("## Memory", "", f"Loading {d.get('model')} (`benchmarks/load_memory.py`; goal: {d.get('goal')};"
                     f" machine {self.m.of('load_memory.json', d)}), {link('load_memory.json')}:", "")
            self.add(*table(["loader", "dtype", "weights MiB", "load peak MiB", "x weights", "whole load MiB"],
                            [[c["loader"], c["dtype"], fmt(c["weight_bytes"] / mib), fmt(c["load_peak"] / mib),
                              fmt(c.get("load_peak_over_weights"), 2, "x"), fmt(c["total_peak"] / mib)]
                             for c in d["cases"]]))
        d = self.data.get("prefill_memory.json")
        if d:
            self.used.add("prefill_memory.json")
            self.add(f"Peak memory of one long prefill by chunk budget (`benchmarks/prefill_memory.py`; machine"
                     f" {self.m.of('prefill_memory.json', d)}), {link('prefill_memory.json')}:", "")
            self.add(*table(["prompt tokens", "max_num_batched_tokens", "peak above baseline MiB", "planner's bound MiB",
                             "prefill s"],
                            [[r["tokens"], r["max_num_batched_tokens"] or "unchunked", fmt(r["peak_above_baseline_mib"]),
                              fmt(r.get("estimate_mib")), fmt(r.get("prefill_seconds"))] for r in d["runs"]]))
        d = self.data.get("soak.json")
        if d:
            self.used.add("soak.json")
            w = d.get("windows") or []
            self.add("## Soak (`benchmarks/run_soak.sh`)", "",
                     f"{d.get('minutes')} minutes of mixed traffic at concurrency {d.get('concurrency')}, max_tokens"
                     f" {d.get('max_tokens')}: {d.get('requests')} requests, {d.get('errors')} errors (machine"
                     f" {self.m.of('soak.json', d)}), {link('soak.json')}.", "")
            if w:
                self.add(*table(["", "first window", "last window"], [
                    ["requests", w[0]["requests"], w[-1]["requests"]],
                    ["latency p50 s", fmt(w[0]["latency_p50_s"]), fmt(w[-1]["latency_p50_s"])],
                    ["latency p95 s", fmt(w[0]["latency_p95_s"]), fmt(w[-1]["latency_p95_s"])],
                    ["verifier RSS MiB", fmt(w[0]["rss_mib"].get("verifier"), 0), fmt(w[-1]["rss_mib"].get("verifier"), 0)]]))
        d = self.data.get("proposer_busy.json")
        if d:
            self.used.add("proposer_busy.json")
            self.add("## How busy a verifier keeps its proposer (`benchmarks/proposer_busy.py`)", "",
                     f"`{Path(str(d.get('config'))).name}`, machine {self.m.of('proposer_busy.json', d)},"
                     f" {link('proposer_busy.json')}:", "")
            self.add(*table(["concurrency", "proposer call / step time", "drafting / wall"],
                            [[r["concurrency"], fmt(r["b_call_over_step"], 3), fmt(r["drafting_over_wall"], 3)]
                             for r in d["rows"]]))

    def gpu(self):
        self.add("## GPU", "")
        roof = [rel for rel in self.data if Path(rel).name.startswith("gpu_roofline")]
        if not roof:
            self.add("No `gpu_roofline*.json` yet: `python benchmarks/gpu_roofline.py --json",
                     "benchmarks/results/gpu_roofline_<gpu>.json` on a GPU machine writes one ([README.md](README.md), \"GPU\").", "")
        for rel in roof:
            d = self.data[rel]
            self.used.add(rel)
            s = d.get("summary") or {}
            gpu = s.get("gpu") or (d.get("environment") or {}).get("gpu_model") or "?"
            self.add(f"### Roofline: `{Path(rel).stem}` ({gpu})", "",
                     f"{link(rel)}: shapes `{(d.get('args') or {}).get('shape')}`, bandwidth {fmt(s.get('bandwidth_gb_s'))} GB/s,"
                     f" weights read once in {fmt(s.get('weights_read_ms'), 3)} ms; machine {self.m.of(rel, d)}.", "")
            roof_ms = s.get("weights_read_ms")
            rows = []
            for r in d.get("decode", []):
                rows.append([f"decode b={r['batch']} {'compiled' if r['compiled'] else 'eager'}", fmt(r["ms_per_step"], 3),
                             fmt(r["ms_per_step"] / roof_ms if roof_ms else None, 2), fmt(r.get("tok_s"))])
            for r in d.get("verify", []):
                rows.append([f"verify {r['what']} (b=1)", fmt(r["ms"], 3), fmt(r["ms"] / roof_ms if roof_ms else None, 2), "-"])
            for r in d.get("head", []):
                rows.append(["EAGLE-3 head step", fmt(r["ms"], 3), fmt(r["ms"] / roof_ms if roof_ms else None, 2), "-"])
            for r in d.get("peer", []):
                rows.append([f"peer: {r['what']}", fmt(r["ms_per_token"], 3),
                             fmt(r["ms_per_token"] / roof_ms if roof_ms else None, 2), fmt(r.get("tok_s"))])
            self.add(*table(["case", "ms", "x weights read", "tok/s"], rows))
            extra = {k: v for k, v in sorted(s.items()) if k not in ("gpu", "bandwidth_gb_s", "weights_read_ms", "wall_s")}
            if extra:
                self.add(*table(["summary", "value"], [[k, fmt(v, 3) if isinstance(v, float) else v] for k, v in extra.items()]))
            if d.get("errors"):
                self.add(f"{len(d['errors'])} case(s) failed in this run (see `errors` in the JSON).", "")
            if roof_ms:
                def draw(path, d=d, s=s, roof_ms=roof_ms, rel=rel):
                    plt = pyplot()
                    labels, values = [], []
                    for r in d.get("decode", []):
                        labels.append(f"b{r['batch']} {'comp' if r['compiled'] else 'eager'}")
                        values.append(r["ms_per_step"])
                    for r in d.get("verify", []):
                        labels.append(r["what"])
                        values.append(r["ms"])
                    for r in d.get("head", []):
                        labels.append("head step")
                        values.append(r["ms"])
                    for r in d.get("peer", []):
                        labels.append("HF static")
                        values.append(r["ms_per_token"])
                    fig, ax = plt.subplots(figsize=(8, 4))
                    ax.bar(labels, values, color=color(0))
                    ax.axhline(roof_ms, color="tab:red", linestyle="--", label=f"weights read ({roof_ms} ms)")
                    ax.set_ylabel("ms per step")
                    ax.set_title(f"{Path(rel).stem}: {s.get('gpu') or '?'}")
                    ax.legend()
                    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
                    save(fig, path)

                self.plot(f"{Path(rel).stem}.png", f"{Path(rel).stem}: step time against the roofline", draw)
        for rel, d in self.data.items():
            if not (isinstance(d, dict) and "gpu" in d and any(k in d for k in ("speed", "fusion", "exactness"))):
                continue
            self.used.add(rel)
            self.add(f"### `{Path(rel).stem}` ({d['gpu']}, torch {d.get('torch')})", "",
                     f"{link(rel)}; machine {self.m.of(rel, d)}.", "")
            if d.get("speed"):
                self.add(*table(["case", "eager tok/s", "compiled tok/s", "compiled / eager", "outputs equal"],
                                [[r["case"], fmt(r["tok_s_eager"]), fmt(r["tok_s_compiled"]),
                                  fmt(r["compiled_over_eager"], 2, "x"), r.get("outputs_equal", "-")] for r in d["speed"]]))
            if d.get("syncs"):
                self.add(*table(["case", "CUDA syncs per step (max / mean)", "host reads per step"],
                                [[r["case"], f"{r['cuda_syncs_per_step_max']} / {r['cuda_syncs_per_step_mean']}",
                                  r["to_host_reads_max"]] for r in d["syncs"]]))
            if d.get("fusion"):
                self.add(*table(["case", "eager unfused tok/s", "eager fused tok/s", "fused / unfused", "compiled fused tok/s"],
                                [[r["case"], fmt(r["tok_s_eager_unfused"]), fmt(r["tok_s_eager_fused"]),
                                  fmt(r["fused_over_unfused"], 2, "x"), fmt(r["tok_s_compiled_fused"])] for r in d["fusion"]]))
            if d.get("exactness"):
                self.add(*table(["dtype", "batch", "proposer", "speculative == target-only"],
                                [[r["dtype"], r["batch"], r["proposer"], r["equal"]] for r in d["exactness"]]))
            cp = d.get("chunked_prefill")
            if isinstance(cp, dict) and cp.get("rows"):
                self.add(*table(["max_num_batched_tokens", "peak above weights and cache MiB", "outputs equal"],
                                [[r["max_num_batched_tokens"] or "unchunked", fmt(r["peak_above_weights_and_cache_mib"]),
                                  fmt(cp.get("outputs_equal"))] for r in cp["rows"]]))
        for rel, d in sorted(self.data.items()):
            if not (Path(rel).name.startswith("gpu_never_loses") and isinstance(d, dict) and "cells" in d):
                continue
            self.used.add(rel)
            self.add(f"### Cost-aware drafting on the GPU: `{Path(rel).stem}` ({d.get('device')}, torch {d.get('torch')})", "",
                     f"{link(rel)} (`benchmarks/gpu_never_loses.py`): random targets whose acceptance is set by"
                     f" construction; {d.get('dtype')}, compile {d.get('compile')}, {d.get('max_tokens')} tokens,"
                     f" {d.get('rounds')} rounds; speedups over the target alone, adaptive (the default) and fixed"
                     f" (always the full draft). {d.get('note', '')}", "")
            self.add(*table(["target", "T", "conc", "proposer", "base tok/s", "adaptive", "fixed",
                             "drafted / accepted (adaptive)", "drafted / accepted (fixed)", "equal (adaptive, fixed)"],
                            [[c["target"], fmt(c["temperature"], 0), c["concurrency"], c["proposer"], fmt(c["base_tok_s"]),
                              fmt(c["adaptive_speedup"], 2, "x"), fmt(c["fixed_speedup"], 2, "x"),
                              f"{c['adaptive_drafted']} / {c['adaptive_accepted']}", f"{c['fixed_drafted']} / {c['fixed_accepted']}",
                              f"{c['adaptive_equal']}, {c['fixed_equal']}"] for c in d["cells"] if "proposer" in c]))
        for rel, d in sorted(self.data.items()):
            if not (Path(rel).name.startswith("gpu_engine") and isinstance(d, dict) and "runs" in d):
                continue
            self.used.add(rel)
            env = d.get("environment") or {}
            self.add(f"### The engine end to end on the GPU: `{Path(rel).stem}` ({env.get('gpu_model')}, torch {env.get('torch')})", "",
                     f"{link(rel)} (`benchmarks/gpu_engine.py`): tokens out of `LLMEngine` at `{(d.get('args') or {}).get('shape')}`"
                     f" shapes, random bfloat16 weights; machine {self.m.of(rel, d)}. {d.get('note', '')}", "")
            self.add(*table(["config", "batch", "AL", "tok/s", "ms/cycle", "draft", "verify", "host", "GPU idle",
                             "reads/cycle", "= compiled", "= eager"],
                            [[r["config"] + (f" (AL target {r['acceptance_target']})" if r.get("acceptance_target") else "")
                              + (f", T {r['temperature']}" if r.get("temperature") else ""),
                              r["batch"], fmt(r.get("acceptance_length"), 2), fmt(r.get("tok_s")),
                              fmt(r.get("ms_per_cycle"), 2), fmt(r.get("draft_ms"), 2), fmt(r.get("verify_ms"), 2),
                              fmt(r.get("host_ms"), 2), fmt(r.get("gpu_idle_share"), 2), fmt(r.get("host_reads_per_cycle"), 2),
                              r.get("outputs_equal_vs_compiled", "-"), r.get("outputs_equal_vs_eager", "-")]
                             for r in d["runs"]]))
            if d.get("forward_only"):
                self.add(*table(["forward only (compiled), batch", "ms/step", "tok/s"],
                                [[r["batch"], fmt(r["ms_per_step"], 2), fmt(r["tok_s"])] for r in d["forward_only"]]))
            if d.get("phases"):
                self.add("Phases (s): " + ", ".join(f"{p['phase']} {p.get('seconds', p.get('skipped', '?'))}"
                                                    for p in d["phases"]) + ".", "")
        for rel, d in sorted(self.data.items()):
            if not (Path(rel).name.startswith("draft_depths") and isinstance(d, dict) and "cells" in d):
                continue
            self.used.add(rel)
            args = d.get("args") or {}
            self.add(f"### A drafting cycle's depth forwards prepared once: `{Path(rel).stem}`", "",
                     f"{link(rel)} (`benchmarks/draft_depths.py`): the EAGLE-3 proposer's seconds per run (median of"
                     f" {args.get('rounds')} interleaved rounds; `{args.get('shape')}` shapes, {args.get('nodes')} nodes,"
                     f" depth {args.get('depth')}, top-k {args.get('topk')}, {args.get('max_tokens')} tokens), a forward"
                     f" per depth against prepared once (`rayspec/model/tree_steps.py`); machine {self.m.of(rel, d)}.", "")
            if args.get("compare") == "captured":  # the loop from Python against it captured whole
                self.add(f"Compared: the prepared depth loop from Python against the whole loop as one graph "
                         f"(`rayspec/proposers/tree_graph.py`), compiled with `{args.get('backend')}`.", "")
                self.add(*table(["mode", "batch", "loop from Python s", "captured s", "ratio"],
                                [[c["mode"], c["batch"], fmt(c["loop_s"], 3), fmt(c["captured_s"], 3),
                                  fmt(c["captured_over_loop"], 3, "x")] for c in d["cells"]]))
                continue
            self.add(*table(["mode", "batch", "a forward per depth s", "prepared once s", "ratio"],
                            [[c["mode"], c["batch"], fmt(c["per_depth_s"], 3), fmt(c["prepared_s"], 3),
                              fmt(c["prepared_over_per_depth"], 3, "x")] for c in d["cells"]]))
        served = sorted((self.results / "gpu").glob("*/summary.json"))
        if served:
            path = served[-1]
            s = json.loads(path.read_text())
            rel = path.relative_to(self.results).as_posix()
            self.add(f"### Served GPU comparison (`benchmarks/gpu.sh`, latest: {link(rel)})", "")
            self.add(*table(["set", "conc", "system", "tok/s", "TTFT ms", "TPOT ms", "accept len", "speedup"],
                            [[r["set"], r["concurrency"], r["system"], fmt(r["output_throughput"]), fmt(r["mean_ttft_ms"], 0),
                              fmt(r["mean_tpot_ms"], 1), fmt(r.get("mean_acceptance_length"), 2),
                              fmt(r.get("speedup_vs_baseline"), 2, "x")]
                             for r in sorted(s.get("rows", []), key=lambda r: (set_order(r["set"]), r["concurrency"], r["system"]))]))
        else:
            self.add("No served GPU comparison recorded yet (`benchmarks/gpu.sh` writes `benchmarks/results/gpu/<time>/`).", "")

    def config_health(self):
        d = self.data.get("config_health.json")
        if d:
            self.used.add("config_health.json")
            self.add("## The shipped CPU configs, served (`scripts/check_configs.py`)", "",
                     "Each CPU-only config in `configs/` started as a user starts it, `serve run configs/NAME.yaml`"
                     " (Ray's detected resources), until `/health` answers 200; then one 4-token chat completion;"
                     f" then Ctrl-C (SIGINT) until it exits (machine {self.m.of('config_health.json', d)}),"
                     f" {link('config_health.json')}:", "")
            self.add(*table(["config", "CPUs asked", "to /health 200 s", "completion s", "exit after SIGINT s", "ok"],
                            [[r["config"], fmt(r.get("cpus_asked")), fmt(r.get("health_s")), fmt(r.get("completion_s")),
                              fmt(r.get("stop_s")), "yes" if r.get("ok") else f"no: {r.get('error')}"]
                             for r in d["results"]]))

    def others(self):
        rest = [rel for rel in self.data if rel not in self.used]
        if rest:
            self.add("## Other result files", "", "Files this page does not tabulate:", "")
            self.add(*[f"- {link(rel)}" for rel in rest], "")

    def machines(self):
        self.add("## Machines", "")
        rows = [[mid, desc, len(self.m.files[desc])] for desc, mid in sorted(self.m.ids.items(), key=lambda kv: int(kv[1][1:]))]
        self.add(*table(["id", "machine (as the files recorded it)", "files"], rows))
        self.add("\"not recorded\": files written before `rayspec bench` recorded its environment (the AVX-512 AMD EPYC",
                 "of sessions 1-15 in docs/benchmarks-history.md, unless the log says otherwise).", "")


# ---------------------------------------------------------------- plotting

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcdefaults()
    plt.rcParams.update({"font.size": 9, "figure.dpi": 100, "svg.hashsalt": "rayspec", "path.simplify": False})
    return plt


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory; exit 1 if benchmarks/RESULTS.md differs or a plot is missing")
    parser.add_argument("--results", default=str(RESULTS), help=argparse.SUPPRESS)
    parser.add_argument("--page", default=str(PAGE), help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    results, page_path = Path(a.results), Path(a.page)
    page = Page(load_all(results), results)
    text = page.build()
    plots = results / "plots"
    if a.check:
        problems = []
        if not page_path.is_file() or page_path.read_text() != text:
            problems.append(f"{page_path} is stale: run `python benchmarks/results_page.py` and commit it")
        problems += [f"missing plot {plots / name}" for name in sorted(page.plots) if not (plots / name).is_file()]
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"{page_path} is up to date ({len(page.plots)} plots)")
        return 1 if problems else 0
    page_path.write_text(text)
    plots.mkdir(parents=True, exist_ok=True)
    for name, draw in sorted(page.plots.items()):
        draw(plots / name)
    for old in sorted(plots.glob("*.png")):
        if old.name not in page.plots:
            old.unlink()
    print(f"wrote {page_path} and {len(page.plots)} plots in {plots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
