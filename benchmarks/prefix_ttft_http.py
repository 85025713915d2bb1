"""Time to first token over HTTP of two requests sharing a long prefix, one after the other, against a
running server (`rayspec serve --config default`, or any OpenAI server): the second should find the
prefix cached (`usage.prompt_tokens_details.cached_tokens`) and answer its first token far sooner.

  .venv/bin/python benchmarks/prefix_ttft_http.py --url http://127.0.0.1:8000 --prefix-words 1500 --pairs 4

Each pair uses a new prefix (so the first request of a pair finds nothing cached); prints JSON with
each request's TTFT, cached tokens, and the second/first TTFT ratio per pair (docs/benchmarks-history.md,
"Paged KV and prefix caching").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

WORDS = ("river stone cloud lamp orange violin harbor candle meadow copper whisper garden silver thunder "
         "pepper marble").split()


def one(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, cached = time.perf_counter(), None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter() - start
            usage = event.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": round(first, 4), "cached_tokens": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefix-words", type=int, default=1500)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    one(args.url, args.model, "Warm up.", 2)
    pairs = []
    for k in range(args.pairs):
        rng = random.Random(1000 + k)
        prefix = f"Document {k}. " + " ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
        a = one(args.url, args.model, prefix + "\nQuestion: which word comes first?", args.max_tokens)
        b = one(args.url, args.model, prefix + "\nQuestion: which word comes last?", args.max_tokens)
        pairs.append({"first": a, "second": b, "ratio": round(b["ttft_s"] / a["ttft_s"], 4)})
    print(json.dumps({"url": args.url, "prefix_words": args.prefix_words, "pairs": pairs,
                      "median_ratio": statistics.median(p["ratio"] for p in pairs)}, indent=1))


if __name__ == "__main__":
    main()
