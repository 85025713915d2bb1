"""A bounded soak: mixed traffic at a fixed concurrency for a fixed time against a running rayspec
server, sampling latency and the memory of every Ray process on this machine per window.

Traffic (round-robin over the prompts, `--concurrency` clients each sending one request after the
other): streamed chat, non-streamed chat, streamed completion, a JSON-schema-constrained chat,
n=2 sampled completion, a stream the client abandons after its first chunk, and a request that
must be refused (400). Every response must be what it should be (200 with content, or the 400);
anything else is counted as an error (5xx, connection errors, timeouts past --timeout).

Per window (--window seconds): requests, errors, end-to-end latency p50/p95 of the full requests,
and the resident memory (RSS) of the Ray processes by role (verifier, ingress, proxy, controller,
other), from psutil. At the end: the first and last windows side by side, and the verdict figures
(memory growth from the second window to the last, p50 drift), written as JSON.

Usage (with `serve run configs/default.yaml` up on :8000):
    python benchmarks/soak.py --minutes 10 --concurrency 8 --output-json benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from rayspec.bench.prompts import load_prompts

ROLES = (("Verifier", "verifier"), ("OpenAIIngress", "ingress"), ("Proposer", "proposer"),
         ("ProxyActor", "proxy"), ("ServeController", "controller"))


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown"


def ray_memory_mib() -> dict[str, float]:
    """RSS (MiB) of this machine's Ray worker processes, by Serve role."""
    totals: dict[str, float] = {}
    for proc in psutil.process_iter(["name", "cmdline", "memory_info"]):
        try:
            title = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or ""
            if not title.startswith("ray::") and "raylet" not in title and "gcs_server" not in title:
                continue
            role = next((r for key, r in ROLES if key in title), "other_ray")
            totals[role] = totals.get(role, 0.0) + proc.info["memory_info"].rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return {k: round(v, 1) for k, v in sorted(totals.items())}


class Soak:
    def __init__(self, url: str, model: str, prompts: list[str], max_tokens: int, timeout: float):
        self.url, self.model, self.prompts, self.max_tokens, self.timeout = url, model, prompts, max_tokens, timeout
        self.counter = 0
        self.events: list[tuple[float, str, float, bool]] = []  # (end time, kind, seconds, ok)

    def _next(self) -> tuple[int, str]:
        i = self.counter
        self.counter += 1
        return i, self.prompts[i % len(self.prompts)]

    async def one(self, client: httpx.AsyncClient) -> None:
        i, prompt = self._next()
        kinds = ("chat_stream", "chat", "completion_stream", "json_schema", "n2_sampled", "abandoned", "bad_request")
        kind = kinds[i % len(kinds)]
        messages = [{"role": "user", "content": prompt}]
        started = time.monotonic()
        ok = False
        try:
            if kind in ("chat_stream", "completion_stream", "abandoned"):
                route = "chat/completions" if kind != "completion_stream" else "completions"
                body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
                body.update({"messages": messages} if route == "chat/completions" else {"prompt": prompt})
                async with client.stream("POST", f"{self.url}/v1/{route}", json=body) as resp:
                    events = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            events += 1
                            if kind == "abandoned":
                                break
                            if line == "data: [DONE]":
                                ok = resp.status_code == 200 and events > 1
                    ok = ok or (kind == "abandoned" and resp.status_code == 200 and events == 1)
            elif kind == "bad_request":
                resp = await client.post(f"{self.url}/v1/chat/completions",
                                         json={"model": self.model, "messages": messages, "temperature": 7})
                ok = resp.status_code == 400 and "error" in resp.json()
            else:
                body = {"model": self.model, "max_tokens": self.max_tokens}
                if kind == "n2_sampled":
                    route = "completions"
                    body.update(prompt=prompt, n=2, temperature=0.8, seed=i)
                else:
                    route = "chat/completions"
                    body.update(messages=messages, temperature=0)
                    if kind == "json_schema":
                        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                            "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
                resp = await client.post(f"{self.url}/v1/{route}", json=body)
                ok = resp.status_code == 200 and len(resp.json()["choices"]) == body.get("n", 1)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError):
            ok = False
        self.events.append((time.monotonic(), kind, time.monotonic() - started, ok))

    async def client_loop(self, client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            await self.one(client)


async def soak(args) -> dict:
    prompts = load_prompts(args.prompts, args.num_prompts)
    runner = Soak(args.url.rstrip("/"), args.model, prompts, args.max_tokens, args.timeout)
    windows = []
    start = time.monotonic()
    until = start + args.minutes * 60
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        clients = [asyncio.create_task(runner.client_loop(client, until)) for _ in range(args.concurrency)]
        edge = start
        while edge < until:
            await asyncio.sleep(min(args.window, until - edge))
            now = time.monotonic()
            window = [e for e in runner.events if edge <= e[0] < now]
            full = [e[2] for e in window if e[3] and e[1] not in ("abandoned", "bad_request")]
            windows.append({"t_end_s": round(now - start, 1), "requests": len(window),
                            "errors": sum(not e[3] for e in window),
                            "latency_p50_s": round(float(np.percentile(full, 50)), 3) if full else None,
                            "latency_p95_s": round(float(np.percentile(full, 95)), 3) if full else None,
                            "rss_mib": ray_memory_mib()})
            print(json.dumps(windows[-1]), flush=True)
            edge = now
        await asyncio.gather(*clients)
    stats = httpx.get(f"{runner.url}/v1/stats", timeout=60).json()
    rss = [sum(w["rss_mib"].get(r, 0) for r in ("verifier", "ingress", "proposer", "proxy")) for w in windows]
    p50 = [w["latency_p50_s"] for w in windows if w["latency_p50_s"] is not None]
    return {"cpu": cpu_model(), "url": args.url, "minutes": args.minutes, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "requests": len(runner.events),
            "errors": sum(not e[3] for e in runner.events), "windows": windows,
            "serve_rss_mib_second_window": rss[1] if len(rss) > 1 else None, "serve_rss_mib_last_window": rss[-1],
            "latency_p50_first_s": p50[0] if p50 else None, "latency_p50_last_s": p50[-1] if p50 else None,
            "engine_after": {k: stats.get(k) for k in ("num_running", "num_waiting", "num_free_slots", "num_slots",
                                                      "num_finished", "num_aborted", "num_rejected")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="mt_bench", help="a bundled set or a Spec-Bench JSONL")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    result = asyncio.run(soak(args))
    summary = {k: v for k, v in result.items() if k != "windows"}
    print(json.dumps(summary, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
