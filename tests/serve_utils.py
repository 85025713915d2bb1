"""Helpers shared by the Ray Serve tests (tests/test_serve_*.py)."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_args(model_dir, **overrides) -> dict:
    """AppArgs for a fast CPU app on the tiny random model. The adaptive draft length is off: it
    learns from the wall clock, and tests that count drafts must not depend on machine load."""
    args = {
        "model": str(model_dir),
        "served_model_name": "tiny",
        "speculative": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        "engine": {"max_model_len": 1024, "max_num_seqs": 4, "kv_cache_memory_gb": 0.25, "num_threads": 1},
        "ingress": {"ray_actor_options": {"num_cpus": 0.1}},
        "verifier": {"ray_actor_options": {"num_cpus": 0.5}},
        "proposer": {"ray_actor_options": {"num_cpus": 0.5}},
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
    from rayspec.engine import LLMEngine
    from rayspec.sampling import SamplingParams

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
