"""The EAGLE training prompts (data/train/) come from the data files in rayspec/data/prompt_pools/
through rayspec/eagle/prompt_pools.py, byte for byte, and share no 8-word sequence with the
bundled evaluation sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayspec.eagle.prompt_pools import build, check_against_eval, main

ROOT = Path(__file__).resolve().parents[2]


def test_the_generator_rewrites_data_train_byte_for_byte(tmp_path):
    main(["--out-dir", str(tmp_path)])
    main(["--out-dir", str(tmp_path), "--extra"])
    for name in ("code_prompts.jsonl", "chat_prompts.jsonl", "code_prompts_extra.jsonl", "chat_prompts_extra.jsonl"):
        assert (tmp_path / name).read_bytes() == (ROOT / "data" / "train" / name).read_bytes(), name


def test_an_overlap_with_an_evaluation_prompt_is_refused():
    built = build()
    check_against_eval(built["code"][0] + built["chat"][0])  # the shipped prompts pass
    copied = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"
    with pytest.raises(ValueError, match="overlap the evaluation sets"):
        check_against_eval([("writing", copied)])  # MT-bench's first question
    assert check_against_eval([("writing", "Complete the code I provided. " * 3)]) is None  # the shared wrapper
