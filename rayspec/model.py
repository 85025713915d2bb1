"""One Llama-family decoder over an explicit KV cache, configured per family (NATIVE_MODEL_TYPES:
Llama 2/3/3.1/3.3 and SmolLM, Mistral, Qwen2/2.5, Qwen3): attention biases, q/k norms, sliding windows.

Module names mirror Hugging Face's `LlamaForCausalLM`, so HF safetensors load as they are.
The cache is written at explicit positions (as in gpt-fast): a rejected draft needs no
rollback, the next step simply overwrites those positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rayspec import cpu_kernels
from rayspec.parallel import (NO_TP, OP_LOGITS, OP_MOVE_ROWS, OP_NEW_CACHE, TPGroup,
                              VocabParallelEmbedding, column_parallel, row_parallel, send_forward)

logger = logging.getLogger(__name__)


class UnsupportedArchitectureError(ValueError):
    """A checkpoint this model implementation does not compute exactly (model_type not in
    NATIVE_MODEL_TYPES, or a feature of it that is not implemented here)."""


# rope types whose frequencies transformers recomputes from the sequence length during a forward:
# one static inv_freq (what CausalLM.rope uses) would differ from them past the original context
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _llama_family(config) -> dict:
    """Llama (2, 3, 3.1, 3.3, SmolLM): `attention_bias` on q/k/v and o_proj alike, `mlp_bias`."""
    bias = bool(getattr(config, "attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def _mistral_family(config) -> dict:
    """Mistral: no biases; with `sliding_window` set, every layer attends within it."""
    window = getattr(config, "sliding_window", None)
    return dict(sliding_window=window, sliding_layers=tuple(range(config.num_hidden_layers)) if window else ())


def _layer_type_windows(config) -> dict:
    """Qwen2/Qwen3: the layers whose `layer_types` entry is "sliding_attention" (the config
    derives them from use_sliding_window and max_window_layers when not given) attend within
    `sliding_window`, which the config sets to None unless use_sliding_window."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ()
    sliding = tuple(i for i, t in enumerate(types[: config.num_hidden_layers]) if t == "sliding_attention")
    return dict(sliding_window=window, sliding_layers=sliding if window else ())


def _qwen2_family(config) -> dict:
    """Qwen2 / Qwen2.5: biases on q/k/v always (the config has no switch), none on o_proj."""
    return dict(attention_bias=True, o_proj_bias=False, **_layer_type_windows(config))


def _qwen3_family(config) -> dict:
    """Qwen3: per-head RMSNorm on q and k before rope; `attention_bias` on q/k/v and o_proj alike."""
    bias = bool(getattr(config, "attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, **_layer_type_windows(config))


# config.model_type -> the ModelArgs fields particular to that family (the shapes are read alike)
NATIVE_MODEL_TYPES = {
    "llama": _llama_family,
    "mistral": _mistral_family,
    "qwen2": _qwen2_family,
    "qwen3": _qwen3_family,
}


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q_proj, k_proj, v_proj
    mlp_bias: bool = False
    max_position_embeddings: int = 8192
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3)
    # layers in sliding_layers see, at position p, only the keys at positions p - sliding_window + 1 .. p
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers without a sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None where it attends to every position."""
        return self.sliding_window if layer in self.sliding_layers else None

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        model_type = getattr(config, "model_type", None)
        family = NATIVE_MODEL_TYPES.get(model_type)
        if family is None:
            raise UnsupportedArchitectureError(
                f"model_type {model_type!r} has no native implementation (native: {', '.join(NATIVE_MODEL_TYPES)})")
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedArchitectureError(f"rope type {rope_type!r} (frequencies that change with the "
                                               "sequence length) has no native implementation")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":  # MLP computes silu(gate) * up
            raise UnsupportedArchitectureError(f"hidden_act {act!r} has no native implementation (silu only)")
        num_heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            **family(config),
        )


class KVCache:
    """Per-layer key/value storage in fixed-size blocks (the paged cache; rayspec.block_manager says
    which blocks a sequence holds).

    k[i], v[i]: layer i's pool, [num_blocks * block_size, num_kv_heads, head_dim] each, a tensor of its
    own: block b is rows b * block_size .. (b + 1) * block_size - 1; a forward reads and writes rows by
    index (ForwardBatch.write_index / read_index). With tensor parallelism each rank holds its own KV
    heads (num_kv_heads / size); rank 0's cache (`tp` set) tells the other ranks to do each of its copies.

    Why a tensor per layer, not one [layers, rows, ...] tensor: under torch.compile a write into a
    view of a graph input (`pool[i][rows] = k`) is functionalized into a copy of the layer's slice
    scattered back into the whole pool, every step (a 2-layer step at 8B widths grew 6x from a 16 MB
    to a 512 MB pool: benchmarks/compiled_pool.py); a write into an input of its own stays in place
    (tests/test_compiled_kv.py inspects the generated code).
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype, device, tp: TPGroup = NO_TP):
        shape = (num_blocks * block_size, args.num_kv_heads // tp.size, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tp = tp
        self.cache_id = 0  # with tp: which of the followers' caches mirrors this one (CausalLM.new_cache)

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * args.num_layers * args.num_kv_heads * args.head_dim * itemsize

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's K and V pools."""
        return [*self.k, *self.v]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, index: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the given pool rows ([n] long), per layer: K of every layer, then V."""
        return [t[index] for t in self.tensors()]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache rows src -> dst ([n] long each, rows of the whole pool), every layer (an
        accepted tree path's rows: a few per sequence)."""
        if self.tp.is_driver:
            self.tp.send(OP_MOVE_ROWS, [src.shape[0], self.cache_id], [src, dst])
        for cache in self.tensors():
            cache.index_copy_(0, dst, cache.index_select(0, src))


@dataclass
class ForwardBatch:
    """Where a forward reads and writes the cache.

    write_index: [B, Q] long, the cache row (of the whole block pool, KVCache) each query token's
               key/value is written to (padding tokens: a scratch block's rows)
    read_index: [B, kv_len] long, the cache row holding each row's key at positions 0..kv_len-1
               (its block table spelled out; positions past a row's blocks: scratch rows, masked)
    positions: [B, Q] long, absolute position of each query token (padding continues past the end)
    kv_len:    keys 0..kv_len-1 are attended (max over rows of start + Q)
    mask:      [B, 1, Q, kv_len] additive float or None (None: one query per row that sees everything)
    cache_positions: [B, Q] long, the position in its sequence each token's key/value is written at;
               None: `positions` (tree queries differ: siblings share a rope position but need their
               own cache rows)
    real_rows: [N] long, the flat indices (row * Q + column) of the real tokens when rows are
               padded; None: every one of the B x Q tokens is real. Projections and MLPs run on
               the N real tokens only (a padded row costs as much as a real one on CPU); only
               attention sees the padded [B, Q] layout.
    packed_output: return [N, ...] (real tokens, row after row) instead of [B, Q, ...]
    sliding_start: keys before it lie outside every query's sliding window (ModelArgs.sliding_window),
               so sliding-window layers attend to keys sliding_start..kv_len-1 only
    sliding_mask: [B, 1, Q, kv_len - sliding_start] additive float, the mask of sliding-window layers
               over those keys; None where `mask` is None (one query per row, at kv_len - 1, whose
               window is exactly those keys) or where the model has no sliding-window layers
    read_range: (lo, hi) when B is 1 and read_index is lo..hi-1 (its blocks consecutive in the pool):
               the keys are read as a view, not gathered
    write_rows: [N] long, write_index of the real tokens (row after row); None: computed from
               write_index and real_rows when asked for (the runner gives it, built on the host)
    paged:     rayspec.paged_attention.PagedLayout: attention reads the pool in place through it
               (read_index and mask unused); None: keys gathered through read_index, masked by mask
    """

    write_index: torch.Tensor
    read_index: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None
    cache_positions: torch.Tensor | None = None
    real_rows: torch.Tensor | None = None
    packed_output: bool = False
    sliding_start: int = 0
    sliding_mask: torch.Tensor | None = None
    read_range: tuple[int, int] | None = None
    write_rows: torch.Tensor | None = None
    paged: "PagedLayout | None" = None

    def token_write_rows(self) -> torch.Tensor:
        """[N] long: the cache row of each real token (see write_rows)."""
        if self.write_rows is not None:
            return self.write_rows
        flat = self.write_index.reshape(-1)
        return flat if self.real_rows is None else flat.index_select(0, self.real_rows)

    def write_tokens_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        rows: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim], the real tokens' keys/values, into one layer's cache
        [rows, kv_heads, head_dim] at `rows` ([N], token_write_rows): one in-place index_copy_ each."""
        cache_k.index_copy_(0, rows, k.to(cache_k.dtype))
        cache_v.index_copy_(0, rows, v.to(cache_v.dtype))

    def write_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, kv_heads, Q, head_dim] into one layer's cache [rows, kv_heads, head_dim]: one
        index_put each."""
        cache_k[self.write_index] = k.transpose(1, 2).to(cache_k.dtype)
        cache_v[self.write_index] = v.transpose(1, 2).to(cache_v.dtype)

    def read_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values through the block tables: [B, kv_heads, kv_len, head_dim] each."""
        if self.read_range is not None:
            lo, hi = self.read_range
            return cache_k[lo:hi][None].transpose(1, 2), cache_v[lo:hi][None].transpose(1, 2)
        # index_select, not cache_k[read_index]: 6x faster on CPU (31 vs 182 us for 1,536 rows of 3 x 64
        # floats, AMD EPYC, 2 threads)
        B, kv_len = self.read_index.shape
        flat = self.read_index.reshape(-1)
        return tuple(c.index_select(0, flat).view(B, kv_len, *c.shape[1:]).transpose(1, 2) for c in (cache_k, cache_v))

    @property
    def shape(self) -> tuple[int, int]:
        return self.positions.shape  # (B, Q)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> [N, ...]: the real tokens."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.real_rows is None else flat.index_select(0, self.real_rows)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [B * Q, D], padding rows zero."""
        if self.real_rows is None:
            return x
        B, Q = self.shape
        return x.new_zeros(B * Q, x.shape[-1]).index_copy_(0, self.real_rows, x)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> what the caller asked for: [N, D] or [B, Q, D]."""
        return x if self.packed_output else self.unpack(x).reshape(*self.shape, x.shape[-1])


def _onednn_linear_available() -> bool:
    return cpu_kernels.onednn_available()


def cpu_bf16_fast() -> bool:
    """True when this CPU runs oneDNN bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    return _onednn_linear_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# oneDNN ran 1 or 2 rows against a prepacked weight slower than 4 on one AMD VM (30 MLPs + LM
# head, 1 thread, 36-45 ms for 1-2 rows, 28-37 ms for 4; docs/benchmarks-history.md, "Small matmuls"),
# so fewer rows may be padded up to this many. Whether to (and whether to use oneDNN at all) is
# measured on the CPU at hand when a model loads (rayspec.cpu_kernels); this is the default for
# layers built outside a model's pack_for_cpu.
ONEDNN_MIN_ROWS = 4


def onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  min_rows: int = ONEDNN_MIN_ROWS) -> torch.Tensor:
    """rows: [N, in] -> [N, out] with a prepacked oneDNN weight (fewer than min_rows rows padded)."""
    n = rows.shape[0]
    if n < min_rows:
        rows = torch.cat((rows, rows.new_zeros(min_rows - n, rows.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")[:n]
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _packable(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_fast())


class Linear(nn.Linear):
    """nn.Linear with fast CPU inference paths.

    Why: on this kind of CPU, MKL's x @ W^T with few rows (decode, verification of k+1 tokens)
    runs far below memory bandwidth. Measured on 2 cores, 60 weights of 1536x576:
    F.linear 14-32 ms for 1-8 rows, W @ x^T 7-25 ms, oneDNN with a prepacked weight 7-9 ms
    for any row count up to 16 (and 2x faster than F.linear for a 300-row prefill).
    So `pack_for_cpu()` keeps a oneDNN-packed copy of the weight for inference; without
    oneDNN, few-row inputs fall back to (W @ x^T)^T (a single row doubled).
    """

    FEW_ROWS = 8
    min_rows = ONEDNN_MIN_ROWS  # the default's padding (no measured choice)
    # the kernel per row count, measured on this CPU (set by CausalLM.pack_for_cpu); None: oneDNN when
    # packed, else W @ x^T up to FEW_ROWS rows, else F.linear
    kernels: "cpu_kernels.CpuKernels | None" = None
    _packed: torch.Tensor | None = None
    _packed_version: int = -1
    int8 = None  # a rayspec.quantize.Int8Weight (weight-only int8): replaces the float weight

    def pack_for_cpu(self) -> None:
        w = self.weight
        if self.int8 is not None:
            return
        if w.device.type == "cpu" and _onednn_linear_available() and _packable(w.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
            self._packed_version = w._version

    def path_for(self, rows: int) -> str:
        if self.kernels is not None:
            return self.kernels.path_for(rows)
        if self._packed is not None:
            return "onednn_pad4" if self.min_rows >= 4 else "onednn"
        return "wxt" if rows <= self.FEW_ROWS else "flinear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(x)
        if x.device.type != "cpu" or torch.compiler.is_compiling():  # (compiled: inductor picks the kernel)
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        n = rows.shape[0]
        path = self.path_for(n)
        if (path in cpu_kernels.ONEDNN and self._packed is not None and x.dtype == self.weight.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and self.weight._version == self._packed_version):  # stale after in-place updates
            out = onednn_linear(rows, self._packed, self.bias, cpu_kernels.ONEDNN[path])
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if path != "wxt" or n > cpu_kernels.ROWS[-1]:
            return F.linear(x, self.weight, self.bias)
        if n == 1:
            rows = rows.expand(2, -1).contiguous()
        out = (self.weight @ rows.t()).t()[:n]  # [N, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class FusedProjection:
    """Several Linear layers that read the same input, run as one oneDNN matmul at inference.

    Why: each oneDNN call has a fixed cost of tens of microseconds on CPU; q/k/v and gate/up
    fused save about 40 us per decoder layer for 1 to 9 rows (measured on 2 cores). Built by
    `pack_for_cpu`; the parts keep their own weights (checkpoints load and train unchanged), and
    the fused copy is skipped when a part's weight has changed since (`None` from `__call__`).
    """

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self.versions = [p.weight._version for p in parts]
        weight = torch.cat([p.weight.detach() for p in parts])  # [sum(out), in]
        self.bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        self.lead = parts[0]  # whose kernel choice (path_for) this follows
        for p in parts:  # the fused copy replaces the parts' own packed copies
            p._packed = None

    @classmethod
    def build(cls, parts: list[Linear]) -> "FusedProjection | None":
        w = parts[0].weight
        usable = (w.device.type == "cpu" and _onednn_linear_available() and _packable(w.dtype)
                  and all(p.weight.dtype == w.dtype for p in parts) and len({p.bias is None for p in parts}) == 1)
        return cls(parts) if usable else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        if (x.device.type != "cpu" or torch.compiler.is_compiling() or x.dtype != self.parts[0].weight.dtype
                or torch.is_grad_enabled()
                or any(p.weight._version != v for p, v in zip(self.parts, self.versions))):
            return None
        rows = x.reshape(-1, x.shape[-1])
        path = self.lead.path_for(rows.shape[0]) if self.lead.kernels is not None else (
            "onednn_pad4" if self.lead.min_rows >= 4 else "onednn")
        if path not in cpu_kernels.ONEDNN:  # this row count runs faster on another kernel: the parts' own
            return None
        out = onednn_linear(rows, self.packed, self.bias, cpu_kernels.ONEDNN[path])
        return list(out.reshape(*x.shape[:-1], out.shape[-1]).split(self.sizes, dim=-1))


def fuse_weights(parts: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """Off the CPU: the parts' weights (and biases) become views of one tensor, so one matmul computes
    them all (q/k/v, gate/up: one kernel launch instead of three or two) with no extra memory; the
    parts stay Parameters of their own (checkpoints load, TP shards, state_dict unchanged).
    Returns (weight, bias, sizes), or None where the parts cannot be fused."""
    w = parts[0].weight
    if (any(p.weight.dtype != w.dtype or p.weight.device != w.device for p in parts)
            or len({p.bias is None for p in parts}) != 1 or w.device.type == "meta"):
        return None
    sizes = [p.weight.shape[0] for p in parts]
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    for i, (p, view) in enumerate(zip(parts, weight.split(sizes))):
        tied = p.weight
        p.weight = nn.Parameter(view, requires_grad=tied.requires_grad)
        if bias is not None:
            p.bias = nn.Parameter(bias.split(sizes)[i], requires_grad=p.bias.requires_grad)
    return weight, bias, sizes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [N, heads, head_dim] with cos / sin_signed [N, 1, head_dim] (CausalLM.rotary):
    x * cos + rotate_half(x) * sin, where rotate_half(x) * sin = roll(x, head_dim / 2) * sin_signed
    (sin_signed: sin with its first half negated, exact). Three kernels (q and k of a fused q/k/v
    projection go through at once), not the five of mul / neg / cat / mul / add per tensor."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, input_size: int | None = None, layer: int | None = None,
                 tp: TPGroup = NO_TP):
        """input_size: width of the attention input when it is not hidden_size (EAGLE-3: 2x);
        layer: the decoder layer's index (whether it is a sliding-window layer).
        With tp, this rank's heads only (q/k/v column-parallel, o_proj row-parallel)."""
        super().__init__()
        tp.shard(args.num_heads, "num_attention_heads")  # raise early, naming what does not divide
        tp.shard(args.num_kv_heads, "num_key_value_heads")
        self.tp = tp
        self.num_heads, self.num_kv_heads = args.num_heads // tp.size, args.num_kv_heads // tp.size
        self.head_dim = hd = args.head_dim
        h, bias = args.hidden_size, args.attention_bias
        d_in = input_size or h
        self.q_proj = column_parallel(Linear(d_in, self.num_heads * hd, bias=bias), tp, args.num_heads * hd, "q_proj")
        self.k_proj = column_parallel(Linear(d_in, self.num_kv_heads * hd, bias=bias), tp, args.num_kv_heads * hd,
                                      "k_proj")
        self.v_proj = column_parallel(Linear(d_in, self.num_kv_heads * hd, bias=bias), tp, args.num_kv_heads * hd,
                                      "v_proj")
        # its bias (Qwen3, Llama with attention_bias) is added once: on rank 0, after the ranks' sum
        self.o_proj = row_parallel(Linear(self.num_heads * hd, h, bias=args.o_proj_bias), tp, args.num_heads * hd,
                                   "o_proj")
        # Qwen3: RMSNorm over each head's head_dim, one weight shared by the heads (whole on every rank)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.sliding_window = None if layer is None else args.layer_window(layer)
        self.qkv: FusedProjection | None = None  # set by pack_for_cpu
        self.qkv_fused = None  # (weight, bias, sizes) off the CPU (fuse_weights)

    def fuse_for_cpu(self) -> None:
        self.qkv = FusedProjection.build([self.q_proj, self.k_proj, self.v_proj])

    def fuse_for_device(self) -> None:
        self.qkv_fused = fuse_weights([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, cos, sin, cache_k, cache_v, batch: ForwardBatch) -> torch.Tensor:
        # x: [N, H] real tokens (batch.pack); cos / sin: [N, 1, head_dim] (CausalLM.rotary: sin signed);
        # cache_k/v: [rows, kv_heads, head_dim] (one layer's block pool) -> [N, H]
        B, Q = batch.shape
        N, hd, nq, nkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        fused = self.qkv(x) if self.qkv is not None else None
        if fused is None and self.qkv_fused is not None and x.device == self.qkv_fused[0].device:
            weight, bias, _ = self.qkv_fused
            qkv = F.linear(x, weight, bias)  # [N, (heads + 2 kv_heads) * head_dim]
            q, k, v = qkv.view(N, nq + 2 * nkv, hd).split((nq, nkv, nkv), dim=1)
            if self.q_norm is None:  # q and k rotated at once: one slice of the fused output
                qk = apply_rotary(qkv[:, : (nq + nkv) * hd].view(N, nq + nkv, hd), cos, sin)
                q, k = qk.split((nq, nkv), dim=1)
            else:
                q, k = self._rotate(q, k, cos, sin)
        else:
            q, k, v = fused or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
            q, k, v = q.view(N, nq, hd), k.view(N, nkv, hd), v.view(N, nkv, hd)
            q, k = self._rotate(q, k, cos, sin)
        # this step's keys/values, then every key through the block tables
        batch.write_tokens_kv(cache_k, cache_v, k, v, batch.token_write_rows())
        q = batch.unpack(q.reshape(N, nq * hd)).view(B, Q, nq, hd).transpose(1, 2)  # padding rows zero
        if batch.paged is not None and self.sliding_window is None:  # the pool read in place
            out = batch.paged.attend(q, cache_k, cache_v)
        else:  # every key gathered through the block tables
            keys, values = batch.read_kv(cache_k, cache_v)
            mask = batch.mask
            if self.sliding_window is not None:  # only the keys inside some query's window, and its own mask
                if batch.sliding_mask is None and batch.mask is not None:
                    raise ValueError("a sliding-window layer needs ForwardBatch.sliding_mask (ModelRunner builds it)")
                keys, values = keys[:, :, batch.sliding_start:], values[:, :, batch.sliding_start:]
                mask = batch.sliding_mask
            out = attention(q, keys, values, mask)  # [B, heads, Q, head_dim]
        out = self.o_proj(batch.pack(out.transpose(1, 2)).reshape(-1, nq * hd))
        return self.tp.all_reduce(out)  # [N, H]: the ranks' partial sums

    def _rotate(self, q, k, cos, sin):
        """q [N, heads, D], k [N, kv_heads, D] -> rotated (Qwen3: each head RMS-normed first)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


_MATH_FALLBACK: dict[tuple, bool] = {}  # (dtype, head_dim, device index) -> SDPA's choice was its math path


def repeats_kv_heads(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether attention repeats the KV heads rather than pass grouped-query heads to SDPA.

    On CUDA, depending on the torch version and GPU, no fused SDPA kernel may take an arbitrary
    mask and grouped-query heads together (torch 2.5's memory-efficient kernel took no
    enable_gqa; on an H100 with torch 2.11, cuDNN takes both). SDPA then falls back to its math
    path and materializes float32 scores [B, heads, Q, kv_len] (2 GiB for a 2,048-token chunk over
    8k keys at 32 heads). So SDPA's own choice is asked once per dtype and head size, and only
    where it would be the math path, and the query has more than head_dim rows (a prefill chunk),
    are the KV heads repeated ([B, heads, kv_len, head_dim], twice: less than the scores there).
    Few query rows (verification) keep the math path, whose scores are then the smaller tensor.
    On CPU the flash kernel takes a mask and grouped heads together."""
    if (q.device.type != "cuda" or mask is None or q.shape[1] == keys.shape[1] or q.shape[2] <= q.shape[3]):
        return False
    key = (q.dtype, q.shape[3], q.device.index)
    if key not in _MATH_FALLBACK:
        from torch.nn.attention import SDPBackend
        try:
            choice = torch._fused_sdp_choice(q, keys, keys, mask, 0.0, False, enable_gqa=True)
        except (AttributeError, RuntimeError, TypeError):  # a torch without it: assume the fallback
            choice = SDPBackend.MATH.value
        _MATH_FALLBACK[key] = choice == SDPBackend.MATH.value
        if _MATH_FALLBACK[key]:
            logger.info("SDPA takes no masked grouped-query heads here: prefill chunks repeat the KV heads")
    return _MATH_FALLBACK[key]


def attention(q, keys, values, mask, repeat_kv: bool | None = None) -> torch.Tensor:
    """SDPA over q [B, heads, Q, D] and keys/values [B, kv_heads, kv_len, D] (see repeats_kv_heads).

    On CPU, bfloat16 / float16 attention runs in float32: the CPU flash kernel in reduced precision
    rounds the attention probabilities to that dtype in blocks whose shape follows the number of
    query rows and keys, so one row's output changes with what is batched beside it. A verification
    forward (the pending token and k drafts) then computes the pending token's row differently from
    target-only decoding (one row), and greedy speculation drifts from target-only output (6-7 of
    10 prompts equal on an AMD EPYC; benchmarks/bf16_equality.py). In float32 a row's output does not
    depend on its batch there (10 of 10), and the upcast copy costs the keys and values of one layer.
    (On an H100 with torch 2.11, bfloat16 attention needs no such care: 10 of 10 equal as it is,
    benchmarks/results/gpu_checks_h100.json.)"""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return attention(q.float(), keys.float(), values.float(), None if mask is None else mask.float(),
                         repeat_kv).to(q.dtype)
    gqa = q.shape[1] != keys.shape[1]
    if gqa and (repeats_kv_heads(q, keys, mask) if repeat_kv is None else repeat_kv):
        repeat = q.shape[1] // keys.shape[1]
        keys, values, gqa = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1), False
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPGroup = NO_TP):
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        tp.shard(i, "intermediate_size")
        local = i // tp.size
        self.tp = tp
        self.gate_proj = column_parallel(Linear(h, local, bias=bias), tp, i, "gate_proj")
        self.up_proj = column_parallel(Linear(h, local, bias=bias), tp, i, "up_proj")
        self.down_proj = row_parallel(Linear(local, h, bias=bias), tp, i, "down_proj")
        self.gate_up: FusedProjection | None = None  # set by pack_for_cpu
        self.gate_up_fused = None  # (weight, bias, sizes) off the CPU (fuse_weights)

    def fuse_for_cpu(self) -> None:
        self.gate_up = FusedProjection.build([self.gate_proj, self.up_proj])

    def fuse_for_device(self) -> None:
        self.gate_up_fused = fuse_weights([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up(x) if self.gate_up is not None else None
        if fused is None and self.gate_up_fused is not None and x.device == self.gate_up_fused[0].device:
            weight, bias, sizes = self.gate_up_fused
            fused = F.linear(x, weight, bias).split(sizes, dim=-1)
        gate, up = fused or (self.gate_proj(x), self.up_proj(x))
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int | None = None, tp: TPGroup = NO_TP):
        super().__init__()
        self.self_attn = Attention(args, layer=layer, tp=tp)
        self.mlp = MLP(args, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache_k, cache_v, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


def _probe_mlp(src: MLP, variant: str) -> MLP:
    """A copy of `src` sharing its weights that runs every row count on one of
    rayspec.cpu_kernels.VARIANTS."""
    probe = MLP.__new__(MLP)
    nn.Module.__init__(probe)
    probe.tp = NO_TP  # times this rank's share alone
    packed = variant in cpu_kernels.ONEDNN
    for name in ("gate_proj", "up_proj", "down_proj"):
        part = getattr(src, name)
        lin = Linear(part.in_features, part.out_features, bias=part.bias is not None, device="meta")
        lin.weight, lin.bias = part.weight, part.bias
        lin.kernels = cpu_kernels.CpuKernels.single(variant, "probe")
        if packed:
            lin.pack_for_cpu()
        setattr(probe, name, lin)
    probe.gate_up = None
    probe.gate_up_fused = None
    if packed:
        probe.fuse_for_cpu()
    return probe


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPGroup = NO_TP):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(args, i, tp) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Float32Rotary(nn.Module):
    """A module with an `inv_freq` rotary buffer that stays float32 through any cast (`.to(bfloat16)`,
    `.half()`): in bfloat16 the frequencies would be rounded to 8 bits of mantissa, and the angle error
    grows with the position (transformers keeps them float32 as well). Moves between devices still apply."""

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:  # fn cast it: take the float32 original to its new device
            self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        return self


class CausalLM(Float32Rotary):
    """Decoder + LM head. `forward` returns final-norm hidden states; `logits` projects them.

    With tp (rayspec.parallel), this is one rank's shard: rank 0's forward / logits / cache first
    tell the other ranks (running `serve_commands`) to do the same on theirs."""

    def __init__(self, args: ModelArgs, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 tp: TPGroup = NO_TP):
        super().__init__()
        self.args = args
        self.tp = tp
        # which of the followers' models this shard is (rayspec.tp_ranks.serve_commands): in load order
        self.model_id = 0
        if tp.size > 1:
            self.model_id, tp.num_models = tp.num_models, tp.num_models + 1
        self.model = Backbone(args, tp)
        embed = self.model.embed_tokens
        self.lm_head = Linear(args.hidden_size, embed.num_embeddings, bias=False)  # this rank's vocabulary rows
        if embed.split:
            self.lm_head.tp_shards = {"weight": (0, embed.vocab_start, embed.vocab_stop)}
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, Q] -> cos, sin: [B, 1, Q, head_dim]
        freqs = positions.float()[..., None] * self.inv_freq  # [B, Q, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin

    def rotary(self, batch: ForwardBatch, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed: [N, 1, head_dim] for the batch's real tokens (apply_rotary), once per forward."""
        positions = batch.pack(batch.positions)  # [N]
        freqs = positions.float()[:, None] * self.inv_freq  # [N, head_dim/2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]

    def forward(self, input_ids: torch.Tensor, cache: KVCache, batch: ForwardBatch,
                aux_layers: tuple[int, ...] | None = None):
        """input_ids: [B, Q] -> hidden: [B, Q, hidden_size] after the final norm ([N, hidden_size]
        with batch.packed_output).

        With aux_layers, also returns the inputs of those layers concatenated,
        [B, Q, len(aux_layers) * hidden_size] (the features an EAGLE-3 head drafts from).
        """
        if self.tp.is_driver:
            send_forward(self.tp, input_ids, batch, cache.cache_id, self.model_id)
        x = self.model.embed_tokens(batch.pack(input_ids))  # [N, H]
        cos, sin = self.rotary(batch, x.dtype)
        aux = []
        for i, layer in enumerate(self.model.layers):
            if aux_layers is not None and i in aux_layers:
                aux.append(x)
            x = layer(x, cos, sin, cache.k[i], cache.v[i], batch)
        hidden = batch.output(self.model.norm(x))
        if aux_layers is None:
            return hidden
        return hidden, batch.output(torch.cat(aux, dim=-1))

    def pack_for_cpu(self) -> "CausalLM":
        """On CPU, pick the projections' matmul kernel per row count by measuring this CPU
        (rayspec.cpu_kernels) and, when any is oneDNN, prepack every projection, q/k/v and gate/up
        fused (used at the row counts that chose oneDNN). No-op elsewhere.
        The choice is kept in `self.cpu_kernels` (None off the CPU)."""
        self.cpu_kernels = None
        if getattr(self, "quantization", None):  # int8 linears run their own kernels (rayspec.quantize)
            return self
        param = next(self.parameters())
        mlp = next((m for m in self.modules() if isinstance(m, MLP)), None)
        if param.device.type != "cpu":  # elsewhere q/k/v and gate/up run as one matmul each too
            for module in self.modules():
                if isinstance(module, (Attention, MLP)):
                    module.fuse_for_device()
            return self
        if mlp is None:
            return self
        self.cpu_kernels = cpu_kernels.choose(lambda variant: _probe_mlp(mlp, variant), mlp.gate_proj.in_features,
                                              mlp.gate_proj.weight.dtype)
        logger.info("CPU matmul kernels: %s", self.cpu_kernels.describe())
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernels = self.cpu_kernels
        if not self.cpu_kernels.onednn:
            return self
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.fuse_for_cpu()
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def new_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """A KV cache for this model (with tp: this rank's heads; rank 0 has the others make theirs)."""
        cache = KVCache(self.args, num_blocks, block_size, self.compute_dtype, self.model.norm.weight.device, self.tp)
        if self.tp.size > 1:
            cache.cache_id, self.tp.num_caches = self.tp.num_caches, self.tp.num_caches + 1
            if self.tp.is_driver:
                self.tp.send(OP_NEW_CACHE, [num_blocks, block_size, self.model_id])
        return cache

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden_size] -> [..., vocab] in float32 (sampling wants full precision)
        if not self.model.embed_tokens.split:
            return self.lm_head(hidden).float()
        if self.tp.is_driver:  # the other ranks project the same rows onto their vocabulary slices
            self.tp.send(OP_LOGITS, [hidden[..., 0].numel(), hidden.shape[-1], self.model_id],
                         [hidden.reshape(-1, hidden.shape[-1])])
        return self.tp.all_gather_last(self.lm_head(hidden).float())
