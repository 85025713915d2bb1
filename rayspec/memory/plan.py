"""Memory of an engine process from model shapes alone (no weights loaded).

`kv_cache_plan` is how `LLMEngine` sizes its KV cache; the rest counts what the process holds
next to it (weights: rayspec.memory.weight_memory; a proposer's weights and cache; activations:
rayspec.memory.activation_memory), for `rayspec plan`. Every
figure is in bytes. GB = 10**9 bytes, GiB = 2**30; `kv_cache_memory_gb` is read as GiB, as the
engine has always read it.

A process, in the order it fills its device (GPU figures; a CPU process fills host memory the
same way and, where its load picks the oneDNN path, adds prepacked copies of the projections):
  1. the target, allocated at its dtype and streamed in from the checkpoint (`loader.empty_model`,
     `rayspec.model.weights.checkpoint.load_checkpoint`): the device holds the weights alone, the host one
     READ_CHUNK_BYTES staging buffer besides;
  2. the target's KV cache: a pool of blocks (`kv_cache_plan`), at most what max_num_seqs sequences
     of max_model_len + max_k + 1 positions fill;
  3. the proposer: a draft LM (loaded like the target) or an EAGLE head (its own weights; it
     shares the target's embedding unless its checkpoint has one) with a KV cache of its own;
  4. per step, the activations of one forward over at most a chunk of tokens.

With tensor parallelism (tp_size N > 1, rayspec.model.parallel) every rank is such a process on a GPU of
its own: it holds 1/N of each projection (q/k/v/gate/up by output, o/down by input; norms and
row-parallel biases whole), 1/N of the KV heads (the KV cache is 1/N of the one `kv_cache_plan`
sizes: `kv_cache_memory_gb` is the budget over all ranks), the embedding and LM head split by
vocabulary when it divides by N (else whole on every rank). Rank 0 alone runs the proposer and
samples. Models rayspec.model.native does not describe (mixture of experts, attention sinks: the generic
path, rayspec.model.generic) are counted from transformers' own model of their config, built on
the meta device (`generic_weights`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.eagle.head import EagleConfig
from rayspec.memory.activation_memory import ActivationPlan, forward_activations, forward_tokens
from rayspec.memory.weight_memory import (NO_WEIGHTS, ModelShape, Weights, as_shape, eagle_head_weights, int8_weights,
                                          load_bytes, target_io_weights)
from rayspec.model.families import ModelArgs
from rayspec.model.kv_cache import KVCache
from rayspec.kv.kv_space import DEFAULT_BLOCK_SIZE, default_num_blocks, proposer_num_blocks
from rayspec.model.parallel import TPGroup, splits_vocab

GB, GiB = 10**9, 2**30

logger = logging.getLogger(__name__)


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """The dtype the engine runs `EngineConfig.dtype` in on `device` (None: float32 on CPU,
    bfloat16 on CUDA): rayspec.model.loader.parse_dtype, the function the engine calls."""
    from rayspec.model.loader import parse_dtype

    return parse_dtype(name, torch.device(device))


# ---- the KV cache -------------------------------------------------------------------------

@dataclass(frozen=True)
class KVPlan:
    """A paged KV cache: `num_blocks` blocks of `block_size` positions (one scratch block besides,
    rayspec.model.runner), shared by at most `num_slots` running sequences of at most `capacity` positions."""

    num_slots: int
    capacity: int  # positions one sequence may write: max_model_len + the slack drafts write past it
    bytes_per_token: int  # K and V of every layer at one position
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def bytes(self) -> int:
        return (self.num_blocks + 1) * self.bytes_per_block  # + the scratch block

    def sequences_of(self, num_tokens: int) -> int:
        """How many sequences of num_tokens positions each (count the slack drafts write past them in)
        the pool holds at once, at most num_slots."""
        per_seq = -(-num_tokens // self.block_size)
        return min(self.num_slots, self.num_blocks // max(1, per_seq))

    def rank_share(self, tp_size: int) -> "KVPlan":
        """What one of tp_size ranks holds of this cache: the same blocks and positions, 1/tp_size of
        the KV heads (every rank's share is equal: the heads divide evenly, or the model refuses)."""
        return dataclasses.replace(self, bytes_per_token=self.bytes_per_token // tp_size)


def kv_cache_plan(args: ModelArgs, dtype: torch.dtype, max_model_len: int, max_k: int, max_num_seqs: int,
                  kv_cache_memory_gb: float, method: str, block_size: int = DEFAULT_BLOCK_SIZE,
                  draft_fraction: float = 1.0) -> KVPlan:
    """The target's KV cache as LLMEngine sizes it: as many blocks as `kv_cache_memory_gb` (GiB)
    holds (the scratch block included), at most what max_num_seqs sequences of max_model_len +
    max_k + 1 positions (a verification writes the pending token and k drafts past the committed
    ones) can fill. `max_model_len` is the engine's: min(EngineConfig.max_model_len,
    args.max_position_embeddings).

    With method draft_model the budget also pays for the draft's own cache: `draft_fraction` of the
    target's per token (draft_kv_fraction: from the draft's layers, KV heads, head size and dtype;
    1 where its config cannot be read). Counted whole, an 8-of-30-layer
    self-draft halved the target's pool: its cached long documents were evicted before they came
    back, served 0.55-0.89x on the long-documents set."""
    capacity = max_model_len + max_k + 1
    per_token = KVCache.bytes_per_token(args, dtype)
    budget_per_token = int(per_token * (1 + draft_fraction)) if method == "draft_model" else per_token
    per_block = budget_per_token * block_size
    num_blocks = min(default_num_blocks(max_num_seqs, capacity, block_size),
                     int(kv_cache_memory_gb * GiB // per_block) - 1)
    if num_blocks * block_size < max_k + 2:
        raise ValueError(
            f"kv_cache_memory_gb={kv_cache_memory_gb} cannot hold one token and its drafts "
            f"({max_k + 2} positions of {budget_per_token:,} B, in blocks of {block_size}); raise it")
    return KVPlan(max_num_seqs, capacity, per_token, num_blocks, block_size)


def draft_kv_fraction(spec, target_model: str, target_args: ModelArgs, dtype: torch.dtype | None = None,
                      draft_args: ModelArgs | None = None, device: str | torch.device = "cpu") -> float:
    """A draft model's KV bytes per token over the target's (`dtype`: the target's; the draft runs
    in spec.draft_dtype or the same). `draft_args`: the draft's shape (draft_num_layers applied),
    else found as the proposer loads it: the target's own checkpoint (draft_model unset or the
    target's name) cut to draft_num_layers layers, or another checkpoint's config file read
    (`draft_args_from_config`); 1 (counted as large as the target's) where neither tells."""
    if spec.method != "draft_model":
        return 1.0
    if draft_args is None:
        draft_args = draft_args_from_config(spec, target_model, target_args)
        if draft_args is None:
            return 1.0
    target_dtype = dtype if dtype is not None else torch.float32
    draft_dtype = resolve_dtype(spec.draft_dtype, device) if spec.draft_dtype is not None else target_dtype
    return KVCache.bytes_per_token(draft_args, draft_dtype) / KVCache.bytes_per_token(target_args, target_dtype)


def draft_args_from_config(spec, target_model: str, target_args: ModelArgs) -> ModelArgs | None:
    """The shape of the draft model `spec` (a SpeculativeConfig) loads, cut to draft_num_layers:
    the target's own args, or the draft checkpoint's config file (a local folder, a .gguf, a hub id:
    the file the load reads anyway); None where it cannot be read or rayspec.model.native does not run
    the family natively (the generic path keeps a cache of its own shape)."""
    args = target_args
    if spec.draft_model not in (None, target_model):
        from rayspec.model.weights import hub

        try:
            args = ModelArgs.from_hf_config(hub.load_model_config(spec.draft_model))
        except Exception as e:  # noqa: BLE001 - any unreadable config: counted as large, the load reports it
            logger.info("draft %s's KV size unknown (%s): budgeted as the target's", spec.draft_model, e)
            return None
    if spec.draft_num_layers:
        args = dataclasses.replace(args, num_layers=min(spec.draft_num_layers, args.num_layers))
    return args


# ---- proposers ----------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftShape:
    """What a proposer loads, from config files alone: a draft LM or an EAGLE head (None: neither,
    e.g. ngram)."""

    model: ModelArgs | None = None  # draft_model: the draft, num_layers already cut to draft_num_layers
    head: EagleConfig | None = None  # eagle3 / eagle
    head_has_embedding: bool = False  # the head's checkpoint carries its own embedding
    model_generic: object | None = None  # a draft on the generic path: its transformers config (ModelShape)
    model_dense_4bit: int | None = None  # a draft whose projections stay 4-bit (ModelShape.dense_4bit)

    @property
    def args(self) -> ModelArgs | None:
        return self.model if self.model is not None else (self.head.args if self.head is not None else None)

    def weights(self, dtype: torch.dtype) -> Weights:
        if self.model is not None:
            return ModelShape(self.model, self.model_generic, self.model_dense_4bit).weights(dtype)
        if self.head is not None:
            return eagle_head_weights(self.head, dtype, self.head_has_embedding)
        return NO_WEIGHTS


def proposer_slack(spec: SpeculativeConfig, draft: DraftShape) -> int:
    """Positions past max_model_len the proposer's cache holds, as its runner is built:
    DraftModelProposer k + 1, EagleProposer topk x depth + k + 2 (a tree's nodes beside the chain)."""
    k = spec.num_speculative_tokens
    if draft.head is not None:
        return max(1, spec.eagle_topk) * (spec.num_steps or k) + k + 2
    return k + 1


def proposer_cache_plan(spec: SpeculativeConfig, draft: DraftShape, dtype: torch.dtype, max_model_len: int,
                        num_slots: int, target_blocks: int | None = None,
                        block_size: int = DEFAULT_BLOCK_SIZE) -> KVPlan | None:
    """The proposer's own KV cache (a draft LM's layers, an EAGLE head's), None for proposers without:
    the target's pool (target_blocks; None: a proposer deployment's, sized for num_slots whole
    sequences) plus its slack per sequence (rayspec.model.runner.proposer_num_blocks)."""
    args = draft.args
    if args is None:
        return None
    slack = proposer_slack(spec, draft)
    return KVPlan(num_slots, max_model_len + slack, KVCache.bytes_per_token(args, dtype),
                  proposer_num_blocks(target_blocks, num_slots, max_model_len + slack, slack, block_size), block_size)


# ---- one process --------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanItem:
    name: str
    bytes: int
    detail: str = ""


@dataclass
class ProcessPlan:
    """One engine (or proposer) process: what it holds once loaded (`items`), its peak forward
    activations, and its peak while loading. With tensor parallelism, one rank of the engine."""

    role: str  # "engine" or "proposer"
    device: str
    dtype: torch.dtype
    items: list[PlanItem] = field(default_factory=list)
    activations: ActivationPlan | None = None
    load_peak: int = 0
    load_detail: str = ""
    kv: KVPlan | None = None  # the target's cache (engines; with tp: this rank's share)
    draft_kv: KVPlan | None = None  # the proposer's cache
    rank: int = 0
    tp_size: int = 1

    @property
    def resident(self) -> int:
        return sum(item.bytes for item in self.items)

    @property
    def total(self) -> int:
        """Resident memory plus the peak activations of a forward."""
        return self.resident + (self.activations.total if self.activations is not None else 0)

    @property
    def peak(self) -> int:
        return max(self.total, self.load_peak)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fmt_gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _add_proposer(plan: ProcessPlan, spec: SpeculativeConfig, draft: DraftShape, dtype: torch.dtype,
                  max_model_len: int, num_slots: int, target_blocks: int | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[Weights, int]:
    """Add the proposer's weights and cache to `plan`; returns its weights and what loading it
    holds beyond them for a while."""
    weights = draft.weights(dtype)
    if draft.model is not None and spec.draft_quantization == "int8":
        weights = int8_weights(draft.model, weights, dtype)
        plan.items.append(PlanItem("draft model weights", weights.bytes,
                                   f"{weights.num_params:,} params, {draft.model.num_layers} layers, int8 linears "
                                   f"(a scale per output channel), embedding and norms {_dtype_name(dtype)}"))
        transient = load_bytes(draft.weights(dtype), plan.device) - weights.bytes  # loaded in float, then quantized
    elif draft.model is not None:
        path = ", generic path" if draft.model_generic is not None else ""
        plan.items.append(PlanItem("draft model weights", weights.bytes,
                                   f"{weights.num_params:,} params, {draft.model.num_layers} layers, "
                                   f"{_dtype_name(dtype)}{path}{_held_4bit(draft.model_dense_4bit)}"))
        transient = load_bytes(weights, plan.device) - weights.bytes  # streamed like the target
    elif draft.head is not None:
        shared = "its own embedding" if draft.head_has_embedding else "the target's embedding shared"
        plan.items.append(PlanItem(f"{draft.head.kind} head weights", weights.bytes,
                                   f"{weights.num_params:,} params, {_dtype_name(dtype)}, {shared}"))
        # the head is built with an embedding of its own, moved to the device, then given the target's
        a = draft.head.args
        transient = 0 if draft.head_has_embedding else a.vocab_size * a.hidden_size * dtype.itemsize
    else:
        return NO_WEIGHTS, 0
    cache = proposer_cache_plan(spec, draft, dtype, max_model_len, num_slots, target_blocks, block_size)
    plan.draft_kv = cache
    plan.items.append(PlanItem(f"{'draft' if draft.model is not None else draft.head.kind + ' head'} KV cache",
                               cache.bytes, f"{cache.num_blocks:,} blocks (+1 scratch) x {cache.block_size} "
                                            f"positions x {cache.bytes_per_token:,} B"))
    return weights, transient


def _cpu_copies(plan: ProcessPlan, *weights: Weights) -> None:
    if torch.device(plan.device).type == "cpu":
        linear = sum(w.linear_bytes for w in weights)
        plan.items.append(PlanItem("oneDNN prepacked projections", linear,
                                   "CPU: a copy of every Linear weight, where the load picks the oneDNN path "
                                   "(rayspec.cpu.kernels; none with the plain one)"))


def _held_4bit(group: int | None) -> str:
    if group is None:
        return ""
    return f", decoder projections held 4-bit ({'NVFP4' if group == 16 else 'MXFP4'}) + one dequantization scratch"


def engine_plan(config: EngineConfig, target: ModelArgs | ModelShape, device: str, draft: DraftShape = DraftShape(),
                proposer_in_process: bool = True, rank: int = 0) -> ProcessPlan:
    """The memory of an LLMEngine process (a verifier replica) on `device`, from the target's and the
    proposer's shapes. `proposer_in_process`: the proposer runs in it (colocated), else in a
    proposer deployment (see `proposer_plan`). With config.tensor_parallel_size N > 1: the memory of
    rank `rank` (0: the replica's own process, with the proposer and sampling; the others hold the
    same shard and cache share, and compute their share of every forward)."""
    spec = config.speculative
    shape = as_shape(target)
    target = shape.args
    tp_size = config.tensor_parallel_size
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of tensor_parallel_size {tp_size}")
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = min(config.max_model_len, target.max_position_embeddings)
    total_kv = kv_cache_plan(target, dtype, max_model_len, spec.num_speculative_tokens, config.max_num_seqs,
                             config.kv_cache_memory_gb,  # the blocks: every rank has them all
                             spec.method if proposer_in_process else "none",  # a remote draft: its own budget
                             config.block_size,
                             draft_kv_fraction(spec, config.model, target, dtype, draft.model, device))
    kv = total_kv.rank_share(tp_size)
    plan = ProcessPlan("engine", device, dtype, kv=kv, rank=rank, tp_size=tp_size)
    weights = shape.weights(dtype, tp_size)
    of = ""
    if tp_size > 1:
        vocab = "split by vocabulary" if splits_vocab(TPGroup(size=tp_size), target.vocab_size) else \
            "embedding and LM head whole"
        of = f", rank {rank}'s shard of {tp_size} ({vocab})"
    plan.items.append(PlanItem("target weights", weights.bytes,
                               f"{weights.num_params:,} params, {_dtype_name(dtype)}{of}"
                               + (", generic path" if shape.generic is not None else "")
                               + _held_4bit(shape.dense_4bit)))
    share = f" (1/{tp_size} of {fmt_gb(total_kv.bytes)}: its KV heads)" if tp_size > 1 else ""
    plan.items.append(PlanItem("target KV cache", kv.bytes,
                               f"{kv.num_blocks:,} blocks (+1 scratch) x {kv.block_size} positions x "
                               f"{kv.bytes_per_token:,} B{share}; {kv.sequences_of(kv.capacity)} sequences of "
                               f"max_model_len {max_model_len:,} + {kv.capacity - max_model_len} slack at once, "
                               f"more when shorter"))
    in_process = proposer_in_process and rank == 0
    draft_weights, io, transient = NO_WEIGHTS, NO_WEIGHTS, 0
    draft_dtype = resolve_dtype(spec.draft_dtype or dtype, device)
    if in_process and draft.head is not None and tp_size > 1:
        # rank 0 holds a vocabulary slice (or the embedding whole): the head gets a whole copy of its own
        io = target_io_weights(target, dtype)
        plan.items.append(PlanItem("target embedding + LM head", io.bytes,
                                   f"{io.num_params:,} params, {_dtype_name(dtype)}, whole, for the head"))
    if in_process:
        draft_weights, transient = _add_proposer(plan, spec, draft, draft_dtype, max_model_len, kv.num_slots,
                                                 kv.num_blocks, kv.block_size)
    _cpu_copies(plan, weights, io, draft_weights)

    tokens = forward_tokens(config, max_model_len, kv.num_slots)
    # the target hands an EAGLE head its feature layers wherever the head runs (rank 0 captures them);
    # the prompt being prefilled keeps its features until its first draft (its whole length)
    feature_size = draft.head.feature_size if draft.head is not None and rank == 0 else 0
    plan.activations = forward_activations(
        target, dtype, tokens, kv.capacity, kv.num_slots * (spec.num_speculative_tokens + 1),
        feature_size=feature_size, held_feature_rows=max_model_len if feature_size else 0,
        tp_size=tp_size, rank=rank)
    if in_process and draft.args is not None:  # the proposer's forwards come at other times
        own = _proposer_activations(config, draft, draft_dtype, plan.draft_kv, tokens)
        if own.total > plan.activations.total:
            plan.activations = own

    # the target streams in, its KV cache is allocated, then the proposer loads (streamed, or an
    # EAGLE head arriving with a placeholder embedding)
    target_load = load_bytes(weights, device)
    io_load = load_bytes(io, device) - io.bytes if io.num_params else 0
    after_target = weights.bytes + kv.bytes + io.bytes + io_load + draft_weights.bytes + transient
    plan.load_peak = max(target_load, after_target)
    if target_load >= after_target:
        buffer = " (+ the host read buffer)" if target_load > weights.bytes else ""
        plan.load_detail = "the target streamed in" + buffer
    elif draft_weights.num_params:
        plan.load_detail = "the target and its KV cache in place while the proposer loads"
    else:
        plan.load_detail = "the target and its KV cache"
    return plan


def _proposer_activations(config: EngineConfig, draft: DraftShape, dtype: torch.dtype, cache: KVPlan,
                          tokens: int) -> ActivationPlan:
    """A proposer's catch-up forward: chunks as the target's prefill (max_num_batched_tokens)."""
    args = draft.args
    rows = cache.num_slots * max(1, config.speculative.eagle_topk)
    if draft.head is not None:  # the head's LM head is over the draft vocabulary
        args = dataclasses.replace(args, vocab_size=draft.head.draft_vocab_size)
    return forward_activations(args, dtype, tokens, cache.capacity, rows,
                               feature_size=draft.head.feature_size if draft.head is not None else 0)


def proposer_plan(config: EngineConfig, target: ModelArgs | ModelShape, device: str, draft: DraftShape,
                  num_slots: int) -> ProcessPlan:
    """The memory of a proposer deployment replica (deployments.replicas.proposer): the proposer with a cache
    of `num_slots` slots (every verifier replica's sequences may land there) of the configured
    max_model_len; an EAGLE head also loads the target without its layers."""
    spec = config.speculative
    target = as_shape(target).args
    dtype = resolve_dtype(config.dtype, device)
    draft_dtype = resolve_dtype(spec.draft_dtype or dtype, device)
    plan = ProcessPlan("proposer", device, draft_dtype)
    io = NO_WEIGHTS
    if draft.head is not None:
        io = target_io_weights(target, dtype)
        plan.items.append(PlanItem("target embedding + LM head", io.bytes,
                                   f"{io.num_params:,} params, {_dtype_name(dtype)} (no decoder layers)"))
    weights, transient = _add_proposer(plan, spec, draft, draft_dtype, config.max_model_len, num_slots,
                                       block_size=config.block_size)
    _cpu_copies(plan, io, weights)
    if plan.draft_kv is not None:
        tokens = config.max_num_batched_tokens or config.max_model_len * num_slots
        plan.activations = _proposer_activations(config, draft, draft_dtype, plan.draft_kv, tokens)
    if draft.model is not None:
        plan.load_peak, plan.load_detail = load_bytes(weights, device), "the draft streamed in"
    else:
        plan.load_peak = max(load_bytes(io, device), io.bytes + weights.bytes + transient)
        plan.load_detail = "the target's embedding and LM head in place while the head arrives"
    return plan
