"""Bytes of a model's weights from its shape alone (no weights loaded): the native model's (per
tensor-parallel rank), a generic one's (transformers' model built on the meta device), an EAGLE
head's, an int8 draft's, and what a load holds at its peak. rayspec.memory.plan adds them up per process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rayspec.eagle.head import EagleConfig
from rayspec.model.families import ModelArgs
from rayspec.model.parallel import TPGroup, splits_vocab
from rayspec.model.weights.checkpoint import READ_CHUNK_BYTES

FLOAT32 = 4  # bytes: rotary frequencies, attention scores, sampled logits


@dataclass(frozen=True)
class Weights:
    """What a module holds on its device (with tensor parallelism: what one rank holds)."""

    num_params: int
    bytes: int  # parameters in the module's dtype, plus its buffers
    linear_bytes: int  # the Linear weights among them: oneDNN keeps a prepacked copy of each on CPU


NO_WEIGHTS = Weights(0, 0, 0)


def _rope_buffer(args: ModelArgs) -> int:
    return args.head_dim // 2 * FLOAT32  # inv_freq, kept float32 through any cast (Float32Rotary)


def _check_divides(args: ModelArgs, tp_size: int) -> None:
    """Refuse a tp_size the model cannot be split by, with the model's own message (TPGroup.shard)."""
    tp = TPGroup(rank=0, size=tp_size)
    split = (args.num_experts, "num_local_experts") if args.num_experts else (args.intermediate_size, "intermediate_size")
    for n, what in ((args.num_heads, "num_attention_heads"), (args.num_kv_heads, "num_key_value_heads"), split):
        tp.shard(n, what)


def _attention(args: ModelArgs, input_size: int, tp_size: int = 1) -> tuple[int, int]:
    """(parameters, of which Linear weights) of one rank's rayspec.model.native.Attention: q/k/v
    column-parallel (their biases split with them), o_proj row-parallel (its bias whole on every
    rank), q/k norms (one head_dim weight each) whole."""
    hd, h = args.head_dim, args.hidden_size
    q, kv = args.num_heads // tp_size * hd, args.num_kv_heads // tp_size * hd
    weights = input_size * (q + 2 * kv) + q * h
    params = weights + ((q + 2 * kv) if args.attention_bias else 0)
    params += h if getattr(args, "o_proj_bias", False) else 0  # the families' ModelArgs (Qwen2/3, Llama)
    params += 2 * hd if getattr(args, "qk_norm", False) else 0  # Qwen3
    params += args.num_heads // tp_size if getattr(args, "attention_sinks", False) else 0  # gpt-oss
    return params, weights


def _expert_weights(args: ModelArgs, tp_size: int = 1) -> int:
    """The expert projections' weights one rank holds (rayspec.model.moe: whole experts per rank)."""
    return args.num_experts // tp_size * 3 * args.hidden_size * args.intermediate_size


def _mlp(args: ModelArgs, tp_size: int = 1) -> tuple[int, int]:
    """gate/up column-parallel, down row-parallel (its bias whole on every rank). A mixture of experts
    (rayspec.model.moe): this rank's experts with their biases and the whole router; no Linear among them."""
    if getattr(args, "num_experts", 0):
        h, i, local = args.hidden_size, args.intermediate_size, args.num_experts // tp_size
        return _expert_weights(args, tp_size) + local * (2 * i + h) + args.num_experts * (h + 1), 0
    h, i = args.hidden_size, args.intermediate_size // tp_size
    weights = 3 * h * i
    return weights + ((2 * i + h) if args.mlp_bias else 0), weights


def _decoder_layer(args: ModelArgs, input_size: int, num_norms: int, tp_size: int = 1) -> tuple[int, int]:
    attn, attn_linear = _attention(args, input_size, tp_size)
    mlp, mlp_linear = _mlp(args, tp_size)
    return attn + mlp + num_norms * args.hidden_size, attn_linear + mlp_linear


def _weights(num_params: int, linear_params: int, dtype: torch.dtype, buffers: int) -> Weights:
    size = dtype.itemsize
    return Weights(num_params, num_params * size + buffers, linear_params * size)


def dense_4bit_bytes(num_weights: int, group: int) -> int:
    """A 4-bit projection's bytes as held (rayspec.model.fp4_linear): half a byte a weight, a scale byte per
    `group` (NVFP4 16, MXFP4 32), NVFP4's float32 global scale."""
    return num_weights // 2 + num_weights // group + (4 if group == 16 else 0)


def dequant_scratch_bytes(args: ModelArgs, dtype: torch.dtype, tp_size: int = 1) -> int:
    """What a model with 4-bit projections holds besides them: one dequantization scratch the size of its
    largest projection (this rank's): int32 byte and scale indices, float32 values and the weight at `dtype`
    (rayspec.model.fp4_linear.DequantScratch on CPU; a prefill's transient dequantized weight on CUDA)."""
    q = args.num_heads // tp_size * args.head_dim
    largest = args.hidden_size * max(q, args.intermediate_size // tp_size)
    return largest // 2 * 4 + largest // 16 * 4 + largest * 4 + (0 if dtype == torch.float32 else largest * dtype.itemsize)


def causal_lm_weights(args: ModelArgs, dtype: torch.dtype, tp_size: int = 1, dense_4bit: int | None = None) -> Weights:
    """rayspec.model.native.CausalLM, or one rank's shard of it (every rank's is the same size): embedding
    and LM head (split by vocabulary when it divides by tp_size; the LM head none of its own when
    tied to the embedding, though on CPU it still gets a prepacked copy), decoder layers (see
    `_attention`, `_mlp`), final norm, rotary buffer. dense_4bit: the group size (16 NVFP4, 32 MXFP4)
    of decoder projections kept 4-bit (`quantized_weights: keep` of a 4-bit checkpoint): counted as held,
    plus the dequantization scratch, and no prepacked CPU copies (no float MLP to choose kernels on)."""
    if tp_size > 1:
        _check_divides(args, tp_size)
    v = args.vocab_size // tp_size if splits_vocab(TPGroup(size=tp_size), args.vocab_size) else args.vocab_size
    h = args.hidden_size
    layer, layer_linear = _decoder_layer(args, h, num_norms=2, tp_size=tp_size)
    params = v * h + args.num_layers * layer + h + (0 if args.tie_word_embeddings else v * h)
    weights = _weights(params, args.num_layers * layer_linear + v * h, dtype, _rope_buffer(args))
    if getattr(args, "num_experts", 0):  # no MLP to choose CPU kernels on: nothing prepacked (CausalLM.pack_for_cpu)
        weights = dataclasses.replace(weights, linear_bytes=0)
    if getattr(args, "mxfp4_experts", False):  # kept as MXFP4: a byte per two weights and one per 32
        packed = args.num_layers * _expert_weights(args, tp_size)
        weights = dataclasses.replace(weights, bytes=weights.bytes - packed * dtype.itemsize + packed * 17 // 32)
    if dense_4bit is not None:
        dense = args.num_layers * layer_linear
        projections = 4 if getattr(args, "num_experts", 0) else 7  # (a mixture of experts: attention's only)
        held = args.num_layers * (layer_linear // 2 + layer_linear // dense_4bit + projections * 4 * (dense_4bit == 16))
        weights = dataclasses.replace(weights, bytes=weights.bytes - dense * dtype.itemsize + held
                                      + dequant_scratch_bytes(args, dtype, tp_size), linear_bytes=0)
    return weights


def target_io_weights(args: ModelArgs, dtype: torch.dtype) -> Weights:
    """What an EAGLE proposer loads of the target, whole, where it cannot share the engine's (a
    proposer deployment; rank 0 of a tensor-parallel target, which holds a vocabulary slice): the
    model without its decoder layers (embedding, final norm, LM head), as
    rayspec.proposers.eagle._load_target_io does."""
    return causal_lm_weights(dataclasses.replace(args, num_layers=0), dtype)


def generic_weights(hf_config, dtype: torch.dtype) -> Weights:
    """What the generic path (rayspec.model.generic.load_generic_model) holds: transformers' model of
    `hf_config` at `dtype` (modules it keeps in float32 stay so), its parameters (tied ones once)
    and buffers, counted from a build on the meta device (no memory, config.json alone). No
    prepacked CPU copies: the generic path has no CPU kernel choice."""
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype)
    params = {id(p): p for p in model.parameters()}.values()  # tied weights are one Parameter
    buffers = {id(b): b for b in model.buffers()}.values()
    return Weights(sum(p.numel() for p in params),
                   sum(t.numel() * t.element_size() for t in (*params, *buffers)), 0)


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner counts it: its ModelArgs (KV cache, activations, the native weights),
    and for a model the engine runs on the generic path its transformers config (`generic`)."""

    args: ModelArgs
    generic: object | None = None  # the transformers config of a generic-path model
    dense_4bit: int | None = None  # decoder projections kept 4-bit: their group size (causal_lm_weights)

    def weights(self, dtype: torch.dtype, tp_size: int = 1) -> Weights:
        if self.generic is None:
            return causal_lm_weights(self.args, dtype, tp_size, self.dense_4bit)
        if tp_size > 1:
            raise ValueError(f"{type(self.generic).__name__} runs on the generic path (rayspec.model.generic), "
                             "which has no tensor parallelism: set tensor_parallel_size 1")
        return generic_weights(self.generic, dtype)


def as_shape(model: ModelArgs | ModelShape) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape(model)


def eagle_head_weights(config: EagleConfig, dtype: torch.dtype, has_own_embedding: bool = False) -> Weights:
    """rayspec.eagle.head: an EAGLE-3 head (fc over the fused features, one decoder layer whose
    attention reads 2 x hidden, final norm, LM head over the draft vocabulary, the d2t / t2d maps) or
    an EAGLE-1 head (fc over [embedding, hidden], its layers, the first without an input norm; it
    reads out through the target's LM head). The embedding is the target's unless the checkpoint
    has its own."""
    a = config.args
    h = a.hidden_size
    embedding = a.vocab_size * h if has_own_embedding else 0
    if config.kind == "eagle3":
        layer, layer_linear = _decoder_layer(a, 2 * h, num_norms=3)  # input, hidden and post-attention norms
        fc = config.feature_size * h
        lm_head = config.draft_vocab_size * h
        params = embedding + fc + layer + h + lm_head
        maps = config.draft_vocab_size * torch.int64.itemsize + a.vocab_size * torch.bool.itemsize  # d2t, t2d
        return _weights(params, fc + layer_linear + lm_head, dtype, maps + _rope_buffer(a))
    first, first_linear = _decoder_layer(a, h, num_norms=1)
    rest, rest_linear = _decoder_layer(a, h, num_norms=2)
    fc = 2 * h * h
    params = embedding + fc + (h if config.fc_bias else 0) + first + (a.num_layers - 1) * rest
    linear = fc + first_linear + (a.num_layers - 1) * rest_linear
    return _weights(params, linear, dtype, _rope_buffer(a))


def load_bytes(weights: Weights, device: str | torch.device) -> int:
    """Memory while a model streams in (rayspec.model.weights.checkpoint.load_checkpoint): its parameters, allocated at
    their dtype on the device, filled tensor by tensor through one READ_CHUNK_BYTES host buffer
    (casts of a chunk happen on the host too). So a GPU holds the weights alone, and a CPU process
    the weights plus that buffer. (The loader before it built float32 weights on the device and
    cast them: 33.17 GB measured on an H100 for Llama-3.1-8B in bfloat16, 2x its weights.)"""
    return weights.bytes + (READ_CHUNK_BYTES if torch.device(device).type == "cpu" else 0)


def int8_weights(args: ModelArgs, weights: Weights, dtype: torch.dtype) -> Weights:
    """A draft LM with weight-only int8 linears (rayspec.model.quantize): every Linear one byte per weight
    plus a float32 scale (and fbgemm's int32 column offset) per output channel; the embedding (which
    a tied LM head's int8 copy leaves in place), norms and buffers in `dtype`. No oneDNN copies."""
    linear = weights.linear_bytes // dtype.itemsize  # linear parameters
    tied_embedding = args.vocab_size * args.hidden_size if args.tie_word_embeddings else 0
    floats = weights.bytes - weights.linear_bytes + tied_embedding * dtype.itemsize
    per_channel = 8 * (linear // args.hidden_size)  # about one output channel per hidden_size weights
    return Weights(weights.num_params, floats + linear + per_channel, 0)
