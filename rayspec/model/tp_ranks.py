"""The ranks of a tensor-parallel model, above the parallel layers (rayspec.model.parallel): a follower's
whole life (`run_rank`: join the group, load its shard, follow rank 0's commands), rank 0's start
(`start_tensor_parallel`), and the launcher interface (`RankLauncher`; Ray's is
deployments.replicas.tensor_parallel.RayRankLauncher). It builds models, so it sits above rayspec.model.native and
rayspec.model.loader; rayspec.model.parallel imports neither (no import circle)."""

from __future__ import annotations

import secrets

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayspec.model import loader
from rayspec.model.kv_cache import ForwardBatch
from rayspec.model.parallel import (IDLE_TIMEOUT_S, OP_FORWARD, OP_LOGITS, OP_MOVE_ROWS, OP_NEW_CACHE,
                                    OP_STOP, RankFailure, TPGroup)


def receive_forward(tp: TPGroup, header: list[int], dtype: torch.dtype):
    """A follower: the inputs of the forward rank 0 announced -> (input_ids, ForwardBatch)."""
    _, B, Q, kv_len, has_mask, has_cache_pos, n_real, packed = header[:8]
    long = torch.long
    input_ids, write_index = tp.receive((B, Q), long), tp.receive((B, Q), long)
    read_index, positions = tp.receive((B, kv_len), long), tp.receive((B, Q), long)
    mask = tp.receive((B, 1, Q, kv_len), dtype) if has_mask else None
    cache_positions = tp.receive((B, Q), long) if has_cache_pos else None
    real_rows = tp.receive((n_real,), long) if n_real >= 0 else None
    sliding_start, sliding_keys, read_lo, read_hi = header[10:14]
    sliding_mask = tp.receive((B, 1, Q, sliding_keys), dtype) if sliding_keys >= 0 else None
    batch = ForwardBatch(write_index=write_index, read_index=read_index, positions=positions, kv_len=kv_len,
                         mask=mask, cache_positions=cache_positions, real_rows=real_rows,
                         packed_output=bool(packed), sliding_start=sliding_start, sliding_mask=sliding_mask,
                         read_range=(read_lo, read_hi) if read_lo >= 0 else None)
    return input_ids, batch


@torch.inference_mode()
def serve_commands(models: list, tp: TPGroup) -> int:
    """A follower's life: do rank 0's commands until OP_STOP. Returns the number of commands run.
    models: this rank's shards, by model id (the target; a draft model sharded the same way)."""
    caches, count = [], 0  # KV caches by id (one per engine or proposer rank 0 runs on a model)
    while True:
        header = tp.receive_header()
        op = header[0]
        if op == OP_STOP:
            return count
        count += 1
        if op == OP_FORWARD:
            model = models[header[9]]
            input_ids, batch = receive_forward(tp, header, model.compute_dtype)
            model(input_ids, caches[header[8]], batch)
        elif op == OP_LOGITS:
            model = models[header[3]]
            model.logits(tp.receive((header[1], header[2]), model.compute_dtype))
        elif op == OP_NEW_CACHE:
            caches.append(models[header[3]].new_cache(header[1], header[2]))
        elif op == OP_MOVE_ROWS:
            n, cache_id = header[1:3]
            caches[cache_id].move_rows(tp.receive((n,), torch.long), tp.receive((n,), torch.long))
        else:
            raise RankFailure(f"unknown tensor-parallel command {op}")


def run_rank(rank: int, size: int, init_method: str, model_spec: str, device: str, dtype: str | None,
             draft: "DraftShard | None" = None, timeout_s: float = IDLE_TIMEOUT_S, secret: bytes | None = None,
             quantized_weights: str = "keep") -> int:
    """A follower rank's whole process: join the group, load this rank's shard of the model (and of
    the draft model, when it is sharded too), then serve rank 0's commands until it stops them (or
    the group breaks)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tp = TPGroup.init(rank, size, init_method, device, timeout_s, secret=secret)
    try:
        models = [loader.load_model(model_spec, device=device, dtype=dtype, tp=tp, tokenizer=False,
                                    quantized_weights=quantized_weights)[0]]
        if draft is not None:
            models.append(draft.load(device, dtype, tp))
        tp.all_reduce(torch.zeros(1, device=device))  # loaded: rank 0 waits for this
        return serve_commands(models, tp)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- starting the ranks --------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftShard:
    """A draft model split over the target's ranks (draft_tensor_parallel_size equal to
    tensor_parallel_size): what each rank loads, as model id 1."""

    model: str
    num_layers: int | None = None
    dtype: str | None = None
    quantized_weights: str = "keep"

    @classmethod
    def of(cls, config) -> "DraftShard | None":
        """The draft of an EngineConfig when it is sharded with the target, else None."""
        spec = config.speculative
        if spec.method != "draft_model" or spec.draft_tensor_parallel_size in (None, 1):
            return None
        return cls(spec.draft_model or config.model, spec.draft_num_layers, spec.draft_dtype, config.quantized_weights)

    def load(self, device, dtype, tp: TPGroup):
            return loader.load_model(self.model, device=device, dtype=self.dtype or dtype, num_layers=self.num_layers,
                                 tp=tp, tokenizer=False, quantized_weights=self.quantized_weights)[0]


class RankLauncher:
    """Starts ranks 1..size-1, each running `run_rank` in a process of its own on its own device.
    deployments.replicas.tensor_parallel.RayRankLauncher does it with Ray actors in a placement group."""

    def address(self) -> str:
        """An address of this process's host that the ranks can reach (rank 0 listens there)."""
        raise NotImplementedError

    def launch(self, size: int, init_method: str, model_spec: str, device: str, dtype: str | None,
               draft: DraftShard | None = None, secret: bytes | None = None, quantized_weights: str = "keep"):
        """Start the ranks (each runs run_rank with `secret` and `quantized_weights`, over a channel the launcher trusts: Ray's,
        a process's arguments); returns a handle with `wait_started()` (raises when a rank cannot
        start), `alive() -> bool` and `shutdown()`."""
        raise NotImplementedError


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_tensor_parallel(config, launcher: RankLauncher | None):
    """Rank 0's side of starting an engine at config.tensor_parallel_size: start the other ranks,
    join their group, load this rank's shard; returns (model, tokenizer, the ranks' handle)."""
    size = config.tensor_parallel_size
    if launcher is None:
        raise ValueError(f"tensor_parallel_size {size} needs its other ranks started: run it under Ray "
                         "(the verifier deployment, `rayspec bench offline --tensor-parallel-size`) or pass "
                         "rank_launcher=deployments.replicas.tensor_parallel.RayRankLauncher()")
    device = torch.device(config.device) if config.device else loader.default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    init_method = f"tcp://{launcher.address()}:{free_port()}"
    secret = secrets.token_bytes(32)  # the group's: its ranks prove it once joined (TPGroup._prove)
    ranks = launcher.launch(size, init_method, config.model, device.type, config.dtype, DraftShard.of(config),
                            secret=secret, quantized_weights=config.quantized_weights)
    try:
        ranks.wait_started()  # the ranks' processes run (else joining the group below would wait forever)
        tp = TPGroup.init(0, size, init_method, device, secret=secret)
        model, tokenizer = loader.load_model(config.model, device=device, dtype=config.dtype, tp=tp,
                                             quantized_weights=config.quantized_weights)
        draft = DraftShard.of(config)
        if draft is not None:  # the draft proposer takes it (rayspec.proposers.draft_model)
            model.draft_shard = draft.load(device, config.dtype, tp)
        tp.all_reduce(torch.zeros(1, device=device))  # every rank has loaded its shard
    except BaseException:
        ranks.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return model, tokenizer, ranks
