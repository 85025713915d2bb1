"""Checkpoint weight formats beyond plain float tensors: which one a checkpoint is in, read from
its config files alone.

- NVFP4 (NVIDIA ModelOpt, `rayspec.model.formats.nvfp4`): the Linear weights of the decoder layers in
  4-bit E2M1 with an FP8 scale per 16 inputs and one float32 scale per tensor. Loaded on the native
  path (rayspec.model.native), target and draft alike, at any tensor-parallel size: kept 4-bit
  (`quantized_weights: keep`, the default: rayspec.model.fp4_linear), or each weight dequantized to the
  engine's dtype as it is read (`dequantize`; rayspec.model.weights.checkpoint.load_checkpoint). Dense
  projections stored MXFP4 (`<module>.weight_blocks` / `_scales`) load the same two ways.
- MXFP4 (gpt-oss, `rayspec.model.formats.mxfp4`): the MoE expert weights in E2M1 with a power-of-two
  scale per 32 inputs. Kept 4-bit by the native model (rayspec.model.moe), each expert dequantized when
  used; dequantized at load on the generic path (transformers' gpt_oss).

A checkpoint says its format in `hf_quant_config.json` (ModelOpt's own file: `quantization.
quant_algo`, `group_size`, `exclude_modules`) or in config.json's `quantization_config`
(`quant_method` "modelopt" with `quant_algo` and `ignore`, or "mxfp4" with
`modules_to_not_convert`). Anything else quantized is refused by name, not misread.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

NVFP4, MXFP4 = "NVFP4", "MXFP4"
SUPPORTED = (NVFP4, MXFP4)


class UnsupportedQuantizationError(ValueError):
    """A checkpoint quantized in a format rayspec does not load."""


@dataclass(frozen=True)
class Quantization:
    """What a checkpoint's config files say of its quantization.

    algo: NVFP4 or MXFP4; group_size: inputs per scale (16 for NVFP4, 32 for MXFP4); exclude:
    module name patterns (fnmatch) left unquantized; kv_cache: the KV-cache scheme the checkpoint was
    calibrated for ("FP8" or None): its k/v scales are not read, rayspec keeps the KV cache in the
    engine's dtype; source: the file it was read from."""

    algo: str
    group_size: int
    exclude: tuple[str, ...] = ()
    kv_cache: str | None = None
    source: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def excludes(self, module: str) -> bool:
        """Whether module `module` (e.g. "lm_head", "model.layers.0.mlp.down_proj") stays unquantized
        by the config's patterns."""
        return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in self.exclude)


def _from_modelopt(q: dict, source: str) -> Quantization:
    algo = str(q.get("quant_algo") or "").upper()
    if algo != NVFP4:
        raise UnsupportedQuantizationError(
            f"{source}: ModelOpt quant_algo {q.get('quant_algo')!r} is not supported (rayspec loads NVFP4 "
            "ModelOpt checkpoints and MXFP4 gpt-oss; use the float checkpoint otherwise)")
    group = int(q.get("group_size") or 16)
    if group != 16:
        raise UnsupportedQuantizationError(f"{source}: NVFP4 with group_size {group} (rayspec reads 16)")
    exclude = tuple(q.get("exclude_modules") or q.get("ignore") or ())
    kv = q.get("kv_cache_quant_algo")
    if kv is None and isinstance(q.get("kv_cache_scheme"), dict):
        kv = "FP8" if q["kv_cache_scheme"].get("type") == "float" else str(q["kv_cache_scheme"])
    return Quantization(NVFP4, group, exclude, kv, source, dict(q))


def read_quantization(model_dir: Path, config: dict | None = None) -> Quantization | None:
    """The checkpoint's quantization from `hf_quant_config.json` or config.json's
    `quantization_config` (config: config.json already read), or None for a float checkpoint.
    UnsupportedQuantizationError for a quantization rayspec does not load."""
    model_dir = Path(model_dir)
    modelopt_file = model_dir / "hf_quant_config.json"
    if modelopt_file.is_file():
        doc = json.loads(modelopt_file.read_text())
        return _from_modelopt(doc.get("quantization") or doc, str(modelopt_file.name))
    if config is None:
        path = model_dir / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
    return quantization_of_config(config)


def quantization_of_config(config: dict) -> Quantization | None:
    """The quantization a config.json's `quantization_config` names (None: none)."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method") or "").lower()
    if method == "modelopt":
        return _from_modelopt(q, "config.json quantization_config")
    if method == "mxfp4":
        return Quantization(MXFP4, 32, tuple(q.get("modules_to_not_convert") or ()), None,
                            "config.json quantization_config", dict(q))
    raise UnsupportedQuantizationError(
        f"config.json: quant_method {q.get('quant_method')!r} is not supported (rayspec loads NVFP4 ModelOpt "
        "checkpoints and MXFP4 gpt-oss; use the float checkpoint otherwise)")


def stored_bytes(model, quantization: Quantization | None, float_bytes: int = 2) -> tuple[int, int]:
    """(bytes, quantized parameters) of the checkpoint of `model` (any torch module, e.g. built on the
    meta device) as `quantization` stores it: the quantized weights at their format's size, every other
    parameter (tied ones once) at `float_bytes` each."""
    from rayspec.model.formats import mxfp4, nvfp4

    quantized = {}  # id(param) -> stored bytes
    if quantization is not None:
        rule = {NVFP4: nvfp4.quantized_params, MXFP4: mxfp4.quantized_params}[quantization.algo]
        quantized = rule(model, quantization)
    params = {id(p): p for p in model.parameters()}
    total = sum(quantized.get(key, p.numel() * float_bytes) for key, p in params.items())
    return total, sum(params[key].numel() for key in quantized)
