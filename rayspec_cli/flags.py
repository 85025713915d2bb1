"""Flags generated from the config dataclasses, a new field a new flag: the speculative ones from
rayspec.config.SpeculativeConfig (generate, bench offline, bench sweep; defaults the dataclass's, help from
SPECULATIVE_HELP), the engine ones from EngineConfig (serve, bench; unset unless given: they override a config)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

# the help of each SpeculativeConfig field's flag (rayspec.config documents the field itself)
SPECULATIVE_HELP = {
    "method": "speculative method",
    "num_speculative_tokens": "the maximum draft length k",
    "adaptive": "cost-aware drafting: per step draft only what pays (--no-adaptive: always the full length)",
    "draft_costs": "the planner's step costs as a JSON object of rayspec.engine.drafting.ModelledCosts' keys "
                   "(default: timed online)",
    "probe_share": "at most this share of a step's estimated time goes to catch-up probes (none: paced "
                   "engine-wide only)",
    "prompt_lookup_min": "ngram: the shortest n-gram matched",
    "prompt_lookup_max": "ngram: the longest n-gram matched",
    "draft_model": "draft_model: the draft LM (default: the target, a self-draft); eagle3/eagle: the head "
                   "(hub id, directory or .gguf)",
    "draft_num_layers": "keep only the first N draft layers",
    "draft_dtype": "the draft's (or head's) dtype (default: the target's)",
    "draft_quantization": "draft_model: weight-only int8 draft linears (vLLM: speculative_config quantization)",
    "draft_tensor_parallel_size": "draft_model: split the draft over the target's tensor-parallel ranks "
                                  "(1: whole on rank 0)",
    "eagle_topk": "eagle3/eagle: branching per tree node (1: a chain)",
    "num_steps": "eagle3/eagle: tree depth (default: num_speculative_tokens)",
    "eagle_stop_prob": "eagle3/eagle: stop drafting deeper when the frontier's path probability is below this",
    "eagle_prompt_lookup": "eagle3/eagle: add an n-gram prompt-lookup branch of up to N tokens to greedy trees",
    "tree_max_batch": "eagle3/eagle: trees only while at most this many sequences run (chains above)",
    "disable_by_batch_size": "draft nothing in steps whose batch has at least this many sequences",
}


def _field_kinds(cls) -> list[tuple[dataclasses.Field, type, bool]]:
    """(field, its one type other than None, whether None is allowed) of each field of cls."""
    hints = typing.get_type_hints(cls)  # Annotated bounds stripped: Positive | None -> int | None
    found = []
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name])
        kinds = [t for t in args or (hints[f.name],) if t is not type(None)]
        kind = (typing.get_origin(kinds[0]) or kinds[0]) if len(kinds) == 1 else None  # dict[str, float] -> dict
        found.append((f, kind, type(None) in args))
    return found


def speculative_fields() -> list[tuple[dataclasses.Field, type, bool]]:
    """(field, type, whether None is allowed) of every rayspec.config.SpeculativeConfig field, each a flag;
    type is int, float, str, bool or dict (a JSON object)."""
    from rayspec.config import SpeculativeConfig

    found = _field_kinds(SpeculativeConfig)
    for f, kind, _ in found:
        if kind not in (int, float, str, bool, dict):
            raise TypeError(f"SpeculativeConfig.{f.name}: no flag for its type {kind}")
    return found


def _flag_type(kind: type, optional: bool):
    """argparse's type for a field: the value parsed as kind (dict: JSON); `none` where None is allowed."""
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return json.loads(text) if kind is dict else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def add_speculative_flags(parser, skip: tuple[str, ...] = ()) -> None:
    """A flag per SpeculativeConfig field (--method's choices: the proposer registry), defaults the
    dataclass's; speculative_config(args) reads them back."""
    from rayspec.model.quantize import SCHEMES
    from rayspec.proposers import PROPOSERS

    choices = {"method": list(PROPOSERS), "draft_quantization": list(SCHEMES)}
    group = parser.add_argument_group("speculative", "the proposer's settings (speculative: in the app args)")
    for f, kind, optional in speculative_fields():
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        text = SPECULATIVE_HELP.get(f.name, f"speculative.{f.name}")
        text = text if "(default:" in text else f"{text} (default: {f.default})"  # (None's meaning, where told)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            group.add_argument(flag, type=_flag_type(kind, optional), default=f.default, choices=choices.get(f.name),
                               help=text)


def speculative_config(args):
    """The SpeculativeConfig of the flags add_speculative_flags added (any it skipped: the dataclass's defaults)."""
    from rayspec.config import SpeculativeConfig

    return SpeculativeConfig(**speculative_args(args))


def speculative_args(args, skip: tuple[str, ...] = ()) -> dict:
    """The SpeculativeConfig fields the parser took as flags, by name (but those of skip)."""
    return {f.name: getattr(args, f.name) for f, _, _ in speculative_fields()
            if f.name not in skip and hasattr(args, f.name)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and the speculative flags (an engine built in this process: generate, bench offline)."""
    from rayspec.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="hub id, directory, .gguf or the default")
    add_speculative_flags(p)


def engine_flag_fields() -> list[tuple[str, type, object]]:
    """(name, type, default) of the engine settings `rayspec serve` takes as flags: every scalar field of
    rayspec.config.EngineConfig (the one list of them; the serve app's engine args mirror it)."""
    from rayspec.config import EngineConfig

    return [(f.name, kind, f.default) for f, kind, _ in _field_kinds(EngineConfig)
            if kind in (int, float, str, bool) and f.name != "model"]


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
