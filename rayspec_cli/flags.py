"""Engine flags shared by the subcommands: model, device, dtype, proposer, and every other EngineConfig field."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, directory, .gguf or the default")
    p.add_argument("--method", default="ngram", help="speculative method: none, ngram, draft_model")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--no-adaptive", action="store_true", help="always draft the full length")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--draft-num-layers", type=int, default=None, help="keep only the first N draft layers")
    p.add_argument("--draft-quantization", default=None, choices=["int8"],
                   help="draft_model: weight-only int8 draft linears (vLLM: speculative_config quantization)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--eagle-topk", type=int, default=1, help="eagle3/eagle: branching per tree node (1: a chain)")
    p.add_argument("--num-steps", type=int, default=None, help="eagle3/eagle: tree depth")
    p.add_argument("--eagle-stop-prob", type=float, default=0.0,
                   help="eagle3/eagle: stop drafting deeper when the frontier's path probability is below this")
    p.add_argument("--eagle-prompt-lookup", type=int, default=0,
                   help="eagle3/eagle: add an n-gram prompt-lookup branch of up to N tokens to greedy trees")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="draft nothing in steps whose batch has at least this many sequences")


def engine_flag_fields() -> list[tuple[str, type, object]]:
    """(name, type, default) of the engine settings `rayspec serve` takes as flags: every scalar field of
    rayspec.config.EngineConfig (the one list of them; the serve app's engine args mirror it)."""
    import dataclasses
    import typing

    from rayspec.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    fields = []
    for f in dataclasses.fields(EngineConfig):
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        if len(kinds) == 1 and kinds[0] in (int, float, str, bool) and f.name != "model":
            fields.append((f.name, kinds[0], f.default))
    return fields


def add_engine_flags(parser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine", "the config's engine settings (engine: in the app args)")
    for name, kind, default in engine_flag_fields():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"engine.{name} (default: {default})")
        else:
            group.add_argument(flag, type=kind, default=None, help=f"engine.{name} (default: {default})")
