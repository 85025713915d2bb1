"""The mixture-of-experts MLP of gpt-oss: a router picks experts_per_token of num_experts experts per
token (top-k of its logits, softmax over the k chosen), each expert is a clamped SwiGLU MLP with biases,
and a token's output is the routing-weighted sum of its experts' outputs.

Module and parameter names mirror transformers' GptOssMLP, so checkpoints load as they are:
  `router.weight` [E, H], `router.bias` [E]
  float experts (transformers' layout, x @ W): `experts.gate_up_proj` [E, H, 2I], `experts.down_proj`
  [E, I, H]; MXFP4 experts (the checkpoint's layout, rows = outputs): `experts.gate_up_proj_blocks`
  uint8 [E, 2I, H / 32, 16] and `_scales` [E, 2I, H / 32], `experts.down_proj_blocks` [E, H, I / 32, 16]
  and `_scales`; and the biases `experts.gate_up_proj_bias` [E, 2I], `experts.down_proj_bias` [E, H].
gate and up are interleaved in gate_up's outputs (gate at even columns, up at odd ones).

MXFP4 experts stay 4-bit in memory; an expert is dequantized (rayspec.model.formats.mxfp4.dequantize,
exact) when a token of the forward routes to it, and the copy is dropped after.

Tensor parallelism: expert parallelism. Each rank holds num_experts / size whole experts (a `tp_shard`
on the experts' first dim) and the whole router, computes its experts' share of every token, and one
all-reduce sums the ranks' shares (each expert's bias is added by its own rank, once).

The expert loop is one custom op, rayspec::moe_experts: it reads on the host which experts a forward uses
(one read per layer), which torch.compile cannot trace; as an opaque op it leaves the compiled step one
graph (rayspec.model.compiled: without CUDA graphs, which cannot hold the read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayspec.model.families import ModelArgs
from rayspec.model.formats import mxfp4
from rayspec.model.parallel import NO_TP, TPGroup


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [n, 2I] (gate at even columns, up at odd) -> [n, I]: (up + 1) * gate * sigmoid(alpha * gate),
    gate clamped above at limit, up to [-limit, limit] (gpt-oss's activation)."""
    gate = gate_up[:, ::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(nn.Module):
    """This rank's experts (first .. first + num_local - 1 of the model's), float or MXFP4 (module doc)."""

    def __init__(self, args: ModelArgs, tp: TPGroup = NO_TP):
        super().__init__()
        E, H, I = args.num_experts, args.hidden_size, args.intermediate_size
        self.first, stop = tp.shard(E, "num_local_experts")
        self.num_local = n = stop - self.first
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        self.packed = args.mxfp4_experts
        self.gate_up_proj_bias = nn.Parameter(torch.empty(n, 2 * I))
        self.down_proj_bias = nn.Parameter(torch.empty(n, H))
        if self.packed:
            group = mxfp4.GROUP_SIZE
            if H % group or I % group:
                raise ValueError(f"MXFP4 experts need hidden_size ({H}) and intermediate_size ({I}) in groups of {group}")

            def codes(*shape):
                return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

            self.gate_up_proj_blocks = codes(n, 2 * I, H // group, group // 2)
            self.gate_up_proj_scales = codes(n, 2 * I, H // group)
            self.down_proj_blocks = codes(n, H, I // group, group // 2)
            self.down_proj_scales = codes(n, H, I // group)
            names = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(n, H, 2 * I))
            self.down_proj = nn.Parameter(torch.empty(n, I, H))
            names = ("gate_up_proj", "down_proj")
        if tp.size > 1:  # whole experts per rank: a slice of the first dim of each
            self.tp_shards = {name: (0, self.first, stop) for name in (*names, "gate_up_proj_bias", "down_proj_bias")}

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; experts [N, k] long (the model's expert ids); weights [N, k] -> [N, H]: the weighted sum
        of this rank's experts' outputs (zero for tokens none of them serves). One opaque op
        (rayspec::moe_experts) to torch.compile: its loop over the experts used reads them on the host."""
        if self.packed:
            return torch.ops.rayspec.moe_experts(x, experts, weights, self.gate_up_proj_blocks, self.gate_up_proj_scales,
                                                 self.gate_up_proj_bias, self.down_proj_blocks, self.down_proj_scales,
                                                 self.down_proj_bias, self.first, self.alpha, self.limit)
        return torch.ops.rayspec.moe_experts(x, experts, weights, self.gate_up_proj, None, self.gate_up_proj_bias,
                                             self.down_proj, None, self.down_proj_bias, self.first, self.alpha,
                                             self.limit)


def _project(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    """x [n, in] through one expert's projection: weight [in, out] float, or (scales given) its MXFP4 codes
    [out, in / 32, 16] with scales [out, in / 32], dequantized into the float layout ([in, out], contiguous)
    and multiplied as a float one is: the same matmul on the same values, the same bits as its twin."""
    if scales is not None:
        weight = mxfp4.dequantize(weight, scales, x.dtype).t().contiguous()
    return x @ weight + bias


@torch.library.custom_op("rayspec::moe_experts", mutates_args=(), schema=(
    "(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor? gate_up_scales, Tensor gate_up_bias, "
    "Tensor down, Tensor? down_scales, Tensor down_bias, int first, float alpha, float limit) -> Tensor"))
def moe_experts(x, experts, weights, gate_up, gate_up_scales, gate_up_bias, down, down_scales, down_bias,
                first, alpha, limit):
    """Experts.forward's computation over this rank's experts first.. (gate_up / down: [E_local, ...], float or
    MXFP4 codes with their scales): the experts used in increasing order, each over its tokens at once (as
    transformers' loop), their outputs weighted and added per token."""
    out = torch.zeros_like(x)
    local = experts - first  # [N, k]: this rank's index of each chosen expert
    mine = (local >= 0) & (local < gate_up.shape[0])
    for e in torch.unique(local[mine]).tolist():  # the experts used: one host read per layer
        token, slot = torch.where(local == e)
        h = _project(x[token], gate_up[e], None if gate_up_scales is None else gate_up_scales[e], gate_up_bias[e])
        h = _project(clamped_swiglu(h, alpha, limit), down[e], None if down_scales is None else down_scales[e],
                     down_bias[e])
        out.index_add_(0, token, h * weights[token, slot, None])
    return out


@moe_experts.register_fake
def _(x, *args):
    return torch.empty_like(x)


class Router(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.experts_per_token
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.empty(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (experts [N, k] long, weights [N, k]): the top-k logits' experts, softmax over those k."""
        top, experts = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return experts, torch.softmax(top, dim=-1)


class MoE(nn.Module):
    """gpt-oss's MLP: Router, then this rank's Experts, summed over the ranks (one all-reduce)."""

    def __init__(self, args: ModelArgs, tp: TPGroup = NO_TP):
        super().__init__()
        self.tp = tp
        self.router = Router(args)
        self.experts = Experts(args, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, H] real tokens -> [N, H]
        experts, weights = self.router(x)
        return self.tp.all_reduce(self.experts(x, experts, weights))


@torch.no_grad()
def fill_dequantized(param: torch.Tensor, name: str, tensors, shard: tuple[int, int, int] | None) -> None:
    """Fill a float expert projection `param` (transformers' layout [E, in, out], or its tp_shard's experts)
    named `name` ("...experts.gate_up_proj") from the checkpoint's MXFP4 `name_blocks` / `name_scales`
    ([E, out, in / 32, 16] / [E, out, in / 32]), an expert at a time. tensors:
    rayspec.model.weights.checkpoint.CheckpointTensors."""
    blocks, scales = tensors.read(name + mxfp4.BLOCKS), tensors.read(name + mxfp4.SCALES)
    start, stop = (0, blocks.shape[0]) if shard is None else shard[1:]
    if shard is not None and shard[0] != 0:
        raise ValueError(f"{name}: experts split by rank only (tp_shard on dim 0), not {shard}")
    want = (stop - start, blocks.shape[2] * 2 * blocks.shape[3], blocks.shape[1])
    if tuple(param.shape) != want:
        raise ValueError(f"{name}: the model's parameter has shape {list(param.shape)}, the checkpoint's MXFP4 "
                         f"experts dequantize to {list(want)}")
    for i, e in enumerate(range(start, stop)):
        param[i].copy_(mxfp4.dequantize(blocks[e], scales[e]).t())


def dequantized_names(names) -> dict[str, str]:
    """The float expert projections a checkpoint holds as MXFP4: "<...>.experts.<proj>" -> its "_blocks" name."""
    names = set(names)
    return {n.removesuffix(mxfp4.BLOCKS): n for n in names
            if n.endswith(mxfp4.BLOCKS) and n.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES in names}
