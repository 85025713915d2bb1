"""The weight formats a config may name, as data: checked without importing torch (rayspec.config
validates a serve config's settings in a Serve ingress replica, which imports no torch)."""

from __future__ import annotations

# quantized_weights: what a 4-bit (NVFP4/MXFP4) checkpoint's weights become (rayspec.model.fp4_linear)
MODES = ("keep", "dequantize")
# draft_quantization: how a draft LM's linear layers are quantized at load (rayspec.model.quantize)
SCHEMES = ("int8",)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"quantized_weights {mode!r}: use one of {list(MODES)}")
    return mode


def check_scheme(scheme: str | None) -> str | None:
    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise ValueError(f"draft_quantization {scheme!r} is not supported; supported: {list(SCHEMES)} (or null)")
    return scheme
