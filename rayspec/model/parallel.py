"""Tensor parallelism: a process group, the parallel layers the one model is built from, and the
command channel that makes the other ranks follow rank 0.

Megatron-style, as gpt-fast's tp.py and nano-vllm's layers do it: q/k/v and gate/up are
column-parallel (each rank holds a slice of the heads / of the intermediate width), o_proj and
down_proj row-parallel (each rank multiplies its slice, one all-reduce sums them), the embedding and
the LM head vocab-parallel. So a decoder layer costs two all-reduces, and the model code reads the
same at TP=1 (every layer a plain Linear) and TP=N.

Only rank 0 runs the engine (scheduler, proposer, sampling). The other ranks run `serve_commands` (rayspec.model.tp_ranks):
they wait for the next command from rank 0 (a forward, a logits call, a KV-cache copy) and do their
share of it. Every command has a declared layout: an int64 header of HEADER_LEN values, then
tensors whose shapes the header gives, all by `broadcast` (nothing is pickled). NCCL on CUDA, gloo
on CPU: the same code. Launching the ranks is someone else's job (deployments.replicas.tensor_parallel starts
them as Ray actors in the replica's placement group); this module needs no Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

HEADER_LEN = 16
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # see TPGroup.init
OP_STOP, OP_FORWARD, OP_LOGITS, OP_NEW_CACHE, OP_MOVE_ROWS = range(5)


class RankFailure(RuntimeError):
    """A collective or a command broadcast failed: a rank died or the group broke. The engine cannot
    go on (its ranks' caches no longer agree); the replica must be replaced."""

    fatal = True


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group. size 1: no group, every op is the identity."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where collectives run (cuda:i for NCCL, cpu for gloo)
    group: object = None  # the torch.distributed process group (None: the default group)
    broken: BaseException | None = None
    num_caches: int = 0  # KV caches made so far (each engine on a model makes its own; ids in order)
    num_models: int = 0  # models sharded over this group so far (the target 0, a draft model 1)

    @property
    def is_driver(self) -> bool:
        return self.size > 1 and self.rank == 0

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: torch.device,
             timeout_s: float = IDLE_TIMEOUT_S, secret: bytes | None = None) -> "TPGroup":
        """Join the group (blocks until every rank has). NCCL on CUDA devices, gloo elsewhere.

        secret: the group's, handed to every rank by whoever started them (rank 0, over Ray): the
        rendezvous (torch's TCP store) takes whoever connects first as a rank, so once joined every
        rank proves it holds the secret (`_prove`) and the group is refused when one does not.

        The timeout bounds every collective, including a follower's wait for rank 0's next command,
        which lasts as long as the engine is idle: so it is long. A rank that dies is noticed
        otherwise: gloo raises as soon as a peer's connection closes, and the launcher's handle
        (`alive()`, the verifier's health check) sees a rank's process end, for NCCL too."""
        device = torch.device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        group = cls(rank=rank, size=size, device=device)
        if secret is not None:
            group._prove(secret)
        logger.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, size, backend, device)
        return group

    def _prove(self, secret: bytes) -> None:
        """Every rank shows HMAC-SHA256(secret, rank 0's fresh nonce, its rank) to every other; one
        that cannot (an impostor that reached the rendezvous first) fails the group on every rank."""
        import hashlib
        import hmac
        import secrets as random_bytes

        nonce = torch.zeros(32, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            nonce.copy_(torch.frombuffer(bytearray(random_bytes.token_bytes(32)), dtype=torch.uint8))
        dist.broadcast(nonce, src=0)
        nonce_bytes = bytes(nonce.cpu().tolist())

        def tag(rank: int) -> bytes:
            return hmac.new(secret, nonce_bytes + rank.to_bytes(4, "little"), hashlib.sha256).digest()

        mine = torch.frombuffer(bytearray(tag(self.rank)), dtype=torch.uint8).to(self.device)
        tags = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(tags, mine)
        bad = [r for r, t in enumerate(tags) if not hmac.compare_digest(bytes(t.cpu().tolist()), tag(r))]
        if bad:
            dist.destroy_process_group()
            raise RankFailure(f"tensor-parallel ranks {bad} could not prove the group's secret: refused")

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """(start, stop) of this rank's equal slice of n things."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size {self.size}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    # ---- collectives ---------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken is not None:
            raise RankFailure(f"the tensor-parallel group is broken: {self.broken!r}") from self.broken

    def _run(self, op, *args):
        self._check()
        try:
            return op(*args, group=self.group)
        except Exception as err:  # noqa: BLE001 - a dead peer: gloo/NCCL raise assorted errors
            self.broken = err
            raise RankFailure(f"tensor-parallel collective failed (a rank died?): {err!r}") from err

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place, batch-invariantly: every element is summed in rank order
        (rank 0 + rank 1 + ...), whatever x's size.

        A library all-reduce is not: gloo's ring (and NCCL's ring/tree) cut the buffer into chunks by
        its size, so which rank's value an element's sum starts from depends on how many rows the
        tensor has (measured on gloo, 3 ranks: one row reduced alone differs by 4e-6 from the same
        row reduced among five). Then a verification forward of k+1 rows would not compute what
        decoding one row computes, and greedy speculation could leave target-only decoding at a
        near-tie. So: gather the partial sums, add them in a fixed order. It moves (size-1) x the
        tensor to every rank (a ring all-reduce moves about 2x); at decode and verification sizes
        both are latency-bound."""
        if self.size > 1:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._run(dist.all_gather, parts, x.contiguous())
            total = parts[0]
            for part in parts[1:]:
                total += part
            x.copy_(total)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run(dist.all_gather, parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        self._run(dist.broadcast, x, 0)
        return x

    # ---- the command channel (rank 0 sends, the others receive) ------------------------------
    def send(self, op: int, ints: list[int] = (), tensors: list[torch.Tensor] = ()) -> None:
        header = [op, *ints] + [0] * (HEADER_LEN - 1 - len(ints))
        self.broadcast(torch.tensor(header, dtype=torch.long).to(self.device))
        for t in tensors:
            self.broadcast(t.contiguous())

    def receive_header(self) -> list[int]:
        header = self.broadcast(torch.empty(HEADER_LEN, dtype=torch.long, device=self.device))
        return header.tolist()  # a follower's one host read per command

    def receive(self, shape, dtype) -> torch.Tensor:
        return self.broadcast(torch.empty(shape, dtype=dtype, device=self.device))

    def stop(self) -> None:
        """Release the followers (they return from serve_commands) and leave the group."""
        if self.size > 1 and self.broken is None and self.rank == 0:
            try:
                self.send(OP_STOP)
            except RankFailure:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


NO_TP = TPGroup()


# ---- parallel layers -------------------------------------------------------------------------
# Layers tag their parameters with the checkpoint slice they hold (`tp_shards`: name -> (dim, start,
# stop)); `tag_shards` copies that onto the parameters as `tp_shard`, which the loader reads to load
# only its slice (see rayspec.model.weights.checkpoint).

def column_parallel(linear: torch.nn.Module, tp: TPGroup, out_features: int, what: str) -> torch.nn.Module:
    """Mark a Linear built with out_features / tp.size outputs as this rank's rows of the full one."""
    if tp.size > 1:
        start, stop = tp.shard(out_features, what)
        linear.tp_shards = {"weight": (0, start, stop), "bias": (0, start, stop)}
    return linear


def row_parallel(linear: torch.nn.Module, tp: TPGroup, in_features: int, what: str) -> torch.nn.Module:
    """Mark a Linear built with in_features / tp.size inputs as this rank's columns of the full one;
    its output is then a partial sum: the caller all-reduces it (`tp.all_reduce`). Its bias is
    added on rank 0 only (the other ranks' copies are zeroed after loading, `zero_row_biases`)."""
    if tp.size > 1:
        start, stop = tp.shard(in_features, what)
        linear.tp_shards = {"weight": (1, start, stop)}
        linear.tp_row_parallel = True
    return linear


def tag_shards(model: torch.nn.Module) -> None:
    """Put each module's `tp_shards` onto its parameters as `tp_shard` (parameters are new objects
    after `to_empty`, so this runs after materializing and before loading)."""
    for module in model.modules():
        for name, where in getattr(module, "tp_shards", {}).items():
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter):
                param.tp_shard = where


@torch.no_grad()
def zero_row_biases(model: torch.nn.Module, tp: TPGroup) -> None:
    if tp.rank == 0:
        return
    for module in model.modules():
        if getattr(module, "tp_row_parallel", False) and getattr(module, "bias", None) is not None:
            module.bias.zero_()


def splits_vocab(tp: TPGroup, vocab_size: int) -> bool:
    """Whether the embedding and LM head are split over the ranks: when the vocabulary divides
    evenly (128256, 151936 and 49152 do for 2, 4 and 8 ranks, 49152 for 3); otherwise each rank
    keeps them whole (memory, not correctness)."""
    return tp.size > 1 and vocab_size % tp.size == 0


class VocabParallelEmbedding(torch.nn.Embedding):
    """An embedding whose rows (token ids start..stop) are split over the ranks: each rank looks up
    the ids it holds, zeros for the others, and one all-reduce assembles the rows."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        self.tp = tp
        self.split = splits_vocab(tp, vocab_size)
        self.vocab_start, self.vocab_stop = tp.shard(vocab_size, "vocab_size") if self.split else (0, vocab_size)
        # the weight given, not drawn by reset_parameters: on the meta device (every loaded model) torch's
        # init runs through its reference ops, whose first call imports torch._dynamo (0.4 s of every
        # process that builds a model: each Serve replica); drawn as torch draws it elsewhere
        weight = torch.empty(self.vocab_stop - self.vocab_start, dim)
        if weight.device.type != "meta":
            torch.nn.init.normal_(weight)
        super().__init__(self.vocab_stop - self.vocab_start, dim, _weight=weight)
        if self.split:
            self.tp_shards = {"weight": (0, self.vocab_start, self.vocab_stop)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return super().forward(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        x = super().forward(local).masked_fill(outside[..., None], 0)
        return self.tp.all_reduce(x)


# ---- what the other ranks run -------------------------------------------------------------------

def send_forward(tp: TPGroup, input_ids: torch.Tensor, batch, cache_id: int, model_id: int) -> None:
    """Rank 0: tell the followers to run this forward (rayspec.model.kv_cache.ForwardBatch `batch`) of their
    model `model_id` over their KV cache `cache_id`."""
    B, Q = input_ids.shape
    n_real = -1 if batch.real_rows is None else batch.real_rows.shape[0]
    ints = [B, Q, batch.kv_len, int(batch.mask is not None), int(batch.cache_positions is not None), n_real,
            int(batch.packed_output), cache_id, model_id, batch.sliding_start,
            -1 if batch.sliding_mask is None else batch.sliding_mask.shape[-1],
            *(batch.read_range or (-1, -1))]
    tensors = [input_ids, batch.write_index, batch.read_index, batch.positions]
    tensors += [m for m in (batch.mask, batch.cache_positions, batch.real_rows, batch.sliding_mask) if m is not None]
    tp.send(OP_FORWARD, ints, tensors)
