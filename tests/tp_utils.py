"""A launcher for tensor-parallel ranks as plain local processes (torch.multiprocessing, spawn):
core tests of the parallel layers without a Ray cluster. Serving uses deployments.replicas.tensor_parallel."""

from __future__ import annotations

import torch.multiprocessing as mp

from rayspec.model.tp_ranks import RankLauncher, run_rank


class _Processes:
    def __init__(self, procs):
        self.procs = procs

    def wait_started(self) -> None:
        pass

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self) -> None:
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class ProcessLauncher(RankLauncher):
    def address(self) -> str:
        return "127.0.0.1"

    def launch(self, size, init_method, model_spec, device, dtype, draft=None, secret=None, quantized_weights="keep"):
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=run_rank, args=(rank, size, init_method, model_spec, device, dtype, draft),
                             kwargs={"secret": secret, "quantized_weights": quantized_weights}, daemon=True)
                 for rank in range(1, size)]
        for p in procs:
            p.start()
        return _Processes(procs)
