"""Head training scaled out on Ray: `rayspec train eagle3 ... --num-workers N`.

Stages 1 and 2 (answers, features): N Ray actors each hold a copy of the target and take chunks
of prompts (then of conversations); the calling process writes what comes back into the work
dir, answers as chunks finish, feature shards in answers.jsonl's order. Stage 3 (training): N
Ray Train TorchTrainer workers (torch.distributed over gloo) load the examples from the work dir,
so on a multi-node cluster it must be on storage every node sees (NFS, a mounted bucket).
Every optimizer step takes num_workers x grad_accum batches: each worker backpropagates its own,
the gradients are summed with one all-reduce, and every worker takes the same step, so the result
is the head one process would train accumulating all those batches. Rank 0 writes checkpoints
(resumable, also by a single process with grad_accum = num_workers) and the head.

Workers run on one GPU each where the cluster has GPUs (`device` None or "cuda"; NCCL all-reduce),
else on CPU with `num_threads` torch threads each (default: 1 per worker; gloo).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from rayspec.eagle.train import TrainConfig


def _ensure_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init()  # joins the running cluster (RAY_ADDRESS, `ray start`), else starts a local one


def use_gpus(cfg: TrainConfig) -> bool:
    """Whether the Ray workers take a GPU each: `device` "cuda", or unset on a cluster that has GPUs."""
    import ray

    if cfg.device is not None:
        return cfg.device.startswith("cuda")
    _ensure_ray()
    return ray.cluster_resources().get("GPU", 0) > 0


class _TargetActor:
    """A copy of the target on a Ray worker: answers prompts, extracts features."""

    def __init__(self, target: str, num_threads: int, max_new_tokens: int, aux_layers: tuple[int, ...],
                 gpu: bool = False, dtype: str | None = None):
        from rayspec.eagle.data import FeatureExtractor
        from rayspec.eagle.train import answer_engine
        from rayspec.memory.malloc import keep_freed_memory
        from rayspec.model.loader import load_model

        torch.set_num_threads(num_threads)
        keep_freed_memory()
        model, tokenizer = load_model(target, device="cuda" if gpu else "cpu", dtype=dtype)  # Ray set the visible GPU
        self.engine = answer_engine(model, tokenizer, target)
        self.extract = FeatureExtractor(model, tuple(aux_layers))
        self.max_new_tokens = max_new_tokens

    def answer(self, prompts: list[str]) -> list[dict]:
        from rayspec.eagle.data import answer_stream

        return list(answer_stream(self.engine, prompts, self.max_new_tokens, progress=False))

    def features(self, rows: list[dict]) -> list[dict[str, torch.Tensor]]:
        return [self.extract(r) for r in rows]


class TargetPool:
    """cfg.num_workers target actors, fed chunks of work by a Ray ActorPool."""

    def __init__(self, cfg: TrainConfig, aux_layers: tuple[int, ...]):
        import ray
        from ray.util import ActorPool

        _ensure_ray()
        self.num_workers = cfg.num_workers
        threads = cfg.num_threads or 1
        gpu = use_gpus(cfg)
        actor = ray.remote(num_cpus=threads, num_gpus=1 if gpu else 0)(_TargetActor)
        target = str(Path(cfg.target).resolve()) if Path(cfg.target).exists() else cfg.target
        self.actors = [actor.remote(target, threads, cfg.max_new_tokens, tuple(aux_layers), gpu, cfg.target_dtype)
                       for _ in range(cfg.num_workers)]
        self.pool = ActorPool(self.actors)

    def close(self) -> None:
        """Frees the actors' CPUs and memory for the training workers."""
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors, self.pool = [], None

    def _chunks(self, items: list) -> list[list]:
        size = max(1, min(64, math.ceil(len(items) / (2 * self.num_workers))))  # >= 2 chunks per worker
        return [items[i: i + size] for i in range(0, len(items), size)]

    def answer(self, prompts: list[str], out_path: Path) -> None:
        """Appends each chunk's answers to out_path as it finishes (resumable chunk by chunk)."""
        with out_path.open("a") as f, tqdm(total=len(prompts), desc="target answers", unit="prompt") as bar:
            for rows in self.pool.map_unordered(lambda a, chunk: a.answer.remote(chunk), self._chunks(prompts)):
                f.write("".join(json.dumps(r) + "\n" for r in rows))
                f.flush()
                bar.update(len(rows))

    def extract(self, rows: list[dict], out_dir: Path, first_shard: int) -> list[Path]:
        """Feature shards for `rows`, in their order."""
        from rayspec.eagle.data import ShardWriter

        writer = ShardWriter(out_dir, first_shard)
        with tqdm(total=len(rows), desc="target features", unit="conv") as bar:
            for examples in self.pool.map(lambda a, chunk: a.features.remote(chunk), self._chunks(rows)):
                for e in examples:
                    writer.add(e)
                bar.update(len(examples))
        return writer.flush()


def _worker_loop(config: dict) -> None:
    import torch.distributed as dist
    from ray import train

    from rayspec.eagle.train import load_prepared, load_target, train_head
    from rayspec.memory.malloc import keep_freed_memory

    cfg = TrainConfig(**config)
    if cfg.device is not None and cfg.device.startswith("cuda"):
        from ray.train.torch import get_device

        cfg = dataclasses.replace(cfg, device=str(get_device()))  # this worker's GPU
    torch.set_num_threads(cfg.num_threads or 1)
    keep_freed_memory()
    rank, world = train.get_context().get_world_rank(), train.get_context().get_world_size()

    def sync(grads: list[torch.Tensor], stats: torch.Tensor) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads] + [stats.to(grads[0].device)])  # one all-reduce per step
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        stats.copy_(flat[offset:])

    target, _ = load_target(cfg)
    train_head(cfg, target, load_prepared(cfg), rank=rank, world=world, sync=sync)


def train_on_ray(cfg: TrainConfig) -> Path:
    """Stage 3 on cfg.num_workers Ray Train workers (joins the running Ray cluster, or starts one)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    def absolute(path: str | None) -> str | None:  # workers do not run in this directory
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    work = Path(cfg.work_dir).resolve()
    config = {**dataclasses.asdict(cfg), "work_dir": str(work), "output": str(Path(cfg.output).resolve()),
              "prompts": tuple(cfg.prompts), "target": absolute(cfg.target), "init_head": absolute(cfg.init_head)}
    _ensure_ray()
    gpu = use_gpus(cfg)
    config["device"] = "cuda" if gpu else "cpu"
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=gpu,
                                     resources_per_worker={"CPU": cfg.num_threads or 1, **({"GPU": 1} if gpu else {})}),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        run_config=RunConfig(name=f"rayspec-train-{cfg.kind}", storage_path=str(work / "ray_train")))
    trainer.fit()
    return Path(cfg.output)
