"""`rayspec train eagle3 ...` end to end: answers, features, training, in one process or on Ray.

The stages themselves live elsewhere: answers and features in `data.py`, the trainer in
`train.py`, their Ray versions in `train_ray.py`. This module only chains them, so the
dependencies run one way (pipeline -> train_ray -> train), and it decides where the head
goes: a new directory unless asked, never over a head that is already there.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from rayspec.eagle.train import TrainConfig, answer_engine, head_config, load_examples, load_target, train_head
from rayspec.memory.malloc import keep_freed_memory


def new_output_dir(kind: str, root: str | Path = "runs") -> Path:
    """runs/<kind>-YYYYmmdd-HHMMSS, a name no earlier run took (a suffix if one started this second)."""
    base = Path(root) / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def check_output(cfg: TrainConfig) -> TrainConfig:
    """cfg with its output directory chosen (None: a new one); refuses one that holds files unless
    cfg.overwrite, so a training run never replaces a head (the shipped one included) by accident."""
    if cfg.output is None:
        return replace(cfg, output=str(new_output_dir(cfg.kind)))
    out = Path(cfg.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not cfg.overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite (overwrite=True) to write "
                              f"the head there, or leave --output out for a new runs/{cfg.kind}-<time> directory")
    return cfg


def run(cfg: TrainConfig) -> Path:
    """All three stages. Answers and features come from this process; training runs here, or on
    `cfg.num_workers` Ray Train workers (data-parallel) when that is more than 1. -> the head's directory."""
    cfg = check_output(cfg)  # before hours of work, not after
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    keep_freed_memory()
    target, tokenizer = load_target(cfg)
    examples = prepare_data(cfg, target, tokenizer)
    if cfg.num_workers > 1:
        from rayspec.eagle.train_ray import train_on_ray  # Ray only here: the core runs without it

        del examples, target
        return train_on_ray(cfg)
    return train_head(cfg, target, examples)


def read_prompts(cfg: TrainConfig) -> list[str]:
    from rayspec.eagle.data import read_prompt_file

    prompts: list[str] = []
    for spec in cfg.prompts:  # "file.jsonl" or "file.jsonl:N" (N prompts drawn at random from it)
        path, _, count = spec.rpartition(":") if spec.rpartition(":")[2].isdigit() else (spec, "", "")
        rows = read_prompt_file(path)
        if count:
            random.Random(cfg.seed).shuffle(rows)
            rows = rows[: int(count)]
        prompts += rows
    return prompts[: cfg.max_prompts] if cfg.max_prompts else prompts


def prepare_data(cfg: TrainConfig, target, tokenizer) -> list[dict]:
    """Stages 1 and 2 (resumable): the target's answers, then its features; -> the examples.
    With num_workers > 1 both run on that many Ray actors, each holding a copy of the target."""
    from rayspec.eagle.data import extract_features, generate_answers, read_answers, unanswered

    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    _, tcfg = head_config(cfg, target)
    aux_layers = tcfg.aux_layers or (target.args.num_layers - 1,)
    pool = None

    def target_pool():  # started only when there is work for it
        nonlocal pool
        if pool is None:
            from rayspec.eagle.train_ray import TargetPool  # Ray only here: the core runs without it

            pool = TargetPool(cfg, aux_layers)
        return pool

    # 1. answers
    answers = work / "answers.jsonl"
    todo = unanswered(read_prompts(cfg), answers)
    if cfg.num_workers > 1 and todo:
        target_pool().answer(todo, answers)
    elif todo:
        generate_answers(answer_engine(target, tokenizer, cfg.target), read_prompts(cfg), answers,
                         cfg.max_new_tokens)

    # 2. features
    feat_dir = work / f"features-{cfg.kind}"
    feat_dir.mkdir(exist_ok=True)
    rows = read_answers(answers)
    shards = sorted(feat_dir.glob("features-*.pt"))
    examples = load_examples(shards, cfg.kind)  # shards follow answers.jsonl row by row

    def same(e, r):
        return torch.equal(e["ids"], torch.tensor((r["prompt_ids"] + r["output_ids"])[: len(e["ids"])]))

    if len(examples) > len(rows) or (examples and not same(examples[-1], rows[len(examples) - 1])):
        raise RuntimeError(f"{feat_dir} does not match {answers} row by row; delete the features to redo them")
    if len(examples) < len(rows):  # new answers (or a fresh work dir): extract only what is missing
        if cfg.num_workers > 1:
            new = target_pool().extract(rows[len(examples):], feat_dir, first_shard=len(shards))
        else:
            new = extract_features(target, rows[len(examples):], feat_dir, aux_layers, first_shard=len(shards))
        examples += load_examples(new, cfg.kind)
    if pool is not None:
        pool.close()
    for e, r in zip(examples, rows):
        e["prompt_len"] = len(r["prompt_ids"])
    return examples
