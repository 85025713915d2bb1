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
(memory growth: each role's peak RSS in the run's second half against its first, p50 drift), written as JSON.

Usage (with `serve run configs/default.yaml` up on :8000):
    python benchmarks/soak.py --minutes 10 --concurrency 8 --output-json benchmarks/results/soak.json

With faults (#51 item 7), `--kill-every-s S`: every S seconds a verifier replica's process is
killed (SIGKILL; found with psutil by its Ray actor title, ServeReplica:<--app>:Verifier, in turn),
and half-way between two such kills the proposer replica's (disaggregated: its channel is cut) when
there is one. Traffic is then only requests whose answer can be checked exactly: greedy completions
and chats (streamed and not) with ignore_eos, each of --max-tokens tokens. Each request is counted
as answered (200, exactly --max-tokens tokens, one [DONE], the usage counts of a stream only rising),
retryable (429/503 with Retry-After, before or in-band), other_error, lost (no answer within
--timeout) or duplicated (a stream whose token count goes back or past --max-tokens, or with two
[DONE]: tokens sent again after a failover); answers that differ from the first answer to the same
request are counted apart (differs_from_first: greedy output should not change over a failover).
The server may be started here (`--serve-config`, `--set KEY=VALUE` as benchmarks/abuse.py:
dotted keys set inside nested args, e.g. verifier.num_replicas=2):
    python benchmarks/soak.py --serve-config configs/disaggregated.yaml --port 8438 \
        --set verifier.num_replicas=2 ... --kill-every-s 120 --concurrency 16 --output-json ...
`--dry-run`: 20 s, 2 clients of 8 tokens, (with --kill-every-s) a kill every 10 s, 5 s windows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections import Counter
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


def replica_pids(app: str, deployment: str) -> list[int]:
    """The processes of app's replicas of deployment on this machine (Ray actor title
    ray::ServeReplica:<app>:<deployment>...)."""
    key = f"ServeReplica:{app}:{deployment}"
    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            title = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith("ray::") and key in title:
            pids.append(proc.pid)
    return sorted(pids)


async def killer(app: str, every_s: float, kill_proposer: bool, start: float, until: float, kills: list) -> None:
    """Every every_s a verifier replica killed (in turn), and half-way between, the proposer's."""
    turn = 0
    schedule = []
    t = every_s
    while t < until - start:
        schedule.append((t, "Verifier"))
        if kill_proposer and t + every_s / 2 < until - start:
            schedule.append((t + every_s / 2, "Proposer"))
        t += every_s
    for at, deployment in sorted(schedule):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        pids = replica_pids(app, deployment)
        if not pids:
            kills.append({"t_s": round(time.monotonic() - start, 1), "deployment": deployment, "pid": None})
            continue
        pid = pids[turn % len(pids)]
        turn += deployment == "Verifier"
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kills.append({"t_s": round(time.monotonic() - start, 1), "deployment": deployment, "pid": pid})
        print(json.dumps({"killed": kills[-1]}), flush=True)


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
            await (self.exact(client) if self.faults else self.one(client))

    faults = False
    outcomes: Counter
    reasons: Counter  # (outcome, what was seen) of every request not answered, in fault mode
    first_answers: dict

    async def exact(self, client: httpx.AsyncClient) -> None:
        """One request whose answer is checked exactly (fault mode): its outcome counted."""
        i, prompt = self._next()
        kind = ("completion_stream", "chat_stream", "completion", "chat")[i % 4]
        route = "chat/completions" if kind.startswith("chat") else "completions"
        stream = kind.endswith("stream")
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        body.update({"messages": [{"role": "user", "content": prompt}]} if route == "chat/completions" else {"prompt": prompt})
        if stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        started = time.monotonic()
        outcome, text, why = "other_error", None, None
        try:
            async with asyncio.timeout(self.timeout):
                outcome, text, why = await (self._exact_stream(client, route, body) if stream
                                            else self._exact_whole(client, route, body))
        except (TimeoutError, httpx.TimeoutException) as err:
            outcome, why = "lost", f"{kind}: no answer within {self.timeout:g} s ({type(err).__name__})"
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            outcome, why = "other_error", f"{kind}: {type(err).__name__}: {str(err)[:120]}"
        if why is not None and outcome != "answered":
            self.reasons[(outcome, why)] += 1
        if outcome == "answered" and text is not None:
            key = (kind, prompt)
            first = self.first_answers.setdefault(key, text)
            if first != text:
                self.outcomes["differs_from_first"] += 1
        self.outcomes[outcome] += 1
        self.events.append((time.monotonic(), kind, time.monotonic() - started, outcome == "answered", outcome))

    @staticmethod
    def _refused(resp: httpx.Response) -> tuple[str, None, str]:
        retryable = resp.status_code in (429, 503) and "retry-after" in resp.headers
        try:
            error = resp.json().get("error") or {}
            said = f"{error.get('code') or error.get('type')}: {str(error.get('message'))[:100]}"
        except (ValueError, AttributeError):
            said = resp.text[:100]
        return ("retryable" if retryable else "other_error"), None, f"HTTP {resp.status_code} {said}"

    async def _exact_whole(self, client, route, body) -> tuple[str, str | None]:
        resp = await client.post(f"{self.url}/v1/{route}", json=body)
        if resp.status_code != 200:
            return self._refused(resp)
        data = resp.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        got = data["usage"]["completion_tokens"]
        if got != self.max_tokens:
            return "other_error", text, f"whole: {got} tokens, not {self.max_tokens}"
        return "answered", text, None

    async def _exact_stream(self, client, route, body) -> tuple[str, str | None]:
        async with client.stream("POST", f"{self.url}/v1/{route}", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return self._refused(resp)
            done, counts, parts, error = 0, [], [], None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done += 1
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    continue
                for choice in event.get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
                usage = event.get("usage") or {}
                if "completion_tokens" in usage and event.get("choices"):
                    counts.append(usage["completion_tokens"])
        if done > 1 or any(b < a for a, b in zip(counts, counts[1:])) or (counts and counts[-1] > self.max_tokens):
            return "duplicated", None, f"stream: {done} [DONE], usage counts {counts[-4:]}"
        if error is not None:  # in-band: retryable when the server says so (a replica lost past the failover)
            said = f"in-band {error.get('code') or error.get('type')}: {str(error.get('message'))[:100]}"
            return ("retryable" if error.get("code") in ("replica_lost", "server_overloaded", "not_ready")
                    else "other_error"), None, said
        if done == 1 and counts and counts[-1] == self.max_tokens:
            return "answered", "".join(parts), None
        return "other_error", None, f"stream: {done} [DONE], {counts[-1] if counts else 0} of {self.max_tokens} tokens"


def memory_growth(windows: list[dict]) -> dict[str, float]:
    """Per role, the peak RSS of the run's second half minus that of its first (the first window, the
    warm-up, left out). Peaks, not one window against another: with faults a role's processes are
    killed and replaced, and a window may catch one replica of two (the other still loading, its RSS
    not counted), which would read as memory freed or grown when none was."""
    rest = windows[1:] if len(windows) > 2 else windows
    half = max(1, len(rest) // 2)
    roles = sorted({role for w in rest for role in w["rss_mib"]})

    def peak(part, role):
        return max((w["rss_mib"].get(role, 0.0) for w in part), default=0.0)

    return {role: round(peak(rest[half:], role) - peak(rest[:half], role), 1) for role in roles}


async def soak(args) -> dict:
    prompts = load_prompts(args.prompts, args.num_prompts)
    runner = Soak(args.url.rstrip("/"), args.model, prompts, args.max_tokens, args.timeout)
    runner.faults, runner.outcomes, runner.first_answers = bool(args.kill_every_s), Counter(), {}
    runner.reasons = Counter()
    windows, kills = [], []
    start = time.monotonic()
    until = start + args.minutes * 60
    limits = httpx.Limits(max_connections=max(100, 2 * args.concurrency))
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        clients = [asyncio.create_task(runner.client_loop(client, until)) for _ in range(args.concurrency)]
        if args.kill_every_s:
            clients.append(asyncio.create_task(killer(args.app, args.kill_every_s, args.kill_proposer, start, until,
                                                      kills)))
        edge = start
        while edge < until:
            await asyncio.sleep(min(args.window, until - edge))
            now = time.monotonic()
            window = [e for e in runner.events if edge <= e[0] < now]
            full = [e[2] for e in window if e[3] and e[1] not in ("abandoned", "bad_request")]
            windows.append({"t_end_s": round(now - start, 1), "requests": len(window),
                            "outcomes": dict(Counter(e[4] for e in window if len(e) > 4)),
                            "errors": sum(not e[3] for e in window),
                            "latency_p50_s": round(float(np.percentile(full, 50)), 3) if full else None,
                            "latency_p95_s": round(float(np.percentile(full, 95)), 3) if full else None,
                            "rss_mib": ray_memory_mib()})
            print(json.dumps(windows[-1]), flush=True)
            edge = now
        await asyncio.gather(*clients)
    try:
        stats = httpx.get(f"{runner.url}/v1/stats", timeout=60).json()
    except (httpx.HTTPError, ValueError):  # (after faults: a replica may still be coming back)
        stats = {}
    rss = [sum(w["rss_mib"].get(r, 0) for r in ("verifier", "ingress", "proposer", "proxy")) for w in windows]
    p50 = [w["latency_p50_s"] for w in windows if w["latency_p50_s"] is not None]
    return {"cpu": cpu_model(), "url": args.url, "minutes": args.minutes, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "requests": len(runner.events),
            "kill_every_s": args.kill_every_s, "kills": kills, "outcomes": dict(runner.outcomes),
            "fault_verdict": None if not args.kill_every_s else {
                "every_request_answered_or_retryable": runner.outcomes["other_error"] == 0
                and runner.outcomes["lost"] == 0 and runner.outcomes["duplicated"] == 0,
                "none_lost": runner.outcomes["lost"] == 0, "none_duplicated": runner.outcomes["duplicated"] == 0,
                "memory_flat_within_mib": args.memory_growth_bound_mib,
                "memory_growth_mib_by_role": memory_growth(windows),
                "memory_flat": sum(memory_growth(windows).values()) <= args.memory_growth_bound_mib},
            "errors": sum(not e[3] for e in runner.events), "windows": windows,
            "why_not_answered": [{"outcome": o, "why": w, "count": c} for (o, w), c in runner.reasons.most_common()],
            "serve_rss_mib_second_window": rss[1] if len(rss) > 1 else None, "serve_rss_mib_last_window": rss[-1],
            "latency_p50_first_s": p50[0] if p50 else None, "latency_p50_last_s": p50[-1] if p50 else None,
            "engine_after": {k: stats.get(k) for k in ("num_running", "num_waiting", "num_free_slots", "num_slots",
                                                      "num_finished", "num_aborted", "num_rejected")}}


def main(argv=None) -> int:
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
    parser.add_argument("--kill-every-s", type=float, default=0.0,
                        help="fault mode: kill a verifier replica's process this often (0: no faults)")
    parser.add_argument("--kill-proposer", action=argparse.BooleanOptionalAction, default=True,
                        help="fault mode: also kill the proposer replica's process half-way between (when there is one)")
    parser.add_argument("--app", default="rayspec", help="the Serve app whose replicas are killed")
    parser.add_argument("--memory-growth-bound-mib", type=float, default=256.0,
                        help="fault mode: the serving processes' peak RSS may grow this much, second half of the run against the first")
    parser.add_argument("--serve-config", help="serve this config's apps first (as benchmarks/abuse.py does), on --port")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --serve-config: an app arg (YAML value; dotted keys inside nested ones)")
    parser.add_argument("--dry-run", action="store_true", help="20 s, 2 clients, 8 tokens, kills every 10 s (CI)")
    parser.add_argument("--output-json")
    parser.add_argument("--reanalyze", metavar="JSON",
                        help="recompute a recorded fault run's memory verdict from its windows (no run), in place")
    args = parser.parse_args(argv)
    if args.reanalyze:
        path = Path(args.reanalyze)
        result = json.loads(path.read_text())
        growth = memory_growth(result["windows"])
        bound = result["fault_verdict"]["memory_flat_within_mib"]
        result["fault_verdict"].update(memory_growth_mib_by_role=growth, memory_flat=sum(growth.values()) <= bound)
        result["reanalyzed"] = "memory verdict recomputed by soak.py --reanalyze (peaks per role, second half vs first)"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["fault_verdict"], indent=1))
        return 0
    if args.dry_run:
        args.minutes, args.concurrency, args.max_tokens, args.window = 20 / 60, 2, 8, 5.0
        args.num_prompts, args.timeout = 4, min(args.timeout, 60.0)
        args.kill_every_s = args.kill_every_s and 10.0
    server = None
    if args.serve_config:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from abuse import _overrides, start_server

        _overrides(args.set)
        args.url, server = start_server(args.serve_config, args.port, args.set)
    try:
        result = asyncio.run(soak(args))
    finally:
        if server is not None:
            from abuse import stop_server

            stop_server(server)
    result["command"] = " ".join(["soak.py", *(sys.argv[1:] if argv is None else argv)])
    summary = {k: v for k, v in result.items() if k != "windows"}
    print(json.dumps(summary, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
