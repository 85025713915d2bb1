"""Overload and abuse (#35, "Done when"): well-behaved streaming clients beside abusive ones.

Two phases against one server, the same well-behaved workload in each:
1. unloaded: `--good` streaming clients alone, each sending `--good-requests` streamed completions
   one after the other (greedy, `--max-tokens` tokens each, ignore_eos);
2. loaded: the same, while at the same time
   - `--big` clients send request bodies of `--body-mib` MiB, one after the other (half with a
     Content-Length, half chunked without one), each expecting a 413;
   - `--idle` clients open a streamed completion (`--idle-max-tokens` tokens) and never read it;
     when phase 2 ends each finds out what happened to its stream (read to the end: complete,
     cut by the server, or refused with a status);
   - `--hammer` clients send POST /tokenize and GET /health alternately, as fast as they get answers.

Reported (JSON, `--output-json`): per phase the well-behaved clients' errors (any status but 200, an
error event, a stream without [DONE], a connection error), time to first token and inter-token
latency (per stream: (last chunk - first chunk) / (tokens - 1), from the usage every chunk carries;
the median over streams, and p90), and the loaded/unloaded ratio of the median ITL; the abusive
requests' outcomes by status code or cut; the peak resident memory (RSS) of the ingress, verifier
and Serve proxy processes over each phase (psutil, processes on this machine), and the CPU model and
load average (the machine may be shared: the ratio is then noisy).

Usage, against a running server:
    serve run configs/default.yaml &
    python benchmarks/abuse.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
        --output-json benchmarks/results/abuse_default_overload.json
or let it start one (the config's apps, their args changed by any `--set KEY=VALUE`, on a Ray
cluster of its own, started in a child process of its own session as `serve run` would, on --port;
stopped at the end; its processes' memory counted):
    python benchmarks/abuse.py --serve-config configs/default.yaml --port 8437 \
        --set max_ongoing_per_client=8 --clients-autogroup-nice 19 --output-json ...
Clients: on loopback each well-behaved client sends from an address of its own (127.0.1.N) and each
abusive group from one (127.0.2.1 bodies, 127.0.3.1 unread streams, 127.0.4.1 the hammer): the
attack comes from three hosts, the traffic it must not hurt from sixteen (`--one-address`: all
from 127.0.0.1). `--clients-autogroup-nice 19` gives this process's session (the clients) the CPU
weight of nice 19 against the server's: on a 2-core machine the load generator otherwise takes
the cores the server needs, which clients on other machines would not.
`--dry-run`: tiny counts and bodies (2 good clients x 2 requests of 8 tokens, 2 big 1 MiB bodies,
2 idle streams, 4 hammer clients) for CI (tests/test_abuse_bench.py, against an app whose body limit
is below 1 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

try:
    import psutil
except ImportError:  # /proc then
    psutil = None

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a bicycle stays upright, step by step.",
           "List ten fruits and one fact about each.",
           "Describe the water cycle to a ten-year-old.",
           "What are the pros and cons of working from home?",
           "Give me a recipe for pancakes with a twist."]
ROLES = (("OpenAIIngress", "ingress"), ("Verifier", "verifier"), ("ProxyActor", "proxy"))


# ---- machine ----------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown"


def _proc_rss_mib(root_pid: int | None = None) -> dict[str, float]:
    """RSS (MiB) of the Serve replica and proxy processes by role, summed per role: those under
    root_pid (the process that started the Ray cluster: other clusters on a shared machine are not
    counted), else every one on this machine."""
    totals: dict[str, float] = {}
    if psutil is not None:
        procs = []
        try:
            candidates = psutil.Process(root_pid).children(recursive=True) if root_pid else psutil.process_iter()
        except psutil.NoSuchProcess:
            candidates = []
        for proc in candidates:
            try:
                procs.append((" ".join(proc.cmdline() or []), proc.memory_info().rss))
            except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
                continue
    else:
        procs = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
                procs.append((title, pages * os.sysconf("SC_PAGE_SIZE")))
            except (OSError, ValueError, IndexError):
                continue
    for title, rss in procs:
        if not title.startswith("ray::"):
            continue
        role = next((r for key, r in ROLES if key in title), None)
        if role is not None:
            totals[role] = totals.get(role, 0.0) + rss / 2**20
    return totals


class MemoryWatch:
    """Samples _proc_rss_mib every `interval` s in the background; peak per role."""

    def __init__(self, root_pid: int | None, interval: float = 0.5):
        self.root_pid, self.interval, self.peak, self.first = root_pid, interval, {}, None
        self._task = None

    async def _run(self):
        while True:
            sample = await asyncio.to_thread(_proc_rss_mib, self.root_pid)
            if self.first is None:
                self.first = sample
            for role, mib in sample.items():
                self.peak[role] = max(self.peak.get(role, 0.0), mib)
            await asyncio.sleep(self.interval)

    def __enter__(self):
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc):
        self._task.cancel()

    def report(self) -> dict:
        return {"start_mib": {k: round(v, 1) for k, v in sorted((self.first or {}).items())},
                "peak_mib": {k: round(v, 1) for k, v in sorted(self.peak.items())}}


# ---- well-behaved clients ---------------------------------------------------------------------------
def _stream_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def good_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: {ok, error, ttft_s, itl_s, tokens}."""
    out = {"ok": False, "error": None, "ttft_s": None, "itl_s": None, "tokens": 0}
    started = time.monotonic()
    first = last = None
    first_tokens = tokens = 0
    done = False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_stream_body(model, prompt, max_tokens)) as resp:
            if resp.status_code != 200:
                out["error"] = f"status {resp.status_code}"
                await resp.aread()
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out["error"] = f"error event {event['error'].get('code')}"
                    return out
                usage = event.get("usage") or {}
                if not event.get("choices") or "completion_tokens" not in usage:
                    continue
                now = time.monotonic()
                tokens = usage["completion_tokens"]
                if first is None:
                    first, first_tokens = now, tokens
                last = now
    except httpx.HTTPError as err:
        out["error"] = f"{type(err).__name__}"
        return out
    out["tokens"] = tokens
    if not done:
        out["error"] = "no [DONE]"
        return out
    out["ok"] = True
    out["ttft_s"] = first - started if first is not None else None
    if first is not None and tokens > first_tokens:
        out["itl_s"] = (last - first) / (tokens - first_tokens)
    return out


# ---- who the clients are -----------------------------------------------------------------------------
# On loopback every client may have an address of its own (Linux routes all of 127.0.0.0/8 to lo):
# each well-behaved client one, each abusive group one (an attacker's host), so a server that
# shares by client (app arg max_ongoing_per_client) can tell them apart. --one-address: all 127.0.0.1.
ADDRESSES = {"good": "127.0.1.{}", "big": "127.0.2.1", "idle": "127.0.3.1", "hammer": "127.0.4.1",
             "slow": "127.0.5.1", "heavy": "127.0.6.1", "burst": "127.0.7.1"}
SOURCE = {"on": False}


def _client(timeout, role: str, index: int = 0, connections: int = 100) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=min(connections, 20))
    if not SOURCE["on"]:
        return httpx.AsyncClient(timeout=timeout, limits=limits)
    address = ADDRESSES[role].format(index + 1)
    return httpx.AsyncClient(timeout=timeout, transport=httpx.AsyncHTTPTransport(local_address=address, limits=limits))


async def good_client(url: str, model: str, index: int, requests: int, max_tokens: int, timeout: float) -> list[dict]:
    results = []
    async with _client(timeout, "good", index) as client:
        for r in range(requests):
            results.append(await good_stream(client, url, model, PROMPTS[(index + r) % len(PROMPTS)], max_tokens))
    return results


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarize_good(results: list[dict]) -> dict:
    itls = [r["itl_s"] for r in results if r["itl_s"] is not None]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    errors = Counter(r["error"] for r in results if r["error"] is not None)
    return {"requests": len(results), "errors": sum(errors.values()), "error_kinds": dict(errors),
            "tokens": sum(r["tokens"] for r in results),
            "itl_ms_median": None if not itls else round(1e3 * _pct(itls, 0.5), 2),
            "itl_ms_p90": None if not itls else round(1e3 * _pct(itls, 0.9), 2),
            "ttft_s_median": None if not ttfts else round(_pct(ttfts, 0.5), 3),
            "ttft_s_p90": None if not ttfts else round(_pct(ttfts, 0.9), 3)}


# ---- abusive clients -------------------------------------------------------------------------------
async def big_body_client(url: str, model: str, body_bytes: int, chunked: bool, stop: asyncio.Event,
                          outcomes: Counter, timeout: float, times: list | None = None) -> None:
    """Bodies of body_bytes, one after the other until stop: each outcome counted (status, or cut)."""
    piece = b" " * (1 << 20)

    async def body():
        yield b'{"model": "' + model.encode() + b'", "prompt": "'
        left = body_bytes
        while left > 0:
            n = min(left, len(piece))
            yield piece[:n]
            left -= n
        yield b'", "max_tokens": 1}'

    overhead = len(b'{"model": "' + model.encode() + b'", "prompt": "') + len(b'", "max_tokens": 1}')
    headers = {"content-type": "application/json"}
    if not chunked:
        headers["content-length"] = str(body_bytes + overhead)
    async with _client(timeout, "big") as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                resp = await client.post(f"{url}/v1/completions", content=body(), headers=headers)
                outcomes[str(resp.status_code)] += 1
            except httpx.HTTPError as err:  # the server closed the connection mid-body
                outcomes[f"cut ({type(err).__name__})"] += 1
            if times is not None:
                times.append(time.monotonic() - started)
            await asyncio.sleep(0)


async def idle_stream(url: str, model: str, max_tokens: int, stop: asyncio.Event, outcomes: Counter,
                      timeout: float) -> None:
    """Opens a streamed completion and reads nothing of it until stop; then reads what is left:
    complete ([DONE]), cut (the connection ended early), or the status it was refused with."""
    body = _stream_body(model, PROMPTS[0], max_tokens)
    try:
        async with _client(httpx.Timeout(timeout, read=timeout), "idle") as client:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    outcomes[str(resp.status_code)] += 1
                    return
                await stop.wait()
                text = b""
                try:
                    async for part in resp.aiter_bytes():
                        text += part
                except httpx.HTTPError as err:
                    outcomes[f"200 then cut ({type(err).__name__})"] += 1
                    return
                if b"data: [DONE]" in text:
                    outcomes["200 complete" + (" with error event" if _error_events(text) else "")] += 1
                else:
                    outcomes["200 then cut (ended early)"] += 1
    except httpx.HTTPError as err:
        outcomes[f"cut ({type(err).__name__})"] += 1


async def hammer_client(url: str, model: str, index: int, stop: asyncio.Event, outcomes: Counter,
                        timeout: float) -> None:
    async with _client(timeout, "hammer") as client:
        i = index
        while not stop.is_set():
            i += 1
            try:
                if i % 2:
                    resp = await client.post(f"{url}/tokenize", json={"model": model, "prompt": PROMPTS[i % len(PROMPTS)]})
                    outcomes[f"tokenize {resp.status_code}"] += 1
                else:
                    resp = await client.get(f"{url}/health")
                    outcomes[f"health {resp.status_code}"] += 1
            except httpx.HTTPError as err:
                outcomes[f"{'tokenize' if i % 2 else 'health'} {type(err).__name__}"] += 1


# ---- abusive clients of the hardening round (#51): slow bodies, heavy requests, a burst ------------
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "near an old lighthouse").split()


def long_prompt(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def _host_port(url: str) -> tuple[str, int, str]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80, parsed.raw_path.decode().rstrip("/")


async def slow_body(url: str, kind: str, interval_s: float, give_up_s: float, content_length: int) -> tuple[str, float]:
    """One connection, no API key, sending its request body a byte every interval_s: POST /health
    chunked ("health"), POST /v1/completions chunked without a Content-Length ("chunked"), or with a
    Content-Length of content_length trickled ("content_length"). Raw socket: the bytes keep coming
    while the response is read, so an answer the server gives before the body is whole is seen at
    once. (outcome: the status, "cut" (closed without an answer) or "held" (neither within give_up_s),
    seconds to it)."""
    host, port, prefix = _host_port(url)
    path = prefix + ("/health" if kind == "health" else "/v1/completions")
    local = (ADDRESSES["slow"], 0) if SOURCE["on"] else None
    started = time.monotonic()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=local), 30)
        head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {content_length}\r\n" if kind == "content_length" else "Transfer-Encoding: chunked\r\n"
        writer.write((head + "\r\n").encode())
        await writer.drain()

        async def trickle():
            head = b'{"model": "m", "prompt": "'  # then x after x: never whole (no body held here)
            for i in range(1 << 30):
                byte = head[i:i + 1] if i < len(head) else b"x"
                writer.write(byte if kind == "content_length" else b"1\r\n" + byte + b"\r\n")
                await writer.drain()
                await asyncio.sleep(interval_s)

        sender = asyncio.create_task(trickle())
        try:
            line = await asyncio.wait_for(reader.readline(), give_up_s)
        except asyncio.TimeoutError:
            return "held", time.monotonic() - started
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/"):
            return parts[1].decode(), time.monotonic() - started
        return "cut", time.monotonic() - started
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
        return "cut", time.monotonic() - started
    finally:
        if writer is not None:
            writer.close()


async def slow_body_client(url: str, kind: str, args, stop: asyncio.Event, outcomes: Counter, times: list) -> None:
    """slow_body connections one after the other until stop."""
    while not stop.is_set():
        outcome, seconds = await slow_body(url, kind, args.slow_interval_s, args.body_deadline_s + args.slow_grace_s,
                                           args.slow_content_length)
        outcomes[f"{kind} {outcome}"] += 1
        times.append(seconds)
        await asyncio.sleep(0.05)


def heavy_bodies(model: str, args) -> dict[str, dict]:
    """The two heavy requests: a prompt of heavy_prompt_tokens token ids echoed with 20 logprobs in
    64 choices of 0 new tokens (all prefill and logprobs); 8 sampled choices of burst_max_tokens
    after a burst_prompt_words-word prompt (streamed: its answer is its first event)."""
    return {"echo_n64": {"model": model, "prompt": [1] * args.heavy_prompt_tokens, "n": args.heavy_echo_n,
                         "max_tokens": 0, "echo": True, "logprobs": 20},
            "n8_long": {"model": model, "prompt": long_prompt(args.burst_prompt_words), "n": args.burst_n,
                        "max_tokens": args.burst_max_tokens, "temperature": 1.0, "ignore_eos": True, "stream": True}}


async def answered(client: httpx.AsyncClient, url: str, body: dict, stop: asyncio.Event) -> tuple[str, float, float]:
    """POST /v1/completions: (outcome, seconds to the answer (the status line), seconds in all). A
    streamed 200 is read until it ends or until stop (then left: "200 left at phase end"); a 429 or
    503 says whether it carried Retry-After."""
    started = time.monotonic()
    answer = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            answer = time.monotonic() - started
            status = resp.status_code
            if status in (429, 503):
                await resp.aread()
                tag = f"{status}" + ("" if "retry-after" in resp.headers else " without Retry-After")
                return tag, answer, time.monotonic() - started
            if status != 200 or not body.get("stream"):
                await resp.aread()
                return str(status), answer, time.monotonic() - started
            reading = asyncio.ensure_future(resp.aread())
            halt = asyncio.ensure_future(stop.wait())
            await asyncio.wait({reading, halt}, return_when=asyncio.FIRST_COMPLETED)
            halt.cancel()
            if not reading.done():
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)
                return "200 left at phase end", answer, time.monotonic() - started
            text = reading.result()
            if b"data: [DONE]" in text and not _error_events(text):
                return "200 complete", answer, time.monotonic() - started
            return f"200 with error ({_in_band_error(text)})", answer, time.monotonic() - started
    except httpx.HTTPError as err:
        took = time.monotonic() - started
        return f"cut ({type(err).__name__})", took if answer is None else answer, took


def _error_events(text: bytes) -> list[dict]:
    """A stream's error events: its `data:` lines whose JSON has a top-level "error" (not the bytes
    '"error"' anywhere: a choice whose text is the token "error" has them)."""
    events = []
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("data: ") and '"error"' in line:
            try:
                data = json.loads(line[len("data: "):])
            except ValueError:
                events.append({"type": "unparsed error event"})
                continue
            if isinstance(data, dict) and "error" in data:
                events.append(data["error"] if isinstance(data["error"], dict) else {"type": str(data["error"])})
    return events


def _in_band_error(text: bytes) -> str:
    """The code (else type) of a stream's first error event, or "no [DONE]"."""
    for error in _error_events(text):
        return str(error.get("code") or error.get("type"))
    return "no [DONE]"


async def heavy_client(url: str, model: str, args, stop: asyncio.Event, outcomes: Counter, times: list) -> None:
    """Each heavy request in turn, one after the other, until stop (at least once each)."""
    bodies = heavy_bodies(model, args)
    async with _client(httpx.Timeout(args.timeout), "heavy") as client:
        first = True
        while first or not stop.is_set():
            first = False
            for name, body in bodies.items():
                outcome, answer, total = await answered(client, url, body, stop)
                outcomes[f"{name} {outcome}"] += 1
                times.append({"request": name, "outcome": outcome, "answer_s": round(answer, 3), "total_s": round(total, 3)})


async def burst(url: str, model: str, args, stop: asyncio.Event, outcomes: Counter, times: list) -> None:
    """args.burst streamed completions (n, max_tokens, prompt as the heavy n8_long) sent at once."""
    body = heavy_bodies(model, args)["n8_long"]
    async with _client(httpx.Timeout(args.timeout), "burst", connections=max(args.burst, 1)) as client:  # none queued here
        runs = await asyncio.gather(*(answered(client, url, body, stop) for _ in range(args.burst)))
    for outcome, answer, total in runs:
        outcomes[outcome] += 1
        times.append({"outcome": outcome, "answer_s": round(answer, 3), "total_s": round(total, 3)})


# ---- the run ---------------------------------------------------------------------------------------
async def _good_phase(url: str, model: str, args) -> list[dict]:
    runs = await asyncio.gather(*(good_client(url, model, i, args.good_requests, args.max_tokens, args.timeout)
                                  for i in range(args.good)))
    return [r for run in runs for r in run]


async def _progress(started: float, counters: dict[str, Counter], every_s: float = 30.0) -> None:
    """A line of the abusive clients' outcomes so far every every_s seconds of the loaded phase."""
    while True:
        await asyncio.sleep(every_s)
        print(json.dumps({"loaded_s": round(time.monotonic() - started), "loadavg": os.getloadavg(),
                          **{k: dict(v) for k, v in counters.items()}}), flush=True)


def _checkpoint(report: dict, args, phase: str) -> None:
    """The report so far, written as each phase ends (a run cut short still leaves what it measured)."""
    print(json.dumps({"phase_done": phase, "seconds": report.get(phase, {}).get("seconds"),
                      "loadavg": os.getloadavg()}), flush=True)
    if args.output_json:
        partial = {**report, "partial": f"written after phase {phase!r}; the run had not ended"}
        Path(args.output_json).write_text(json.dumps(partial, indent=2) + "\n")


async def run(url: str, model: str, args) -> dict:
    report: dict = {"url": url, "model": model,
                    "clients": {"good": args.good, "good_requests_each": args.good_requests,
                                "max_tokens": args.max_tokens, "big": args.big, "body_mib": args.body_mib,
                                "idle": args.idle, "idle_max_tokens": args.idle_max_tokens, "hammer": args.hammer,
                                "slow_per_kind": args.slow, "slow_interval_s": args.slow_interval_s,
                                "slow_content_length": args.slow_content_length, "body_deadline_s": args.body_deadline_s,
                                "heavy": args.heavy, "heavy_prompt_tokens": args.heavy_prompt_tokens,
                                "heavy_echo_n": args.heavy_echo_n, "burst": args.burst, "burst_n": args.burst_n,
                                "burst_max_tokens": args.burst_max_tokens, "burst_prompt_words": args.burst_prompt_words},
                    "client_addresses": dict(ADDRESSES) if SOURCE["on"] else "all 127.0.0.1",
                    "clients_autogroup_nice": args.clients_autogroup_nice,
                    "cpu_model": cpu_model(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    started = time.monotonic()
    with MemoryWatch(args.memory_root_pid) as memory:
        good = await _good_phase(url, model, args)
    report["unloaded"] = {**summarize_good(good), "seconds": round(time.monotonic() - started, 1),
                          "memory": memory.report()}
    report["loadavg_after_unloaded"] = os.getloadavg()
    _checkpoint(report, args, "unloaded")

    stop = asyncio.Event()
    big, idle, hammer, slow, heavy, bursts = Counter(), Counter(), Counter(), Counter(), Counter(), Counter()
    big_times, slow_times, heavy_times, burst_times = [], [], [], []
    body_bytes = int(args.body_mib * 2**20)
    started = time.monotonic()
    with MemoryWatch(args.memory_root_pid) as memory:
        abusers = [asyncio.create_task(big_body_client(url, model, body_bytes, i % 2 == 1, stop, big, args.timeout,
                                                       big_times), name=f"big_bodies#{i}") for i in range(args.big)]
        abusers += [asyncio.create_task(idle_stream(url, model, args.idle_max_tokens, stop, idle, args.timeout),
                                        name=f"idle_streams#{i}") for i in range(args.idle)]
        abusers += [asyncio.create_task(hammer_client(url, model, i, stop, hammer, args.timeout),
                                        name=f"tokenize_health#{i}") for i in range(args.hammer)]
        abusers += [asyncio.create_task(slow_body_client(url, kind, args, stop, slow, slow_times),
                                        name=f"slow_bodies_{kind}#{i}")
                    for kind in ("health", "chunked", "content_length") for i in range(args.slow)]
        abusers += [asyncio.create_task(heavy_client(url, model, args, stop, heavy, heavy_times), name=f"heavy#{i}")
                    for i in range(args.heavy)]
        await asyncio.sleep(args.abuse_head_start)  # the abuse is under way before the clients come
        if args.burst:
            abusers.append(asyncio.create_task(burst(url, model, args, stop, bursts, burst_times), name="burst#0"))
        progress = asyncio.create_task(_progress(started, {"big_bodies": big, "idle_streams": idle, "hammer": hammer,
                                                          "slow_bodies": slow, "heavy": heavy, "burst": bursts}))
        good = await _good_phase(url, model, args)
        loaded_s = time.monotonic() - started
        stop.set()
        progress.cancel()
        # every abusive client ends within its request's timeout once told to stop; one still running
        # after that is a request the server never answered: named in the report, then cancelled
        _, pending = await asyncio.wait(abusers, timeout=args.timeout + 60)
        for task in pending:
            task.cancel()
        report["abusive_unfinished"] = dict(Counter(task.get_name().split("#")[0] for task in pending))
    report["loaded"] = {**summarize_good(good), "seconds": round(loaded_s, 1), "memory": memory.report()}
    report["loadavg_end"] = os.getloadavg()
    _checkpoint(report, args, "loaded")

    def most(values):
        return round(max(values), 3) if values else None

    report["abusive"] = {"big_bodies": dict(big), "idle_streams": dict(idle), "tokenize_health": dict(hammer),
                         "slow_bodies": dict(slow), "heavy": dict(heavy), "burst": dict(bursts)}
    report["abusive_answer_s_max"] = {
        "big_bodies": most(big_times), "slow_bodies": most(slow_times),
        "heavy": {name: most([t["answer_s"] for t in heavy_times if t["request"] == name])
                  for name in ("echo_n64", "n8_long")},
        "burst": most([t["answer_s"] for t in burst_times])}
    report["heavy_requests"] = heavy_times
    report["burst_requests"] = burst_times
    un, lo = report["unloaded"]["itl_ms_median"], report["loaded"]["itl_ms_median"]
    report["itl_ratio_loaded_vs_unloaded"] = round(lo / un, 3) if un and lo else None
    return report


def verdict(report: dict, args) -> dict:
    """The issue's criteria, each True or False (the bounds: args)."""
    abusive = report["abusive"]
    answer = report["abusive_answer_s_max"]

    def within(seconds, bound):
        return seconds is None or seconds <= bound

    ratio = report["itl_ratio_loaded_vs_unloaded"]
    slow_ok = all(k.split(" ", 1)[1] in ("cut", "401", "403", "405", "408", "413") for k in abusive["slow_bodies"])
    heavy_ok = all((k.split(" ", 1)[1] == "200" or k.split(" ", 1)[1].startswith(("4", "200 complete",
                                                                                  "200 left at phase end")))
                   and "without Retry-After" not in k for k in abusive["heavy"])  # ("200": a whole answer)
    burst_ok = all(k in ("429", "200 complete", "200 left at phase end") for k in abusive["burst"])
    peaks = {role: max(report[phase]["memory"]["peak_mib"].get(role, 0.0) for phase in ("unloaded", "loaded"))
             for role in ("ingress", "proxy", "verifier")}
    bounds = {"ingress": args.max_rss_ingress_mib, "proxy": args.max_rss_proxy_mib,
              "verifier": args.max_rss_verifier_mib}
    heavy_answers = [t for t in answer["heavy"].values() if t is not None]
    out = {"good_clients_no_error": report["unloaded"]["errors"] == 0 and report["loaded"]["errors"] == 0,
           f"itl_ratio_within_{args.itl_ratio_bound:g}x": ratio is not None and ratio <= args.itl_ratio_bound,
           "big_bodies_all_4xx_or_cut": all(k.startswith(("4", "cut", "200 then cut")) for k in abusive["big_bodies"]),
           "idle_streams_4xx_cut_or_bounded": all(k.startswith(("4", "cut", "200 then cut", "200 complete"))
                                                   for k in abusive["idle_streams"]),
           "slow_bodies_all_4xx_or_cut": slow_ok,
           f"slow_bodies_answered_within_{args.body_deadline_s:g}s_deadline": within(
               answer["slow_bodies"], args.body_deadline_s + args.slow_grace_s),
           "heavy_4xx_429_or_served": heavy_ok,
           "burst_200_or_429_with_retry_after": burst_ok,
           f"no_client_waits_past_{args.answer_deadline_s:g}s": all(
               within(t, args.answer_deadline_s) for t in [answer["big_bodies"], answer["burst"], *heavy_answers])
           and within(answer["slow_bodies"], max(args.answer_deadline_s, args.body_deadline_s + args.slow_grace_s)),
           "every_abusive_client_ended": not report.get("abusive_unfinished"),
           "peak_rss_mib": {role: round(v, 1) for role, v in peaks.items()},
           "peak_rss_bounds_mib": bounds}
    out["peak_rss_within_bounds"] = all(peaks[role] <= bound for role, bound in bounds.items())
    out["all_pass"] = all(v for k, v in out.items() if isinstance(v, bool))
    return out


def _overrides(pairs: list[str]) -> dict:
    """--set KEY=VALUE pairs -> app args (each value read as YAML: 8, true, null, a string)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants KEY=VALUE, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def with_overrides(app_args: dict, overrides: dict) -> dict:
    """app_args with each override set: a dotted key sets inside a nested mapping
    (verifier.num_replicas=2, engine.kv_cache_memory_gb=1.0), the mappings on its way made as needed."""
    import copy

    out = copy.deepcopy(app_args)
    for key, value in overrides.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return out


def serve_forever(config_path: str, port: int, overrides: dict) -> None:
    """The Serve config's applications (their args updated by `overrides`) on a Ray cluster of their
    own, started in this process as `serve run` would, HTTP on `port`; until SIGTERM or SIGINT."""
    import signal

    import ray
    import yaml
    from ray import serve

    from deployments.app import build_app

    config = yaml.safe_load(Path(config_path).read_text())
    http = {**config.get("http_options", {}), "port": port}
    # one try: a failed start leaves its GCS and agents running until this process ends (on a loaded
    # machine the raylet may give up waiting for its dashboard agent: start again later)
    from deployments.frontend.proxy_guard import install_env

    install_env()  # Serve's proxy bounded as `rayspec serve` bounds it (deployments/frontend/proxy_guard.py)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    serve.start(http_options=http, proxy_location=config.get("proxy_location", "HeadOnly"))
    for app in config["applications"]:
        if app.get("import_path", "deployments.app:build_app") != "deployments.app:build_app":
            raise ValueError(f"{app['name']}: only deployments.app:build_app apps are started here")
        serve.run(build_app(with_overrides(app.get("args", {}), overrides)), name=app["name"],
                  route_prefix=app.get("route_prefix", "/"))
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    try:
        while not stopped:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()


def start_server(config_path: str, port: int, overrides: list[str]) -> tuple[str, subprocess.Popen]:
    """serve_forever in a child process of its own session (its own CPU autogroup: the clients here
    can be given less of the CPU, as clients on other machines take none of it); (base URL, the
    process) once /health answers."""
    import yaml

    config = yaml.safe_load(Path(config_path).read_text())
    host = config.get("http_options", {}).get("host", "127.0.0.1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-only", "--serve-config", config_path,
           "--port", str(port)] + [a for pair in overrides for a in ("--set", pair)]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    if not _wait_up(url, 900, proc):
        stop_server(proc)
        raise RuntimeError(f"{url} did not become healthy")
    return url, proc


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _set_autogroup_nice(nice: int) -> None:
    """This process's session (autogroup) gets the weight of `nice` against the server's session."""
    Path("/proc/self/autogroup").write_text(f"{nice}\n")


def _wait_up(url: str, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Until url/health answers 200 (True), or timeout seconds or the server process ends (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--serve-config", help="serve this config's apps first, on a Ray cluster of its own started "
                                           "here, HTTP on --port (stopped at the end)")
    p.add_argument("--port", type=int, default=8000, help="with --serve-config: the port it serves on")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --serve-config: an app arg set in every app (YAML value), e.g. max_ongoing_per_client=8, "
                        "body_timeout_s=10, verifier.num_replicas=2 (dotted: inside a nested one)")
    p.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--one-address", action="store_true",
                   help="every client from 127.0.0.1 (default on loopback: each good client an address of "
                        "its own, each abusive group one)")
    p.add_argument("--clients-autogroup-nice", type=int,
                   help="with --serve-config: the CPU weight of this process's session (the clients) as this "
                        "nice value (19: the clients take only what the server leaves, as remote ones would)")
    p.add_argument("--memory-root-pid", type=int,
                   help="count the memory of Ray processes under this process only (default: the server "
                        "--serve-config starts; else every Ray process on this machine)")
    p.add_argument("--good", type=int, default=16)
    p.add_argument("--good-requests", type=int, default=3, help="streamed completions per well-behaved client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--big", type=int, default=20)
    p.add_argument("--body-mib", type=float, default=200)
    p.add_argument("--idle", type=int, default=50)
    p.add_argument("--idle-max-tokens", type=int, default=512)
    p.add_argument("--hammer", type=int, default=64)
    p.add_argument("--slow", type=int, default=4, help="slow-body connections of each kind (POST /health chunked, "
                   "POST /v1/completions chunked and with a Content-Length), none with an API key")
    p.add_argument("--slow-interval-s", type=float, default=3.0, help="a slow body's seconds between bytes")
    p.add_argument("--slow-content-length", type=int, default=64 << 10,
                   help="the Content-Length the trickled body claims (below the server's body limit: its deadline, "
                        "not its size, must end it)")
    p.add_argument("--body-deadline-s", type=float, default=30.0,
                   help="the server's body_timeout_s: every slow body answered or cut within it (+ --slow-grace-s)")
    p.add_argument("--slow-grace-s", type=float, default=5.0)
    p.add_argument("--heavy", type=int, default=2, help="clients sending the two heavy requests in turn")
    p.add_argument("--heavy-prompt-tokens", type=int, default=2047, help="the echo request's prompt (max_model_len - 1)")
    p.add_argument("--heavy-echo-n", type=int, default=64)
    p.add_argument("--burst", type=int, default=48, help="completions sent at once (0: none)")
    p.add_argument("--burst-n", type=int, default=8)
    p.add_argument("--burst-max-tokens", type=int, default=512)
    p.add_argument("--burst-prompt-words", type=int, default=300)
    p.add_argument("--answer-deadline-s", type=float, default=30.0, help="no client waits longer for an answer")
    p.add_argument("--itl-ratio-bound", type=float, default=2.0)
    p.add_argument("--max-rss-ingress-mib", type=float, default=1024.0)
    p.add_argument("--max-rss-proxy-mib", type=float, default=1024.0)
    p.add_argument("--max-rss-verifier-mib", type=float, default=4096.0)
    p.add_argument("--abuse-head-start", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--dry-run", action="store_true", help="tiny counts and bodies (CI)")
    p.add_argument("--note", default="", help="free text kept in the JSON (e.g. the machine's other load)")
    p.add_argument("--output-json")
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):  # its counts, unless given explicitly
        p.set_defaults(good=2, good_requests=2, max_tokens=8, big=2, body_mib=1, idle=2, idle_max_tokens=16,
                       hammer=4, abuse_head_start=0.5, timeout=60.0, slow=1, slow_interval_s=0.5, heavy=1,
                       heavy_echo_n=4, heavy_prompt_tokens=200, burst=6, burst_n=2, burst_max_tokens=8,
                       burst_prompt_words=30)
    args = p.parse_args(argv)
    if args.serve_only:
        serve_forever(args.serve_config, args.port, _overrides(args.set))
        return 0
    SOURCE["on"] = not args.one_address and httpx.URL(args.url if not args.serve_config else
                                                      "http://127.0.0.1").host.startswith("127.")
    server = None
    if args.serve_config:
        _overrides(args.set)  # a malformed pair fails here, before a cluster starts
        args.url, server = start_server(args.serve_config, args.port, args.set)
        if args.memory_root_pid is None:
            args.memory_root_pid = server.pid  # the Ray cluster's processes are its children
    if args.clients_autogroup_nice is not None:  # (a server started here has a session of its own)
        _set_autogroup_nice(args.clients_autogroup_nice)
    try:
        report = asyncio.run(run(args.url.rstrip("/"), args.model, args))
    finally:
        if server is not None:
            stop_server(server)
    report["command"] = " ".join([Path(sys.argv[0]).name if argv is None else "abuse.py", *(argv or sys.argv[1:])])
    report["note"] = args.note
    report["verdict"] = verdict(report, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
