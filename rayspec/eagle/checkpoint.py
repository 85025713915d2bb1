"""Load and save EAGLE heads in the published layouts.

Formats that load (a directory or hub id with config.json and weights in `*.safetensors`
or `pytorch_model.bin`):
- EAGLE-3 as in `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`: config `architectures`
  `["LlamaForCausalLMEagle3"]` (or any config with `draft_vocab_size`), keys `fc.weight`
  [H, 3H], `midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
  hidden_norm, post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`
  [draft_vocab, H], `d2t` [draft_vocab] (target id = draft id + d2t), `t2d` [vocab] bool;
  `embed_tokens.weight` optional (the target's is shared when absent). Feature layers come
  from `eagle_config.eagle_aux_hidden_state_layer_ids` when present, else (2, L/2, L-3).
- EAGLE-1 as in `yuhuili/EAGLE-LLaMA3-Instruct-8B`: a one-layer LlamaForCausalLM config,
  keys `fc.weight` [H, 2H] (+ `fc.bias`), `layers.N.*` (layer 0 without input_layernorm),
  `embed_tokens.weight` optional; the target's LM head reads the output.
rayspec saves its own heads in the same layouts (safetensors), so they load anywhere these do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rayspec.eagle.head import EagleConfig, EagleHead, attach_target, build_head, default_aux_layers
from rayspec.model.families import ModelArgs
from rayspec.model.native import CausalLM

EAGLE_KINDS = ("eagle3", "eagle")


def detect_kind(hf_config: dict) -> str:
    archs = " ".join(hf_config.get("architectures") or [])
    return "eagle3" if ("Eagle3" in archs or "draft_vocab_size" in hf_config) else "eagle"


def eagle_config_from_hf(hf_config: dict, num_target_layers: int, target_hidden_size: int,
                         fc_bias: bool = False) -> EagleConfig:
    from rayspec.model.weights.plain_config import llama_config

    kind = detect_kind(hf_config)
    args = ModelArgs.from_hf_config(llama_config(hf_config))
    aux = ()
    if kind == "eagle3":
        ids = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else default_aux_layers(num_target_layers)
    return EagleConfig(
        kind=kind, args=args,
        draft_vocab_size=int(hf_config.get("draft_vocab_size") or args.vocab_size),
        target_hidden_size=int(hf_config.get("target_hidden_size") or target_hidden_size),
        aux_layers=aux, fc_bias=fc_bias, hf_config=dict(hf_config))


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The head's tensors: every safetensors shard, else pytorch_model*.bin (memory-mapped)."""
    from rayspec.model.weights.files import load_weights

    state = load_weights(model_dir)  # ModelNotFoundError (a FileNotFoundError) when there are none
    # some exports prefix the head's keys with "model."
    return {k.removeprefix("model."): v for k, v in state.items()}


def read_eagle_head(spec: str, target: CausalLM, kind: str | None = None) -> tuple[EagleHead, bool]:
    """A head built from a directory or hub id, weights loaded, float32 on the CPU, not yet attached
    to its target; and whether the checkpoint carries its own embedding."""
    from rayspec.model.weights.hub import resolve_model_dir

    model_dir = resolve_model_dir(spec)
    hf_config = json.loads((model_dir / "config.json").read_text())
    state = read_state_dict(model_dir)
    config = eagle_config_from_hf(hf_config, target.args.num_layers, target.args.hidden_size,
                                  fc_bias="fc.bias" in state)
    if kind is not None and kind != config.kind:
        raise ValueError(f"{spec} is an {config.kind} head, not {kind}")
    if config.args.vocab_size != target.args.vocab_size:
        raise ValueError(f"head vocab {config.args.vocab_size} != target vocab {target.args.vocab_size}")
    # built without initializing weights the checkpoint then replaces (a 49k-vocabulary embedding's random
    # init took ~0.1 s and its memory, in every engine built with the head): the checkpoint's tensors are
    # assigned, not copied
    head = build_head(config, device="meta")
    has_embedding = "embed_tokens.weight" in state
    if config.kind == "eagle3" and "d2t" not in state:
        if config.draft_vocab_size != config.args.vocab_size:
            raise ValueError(f"{spec}: a reduced draft vocabulary needs a d2t mapping")
        state["t2d"] = torch.ones(config.args.vocab_size, dtype=torch.bool)
    elif config.kind == "eagle3" and "t2d" not in state:  # ModelOpt exports ship d2t alone: t2d follows from it
        d2t = state["d2t"].long()
        state["t2d"] = torch.zeros(config.args.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(len(d2t)) + d2t] = True
    missing, unexpected = head.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"{spec}: not an {config.kind} checkpoint (missing {missing[:4]}, unexpected {unexpected[:4]})")
    if not has_embedding:  # the target's, shared by attach_target; until then one zero of its shape, expanded
        shape, dtype = head.embed_tokens.weight.shape, head.embed_tokens.weight.dtype
        head.embed_tokens.weight = torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(shape), requires_grad=False)
    return head.float(), has_embedding


def load_eagle_head(spec: str, target: CausalLM, kind: str | None = None, device=None, dtype=None) -> EagleHead:
    """Load a head from a directory or hub id and attach it to its target."""
    head, has_embedding = read_eagle_head(spec, target, kind)
    param = next(target.parameters())
    head = head.to(device=device or param.device, dtype=dtype or param.dtype)
    attach_target(head, target, has_embedding)
    return head.eval().pack_for_cpu()


def save_eagle_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write config.json + model.safetensors in the published layout (no embedding: it is the target's)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to("cpu", dtype) if v.is_floating_point() else v.cpu()).contiguous()
             for k, v in head.state_dict().items() if not k.startswith(("embed_tokens.", "target_lm_head."))}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head.config.hf_config, indent=2) + "\n")
    return out


def new_eagle_config(kind: str, target_dir: Path, num_target_layers: int, target_hidden_size: int,
                     draft_vocab_size: int | None = None, num_layers: int = 1,
                     intermediate_size: int | None = None) -> EagleConfig:
    """The config of a fresh head for a target (what `rayspec train` starts from)."""
    target_cfg = json.loads((target_dir / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            # transformers 5 writes rope_parameters (theta, scaling) and no rope_theta: a head without it
            # would rotate at the default theta 10000, not its target's (1e6 for Qwen)
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size",
            "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
    hf = {k: target_cfg[k] for k in keep if k in target_cfg}
    hf.update(model_type="llama", num_hidden_layers=1 if kind == "eagle3" else num_layers,
              tie_word_embeddings=False, torch_dtype="float16")
    if intermediate_size:
        hf["intermediate_size"] = intermediate_size
    if kind == "eagle3":
        hf["architectures"] = ["LlamaForCausalLMEagle3"]
        hf["draft_vocab_size"] = draft_vocab_size or hf["vocab_size"]
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(default_aux_layers(num_target_layers))}
    else:
        hf["architectures"] = ["LlamaForCausalLM"]
        hf["bias"] = True
    return eagle_config_from_hf(hf, num_target_layers, target_hidden_size, fc_bias=kind == "eagle")


def save_atomic(obj, path: Path) -> None:
    """torch.save to a temporary file next to `path`, then renamed over it: a crash mid-write
    leaves the previous checkpoint whole, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

