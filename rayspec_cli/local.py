"""Subcommands outside serving: fetch-model, generate (an engine in this process), configs-dir, train."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rayspec_cli.flags import speculative_config


def cmd_fetch_model(args) -> int:
    from rayspec.model.weights.hub import convert_gguf, fetch_default_model

    path = convert_gguf(Path(args.gguf)) if args.gguf else fetch_default_model(force=args.force)
    print(path)
    return 0


def _structured(args):
    from rayspec.sampling.structured import StructuredOutput

    given = [x for x in (args.json_schema, args.regex, args.choice) if x]
    if len(given) > 1:
        raise SystemExit("give one of --json-schema, --regex, --choice")
    if args.json_schema:
        path = Path(args.json_schema)
        return StructuredOutput.json_schema(path.read_text() if path.is_file() else args.json_schema)
    if args.regex:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput.choice(args.choice)
    return None


def cmd_generate(args) -> int:
    from rayspec.config import EngineConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, speculative=speculative_config(args)))
    ids = engine.encode_chat([{"role": "user", "content": args.prompt}])
    engine.add_request(ids, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                                           structured=_structured(args)))
    start, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            n = len(out.token_ids)
    seconds = time.perf_counter() - start
    print(f"\n\n[{n} tokens in {seconds:.2f} s, {n / seconds:.1f} tok/s; {json.dumps(engine.stats.as_dict())}]",
          file=sys.stderr)
    return 0


def cmd_configs_dir(args) -> int:
    from rayspec.assets import configs_dir

    print(configs_dir())
    return 0


def cmd_train(args) -> int:
    from rayspec.eagle.pipeline import check_output, run
    from rayspec.eagle.train import TrainConfig

    cfg = TrainConfig(kind=args.kind, target=args.target, prompts=tuple(args.prompts), work_dir=args.work_dir,
                      output=args.output, overwrite=args.overwrite, max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                      draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
                      ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                      checkpoint_every=args.checkpoint_every, seed=args.seed, answers_only=args.answers_only,
                      init_head=args.init_head, warmup_steps=args.warmup_steps, grad_accum=args.grad_accum,
                      num_workers=args.num_workers, num_threads=args.num_threads, device=args.device,
                      target_dtype=args.target_dtype)
    try:
        cfg = check_output(cfg)
    except FileExistsError as err:
        print(f"rayspec train: {err}", file=sys.stderr)
        return 2
    print(f"rayspec train: the head goes to {cfg.output}", file=sys.stderr)
    print(run(cfg))
    return 0
