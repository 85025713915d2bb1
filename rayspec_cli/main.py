"""The `rayspec` argument parser: one subparser per command, each bound to its function."""

from __future__ import annotations

import argparse

from rayspec_cli.bench import BENCH_OWN_FLAGS, SWEEP_OWN_FLAGS, cmd_bench_offline, cmd_bench_serve, cmd_bench_sweep
from rayspec_cli.flags import add_engine_args, add_engine_flags, add_speculative_flags
from rayspec_cli.local import cmd_configs_dir, cmd_fetch_model, cmd_generate, cmd_train
from rayspec_cli.serve import cmd_kuberay, cmd_plan, cmd_serve


def build_parser() -> argparse.ArgumentParser:
    from rayspec.config import DEFAULT_MODEL
    from rayspec.proposers import PROPOSERS

    parser = argparse.ArgumentParser(prog="rayspec", description="lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-model", help="put the default model (SmolLM2-135M-Instruct) in the local cache")
    p.add_argument("--gguf", default=None, help="convert this GGUF file instead")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_fetch_model)

    p = sub.add_parser("generate", help="generate from one chat prompt, streaming to stdout")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (a file or JSON text)")
    p.add_argument("--regex", default=None, help="constrain the output to this regex")
    p.add_argument("--choice", action="append", default=None, help="constrain the output to one of these (repeat)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve a model behind OpenAI routes on a local Ray (as `vllm serve`)",
                       description="Build the Serve app (deployments.app:build_app) and run it on an embedded "
                                   "local Ray (or --address's cluster) until Ctrl-C. --config takes a serve config "
                                   "(its first application's args, either builder) or a flat mapping of app args; "
                                   "MODEL and the flags override it.")
    p.add_argument("model", nargs="?", default=None,
                   help=f"hub id, directory, .gguf or {DEFAULT_MODEL} (default: the config's, else that)")
    p.add_argument("--config", default=None,
                   help="a serve config YAML (configs/*.yaml; a shipped one by name too: `--config default`, "
                        "from any directory) or a YAML of app args")
    p.add_argument("--speculative-config", default=None,
                   help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    p.add_argument("--served-model-name", default=None, help="the name clients send (default: MODEL)")
    add_engine_flags(p)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` (or $RAYSPEC_API_KEY); visible in process listings: "
                        "prefer --api-key-file")
    p.add_argument("--api-key-file", default=None, help="read the key from this file (its first line)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve other machines without a key (binding beyond loopback without one refuses to start)")
    p.add_argument("--host", default=None,
                   help="default: the config's http_options, else 127.0.0.1 (0.0.0.0: every interface; set an API key)")
    p.add_argument("--port", type=int, default=None, help="default: the config's http_options, else 8000")
    p.add_argument("--address", default=None, help="a running Ray cluster to join instead of starting a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--app-name", default="rayspec")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("configs-dir", help="print the directory of the shipped serve configs (configs/*.yaml)",
                       description="The checkout's configs/, or the installed wheel's copy: "
                                   'serve run "$(rayspec configs-dir)/default.yaml" from any directory.')
    p.set_defaults(func=cmd_configs_dir)

    p = sub.add_parser("plan", help="memory per deployment and per GPU of a serve config, from config files alone",
                       description="Weights, KV cache, proposer weights and cache, peak forward activations (an "
                                   "upper bound) and the load peak of each deployment of a serve config, sized as "
                                   "the engine sizes itself, without loading weights (hub ids: config.json only). "
                                   "Exit status 1 when something does not fit --gpu-memory, 2 on errors.")
    p.add_argument("config", help="a serve config (configs/*.yaml)")
    p.add_argument("--gpu-memory", default=None,
                   help="GPU size to check against: 80GB (10^9 bytes), 80GiB (2^30 bytes), 24G (= 24GB)")
    p.add_argument("--app", default=None, help="only the application of this name")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of text")
    p.add_argument("--fit", action="store_true",
                   help="also plan the config at tensor_parallel_size 1, 2 and 4 against 80 GB and 141 GB GPUs "
                        "(always done for quantized checkpoints, whose stored and loaded sizes are shown)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("kuberay", help="a KubeRay RayService manifest for a serve config",
                       description="Write a RayService (ray.io/v1): the serve config as serveConfigV2, an "
                                   "autoscaled Ray cluster with a CPU head that takes no work and worker groups "
                                   "for the resources the config's deployments ask for (target_node, draft_node, "
                                   "GPUs, CPUs). See deployments/kuberay/README.md.")
    p.add_argument("config", help="a serve config (configs/*.yaml), e.g. configs/cluster_eagle3.yaml")
    p.add_argument("--image", default=None,
                   help="container image (default: rayproject/ray:<ray version>-py311-gpu; rayspec is then "
                        "installed at pod start from --source)")
    p.add_argument("--source", default="", help="git URL of this repository, cloned and installed at pod start "
                                               "where the image lacks rayspec")
    p.add_argument("--ref", default="", help="branch, tag or commit of --source (default: its default branch)")
    p.add_argument("--name", default="rayspec", help="the RayService's name (Kubernetes DNS label)")
    p.add_argument("--output", default=None, help="write here instead of stdout")
    p.set_defaults(func=cmd_kuberay)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="in-process: rayspec baseline vs method vs HF transformers")
    add_engine_args(p)
    p.add_argument("--prompts", required=True,
                   help="a bundled evaluation set (mt_bench, humaneval, gsm8k) or a Spec-Bench JSONL file")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers runs")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: every system samples, prompt i from the same seed "
                        "(greedy_match is then null)")
    p.add_argument("--unseeded", action="store_true",
                   help="at temperature > 0, send requests without a seed, as most served ones come (a seeded "
                        "request draws coupled to its seed: its output is target-only decoding's, and a drafted "
                        "token is accepted only where it is the target's own draw; unseeded ones go through "
                        "rejection sampling, which accepts more of a draft model's sampled drafts)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the target over N ranks (Ray actors; gloo on CPU, NCCL on GPUs); a TP=1 "
                        "target-only engine runs beside it for tp1_greedy_match and tp_vs_tp1")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: float32 on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_engine_flags(p, skip=BENCH_OWN_FLAGS)  # --compile, --kv-cache-memory-gb, --max-model-len, ...
    p.set_defaults(func=cmd_bench_offline)

    p = bench.add_parser(
        "sweep", help="in-process: speculative methods x num_speculative_tokens (x concurrency) vs the target alone",
        description="Offline (in-process engines sharing one target; served endpoints are not swept: use "
                    "`bench serve` per configuration). For each concurrency the baseline (target only) runs "
                    "every batch of prompts once, interleaved with every (method, k) on the same batch. Each "
                    "method's engine is built once with the largest k; a run at k caps its requests' drafts "
                    "at k (the per-request num_speculative_tokens); prefix caching is off unless --enable-prefix-caching "
                    "(later runs of the same prompts would find them cached). Prints a table of tok/s, speedup, "
                    "acceptance length, acceptance rate, acceptance by draft position, greedy match and the "
                    "proposer's memory (weights + KV cache as `rayspec plan` sizes them; the measured RSS "
                    "delta of building each method's engine is in the JSON); --output-json, --plot (PNG).")
    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id, directory, .gguf or the default")
    p.add_argument("--methods", default="ngram,draft_model",
                   help=f"comma-separated: {', '.join(m for m in PROPOSERS if m != 'none')} (default: ngram,draft_model)")
    p.add_argument("--num-speculative-tokens", default="1,2,3,4,8", help="comma-separated draft lengths k")
    p.add_argument("--concurrency", default="1", help="comma-separated prompts in flight, e.g. 1,8")
    p.add_argument("--eagle-head", default=None,
                   help="eagle3/eagle: the head (default for SmolLM2: the shipped heads/smollm2-135m-eagle3)")
    p.add_argument("--prompts", required=True,
                   help="a bundled evaluation set (mt_bench, humaneval, gsm8k) or a Spec-Bench JSONL file")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: sampled, prompt i seeded alike in every run (greedy_match null)")
    p.add_argument("--unseeded", action="store_true",
                   help="at temperature > 0, send requests without a seed, as most served ones come (a seeded "
                        "request draws coupled to its seed: its output is target-only decoding's, and a drafted "
                        "token is accepted only where it is the target's own draw; unseeded ones go through "
                        "rejection sampling, which accepts more of a draft model's sampled drafts)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every concurrency's batches this many times over, interleaved; each round's ratio "
                        "is kept (speedup_by_round): their spread is the machine's noise")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: tok/s, speedup and acceptance length vs k, acceptance by "
                                                 "draft position at the largest k")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: float32 on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_speculative_flags(p, skip=SWEEP_OWN_FLAGS)  # --draft-model, --no-adaptive, --eagle-topk, ...
    add_engine_flags(p, skip=BENCH_OWN_FLAGS)
    p.set_defaults(func=cmd_bench_sweep)

    p = sub.add_parser("train", help="train a draft head by self-distillation").add_subparsers(
        dest="kind", required=True)
    for kind in ("eagle3", "eagle"):
        t = p.add_parser(kind, help=f"train an {kind} head for a target model")
        t.add_argument("--target", default=DEFAULT_MODEL)
        t.add_argument("--prompts", nargs="+", required=True,
                       help="JSONL prompt files (Spec-Bench `turns` or GSM8K-style `question`); FILE:N takes N at random")
        t.add_argument("--work-dir", required=True, help="answers, features, checkpoints (resumable)")
        t.add_argument("--output", default=None,
                       help=f"where the head is written (default: a new runs/{kind}-YYYYmmdd-HHMMSS); "
                            "an existing non-empty directory is refused unless --overwrite")
        t.add_argument("--overwrite", action="store_true", help="write the head into a non-empty --output")
        t.add_argument("--max-prompts", type=int, default=None)
        t.add_argument("--max-new-tokens", type=int, default=192)
        t.add_argument("--draft-vocab-size", type=int, default=4096)
        t.add_argument("--intermediate-size", type=int, default=None)
        t.add_argument("--ttt-steps", type=int, default=3)
        t.add_argument("--epochs", type=int, default=2)
        t.add_argument("--lr", type=float, default=1e-3)
        t.add_argument("--batch-tokens", type=int, default=4096)
        t.add_argument("--checkpoint-every", type=int, default=100)
        t.add_argument("--warmup-steps", type=int, default=50)
        t.add_argument("--init-head", default=None,
                       help="train further from this head (its weights, shape and draft vocabulary; "
                            "--intermediate-size is then ignored, and a --draft-vocab-size larger than "
                            "the head's grows its draft vocabulary by the data's most frequent tokens)")
        t.add_argument("--grad-accum", type=int, default=1, help="batches per worker per optimizer step")
        t.add_argument("--num-workers", type=int, default=1,
                       help="> 1: train data-parallel on that many Ray Train workers, one GPU each where the "
                            "cluster has GPUs, else CPU (joins the running Ray cluster; the work dir must be on "
                            "storage they all see)")
        t.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="where the target and the head run (default: CUDA where there is a GPU, else CPU)")
        t.add_argument("--target-dtype", default=None,
                       help="the target's dtype for answers and features (default: bfloat16 on CUDA, "
                            "float32 on CPU); the head always trains in float32")
        t.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (per worker)")
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--answers-only", action="store_true",
                       help="loss only on positions whose next token the target wrote (not the user's)")
        t.set_defaults(func=cmd_train)

    p = bench.add_parser("serve", help="streaming chat requests against running OpenAI-compatible endpoints")
    p.add_argument("--endpoint", action="append", required=True,
                   help="base URL, e.g. http://localhost:8000 (repeat to compare endpoints side by side)")
    p.add_argument("--label", action="append", default=None, help="name for each --endpoint, in order (repeat)")
    p.add_argument("--model", action="append", default=None,
                   help=f"served model name (default {DEFAULT_MODEL}): once for every endpoint, or once "
                        "per --endpoint in order (a peer server serving the model under another name)")
    p.add_argument("--prompts", required=True,
                   help="a bundled evaluation set (mt_bench, humaneval, gsm8k) or a Spec-Bench JSONL file "
                        "(turns[0] is the user message)")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,2,4,8",
                   help="comma-separated sweep of requests in flight (with --request-rate: the cap on them, "
                        "vLLM's --max-concurrency)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, arriving as a Poisson process (gamma with --burstiness), as vLLM's "
                        "bench serve; inf (default): closed loop, the next request as soon as one finishes")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps between arrivals (1: Poisson; lower: burstier)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to always decode max-tokens")
    p.add_argument("--extra-body", default=None,
                   help='JSON merged into every request body, e.g. \'{"response_format": {"type": "json_object"}}\'')
    p.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer <key>` (default: $RAYSPEC_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per endpoint before the sweep")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each level this many times, endpoints taking turns in a rotating order "
                        "(sums tokens and time)")
    p.add_argument("--waves", type=int, default=0,
                   help="send at least this many x concurrency requests per level (prompts repeated), so a "
                        "level runs at its concurrency instead of draining (0: each prompt once)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: output tok/s, mean TTFT, mean TPOT and acceptance rate vs "
                                                 "concurrency")
    p.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
