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

from rayspec.eagle.checkpoint import save_atomic
from rayspec.model.runner import make_runner


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


def answer_stream(engine, prompts: list[str], max_tokens: int, progress: bool = True):
    """Greedy answers, continuously batched: yields answers.jsonl rows as requests finish."""
    from rayspec.sampling.sampler import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    queue = list(reversed(prompts))
    meta: dict[str, tuple[str, list[int]]] = {}
    with tqdm(total=len(prompts), desc="target answers", unit="prompt", disable=not progress) as bar:
        while queue or engine.has_unfinished_requests():
            while queue and engine.num_waiting < engine.num_slots:
                p = queue.pop()
                ids = engine.encode_chat([{"role": "user", "content": p}])
                meta[engine.add_request(ids, params)] = (p, ids)
            for out in engine.step():
                if out.finished:
                    p, ids = meta.pop(out.request_id)
                    bar.update(1)
                    yield {"prompt": p, "prompt_ids": ids, "output_ids": out.token_ids}


def unanswered(prompts: list[str], out_path: Path) -> list[str]:
    """The prompts (deduplicated, in order) that answers.jsonl lacks."""
    done = set()
    if out_path.exists():
        done = {json.loads(line)["prompt"] for line in out_path.read_text().splitlines() if line.strip()}
    return [p for p in dict.fromkeys(prompts) if p not in done]


def generate_answers(engine, prompts: list[str], out_path: Path, max_tokens: int) -> None:
    """Stage 1 (resumable): answers of the prompts not answered yet, each appended as it finishes."""
    with out_path.open("a") as f:
        for row in answer_stream(engine, unanswered(prompts, out_path), max_tokens):
            f.write(json.dumps(row) + "\n")
            f.flush()


class FeatureExtractor:
    """One target forward per conversation -> its ids, aux features, final hidden state and labels."""

    def __init__(self, model, aux_layers: tuple[int, ...], max_len: int = 1024):
        self.model, self.aux_layers, self.max_len = model, aux_layers, max_len
        self.runner = make_runner(model, max_len, 1, slack=1)
        self.kv = self.runner.kv

    @torch.inference_mode()
    def __call__(self, row: dict) -> dict[str, torch.Tensor]:
        ids = (row["prompt_ids"] + row["output_ids"])[: self.max_len]
        self.kv.allocate("s")
        hidden, aux = self.runner.forward_hidden(["s"], [ids], aux_layers=self.aux_layers)[0]
        self.kv.free("s")
        label = self.model.logits(hidden[0]).argmax(-1)  # [L]: the target's choice after each position
        # shards live on the CPU, whatever device the target runs on
        return {"ids": torch.tensor(ids, dtype=torch.int32), "aux": aux[0].to("cpu", torch.float16),
                "final": hidden[0].to("cpu", torch.float16), "label": label.to("cpu", torch.int32)}


class ShardWriter:
    """Appends examples to `features-NNNN.pt` shards of about `shard_tokens` tokens, in order."""

    def __init__(self, out_dir: Path, first_shard: int = 0, shard_tokens: int = 200_000):
        self.out_dir, self.first_shard, self.shard_tokens = out_dir, first_shard, shard_tokens
        self.shards: list[Path] = []
        self._current, self._tokens = self._empty(), 0

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"ids": [], "aux": [], "final": [], "label": []}

    def add(self, example: dict[str, torch.Tensor]) -> None:
        for key, rows in self._current.items():
            rows.append(example[key])
        self._tokens += len(example["ids"])
        if self._tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> list[Path]:
        if self._current["ids"]:
            path = self.out_dir / f"features-{self.first_shard + len(self.shards):04d}.pt"
            save_atomic(self._current, path)  # a shard is whole or absent
            self.shards.append(path)
        self._current, self._tokens = self._empty(), 0
        return self.shards


def extract_features(model, rows: list[dict], out_dir: Path, aux_layers: tuple[int, ...],
                     shard_tokens: int = 200_000, max_len: int = 1024, first_shard: int = 0) -> list[Path]:
    """Stage 2: shards of {"ids", "aux", "final", "label"} lists (one entry per answers row), numbered
    from `first_shard` (so a work dir that gained answers extracts only the new rows)."""
    extract = FeatureExtractor(model, aux_layers, max_len)
    writer = ShardWriter(out_dir, first_shard, shard_tokens)
    for row in tqdm(rows, desc="target features", unit="conv"):
        writer.add(extract(row))
    return writer.flush()
