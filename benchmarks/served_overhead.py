"""Where served c1 throughput goes: the engine alone, the engine next to an idle Ray Serve, and
the same config served over HTTP (non-streamed and streamed), taking turns to beat the VM's drift.

usage: python benchmarks/served_overhead.py [CONFIG] [ROUNDS] [N_PROMPTS]
       (default configs/default.yaml, 2 rounds, 5 mt_bench prompts; run inside .venv, nothing else running)

Per round: (a) the config's engine in this process, no Ray running; (b) `serve run CONFIG` started,
settled, then (c) the same in-process engine again while Serve idles beside it, (d) the served
endpoint, sequential non-streamed requests, (e) the same streamed; Serve shut down. Greedy, 128
tokens. Prints tok/s per round and the ratios over (a).
"""

import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import yaml

from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams

URL = "http://127.0.0.1:8000"


def engine_from(config_path: str) -> LLMEngine:
    args = yaml.safe_load(open(config_path))["applications"][0]["args"]
    spec = SpeculativeConfig(**args.get("speculative", {"method": "none"}))
    eng = args.get("engine", {})
    return LLMEngine(EngineConfig(model=args["model"], speculative=spec, max_model_len=eng.get("max_model_len", 2048),
                                  max_num_seqs=eng.get("max_num_seqs", 8), num_threads=eng.get("num_threads")))


def in_process(engine: LLMEngine, prompts: list[str]) -> float:
    params = SamplingParams(temperature=0, max_tokens=128)
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(engine.generate([engine.encode_chat([{"role": "user", "content": p}])], params)[0].token_ids)
    return tokens / (time.perf_counter() - start)


def served(client: httpx.Client, model: str, prompts: list[str], stream: bool) -> float:
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        body = {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": 128, "temperature": 0}
        if not stream:
            tokens += client.post(f"{URL}/v1/chat/completions", json=body).json()["usage"]["completion_tokens"]
            continue
        body.update(stream=True, stream_options={"include_usage": True})
        with client.stream("POST", f"{URL}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens += usage["completion_tokens"] if usage else 0
    return tokens / (time.perf_counter() - start)


def serve_up(config_path: str) -> subprocess.Popen:
    proc = subprocess.Popen(["serve", "run", config_path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(180):
        try:
            if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                time.sleep(20)  # let start-up work settle
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("serve did not come up")


def serve_down(proc: subprocess.Popen) -> None:
    subprocess.run(["serve", "shutdown", "-y"], capture_output=True)
    proc.terminate()
    proc.wait(timeout=60)
    subprocess.run(["ray", "stop", "--force"], capture_output=True, env=dict(os.environ))
    time.sleep(3)


def main(config_path: str, rounds: int, num_prompts: int) -> None:
    prompts = load_prompts("mt_bench", num_prompts)
    model = yaml.safe_load(open(config_path))["applications"][0]["args"].get("served_model_name")
    engine = engine_from(config_path)
    in_process(engine, prompts[:1])  # warm-up
    rows = []
    for r in range(rounds):
        alone = in_process(engine, prompts)
        proc = serve_up(config_path)
        try:
            with httpx.Client(timeout=600) as client:
                served(client, model, prompts[:1], stream=False)  # warm-up
                beside = in_process(engine, prompts)
                whole = served(client, model, prompts, stream=False)
                streamed = served(client, model, prompts, stream=True)
        finally:
            serve_down(proc)
        rows.append((alone, beside, whole, streamed))
        print(f"round {r + 1}: engine alone {alone:.1f}, engine beside idle Serve {beside:.1f}, "
              f"served non-streamed {whole:.1f}, served streamed {streamed:.1f} tok/s", flush=True)
    a, b, w, s = (statistics.mean(col) for col in zip(*rows))
    print(f"ratios over the engine alone: beside idle Serve {b / a:.2f}, served non-streamed {w / a:.2f}, "
          f"served streamed {s / a:.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "configs/default.yaml",
         int(sys.argv[2]) if len(sys.argv) > 2 else 2, int(sys.argv[3]) if len(sys.argv) > 3 else 5)
