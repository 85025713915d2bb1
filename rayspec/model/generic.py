"""Any decoder-only transformers model over rayspec's KV cache: the generic (slower) path.

`GenericCausalLM` runs transformers' own modeling code for the architecture (mixture of experts,
attention sinks, sliding-window layers, soft-capping: whatever the model does) and replaces only
its attention, through transformers' `AttentionInterface`: the registered function "rayspec"
writes each layer's rope'd keys and values into our `KVCache` at the batch's cache positions and
attends over the cached keys with the batch's mask. So the engine, runner and proposers see the
same surface as `rayspec.model.native.CausalLM` (forward, logits, args), and speculation stays lossless:
tree queries (rope position != cache row), padded rows and rejected drafts are handled by the
cache exactly as on the native path. It is slower than the native path (transformers' modules,
a math attention where the model has sinks or soft-capping, no CPU kernel choice).

What the attention function honours, per call, is what transformers hands a flash-attention
kernel: `scaling`, `sliding_window` (key visible iff q_pos - k_pos < window, as transformers'
masks), `softcap` (Gemma 2) and `s_aux` (gpt-oss attention sinks: one extra logit per head in
the softmax, whose probability is dropped).

The cache and batch reach the attention function as one forward kwarg (`rayspec_step`), which
transformers' decoders pass down through each layer to the attention call. transformers builds no
mask of its own for an implementation it has no mask function for (the function gets None and
uses the batch's), and with use_cache=False no cache of its own either.

EAGLE-3 features (the inputs of three decoder layers) come from forward pre-hooks on the decoder
layers (`aux_layers`), which catch each chosen layer's input hidden states as the layer is called;
transformers' `output_hidden_states=True` gives the same tensors, but for every layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from rayspec.model.families import ModelArgs
from rayspec.model.kv_cache import ForwardBatch, KVCache
from rayspec.model.native import repeats_kv_heads

ATTN_IMPLEMENTATION = "rayspec"
_STEP_KWARG = "rayspec_step"  # the forward kwarg transformers carries down to the attention function


@dataclass
class _Step:
    """One forward's cache and batch, as the attention function of every layer sees them."""

    cache: KVCache
    batch: ForwardBatch
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> [B, 1, Q, kv_len]

    def mask_for(self, window: int | None, dtype) -> torch.Tensor | None:
        """The batch's additive mask, narrowed to a sliding window: [B, 1, Q, kv_len] or None."""
        batch = self.batch
        if window is None or window >= batch.kv_len:  # no key can be that far away
            return batch.mask
        if window not in self.window_masks:
            B, Q = batch.shape
            rows = batch.positions if batch.cache_positions is None else batch.cache_positions
            # the position of the key in each cache row: the row itself, except this forward's
            # tree rows, whose rope position is the node's depth (batch_layout.tree_layout)
            key_pos = torch.arange(batch.kv_len, device=rows.device).expand(B, -1).clone()  # [B, kv_len]
            key_pos.scatter_(1, rows, batch.positions)
            far = batch.positions[:, :, None] - key_pos[:, None, :] >= window  # [B, Q, kv_len]
            base = batch.mask if batch.mask is not None else torch.zeros(B, 1, Q, batch.kv_len, dtype=dtype,
                                                                        device=rows.device)
            self.window_masks[window] = base.masked_fill(far[:, None], float("-inf"))
        return self.window_masks[window]


def rayspec_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention over rayspec's KV cache.

    query: [B, heads, Q, D]; key/value: [B, kv_heads, Q, D], rope'd at the batch's positions.
    Returns ([B, Q, heads, D], None) as transformers' attention functions do. `attention_mask`
    is None (transformers builds none for an implementation it has no mask function for); the
    batch's own mask is used.
    """
    step: _Step | None = kwargs.get(_STEP_KWARG)
    if step is None:
        raise RuntimeError("the rayspec attention runs only inside GenericCausalLM.forward (no cache given)")
    cache, batch = step.cache, step.batch
    layer = module.layer_idx
    cache_k, cache_v = cache.k[layer], cache.v[layer]  # [rows, kv_heads, D]: the layer's block pool
    batch.write_kv(cache_k, cache_v, key, value)
    keys, values = batch.read_kv(cache_k, cache_v)  # [B, kv_heads, kv_len, D]
    mask = step.mask_for(sliding_window, query.dtype)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if softcap is not None or s_aux is not None:
        out = _math_attention(query, keys, values, mask, scale, softcap, s_aux)
    else:
        out = _sdpa(query, keys, values, mask, scale)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, heads, D]


def _sdpa(q, keys, values, mask, scale) -> torch.Tensor:
    """SDPA with the native path's care (rayspec.model.native.attention): half-precision attention on CPU
    in float32 (a row's output must not depend on what is batched beside it), and KV heads repeated
    where CUDA's SDPA would fall back to its math path for a long masked query."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return _sdpa(q.float(), keys.float(), values.float(), None if mask is None else mask.float(),
                     scale).to(q.dtype)
    gqa = q.shape[1] != keys.shape[1]
    if gqa and repeats_kv_heads(q, keys, mask):
        repeat = q.shape[1] // keys.shape[1]
        keys, values, gqa = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1), False
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _math_attention(q, keys, values, mask, scale, softcap, sinks) -> torch.Tensor:
    """Attention with what SDPA cannot take: logit soft-capping, and sinks (an extra logit column
    per head whose probability mass goes nowhere). Scores in float32.
    q: [B, heads, Q, D]; keys/values: [B, kv_heads, kv_len, D] -> [B, heads, Q, D]."""
    B, H, Q, D = q.shape
    group = H // keys.shape[1]
    qg = q.float().reshape(B, keys.shape[1], group * Q, D)  # heads of one KV head share its keys
    scores = (qg @ keys.float().transpose(-1, -2)).reshape(B, H, Q, -1) * scale  # [B, H, Q, kv_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    if sinks is not None:
        column = sinks.float().reshape(1, H, 1, 1).expand(B, H, Q, 1)
        probs = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.reshape(B, keys.shape[1], group * Q, -1)
    out = probs @ values.float()  # [B, kv_heads, group * Q, D]
    return out.reshape(B, H, Q, D).to(q.dtype)


def register_attention() -> None:
    """Make "rayspec" an attention implementation transformers can dispatch to (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, rayspec_attention)


def args_from_config(config) -> ModelArgs:
    """ModelArgs (what the engine and the memory planner read) from any decoder config."""
    num_heads = config.num_attention_heads
    return ModelArgs(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=getattr(config, "rms_norm_eps", None) or 1e-6,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        max_position_embeddings=getattr(config, "max_position_embeddings", None) or 8192,
    )


class GenericCausalLM(nn.Module):
    """A transformers causal LM behind rayspec.model.native.CausalLM's surface (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        register_attention()
        if hf_model.config._attn_implementation != ATTN_IMPLEMENTATION:
            hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        hf_model.eval()
        # Only the decoder (embeddings, layers, final norm) and the LM head are kept: the causal-LM
        # wrapper adds nothing a forward here uses. `model` / `lm_head` / `model.embed_tokens` are
        # the names CausalLM has, which EAGLE heads share weights through (eagle.head.attach_target).
        self.model = hf_model.get_decoder()
        self.lm_head = hf_model.get_output_embeddings()
        self.config = hf_model.config
        self.args = args_from_config(self.config)
        # the KV cache's and the masks' dtype (a model may keep some modules in float32)
        self.compute_dtype = compute_dtype or self.lm_head.weight.dtype
        self.layers = tuple(_decoder_layers(self.model, self.args.num_layers))  # where aux_layers hook in
        self.cpu_kernels = None
        self.eval()
        self._check_logits(hf_model)

    @torch.inference_mode()
    def _check_logits(self, hf_model: nn.Module) -> None:
        """`logits` redoes what the causal-LM wrapper does after the decoder (LM head, then known
        scalings); a wrapper doing something else would make every token wrong. So the wrapper's own
        logits of a 2-token probe (same attention, same cache) must match ours."""
        device = self.lm_head.weight.device
        cache = KVCache(self.args, num_blocks=1, block_size=2, dtype=self.compute_dtype, device=device)
        ids = torch.tensor([[1, 2]], device=device) % self.args.vocab_size  # [1, 2]
        visible = torch.ones(2, 2, dtype=torch.bool, device=device).tril()
        mask = torch.zeros(1, 1, 2, 2, dtype=self.compute_dtype, device=device).masked_fill_(~visible, float("-inf"))
        rows = torch.arange(2, device=device)[None]  # [1, 2]: block 0's rows
        batch = ForwardBatch(write_index=rows, read_index=rows, positions=rows, kv_len=2, mask=mask)
        ours = self.logits(self(ids, cache, batch))  # [1, 2, vocab]
        theirs = hf_model(input_ids=ids, position_ids=batch.positions, use_cache=False,
                          **{_STEP_KWARG: _Step(cache, batch)}).logits.float()
        scale = float(theirs.abs().max()) + 1e-6
        if not torch.allclose(ours, theirs, rtol=2e-2, atol=2e-2 * scale):
            raise ValueError(f"{type(hf_model).__name__} computes its logits in a way the generic path does not "
                             f"reproduce (max difference {float((ours - theirs).abs().max()):.3g} on a probe)")

    def forward(self, input_ids: torch.Tensor, cache: KVCache, batch: ForwardBatch,
                aux_layers: tuple[int, ...] | None = None):
        """input_ids: [B, Q] -> hidden: [B, Q, hidden_size] after the final norm ([N, hidden_size]
        with batch.packed_output); with aux_layers also the inputs of those layers concatenated,
        [B, Q, len(aux_layers) * hidden_size] (EAGLE-3 features), as CausalLM.forward.

        Every one of the B x Q tokens is computed (transformers' modules take the padded layout);
        padding rows are dropped from the output."""
        captured: dict[int, torch.Tensor] = {}
        with contextlib.ExitStack() as hooks:
            for i in aux_layers or ():
                handle = self.layers[i].register_forward_pre_hook(_capture_input(captured, i), with_kwargs=True)
                hooks.callback(handle.remove)
            out = self.model(input_ids=input_ids, position_ids=batch.positions, use_cache=False,
                               **{_STEP_KWARG: _Step(cache, batch)})
        hidden = batch.output(batch.pack(out.last_hidden_state))
        if aux_layers is None:
            return hidden
        aux = torch.cat([captured[i] for i in aux_layers], dim=-1)  # [B, Q, len(aux_layers) * H]
        return hidden, batch.output(batch.pack(aux))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden_size] -> [..., vocab] float32, with the LM-head scalings transformers'
        causal LMs apply after the projection (Granite's logits_scaling, Cohere's logit_scale,
        Gemma 2's final soft-capping)."""
        logits = self.lm_head(hidden).float()
        config = self.config
        if getattr(config, "logits_scaling", None):
            logits = logits / config.logits_scaling
        if getattr(config, "logit_scale", None):
            logits = logits * config.logit_scale
        if getattr(config, "final_logit_softcapping", None):
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def pack_for_cpu(self) -> "GenericCausalLM":
        """The native path's CPU kernel choice has no counterpart here (transformers' own Linear layers)."""
        return self


def _decoder_layers(decoder: nn.Module, num_layers: int) -> nn.ModuleList:
    layers = getattr(decoder, "layers", None)
    if layers is None:  # GPT-2-style naming
        layers = getattr(decoder, "h", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != num_layers:
        raise ValueError(f"{type(decoder).__name__} has no list of {num_layers} decoder layers the generic path knows")
    return layers


def _capture_input(captured: dict[int, torch.Tensor], index: int):
    def hook(module, args, kwargs):
        captured[index] = args[0] if args else kwargs["hidden_states"]  # [B, Q, H], the layer's input
    return hook


def _quantization_kwargs(model_dir) -> dict:
    """from_pretrained's arguments for a quantized checkpoint: MXFP4 (gpt-oss experts) dequantized at load
    (rayspec.model.formats.mxfp4); a format transformers' model cannot take is refused by name."""
    from rayspec.model.formats import MXFP4, UnsupportedQuantizationError, read_quantization

    quantization = read_quantization(model_dir)
    if quantization is None:
        return {}
    if quantization.algo != MXFP4:
        raise UnsupportedQuantizationError(
            f"{model_dir}: {quantization.algo} checkpoints load into rayspec's native model families only "
            "(Llama, Mistral, Qwen2, Qwen3), not on the generic transformers path")
    from rayspec.model.formats.mxfp4 import transformers_config

    return {"quantization_config": transformers_config()}


def load_generic_model(model_dir, config, device, dtype: torch.dtype,
                       num_layers: int | None = None) -> GenericCausalLM:
    """A checkpoint's transformers model (weights loaded shard by shard in `dtype` on `device`) on
    the generic path. config: its transformers config (rayspec.model.weights.hub.load_hf_config). num_layers
    keeps only the first layers (a cheap self-draft), as loader.load_model."""
    from transformers import AutoModelForCausalLM

    register_attention()
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:num_layers]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype, device_map=torch.device(device),
                                              attn_implementation=ATTN_IMPLEMENTATION, **_quantization_kwargs(model_dir))
    hf.requires_grad_(False)
    return GenericCausalLM(hf, compute_dtype=dtype)
