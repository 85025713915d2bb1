"""The speculative flags come from rayspec.config.SpeculativeConfig: every field is a flag of `generate`,
`bench offline` and `bench sweep` (but the two the sweep takes as lists), with the dataclass's default,
`--method`'s choices are the proposer registry, and the parsed flags give back the SpeculativeConfig.
One default model, imported wherever it is named."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from rayspec.config import DEFAULT_MODEL, SpeculativeConfig
from rayspec.proposers import PROPOSERS
from rayspec_cli.bench import SWEEP_OWN_FLAGS
from rayspec_cli.flags import SPECULATIVE_HELP, speculative_args, speculative_config
from rayspec_cli.main import build_parser

REQUIRED = {"generate": ["--prompt", "p"], "bench offline": ["--prompts", "x"], "bench sweep": ["--prompts", "x"]}


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for name in command.split():
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[name]
    return parser


def _parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([*command.split(), *REQUIRED[command], *flags])


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_every_speculative_field_is_a_flag_with_its_default(command):
    skip = SWEEP_OWN_FLAGS if command == "bench sweep" else ()
    sub = _subparser(build_parser(), command)
    args = _parse(command)
    for f in dataclasses.fields(SpeculativeConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        assert flag in sub._option_string_actions, f"{command}: SpeculativeConfig.{f.name} has no {flag}"
        assert getattr(args, f.name) == f.default, f"{command} {flag}: default {getattr(args, f.name)!r}, not {f.default!r}"
        assert SPECULATIVE_HELP[f.name] in sub._option_string_actions[flag].help
    assert set(SPECULATIVE_HELP) == {f.name for f in dataclasses.fields(SpeculativeConfig)}  # no stale help
    if command != "bench sweep":
        assert speculative_config(args) == SpeculativeConfig()  # no flags: the dataclass's config
        assert sub._option_string_actions["--method"].choices == list(PROPOSERS)
        assert args.model == DEFAULT_MODEL


def test_method_choices_are_the_registry(capsys):
    assert {"none", "ngram", "draft_model", "eagle3", "eagle"} <= set(PROPOSERS)
    for command in ("generate", "bench offline"):
        assert _subparser(build_parser(), command)._option_string_actions["--method"].choices == list(PROPOSERS)
        with pytest.raises(SystemExit):
            _parse(command, "--method", "medusa")
    assert "invalid choice: 'medusa'" in capsys.readouterr().err


def test_flags_give_back_the_config():
    """Every kind of field round-trips: ints, floats, optional ones (`none`), a JSON object, a bool both ways."""
    args = _parse("bench offline", "--method", "draft_model", "--num-speculative-tokens", "3", "--no-adaptive",
                  "--draft-costs", '{"step_s": 0.01, "row_s": 0.001}', "--probe-share", "none",
                  "--prompt-lookup-min", "3", "--prompt-lookup-max", "4", "--draft-model", "d",
                  "--draft-num-layers", "8", "--draft-dtype", "bfloat16", "--draft-quantization", "int8",
                  "--draft-tensor-parallel-size", "1", "--eagle-topk", "2", "--num-steps", "4",
                  "--eagle-stop-prob", "0.2", "--eagle-prompt-lookup", "5", "--tree-max-batch", "4",
                  "--disable-by-batch-size", "3")
    assert speculative_config(args) == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=3, adaptive=False, draft_costs={"step_s": 0.01, "row_s": 0.001},
        probe_share=None, prompt_lookup_min=3, prompt_lookup_max=4, draft_model="d", draft_num_layers=8,
        draft_dtype="bfloat16", draft_quantization="int8", draft_tensor_parallel_size=1, eagle_topk=2, num_steps=4,
        eagle_stop_prob=0.2, eagle_prompt_lookup=5, tree_max_batch=4, disable_by_batch_size=3)
    assert _parse("generate", "--adaptive").adaptive is True
    bad = _parse("bench offline", "--prompt-lookup-min", "6")  # above --prompt-lookup-max's 5
    assert bad.func(bad) == 2  # refused by the config before any model loads: exit status 2, not a traceback


def test_sweep_gives_each_method_its_own_settings():
    """`bench sweep` takes the same flags; draft settings reach only the draft model's engine, tree settings
    only EAGLE's (draft_quantization would be refused for n-gram)."""
    from rayspec.bench.sweep import METHOD_FIELDS, METHODS, MethodOptions, spec_config

    assert METHODS == tuple(m for m in PROPOSERS if m != "none")
    assert set(METHOD_FIELDS) <= {f.name for f in dataclasses.fields(SpeculativeConfig)}
    args = _parse("bench sweep", "--draft-model", "d", "--draft-quantization", "int8", "--draft-num-layers", "2",
                  "--eagle-topk", "2", "--eagle-head", "h", "--no-adaptive", "--prompt-lookup-max", "7")
    given = speculative_args(args, skip=SWEEP_OWN_FLAGS)
    assert not set(SWEEP_OWN_FLAGS) & set(given)
    opts = MethodOptions(eagle_head=args.eagle_head, speculative=given)
    ngram, draft, eagle = (spec_config(m, 3, "t", opts) for m in ("ngram", "draft_model", "eagle3"))
    assert (ngram.draft_model, ngram.draft_quantization, ngram.eagle_topk) == (None, None, 1)
    assert (draft.draft_model, draft.draft_quantization, draft.draft_num_layers, draft.eagle_topk) == ("d", "int8", 2, 1)
    assert (eagle.draft_model, eagle.draft_quantization, eagle.eagle_topk) == ("h", None, 2)
    for spec in (ngram, draft, eagle):
        assert spec.num_speculative_tokens == 3 and spec.adaptive is False and spec.prompt_lookup_max == 7
    assert spec_config("draft_model", 2, "t", MethodOptions()).draft_model == "t"  # a self-draft


def test_one_default_model():
    from rayspec.config import EngineConfig
    from rayspec.model.weights import hub

    assert hub.DEFAULT_MODEL is DEFAULT_MODEL and EngineConfig().model == DEFAULT_MODEL
    assert _parse("bench sweep").model == DEFAULT_MODEL
    assert build_parser().parse_args(["train", "eagle3", "--prompts", "p", "--work-dir", "w"]).target == DEFAULT_MODEL
