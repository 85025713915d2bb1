"""Data-parallel head training on Ray Train: `rayspec train eagle3 ... --num-workers N`.

The answers and features are made first, by the calling process, into the work dir; each worker
(a Ray Train TorchTrainer worker, torch.distributed over gloo) then loads them from there, so on
a multi-node cluster the work dir must be on storage every node sees (NFS, a mounted bucket).
Every optimizer step takes num_workers x grad_accum batches: each worker backpropagates its own,
the gradients are summed with one all-reduce, and every worker takes the same step, so the result
is the head one process would train accumulating all those batches. Rank 0 writes checkpoints
(resumable, also by a single process with grad_accum = num_workers) and the head.

Workers run on CPU, `num_threads` torch threads each (default: 1 per worker).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rayspec.eagle.train import TrainConfig


def _worker_loop(config: dict) -> None:
    import torch.distributed as dist
    from ray import train

    from rayspec.eagle.train import _load_target, load_prepared, train_head
    from rayspec.malloc import keep_freed_memory

    cfg = TrainConfig(**config)
    torch.set_num_threads(cfg.num_threads or 1)
    keep_freed_memory()
    rank, world = train.get_context().get_world_rank(), train.get_context().get_world_size()

    def sync(grads: list[torch.Tensor], stats: torch.Tensor) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads] + [stats])  # one all-reduce per step
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
        stats.copy_(flat[offset:])

    target, _ = _load_target(cfg)
    train_head(cfg, target, load_prepared(cfg), rank=rank, world=world, sync=sync)


def train_on_ray(cfg: TrainConfig) -> Path:
    """Stage 3 on cfg.num_workers Ray Train workers (joins the running Ray cluster, or starts one)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    def absolute(path: str | None) -> str | None:  # workers do not run in this directory
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    work = Path(cfg.work_dir).resolve()
    config = {**dataclasses.asdict(cfg), "work_dir": str(work), "output": str(Path(cfg.output).resolve()),
              "prompts": tuple(cfg.prompts), "target": absolute(cfg.target), "init_head": absolute(cfg.init_head)}
    if not ray.is_initialized():
        ray.init()
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=False,
                                     resources_per_worker={"CPU": cfg.num_threads or 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"rayspec-train-{cfg.kind}", storage_path=str(work / "ray_train")))
    trainer.fit()
    return Path(cfg.output)
