"""Self-distillation data for EAGLE heads: the target writes the answers, its hidden states are the features.

Stage 1 (`generate_answers`): chat prompts -> greedy answers from the target, batched through
the engine, appended to `answers.jsonl` (resumable: prompts already answered are skipped).
Stage 2 (`extract_features`): one target forward per conversation collects, per position,
the EAGLE-3 features (inputs of the aux layers), the final hidden state (EAGLE-1) and the
target's greedy choice (the label), into `features-*.pt` shards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from rayspec.runner import ModelRunner


def read_answers(path: Path) -> list[dict]:
    """Rows of answers.jsonl that make at least one training position."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if len(r["prompt_ids"]) + len(r["output_ids"]) >= 3]


def read_prompt_file(path: str | Path) -> list[str]:
    """User messages from a Spec-Bench JSONL (`turns[0]`) or a Q/A JSONL (`question`, as GSM8K)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        out.append(row["turns"][0] if "turns" in row else row.get("question") or row["prompt"])
    return out


def generate_answers(engine, prompts: list[str], out_path: Path, max_tokens: int) -> None:
    """Greedy answers, continuously batched (finished requests are written at once)."""
    from rayspec.sampling import SamplingParams

    done = set()
    if out_path.exists():
        done = {json.loads(line)["prompt"] for line in out_path.read_text().splitlines() if line.strip()}
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    queue = list(reversed(todo))
    meta: dict[str, tuple[str, list[int]]] = {}
    with out_path.open("a") as f, tqdm(total=len(todo), desc="target answers", unit="prompt") as bar:
        while queue or engine.has_unfinished_requests():
            while queue and engine.num_waiting < engine.num_slots:
                p = queue.pop()
                ids = engine.encode_chat([{"role": "user", "content": p}])
                meta[engine.add_request(ids, params)] = (p, ids)
            for out in engine.step():
                if out.finished:
                    p, ids = meta.pop(out.request_id)
                    f.write(json.dumps({"prompt": p, "prompt_ids": ids, "output_ids": out.token_ids}) + "\n")
                    f.flush()
                    bar.update(1)


@torch.inference_mode()
def extract_features(model, rows: list[dict], out_dir: Path, aux_layers: tuple[int, ...],
                     shard_tokens: int = 200_000, max_len: int = 1024, first_shard: int = 0) -> list[Path]:
    """Write shards of {"ids", "aux", "final", "label"} lists (one entry per answers row), numbered
    from `first_shard` (so a work dir that gained answers extracts only the new rows)."""
    runner = ModelRunner(model, max_len, 1, slack=1)
    shards, current, n_tokens = [], {"ids": [], "aux": [], "final": [], "label": []}, 0

    def flush():
        nonlocal current, n_tokens
        if current["ids"]:
            path = out_dir / f"features-{first_shard + len(shards):04d}.pt"
            torch.save(current, path)
            shards.append(path)
        current, n_tokens = {"ids": [], "aux": [], "final": [], "label": []}, 0

    for row in tqdm(rows, desc="target features", unit="conv"):
        ids = (row["prompt_ids"] + row["output_ids"])[:max_len]
        runner.allocate("s")
        hidden, aux = runner.forward_hidden(["s"], [ids], aux_layers=aux_layers)[0]
        runner.free("s")
        label = model.logits(hidden[0]).argmax(-1)  # [L]: the target's choice after each position
        current["ids"].append(torch.tensor(ids, dtype=torch.int32))
        current["aux"].append(aux[0].to(torch.float16))
        current["final"].append(hidden[0].to(torch.float16))
        current["label"].append(label.to(torch.int32))
        n_tokens += len(ids)
        if n_tokens >= shard_tokens:
            flush()
    flush()
    return shards
