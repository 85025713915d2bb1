"""EAGLE draft heads: small decoders that draft from the target's own hidden states.

EAGLE-3 (`Eagle3Head`): the inputs of three target layers (low, middle, high) are fused by
`fc` into one hidden vector; one decoder layer reads it next to the embedding of the next
token (its attention takes both, 2 x hidden wide) and predicts over a reduced draft
vocabulary, mapped back to target ids by `d2t` (target id = draft id + d2t[draft id]).
When drafting several tokens ahead, the layer's own output replaces the fused features.

EAGLE-1 (`Eagle1Head`): `fc` fuses [token embedding, last target hidden state] and a few
decoder layers (the first without an input norm) predict the next hidden state, read out by
the target's own LM head.

Both use the module and key names of the published checkpoints
(yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, yuhuili/EAGLE-LLaMA3-Instruct-8B), so those load as
they are (`rayspec.eagle.checkpoint`).

Token alignment (both): head position i reads (target features at i, token i+1) and its
output predicts token i+2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from rayspec.model.families import ModelArgs
from rayspec.model.kv_cache import ForwardBatch, KVCache
from rayspec.model.linear import Linear
from rayspec.model.native import MLP, Attention, CausalLM, Float32Rotary, RMSNorm


@dataclass
class EagleConfig:
    kind: str  # "eagle3" or "eagle"
    args: ModelArgs  # the head's decoder shape (vocab_size is the target's)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] = ()  # eagle3: target layers whose inputs are the features
    fc_bias: bool = False  # eagle: the published EAGLE-1 heads have a bias on fc
    hf_config: dict = field(default_factory=dict)  # the config.json it came from

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size * (len(self.aux_layers) if self.kind == "eagle3" else 1)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    # as EAGLE-3 and vLLM: inputs of layer 2, the middle layer and the third from last
    ids = {2, num_target_layers // 2, num_target_layers - 3}
    if len(ids) == 3 and min(ids) >= 0 and max(ids) < num_target_layers:  # 7 layers or more
        return tuple(sorted(ids))
    # fewer layers: those would repeat or fall outside; take up to 3 distinct ones, evenly spread
    n = min(3, num_target_layers)
    if n <= 1:
        return (0,)
    return tuple(sorted({round(i * (num_target_layers - 1) / (n - 1)) for i in range(n)}))


class Eagle3Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args, input_size=2 * args.hidden_size)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)  # for the embedding
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)  # for the fused features
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def _input(self, emb, hidden):
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)  # [N, 2H]

    def forward(self, emb, hidden, cos, sin, cache_k, cache_v, batch):
        # emb, hidden: [N, H] -> [N, H]
        h = hidden + self.self_attn(self._input(emb, hidden), cos, sin, cache_k, cache_v, batch)
        return h + self.mlp(self.post_attention_layernorm(h))

    def write_kv(self, emb, hidden, cos, sin, cache_k, cache_v, batch) -> None:
        self.self_attn.write_kv(self._input(emb, hidden), cos, sin, cache_k, cache_v, batch)


class Eagle1Layer(nn.Module):
    def __init__(self, args: ModelArgs, first: bool):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        # the published EAGLE-1 heads have no input norm on layer 0 (fc's output goes straight in)
        self.input_layernorm = None if first else RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache_k, cache_v, batch):
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(normed, cos, sin, cache_k, cache_v, batch)
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv(self, x, cos, sin, cache_k, cache_v, batch) -> None:
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        self.self_attn.write_kv(normed, cos, sin, cache_k, cache_v, batch)


class EagleHead(Float32Rotary):
    """Common surface: forward(input_ids, cache, batch, features) -> hidden; draft_logits; to_target."""

    config: EagleConfig

    def __init__(self, config: EagleConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.config = config
        self.args = config.args
        shape = (config.args.vocab_size, config.args.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        if not self.embed_tokens.weight.is_meta:  # (normal_ on the meta device imports torch._dynamo: 0.5 s)
            self.embed_tokens.reset_parameters()
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    rope = CausalLM.rope
    rotary = CausalLM.rotary

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype  # may differ from the shared target embedding's

    pack_for_cpu = CausalLM.pack_for_cpu  # the same oneDNN prepacking of every projection
    remeasure_cpu_kernels = CausalLM.remeasure_cpu_kernels
    _use_cpu_kernels = CausalLM._use_cpu_kernels

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    @property
    def writes_kv_alone(self) -> bool:
        """Whether `write_kv` can cache positions without running them through: with one layer, a
        position's keys and values depend on its own inputs only (a catch-up's rows before its last,
        whose outputs nobody reads, then cost their projections, not attention and the MLP)."""
        return True


class Eagle3Head(EagleHead):
    def __init__(self, config: EagleConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__(config, inv_freq, attention_scaling)
        a = config.args
        self.fc = Linear(config.feature_size, a.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(a)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = Linear(a.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(a.vocab_size, dtype=torch.bool))

    def forward(self, input_ids: torch.Tensor, cache: KVCache, batch: ForwardBatch, features: torch.Tensor):
        """input_ids: [B, Q]; features: [B, Q, 3 x target hidden] (fused target features) or
        [B, Q, H] (the head's own previous output) -> [B, Q, H]."""
        return batch.output(self.midlayer(*self._inputs(input_ids, batch, features), cache.k[0], cache.v[0], batch))

    def write_kv(self, input_ids: torch.Tensor, cache: KVCache, batch: ForwardBatch, features: torch.Tensor) -> None:
        """forward's keys and values of these positions, and nothing past them (writes_kv_alone)."""
        self.midlayer.write_kv(*self._inputs(input_ids, batch, features), cache.k[0], cache.v[0], batch)

    def _inputs(self, input_ids, batch: ForwardBatch, features):
        """The layer's inputs for the batch's real tokens: (emb [N, H], hidden [N, H], cos, sin)."""
        dtype = self.compute_dtype
        emb = self.embed_tokens(batch.pack(input_ids)).to(dtype)  # [N, H]: real tokens only
        features = batch.pack(features).to(dtype)
        hidden = self.fc(features) if features.shape[-1] != self.args.hidden_size else features
        return (emb, hidden, *self.rotary(batch, dtype))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [..., H] -> [..., draft_vocab] float32
        return self.lm_head(self.norm(hidden)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class Eagle1Head(EagleHead):
    def __init__(self, config: EagleConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__(config, inv_freq, attention_scaling)
        a = config.args
        self.fc = Linear(2 * a.hidden_size, a.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList(Eagle1Layer(a, first=i == 0) for i in range(a.num_layers))
        self.target_lm_head: Linear | None = None  # set by attach_target (not a saved weight)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, batch: ForwardBatch, features: torch.Tensor):
        """input_ids: [B, Q]; features: [B, Q, H] last target hidden state or own output -> [B, Q, H]."""
        x, cos, sin = self._inputs(input_ids, batch, features)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], batch)
        return batch.output(x)

    @property
    def writes_kv_alone(self) -> bool:
        return len(self.layers) == 1  # (a second layer's keys need the first one's outputs)

    def write_kv(self, input_ids: torch.Tensor, cache: KVCache, batch: ForwardBatch, features: torch.Tensor) -> None:
        if not self.writes_kv_alone:
            raise ValueError("write_kv needs a one-layer head")
        self.layers[0].write_kv(*self._inputs(input_ids, batch, features), cache.k[0], cache.v[0], batch)

    def _inputs(self, input_ids, batch: ForwardBatch, features):
        """The first layer's input for the batch's real tokens: (x [N, H], cos, sin)."""
        dtype = self.compute_dtype
        emb = self.embed_tokens(batch.pack(input_ids)).to(dtype)  # [N, H]: real tokens only
        x = self.fc(torch.cat((emb, batch.pack(features).to(dtype)), dim=-1))
        return (x, *self.rotary(batch, x.dtype))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target_lm_head(hidden.to(self.target_lm_head.weight.dtype)).float()


def attach_target(head: EagleHead, target: CausalLM, has_own_embedding: bool) -> None:
    """Share the target's embedding (when the checkpoint has none) and, for EAGLE-1, its LM head."""
    if not has_own_embedding:
        head.embed_tokens.weight = target.model.embed_tokens.weight
    if isinstance(head, Eagle1Head):
        head.target_lm_head = target.lm_head


def build_head(config: EagleConfig, device=None) -> EagleHead:
    """A head of this config with freshly initialized weights; device "meta": its weights without storage
    or initialization (for a checkpoint's to be assigned: rayspec.eagle.checkpoint.read_eagle_head), the
    rotary buffer computed all the same."""
    from rayspec.model.loader import rope_from_config
    from rayspec.model.weights.plain_config import llama_config

    inv_freq, scaling = rope_from_config(llama_config(config.hf_config))
    cls = Eagle3Head if config.kind == "eagle3" else Eagle1Head
    if device is None:
        return cls(config, inv_freq, scaling)
    with torch.device(device):
        return cls(config, inv_freq, scaling)
