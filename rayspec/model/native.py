"""One Llama-family decoder over an explicit KV cache, configured per family (NATIVE_MODEL_TYPES:
Llama 2/3/3.1/3.3 and SmolLM, Mistral, Qwen2/2.5, Qwen3, gpt-oss): attention biases, q/k norms, sliding
windows, attention sinks, and a mixture-of-experts MLP (rayspec.model.moe) where the family has one.

Module names mirror Hugging Face's `LlamaForCausalLM`, so HF safetensors load as they are.
The cache is written at explicit positions (as in gpt-fast): a rejected draft needs no
rollback, the next step simply overwrites those positions. What differs per family is read by
rayspec.model.families (ModelArgs); the cache is rayspec.model.kv_cache's, the projections rayspec.model.linear's.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from rayspec.cpu import kernels as cpu_kernels
from rayspec.model.families import ModelArgs
from rayspec.model.fp4_linear import FP4Linear
from rayspec.model.kv_cache import ForwardBatch, KVCache
from rayspec.model.linear import DEVICE_TILE_ROWS, FusedProjection, Linear, device_linear, fuse_weights
from rayspec.model.moe import MoE
from rayspec.model.parallel import (NO_TP, OP_LOGITS, OP_NEW_CACHE, TPGroup, VocabParallelEmbedding, column_parallel,
                                    row_parallel, send_forward)

logger = logging.getLogger(__name__)


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


def _all_float(parts: list[nn.Module]) -> bool:
    """Whether projections are float Linears (4-bit ones, rayspec.model.fp4_linear, are not fused)."""
    return all(isinstance(p, Linear) for p in parts)


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
        # gpt-oss: a learned logit per head in the softmax whose probability is dropped (this rank's heads)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if args.attention_sinks else None
        if args.attention_sinks and tp.size > 1:
            self.tp_shards = {"sinks": (0, *tp.shard(args.num_heads, "num_attention_heads"))}
        self.qkv: FusedProjection | None = None  # set by pack_for_cpu
        self.qkv_fused = None  # (weight, bias, sizes) off the CPU (fuse_weights)

    def fuse_for_cpu(self) -> None:
        if _all_float(parts := [self.q_proj, self.k_proj, self.v_proj]):
            self.qkv = FusedProjection.build(parts)

    def fuse_for_device(self) -> None:
        if _all_float(parts := [self.q_proj, self.k_proj, self.v_proj]):
            self.qkv_fused = fuse_weights(parts)

    def _project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, d_in] -> q [N, heads, head_dim], k and v [N, kv_heads, head_dim], q and k rotated."""
        N, hd, nq, nkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        fused = self.qkv(x) if self.qkv is not None else None
        if fused is None and self.qkv_fused is not None and x.device == self.qkv_fused[0].device:
            weight, bias, _ = self.qkv_fused
            qkv = device_linear(x, weight, bias, self.q_proj.tile_rows)  # [N, (heads + 2 kv_heads) * head_dim]
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
        return q, k, v

    def write_kv(self, x, cos, sin, cache_k, cache_v, batch: ForwardBatch) -> None:
        """The keys and values of x's tokens into the cache, no attention (a one-layer EAGLE head's
        positions whose outputs nobody reads). The same projections as forward: the same rows."""
        _, k, v = self._project(x, cos, sin)
        batch.write_tokens_kv(cache_k, cache_v, k, v, batch.token_write_rows())

    def forward(self, x, cos, sin, cache_k, cache_v, batch: ForwardBatch) -> torch.Tensor:
        # x: [N, H] real tokens (batch.pack); cos / sin: [N, 1, head_dim] (CausalLM.rotary: sin signed);
        # cache_k/v: [rows, kv_heads, head_dim] (one layer's block pool) -> [N, H]
        B, Q = batch.shape
        N, hd, nq = x.shape[0], self.head_dim, self.num_heads
        q, k, v = self._project(x, cos, sin)
        # this step's keys/values, then every key through the block tables
        batch.write_tokens_kv(cache_k, cache_v, k, v, batch.token_write_rows())
        rows = batch.row_keys if self.sliding_window is None else batch.sliding_row_keys
        if rows is not None:  # batch-invariant: each row over its own keys (rayspec.model.row_attention)
            out = rows.attend(q, *batch.read_kv(cache_k, cache_v), sinks=self.sinks)  # [N, heads, head_dim]
            return self.tp.all_reduce(self.o_proj(out.reshape(N, nq * hd)))
        q = batch.unpack(q.reshape(N, nq * hd)).view(B, Q, nq, hd).transpose(1, 2)  # padding rows zero
        if batch.paged is not None and self.sliding_window is None and self.sinks is None:  # the pool read in place
            out = batch.paged.attend(q, cache_k, cache_v)
        else:  # every key gathered through the block tables
            keys, values = batch.read_kv(cache_k, cache_v)
            mask = batch.mask
            if self.sliding_window is not None:  # only the keys inside some query's window, and its own mask
                if batch.sliding_mask is None and batch.mask is not None:
                    raise ValueError("a sliding-window layer needs ForwardBatch.sliding_mask (ModelRunner builds it)")
                keys, values = keys[:, :, batch.sliding_start:], values[:, :, batch.sliding_start:]
                mask = batch.sliding_mask
            if self.sinks is not None:
                out = sink_attention(q, keys, values, mask, self.sinks)
            else:
                out = attention(q, keys, values, mask, invariant=batch.batch_invariant)  # [B, heads, Q, head_dim]
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


def attention(q, keys, values, mask, repeat_kv: bool | None = None, invariant: bool = False) -> torch.Tensor:
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


def sink_attention(q, keys, values, mask, sinks) -> torch.Tensor:
    """Attention with a sink per head (gpt-oss): one more logit column, sinks[h], in each row's softmax,
    whose probability goes to no value. SDPA takes no such column, so the scores are computed here, in
    float32. q [B, heads, Q, D]; keys / values [B, kv_heads, kv_len, D]; mask [B, 1, Q, kv_len] additive or
    None; sinks [heads] -> [B, heads, Q, D]."""
    B, H, Q, D = q.shape
    kv_heads = keys.shape[1]
    grouped = q.float().reshape(B, kv_heads, H // kv_heads * Q, D)  # the heads of a KV head share its keys
    scores = (grouped @ keys.float().transpose(-1, -2)).view(B, H, Q, -1) * D ** -0.5  # [B, H, Q, kv_len]
    if mask is not None:
        scores = scores + mask.float()
    column = sinks.float().view(1, H, 1, 1).expand(B, H, Q, 1)
    probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    out = probs.reshape(B, kv_heads, H // kv_heads * Q, -1) @ values.float()  # [B, kv_heads, group * Q, D]
    return out.view(B, H, Q, D).to(q.dtype)


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
        if _all_float(parts := [self.gate_proj, self.up_proj]):
            self.gate_up = FusedProjection.build(parts)

    def fuse_for_device(self) -> None:
        if _all_float(parts := [self.gate_proj, self.up_proj]):
            self.gate_up_fused = fuse_weights(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up(x) if self.gate_up is not None else None
        if fused is None and self.gate_up_fused is not None and x.device == self.gate_up_fused[0].device:
            weight, bias, sizes = self.gate_up_fused
            fused = device_linear(x, weight, bias, self.gate_proj.tile_rows).split(sizes, dim=-1)
        gate, up = fused or (self.gate_proj(x), self.up_proj(x))
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int | None = None, tp: TPGroup = NO_TP):
        super().__init__()
        self.self_attn = Attention(args, layer=layer, tp=tp)
        self.mlp = MoE(args, tp) if args.num_experts else MLP(args, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache_k, cache_v, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


def _probe_mlp(src: MLP, variant: "str | cpu_kernels.CpuKernels") -> MLP:
    """A copy of `src` sharing its weights that runs every row count on one of
    rayspec.cpu.kernels.VARIANTS (or on a CpuKernels)."""
    kernels = variant if isinstance(variant, cpu_kernels.CpuKernels) else cpu_kernels.CpuKernels.single(variant, "probe")
    probe = MLP.__new__(MLP)
    nn.Module.__init__(probe)
    probe.tp = NO_TP  # times this rank's share alone
    packed = kernels.onednn
    for name in ("gate_proj", "up_proj", "down_proj"):
        part = getattr(src, name)
        lin = Linear(part.in_features, part.out_features, bias=part.bias is not None, device="meta")
        lin.weight, lin.bias = part.weight, part.bias
        lin.kernels = kernels
        if packed:
            lin.pack_for_cpu()
        setattr(probe, name, lin)
    probe.gate_up = None
    probe.gate_up_fused = None
    if packed:
        probe.fuse_for_cpu()
    return probe


def _float_mlp(model: nn.Module) -> "MLP | None":
    """An MLP of float Linears to measure the CPU kernels on (None: none, e.g. all 4-bit)."""
    return next((m for m in model.modules() if isinstance(m, MLP) and _all_float([m.gate_proj])), None)


def _pack_onednn(model: nn.Module) -> None:
    """A oneDNN-packed copy of every projection of `model`, q/k/v and gate/up fused."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            module.fuse_for_cpu()


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

    With tp (rayspec.model.parallel), this is one rank's shard: rank 0's forward / logits / cache first
    tell the other ranks (running `serve_commands`) to do the same on theirs."""

    def __init__(self, args: ModelArgs, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 tp: TPGroup = NO_TP):
        super().__init__()
        self.args = args
        self.tp = tp
        # which of the followers' models this shard is (rayspec.model.tp_ranks.serve_commands): in load order
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
        # set_batch_invariant: whether the projections run the batch-invariant kernel (and on CPU which)
        self.batch_invariant, self.invariant_kernels = False, None

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

    def remeasure_cpu_kernels(self) -> "cpu_kernels.CpuKernels | None":
        """Measure the CPU kernels again (a provisional choice: `CpuKernels.contended`) and use the
        new choice; oneDNN is among the candidates only if the projections hold packed copies (the
        first choice had it somewhere). Returns the choice in use (None off the CPU)."""
        old = self.cpu_kernels
        if old is None or old.source != "measured":
            return old
        mlp = _float_mlp(self)
        packed = any(m._packed is not None for m in self.modules() if isinstance(m, Linear))
        variants = cpu_kernels.VARIANTS if packed else tuple(v for v in cpu_kernels.VARIANTS
                                                              if v not in cpu_kernels.ONEDNN)
        new = self._use_cpu_kernels(mlp, variants)
        logger.info("CPU matmul kernels measured again: %s (were %s)", new.describe(), old.variant)
        return new

    def _use_cpu_kernels(self, mlp: "MLP", variants: tuple[str, ...]) -> "cpu_kernels.CpuKernels":
        """Measure the candidates on `mlp` (rayspec.cpu.kernels.choose) and have every projection use the choice."""
        weight = mlp.gate_proj.weight
        key = cpu_kernels.machine_key(f"MLP {mlp.gate_proj.in_features}x{mlp.gate_proj.out_features} {weight.dtype}")
        self.cpu_kernels = cpu_kernels.choose(lambda variant: _probe_mlp(mlp, variant), mlp.gate_proj.in_features,
                                              weight.dtype, variants=variants, cache=cpu_kernels.KernelCache.from_env(),
                                              cache_key=key)
        if not getattr(self, "batch_invariant", False):  # (else the projections keep the batch-invariant kernel)
            for module in self.modules():
                if isinstance(module, Linear):
                    module.kernels = self.cpu_kernels
        return self.cpu_kernels

    def set_batch_invariant(self, on: bool) -> None:
        """Have every projection (the LM head's too) compute a row with the same bits whatever the row
        count, or not (EngineConfig.batch_invariant; attention's part is the runner's ForwardBatch.row_keys).
        On CPU one kernel for every row count that this CPU computes row-count invariantly, checked once
        on this model's MLP (rayspec.cpu.kernels.choose_invariant; oneDNN ones prepack the weights as
        pack_for_cpu does), instead of the fastest per row count; off the CPU GEMMs of a fixed row count
        (rayspec.model.linear.DEVICE_TILE_ROWS). Cheap to call again with the same value."""
        if on == self.batch_invariant:
            return
        self.batch_invariant = on
        for module in self.modules():  # 4-bit projections: rows in calls of one shape on any device
            if isinstance(module, FP4Linear):
                module.tile_rows = DEVICE_TILE_ROWS if on else None
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if next(self.parameters()).device.type != "cpu":
            for module in linears:
                module.tile_rows = DEVICE_TILE_ROWS if on else None
            return
        mlp = _float_mlp(self)
        if getattr(self, "cpu_kernels", None) is None or mlp is None:  # int8 / 4-bit projections: their own kernels
            return
        if on and self.invariant_kernels is None:
            self.invariant_kernels = cpu_kernels.choose_invariant(lambda kernels: _probe_mlp(mlp, kernels),
                                                                  mlp.gate_proj.in_features, mlp.gate_proj.weight.dtype)
            logger.info("batch-invariant CPU matmul kernel: %s", self.invariant_kernels.describe())
            if self.invariant_kernels.onednn and not self.cpu_kernels.onednn:
                _pack_onednn(self)
        for module in linears:
            module.kernels = self.invariant_kernels if on else self.cpu_kernels

    def pack_for_cpu(self) -> "CausalLM":
        """On CPU, pick the projections' matmul kernel per row count by measuring this CPU
        (rayspec.cpu.kernels) and, when any is oneDNN, prepack every projection, q/k/v and gate/up
        fused (used at the row counts that chose oneDNN). No-op elsewhere.
        The choice is kept in `self.cpu_kernels` (None off the CPU)."""
        self.cpu_kernels = None
        if getattr(self, "quantization", None):  # int8 linears run their own kernels (rayspec.model.quantize)
            return self
        param = next(self.parameters())
        mlp = _float_mlp(self)  # (none where the MLPs are 4-bit: the float layers keep the default kernels)
        if param.device.type != "cpu":  # elsewhere q/k/v and gate/up run as one matmul each too
            for module in self.modules():
                if isinstance(module, (Attention, MLP)):
                    module.fuse_for_device()
            return self
        if mlp is None:
            return self
        self._use_cpu_kernels(mlp, cpu_kernels.VARIANTS)
        logger.info("CPU matmul kernels: %s", self.cpu_kernels.describe())
        if self.cpu_kernels.onednn:
            _pack_onednn(self)
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
