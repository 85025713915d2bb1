"""Helpers shared by the Ray Serve tests (tests/test_serve_*.py)."""

from __future__ import annotations

import time

from planner_costs import MODELLED_COSTS


from ray_utils import free_port  # noqa: F401 (re-exported: the tests import it from here)


QUICK = {"health_check_period_s": 1, "graceful_shutdown_wait_loop_s": 0.1}  # (tiny_args)


def tiny_args(model_dir, **overrides) -> dict:
    """AppArgs for a fast CPU app on the tiny random model, with the production defaults on (the
    adaptive draft planner, prefix caching). The planner weighs modelled step costs
    (engine_utils.MODELLED_COSTS), not the wall clock: what it plans, and every count a test asserts,
    is the same on a loaded machine as on an idle one. A test that turns a default off says why."""
    args = {
        "model": str(model_dir),
        "served_model_name": "tiny",
        "speculative": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True,
                        "draft_costs": dict(MODELLED_COSTS)},
        "engine": {"max_model_len": 1024, "max_num_seqs": 4, "kv_cache_memory_gb": 0.25, "num_threads": 1,
                   "enable_prefix_caching": True},
        # Serve notices a killed replica at its next health check: every 1 s here rather than Serve's
        # default 10 (measured: a killed verifier's replacement listed 8.6 s after the kill at the
        # default, 0.2-0.5 s at 1 s), so the tests that kill replicas wait seconds less for each
        # And a stopping replica checks for unfinished requests every 0.1 s rather than every 2 s, which
        # is also the least it takes to stop (measured: deleting a tiny app 3.0 s at the default, 1.0 s)
        "ingress": {"ray_actor_options": {"num_cpus": 0.1}, **QUICK},
        "verifier": {"ray_actor_options": {"num_cpus": 0.5}, **QUICK},
        "proposer": {"ray_actor_options": {"num_cpus": 0.5}, **QUICK},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    return args


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)


def target_only_texts(model_dir, prompts: list[str]):
    """max_tokens -> the greedy texts of `prompts` from a target-only engine in this process (what a
    served app must reproduce over HTTP)."""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=1024, kv_cache_memory_gb=0.25,
                                    speculative=SpeculativeConfig(method="none")))

    def texts(max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.text for o in engine.generate(prompts, params)]

    return texts


def is_error_event(line: str) -> bool:
    """Whether a server-sent-events line is an error event (a JSON object with an `error` key), not a
    chunk whose generated text happens to contain the word."""
    import json

    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    try:
        event = json.loads(line[len("data: "):])
    except ValueError:
        return True  # not JSON: not a chunk of ours either
    return isinstance(event, dict) and "error" in event


# ---- streamed completions (server-sent events) ---------------------------------------------------

def completion_body(prompt: str, max_tokens: int, temperature: float = 0.0) -> dict:
    """A streamed /v1/completions body for the tiny apps (tiny_args): every token up to max_tokens."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True}


def take_event(line: str, out: dict) -> bool:
    """Fold one line of a streamed completion into `out` ({text, done, error}): the text of its
    chunks, done at `[DONE]`, an error event as `error`. Whether the line was an event."""
    import json

    if not line.startswith("data: "):
        return False
    data = line[len("data: "):]
    if data == "[DONE]":
        out["done"] = True
    elif "error" in (event := json.loads(data)):
        out["error"] = event
    else:
        out["text"] += "".join(c["text"] for c in event["choices"])
    return True


def stream_completion(url: str, prompt: str, max_tokens: int, temperature: float = 0.0,
                      progress: list[int] | None = None, index: int = 0, timeout: float = 180) -> dict:
    """One streamed completion from `url` (.../v1/completions): {status, text, done, error};
    progress[index] counts its events."""
    import httpx

    out = {"status": None, "text": "", "done": False, "error": None}
    with httpx.stream("POST", url, json=completion_body(prompt, max_tokens, temperature), timeout=timeout) as resp:
        out["status"] = resp.status_code
        for line in resp.iter_lines():
            if take_event(line, out) and progress is not None:
                progress[index] += 1
    return out


async def astream_completion(client, url: str, prompt: str, max_tokens: int, progress: list[int],
                             index: int) -> dict:
    """stream_completion on an httpx.AsyncClient: {status, text, done, error, cut}. A status other
    than 200 gives its JSON as the error; a dropped connection sets cut (and the error)."""
    import json

    import httpx

    out = {"status": None, "text": "", "done": False, "error": None, "cut": False}
    try:
        async with client.stream("POST", url, json=completion_body(prompt, max_tokens)) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                out["error"] = json.loads(await resp.aread())
                return out
            async for line in resp.aiter_lines():
                if take_event(line, out):
                    progress[index] += 1
    except (httpx.RemoteProtocolError, httpx.ReadError) as err:  # the connection was dropped
        out["cut"], out["error"] = True, repr(err)
    return out


def run_streams(url: str, prompts: list[str], max_tokens: int, fault=None, after_events: int = 8) -> list[dict]:
    """Greedy streamed completions of `prompts` from the app at `url`, all at once; once each has had
    `after_events` events, fault() runs (none may have ended before)."""
    import concurrent.futures

    progress = [0] * len(prompts)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_completion, url + "/v1/completions", p, max_tokens, progress=progress, index=i)
                   for i, p in enumerate(prompts)]
        if fault is not None:
            wait_for(lambda: min(progress) >= after_events or all(f.done() for f in futures), timeout=120, interval=0.02)
            assert not any(f.done() for f in futures), "a stream ended before the fault"
            fault()
        return [f.result(timeout=180) for f in futures]


def app_stats(url: str) -> dict:
    """The app's /v1/stats."""
    import httpx

    return httpx.get(url + "/v1/stats", timeout=30).json()


def app_deployments(app) -> dict:
    """name -> Deployment of a built Serve application, walking the bound graph from the ingress."""
    from ray.serve.deployment import Application

    found, todo = {}, [app]
    while todo:
        node = todo.pop()
        if isinstance(node, Application):
            dep = node._bound_deployment
            found[dep.name] = dep
            todo.extend(dep.init_args)
            todo.extend(dep.init_kwargs.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
        elif isinstance(node, dict):
            todo.extend(node.values())
    return found
