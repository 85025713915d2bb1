"""`rayspec bench serve`: a serving benchmark against running OpenAI-compatible endpoints.
(Over 500 lines: the request loop, the per-level metrics, the table and the plot all read one result dict.)

Each prompt (Spec-Bench JSONL, `turns[0]` as the user message) is sent as a streaming chat
completion. For every endpoint and every concurrency level of the sweep, exactly `concurrency`
requests are kept in flight until all prompts are done. With `--waves W` a level sends at least
W x concurrency requests (the prompts repeated in order): with few prompts a high level would
otherwise spend much of its time draining below its concurrency. `mean_in_flight` (request time
summed over the level's wall time) shows how much concurrency a level really had. Endpoints are interleaved per level
(A@1, B@1, A@2, B@2, ...), and with `--rounds R` each level is repeated R times in turn, the
order rotating each round (A B C, B C A, C A B, ...), with tokens and time summed, so that drift
in machine speed hits them alike and none always goes first.

`--request-rate R` sends a level's requests as arrivals instead (vLLM's `bench serve`): gaps drawn
from a gamma distribution of shape `--burstiness` (1: Poisson) and mean 1/R, each request sent at
its arrival time while fewer than the level's concurrency are in flight (vLLM's `--max-concurrency`),
else as soon as one finishes; the arrival times are the same for every endpoint (seeded, `--seed`).
R = inf (the default) is the closed loop above.

Each endpoint has its model name (`--model` once for all, or once per `--endpoint` in order), so a
peer server (`vllm serve`, `transformers serve`, ...) is compared side by side.

Per endpoint per level, flat and under vLLM's `bench serve` names: `completed`, `failed`,
`total_input_tokens`, `total_output_tokens`, `request_throughput`, `output_throughput`,
`total_token_throughput`, `duration`, and `mean_/median_/std_/p90_/p99_` + `ttft_ms`, `tpot_ms`
(time per output token after the first), `itl_ms` (gaps between streamed content chunks) and
`e2el_ms` (end-to-end latency); then ours: the draft acceptance rate, both from the responses' usage
(`completion_tokens_details.accepted/rejected_prediction_tokens`) and, where the endpoint offers
`GET /v1/stats` (the rayspec ingress does), from the engine counters' deltas over the level
(acceptance rate and mean acceptance length = 1 + accepted / num_drafts).

A server that wants an API key gets it as `Authorization: Bearer <key>` on every request
(`--api-key`, else $RAYSPEC_API_KEY, else $OPENAI_API_KEY); the key is not written to the results.

(Over 500 lines: the closed loop, the arrival schedule and the per-level figures share one level
runner and its request records; its command line is rayspec_cli's.)
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

from rayspec.bench.environment import environment
from rayspec.bench.prompts import load_prompts
from rayspec.progress import progress_bar

STATS_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds to the first content chunk
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between content chunks
    completion_tokens: int = 0
    prompt_tokens: int = 0
    accepted: int | None = None
    rejected: int | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if "://" not in url:
        url = "http://" + url
    return url


LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names
STAT_PREFIXES = ("mean", "median", "std", "p90", "p99")


def summarize(name: str, values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """vLLM's flat fields for one latency: mean_<name>_ms, median_, std_, p90_, p99_ of `values`
    (seconds) in ms; None where there are no values."""
    keys = [f"{p}_{name}_ms" for p in STAT_PREFIXES]
    if not values:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=np.float64) * scale
    median, p90, p99 = np.percentile(arr, [50, 90, 99])
    return dict(zip(keys, (float(arr.mean()), float(median), float(arr.std()), float(p90), float(p99))))


async def send_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                       temperature: float, ignore_eos: bool = False, extra_body: dict | None = None) -> RequestResult:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})  # e.g. response_format, min_tokens (genai-perf's --extra-inputs)
    res = RequestResult()
    num_chunks = 0
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                res.e2e = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:  # in-band error after the status line
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    res.e2e = now - start
                    return res
                usage = chunk.get("usage")
                if usage:
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("completion_tokens_details") or {}
                    if details.get("accepted_prediction_tokens") is not None:
                        res.accepted = int(details["accepted_prediction_tokens"])
                        res.rejected = int(details.get("rejected_prediction_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        num_chunks += 1
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as err:
        res.error = f"{type(err).__name__}: {err}"
        res.e2e = time.perf_counter() - start
        return res
    res.e2e = time.perf_counter() - start
    if not res.completion_tokens:  # server sent no usage: fall back to content chunks
        res.completion_tokens = num_chunks
    res.ok = True
    return res


async def fetch_stats(client: httpx.AsyncClient, url: str) -> dict | None:
    try:
        r = await client.get(url + "/v1/stats", timeout=30)
        if r.status_code != 200:
            return None
        stats = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(stats, dict) or not all(k in stats for k in STATS_KEYS):
        return None
    return stats


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return _with_rates({k: int(after[k]) - int(before[k]) for k in STATS_KEYS}, after.get("method"))


def _with_rates(d: dict, method: str | None) -> dict:
    """Counter deltas plus acceptance rate and mean acceptance length (1 + accepted / drafts)."""
    drafted, accepted, drafts = d["num_draft_tokens"], d["num_accepted_tokens"], d["num_drafts"]
    d["acceptance_rate"] = accepted / drafted if drafted > 0 else None
    d["mean_acceptance_length"] = 1 + accepted / drafts if drafts > 0 else None
    d["method"] = method
    return d


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the level's start) of n requests at `request_rate` per second, as vLLM's
    bench serve: the first at 0, then gaps from a gamma distribution of shape `burstiness` (1: a
    Poisson process; lower: burstier) and mean 1 / request_rate. inf: all at 0."""
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return [0.0] + np.cumsum(gaps[:-1]).tolist() if n else []


async def run_level(client: httpx.AsyncClient, url: str, model: str, prompts: list[str], concurrency: int,
                    max_tokens: int, temperature: float, ignore_eos: bool = False,
                    extra_body: dict | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                    seed: int = 0, on_request_done: Callable[[RequestResult], None] | None = None) -> dict:
    """Send all prompts keeping exactly `concurrency` requests in flight (request_rate inf), or as
    arrivals at request_rate with at most `concurrency` in flight; return the raw round."""
    stats_before = await fetch_stats(client, url)
    results: list[RequestResult] = []

    async def send(prompt: str) -> None:
        results.append(await send_request(client, url, model, prompt, max_tokens, temperature, ignore_eos,
                                          extra_body))
        if on_request_done is not None:
            on_request_done(results[-1])

    start = time.perf_counter()
    if math.isinf(request_rate):  # closed loop: a worker per slot takes the next prompt
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)

        async def worker():
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await send(prompt)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    else:
        slots = asyncio.Semaphore(concurrency)

        async def arrive(prompt: str, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with slots:
                await send(prompt)

        times = arrival_times(len(prompts), request_rate, burstiness, seed)
        await asyncio.gather(*(arrive(p, t) for p, t in zip(prompts, times)))
    duration = time.perf_counter() - start
    stats_after = await fetch_stats(client, url) if stats_before is not None else None
    return {"results": results, "duration_s": duration, "server_stats": stats_delta(stats_before, stats_after)}


def _merge_stats(deltas: list[dict | None]) -> dict | None:
    if not deltas or any(d is None for d in deltas):
        return None
    return _with_rates({k: sum(x[k] for x in deltas) for k in STATS_KEYS}, deltas[-1].get("method"))


def level_prompts(prompts: list[str], concurrency: int, waves: int) -> list[str]:
    """The prompts a level sends: all of them once, repeated in order up to waves x concurrency."""
    n = max(len(prompts), waves * concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def level_seed(seed: int, round_index: int, concurrency: int) -> int:
    """The arrival times' seed of one level's round: the same for every endpoint there."""
    return seed + 1000 * round_index + concurrency


def rate_json(request_rate: float) -> float | str:
    return "inf" if math.isinf(request_rate) else request_rate  # as vLLM writes it (JSON has no inf)


def level_metrics(concurrency: int, rounds: list[dict], request_rate: float = math.inf,
                  burstiness: float = 1.0) -> dict:
    """One endpoint at one concurrency, over all its rounds (tokens and time summed); vLLM's names,
    flat, then ours (rounds, in-flight, acceptance)."""
    results = [r for rnd in rounds for r in rnd["results"]]
    duration = sum(rnd["duration_s"] for rnd in rounds)
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    with_acc = [r for r in ok if r.accepted is not None]
    acc = sum(r.accepted for r in with_acc)
    rej = sum(r.rejected for r in with_acc)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "concurrency": concurrency,
        "max_concurrency": concurrency,
        "request_rate": rate_json(request_rate),
        "burstiness": burstiness,
        "num_rounds": len(rounds),
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "duration": duration,
        "total_input_tokens": input_tokens,  # from the responses' usage.prompt_tokens
        "total_output_tokens": tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(tokens),
        "total_token_throughput": per_s(input_tokens + tokens),
        # per round, to show the spread the noise gives
        "round_output_throughput": [sum(r.completion_tokens for r in rnd["results"] if r.ok) / rnd["duration_s"]
                                    for rnd in rounds if rnd["duration_s"] > 0],
        # requests in flight on average; below `concurrency` when the level drains at its end
        "mean_in_flight": per_s(sum(r.e2e for r in results)),
        **summarize("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **summarize("tpot", [t for r in ok if (t := r.tpot) is not None]),
        **summarize("itl", [g for r in ok for g in r.itls]),
        **summarize("e2el", [r.e2e for r in ok]),
        "usage_acceptance": {"accepted_tokens": acc, "rejected_tokens": rej,
                             "acceptance_rate": acc / (acc + rej) if acc + rej > 0 else None}
        if with_acc else None,
        "server_stats": _merge_stats([rnd["server_stats"] for rnd in rounds]),
    }


async def run_serve_benchmark_async(endpoints: list[str], labels: list[str], models: list[str], prompts: list[str],
                                    concurrencies: list[int], max_tokens: int, temperature: float,
                                    ignore_eos: bool = False, warmup: int = 1, timeout: float = 600.0,
                                    log=print, rounds: int = 1, waves: int = 0,
                                    extra_body: dict | None = None, api_key: str | None = None,
                                    request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
                                    progress: bool = True) -> dict:
    urls = [base_url(e) for e in endpoints]
    limits = httpx.Limits(max_connections=max(concurrencies) + 4, max_keepalive_connections=max(concurrencies) + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    clients = [httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits, headers=headers)
               for _ in urls]
    results: list[dict] = []
    total = len(urls) * rounds * sum(len(level_prompts(prompts, c, waves)) for c in concurrencies)
    bar = progress_bar(enabled=progress, total=total, desc="bench serve", unit="req")
    failed = 0

    def request_done(r: RequestResult) -> None:
        nonlocal failed
        failed += not r.ok
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed)

    try:
        for client, url, label, model in zip(clients, urls, labels, models):
            for prompt in prompts[:warmup]:
                r = await send_request(client, url, model, prompt, max_tokens, temperature, ignore_eos, extra_body)
                if not r.ok:
                    log(f"[{label}] warmup request failed: {r.error}")
        for c in concurrencies:
            done: dict[str, list[dict]] = {label: [] for label in labels}
            for i in range(rounds):
                # endpoints take turns, and the order rotates each round (A B C, B C A, C A B): drift
                # in machine speed hits every endpoint alike, and no endpoint always goes first
                # (measured: the one going first after the others had run lost 3-4% at c4)
                turn = i % len(urls)
                order = list(zip(clients, urls, labels, models))
                for client, url, label, model in order[turn:] + order[:turn]:
                    bar.set_description(f"bench serve {label} c{c}")
                    # the same arrival times for every endpoint of a level's round
                    rnd = await run_level(client, url, model, level_prompts(prompts, c, waves), c, max_tokens,
                                          temperature, ignore_eos, extra_body, request_rate, burstiness,
                                          seed=level_seed(seed, i, c), on_request_done=request_done)
                    done[label].append(rnd)
                    tokens = sum(r.completion_tokens for r in rnd["results"] if r.ok)
                    log(f"[{label}] concurrency {c} round {i + 1}/{rounds}: "
                        f"{tokens / max(rnd['duration_s'], 1e-9):.1f} tok/s, "
                        f"{sum(not r.ok for r in rnd['results'])} errors, {rnd['duration_s']:.1f} s, "
                        f"{sum(r.e2e for r in rnd['results']) / max(rnd['duration_s'], 1e-9):.1f} in flight")
            for url, label, model in zip(urls, labels, models):
                results.append({"label": label, "endpoint": url, "model_id": model,
                                **level_metrics(c, done[label], request_rate, burstiness)})
    finally:
        bar.close()
        for client in clients:
            await client.aclose()
    return {"config": {"endpoints": urls, "labels": labels, "models": models,
                       "model": ", ".join(dict.fromkeys(models)), "num_prompts": len(prompts),
                       "max_tokens": max_tokens, "temperature": temperature, "concurrency": concurrencies,
                       "request_rate": rate_json(request_rate), "burstiness": burstiness, "seed": seed,
                       "ignore_eos": ignore_eos, "warmup": warmup, "rounds": rounds, "waves": waves,
                       "extra_body": extra_body or {}},
            "environment": environment(),  # of the machine running this client (the servers' may differ)
            "results": results}


def run_serve_benchmark(endpoints: list[str], labels: list[str] | None = None,
                        model: str | list[str] = "smollm2-135m-instruct",
                        prompts_file: str | None = None, num_prompts: int | None = None, max_tokens: int = 128,
                        concurrency: list[int] | str = (1, 2, 4, 8), temperature: float = 0.0,
                        ignore_eos: bool = False, warmup: int = 1, timeout: float = 600.0, log=print,
                        rounds: int = 1, waves: int = 0, extra_body: dict | None = None,
                        api_key: str | None = None, request_rate: float = math.inf, burstiness: float = 1.0,
                        seed: int = 0, progress: bool = True) -> dict:
    """api_key None: $RAYSPEC_API_KEY, else $OPENAI_API_KEY, else none sent. model: one name for
    every endpoint, or a list, one per endpoint in order. progress: a bar of requests on stderr."""
    if not endpoints:
        raise ValueError("give at least one --endpoint")
    if labels and len(labels) != len(endpoints):
        raise ValueError(f"{len(labels)} --label for {len(endpoints)} --endpoint")
    models = endpoint_models(model, len(endpoints))
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: closed loop), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    labels = list(labels) if labels else [base_url(e).split("://", 1)[-1] for e in endpoints]
    concurrencies = parse_concurrency(concurrency) if isinstance(concurrency, str) else [int(c) for c in concurrency]
    if prompts_file is None:
        raise ValueError("give --prompts")
    prompts = load_prompts(prompts_file, num_prompts)
    return asyncio.run(run_serve_benchmark_async(endpoints, labels, models, prompts, concurrencies, max_tokens,
                                                 temperature, ignore_eos, warmup, timeout, log, rounds, waves,
                                                 extra_body, resolve_api_key(api_key), request_rate, burstiness,
                                                 seed, progress))


def endpoint_models(model: str | list[str] | tuple[str, ...] | None, num_endpoints: int) -> list[str]:
    """The model name each endpoint is sent: one for all, or one per endpoint in order."""
    if model is None or isinstance(model, str):
        return [model or "smollm2-135m-instruct"] * num_endpoints
    model = list(model)
    if len(model) == 1:
        return model * num_endpoints
    if len(model) != num_endpoints:
        raise ValueError(f"{len(model)} --model for {num_endpoints} --endpoint (give one for all, or one each)")
    return model


def resolve_api_key(api_key: str | None) -> str | None:
    if api_key:
        return api_key
    return os.environ.get("RAYSPEC_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


def parse_concurrency(text: str) -> list[int]:
    values = [int(v) for v in text.replace(" ", "").split(",") if v]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"bad --concurrency {text!r}: want positive integers like 1,2,4,8")
    return values


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def format_result(result: dict) -> str:
    head = (f"{'endpoint':<16} {'conc':>4} {'flight':>6} {'ok/err':>7} {'tok/s':>8} {'req/s':>6} "
            f"{'TTFT mean/med/p99 ms':>22} {'TPOT mean/p99':>14} {'ITL mean/p99':>14} "
            f"{'E2EL mean/p99 ms':>17} {'acc(usage)':>10} {'acc(srv)':>8} {'mal':>5}")
    lines = [head, "-" * len(head)]
    for r in result["results"]:
        ua, ss = r["usage_acceptance"] or {}, r["server_stats"] or {}
        lines.append(
            f"{r['label'][:16]:<16} {r['concurrency']:>4} {r['mean_in_flight']:>6.2f} {str(r['completed']) + '/' + str(r['failed']):>7} "
            f"{r['output_throughput']:>8.1f} {r['request_throughput']:>6.2f} "
            f"{_fmt(r['mean_ttft_ms']) + '/' + _fmt(r['median_ttft_ms']) + '/' + _fmt(r['p99_ttft_ms']):>22} "
            f"{_fmt(r['mean_tpot_ms']) + '/' + _fmt(r['p99_tpot_ms']):>14} "
            f"{_fmt(r['mean_itl_ms']) + '/' + _fmt(r['p99_itl_ms']):>14} "
            f"{_fmt(r['mean_e2el_ms'], '.0f') + '/' + _fmt(r['p99_e2el_ms'], '.0f'):>17} "
            f"{_fmt(ua.get('acceptance_rate'), '.3f'):>10} {_fmt(ss.get('acceptance_rate'), '.3f'):>8} "
            f"{_fmt(ss.get('mean_acceptance_length'), '.2f'):>5}")
    errors = [(r["label"], r["concurrency"], e) for r in result["results"] for e in r["errors"]]
    for label, c, e in errors:
        lines.append(f"error [{label} @ {c}]: {e}")
    rate = result["config"].get("request_rate", "inf")
    lines.append(("" if rate == "inf" else f"(request rate {rate}/s, burstiness {result['config']['burstiness']}; "
                                            "conc: the cap on requests in flight)\n")
                 + "(flight: requests in flight on average; acc(usage): accepted/(accepted+rejected) from response "
                 "usage; acc(srv), mal: acceptance rate and mean acceptance length from /v1/stats deltas)")
    return "\n".join(lines)


def acceptance_rate(row: dict) -> float | None:
    """A level's draft acceptance rate: the server's counters where it has them, else the responses' usage."""
    for source in (row.get("server_stats"), row.get("usage_acceptance")):
        if source and source.get("acceptance_rate") is not None:
            return source["acceptance_rate"]
    return None


def write_plot(result: dict, path: str | Path) -> None:
    """Output throughput, mean TTFT, mean TPOT and draft acceptance rate against concurrency, one
    line per endpoint (an endpoint that reports no acceptance has no acceptance line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "Output throughput", "output tokens/s"),
              ("mean_ttft_ms", "Mean TTFT", "ms to the first token"),
              ("mean_tpot_ms", "Mean TPOT", "ms per output token"),
              (acceptance_rate, "Draft acceptance rate", "accepted / drafted tokens"))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title, ylabel) in zip(axes.flat, panels):
        for label in result["config"]["labels"]:
            rows = sorted((r for r in result["results"] if r["label"] == label), key=lambda r: r["concurrency"])
            points = [(r["concurrency"], key(r) if callable(key) else r[key]) for r in rows]
            points = [(x, v) for x, v in points if v is not None]
            if points:
                ax.plot([x for x, _ in points], [v for _, v in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["config"]["concurrency"], [str(c) for c in result["config"]["concurrency"]])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
    cfg = result["config"]
    rate = cfg.get("request_rate", "inf")
    fig.suptitle(f"{cfg['model']}: {cfg['num_prompts']} prompts, max_tokens {cfg['max_tokens']}, "
                 f"temperature {cfg['temperature']}" + ("" if rate == "inf" else f", {rate} req/s"))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
