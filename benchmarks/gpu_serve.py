"""benchmarks/gpu.sh's server side: one serve config's app as EAGLE-3 and as its own baseline.

  python benchmarks/gpu_serve.py info  --config C        JSON: names and resolved model dirs
  python benchmarks/gpu_serve.py fetch --config C        download / find target and head, or say why not
  python benchmarks/gpu_serve.py serve --config C --apps eagle3,baseline --port P [--num-gpus G] [--model DIR]
  python benchmarks/gpu_serve.py random-model --out DIR [--shape llama3.1-8b]   a served model with no download
  python benchmarks/gpu_serve.py prompts --out FILE --words 1000 --num 64        Spec-Bench JSONL of word prompts

`serve` starts a Ray of its own (never joins a running one), deploys each named app at
/<name> on port P, prints "ready" once deployed and runs until SIGTERM or SIGINT, then shuts
Serve and its Ray down. The baseline is the config's app with speculation off (method none):
the same engine settings by construction, so no second config file can drift from the first.

`random-model` writes a model directory that serves with no network (issue #50 item 4, the GPU
machine): config.json of the shape (gpu_roofline.py's table), random bfloat16 weights in safetensors,
and a word-level tokenizer with one word per id ("t0" .. "t<vocab-1>": every id the random model emits
decodes) and a plain chat template, so /v1/chat/completions runs end to end. `prompts` writes prompts
of N such words (N tokens each). benchmarks/gpu_serve_random.sh runs the lot on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `deployments` is a top-level package of the repository

APPS = ("eagle3", "baseline")


def config_app_args(path: str) -> dict:
    """The app args of the serve config's first application (either builder)."""
    from deployments.dialects import app_args_of

    doc = yaml.safe_load(Path(path).read_text()) or {}
    apps = doc.get("applications") or []
    found = app_args_of(apps[0]) if apps else None
    if found is None:
        raise ValueError(f"{path}: its first application is not a rayspec app")
    return dict(found)


def app_args(config: str, app: str, num_gpus: float | None = None, kv_cache_memory_gb: float | None = None,
             num_cpus: float | None = None, full_drafts: bool = False) -> dict:
    """The args of one app: the config's (eagle3) or the config's with speculation off (baseline),
    with the verifier's GPU share, CPU share and KV budget overridden where given. full_drafts:
    cost-aware drafting off (every step drafts its whole budget), so a short CPU dry run goes
    through drafting and verification even where the planner would find drafting does not pay."""
    if app not in APPS:
        raise ValueError(f"unknown app {app!r}: one of {APPS}")
    args = config_app_args(config)
    if app == "baseline":
        args["speculative"] = {"method": "none"}
    elif (args.get("speculative") or {}).get("method") in (None, "none"):
        raise ValueError(f"{config}: its app has no speculative method to compare with the baseline")
    elif full_drafts:
        args["speculative"] = {**args["speculative"], "adaptive": False}
    verifier = dict(args.get("verifier") or {})
    options = dict(verifier.get("ray_actor_options") or {})
    if num_gpus is not None:
        options["num_gpus"] = num_gpus
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    verifier["ray_actor_options"] = options
    args["verifier"] = verifier
    if kv_cache_memory_gb is not None:
        args["engine"] = {**(args.get("engine") or {}), "kv_cache_memory_gb": kv_cache_memory_gb}
    return args


def info(config: str) -> dict:
    """What the shell script needs to name the endpoints and start a peer on the same weights."""
    from deployments.config import AppArgs

    cfg = AppArgs.model_validate(app_args(config, "eagle3"))
    spec = cfg.speculative
    return {"model": cfg.model, "served_model_name": cfg.model_name, "draft_model": spec.draft_model,
            "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "max_model_len": cfg.engine.max_model_len, "dtype": cfg.engine.dtype}


def fetch(config: str) -> dict:
    """Resolve (download where needed) the target and the head: local directories, or an error that
    says what is missing. Run before serving, so a slow download is not under the ready timeout."""
    from huggingface_hub import get_token

    from rayspec.model.weights.hub import resolve_model_dir

    names = info(config)
    dirs = {}
    for key in ("model", "draft_model"):
        if names[key]:
            dirs[key + "_dir"] = str(resolve_model_dir(names[key]).resolve())
    return {**names, **dirs, "hf_token_set": bool(get_token())}


def serve_apps(config: str, apps: list[str], port: int, num_gpus: float | None, kv_cache_memory_gb: float | None,
               num_cpus: float | None, ray_num_cpus: int | None, full_drafts: bool = False,
               model: str | None = None) -> int:
    import ray
    from ray import serve

    from deployments.app import build_app

    built = [(app, app_args(config, app, num_gpus, kv_cache_memory_gb, num_cpus, full_drafts)) for app in apps]
    if model is not None:  # (random-model's directory: no download)
        built = [(app, {**args, "model": model}) for app, args in built]

    def stop(signum, frame):
        raise KeyboardInterrupt

    init = {"address": "local", "include_dashboard": False, "log_to_driver": False}
    if ray_num_cpus:
        init["num_cpus"] = ray_num_cpus
    ray.init(**init)
    signal.signal(signal.SIGTERM, stop)  # after ray.init, which installs a handler of its own
    signal.signal(signal.SIGINT, stop)  # (a background job inherits SIGINT ignored)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for app, args in built:
            serve.run(build_app(args), name=app, route_prefix=f"/{app}")
        print(f"ready: {', '.join(f'http://127.0.0.1:{port}/{app}' for app in apps)}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def random_model(out: Path, shape: str, seed: int = 0) -> Path:
    """A Llama of `shape` with random bfloat16 weights, saved with its config and a word-level
    tokenizer covering every id (see the module doc). Built on the GPU where there is one."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from gpu_roofline import SHAPES

    v, h, i, layers, heads, kv, hd, theta = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v, "hidden_size": h,
              "intermediate_size": i, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": hd, "rope_theta": theta, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
              "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                       p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    state = {}
    for name, dims in shapes.items():
        t = (torch.ones(dims, device=device) if "norm" in name
             else torch.empty(dims, device=device).normal_(0.0, 0.02, generator=gen))
        state[name] = t.to(torch.bfloat16).cpu()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    words = {f"t{n}": n for n in range(v)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t2",
                                   pad_token="t1")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return out


def word_prompts(out: Path, vocab: int, words: int, num: int, seed: int = 0) -> Path:
    """Spec-Bench JSONL (turns[0] the user message) of `num` prompts of `words` random words ("t<id>",
    one token each in random_model's tokenizer)."""
    import random

    rng = random.Random(seed)
    lines = [json.dumps({"question_id": k, "category": "random", "turns": [
        " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(words))]}) for k in range(num)]
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("info", "fetch"):
        sub.add_parser(name).add_argument("--config", required=True, help="a serve config whose first app speculates")
    p = sub.add_parser("serve")
    p.add_argument("--config", required=True, help="a serve config whose first app speculates")
    p.add_argument("--apps", default=",".join(APPS), help="comma-separated, of: " + ", ".join(APPS))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-gpus", type=float, default=None, help="each verifier's GPU share (default: the config's)")
    p.add_argument("--num-cpus", type=float, default=None, help="each verifier's CPU share (default: the config's)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="default: the config's")
    p.add_argument("--ray-num-cpus", type=int, default=None, help="logical CPUs of the Ray started here")
    p.add_argument("--model", default=None, help="a model directory served instead of the config's (random-model)")
    p.add_argument("--full-drafts", action="store_true",
                   help="cost-aware drafting off: every step drafts its whole budget (gpu.sh --dry-run)")
    r = sub.add_parser("random-model")
    r.add_argument("--out", required=True)
    r.add_argument("--shape", default="llama3.1-8b")
    w = sub.add_parser("prompts")
    w.add_argument("--out", required=True)
    w.add_argument("--vocab", type=int, default=128256)
    w.add_argument("--words", type=int, default=1000)
    w.add_argument("--num", type=int, default=64)
    args = parser.parse_args(argv)
    if args.command == "random-model":
        print(random_model(Path(args.out), args.shape))
        return 0
    if args.command == "prompts":
        print(word_prompts(Path(args.out), args.vocab, args.words, args.num))
        return 0
    if args.command == "serve":
        return serve_apps(args.config, [a for a in args.apps.split(",") if a], args.port, args.num_gpus,
                          args.kv_cache_memory_gb, args.num_cpus, args.ray_num_cpus, args.full_drafts, args.model)
    from rayspec.model.weights.files import ModelNotFoundError

    try:
        print(json.dumps(info(args.config) if args.command == "info" else fetch(args.config)))
    except (ValueError, OSError, ModelNotFoundError) as err:
        print(f"gpu_serve.py {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
