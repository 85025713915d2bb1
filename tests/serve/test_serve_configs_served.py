"""The shipped configs served as written (their validation without Ray: tests/unit/test_serve_configs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.app import build_app
from deployments.config import AppArgs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.slow
def test_default_config_served(smollm2, serve_url):
    """configs/default.yaml as written (real SmolLM2-135M on CPU), over HTTP with the openai client:
    the served greedy answer is the target's own (an in-process engine without speculation), and
    the app's counters hold exactly that request's drafts. The shared cluster counts more logical CPUs
    than this 2-core machine has (for other modules): the app holds what `rayspec plan` counts, at
    most 2, so it would start with Ray's detected resources too."""
    import openai
    from ray import serve
    from ray_utils import cpus_in_use, serving

    from deployments.operations.resources import resource_plan

    from rayspec.config import SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    doc = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    args = doc["applications"][0]["args"]
    messages = [{"role": "user", "content": "List the numbers from 1 to 10, separated by commas."}]
    max_tokens = 24
    config = AppArgs.model_validate(args).engine_config()
    config.speculative = SpeculativeConfig(method="none")
    config.max_num_seqs, config.kv_cache_memory_gb, config.device = 1, 0.25, "cpu"  # as served: no GPU here
    target = LLMEngine(config)
    ref = target.generate([target.encode_chat(messages)], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    del target
    cpus = resource_plan(AppArgs.model_validate(args)).cpus()
    assert cpus <= 2
    idle = cpus_in_use()
    with serving(("rayspec", build_app(args), "/")):
        assert cpus_in_use(settle_s=10, expect=idle + cpus) == idle + cpus
        client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="x", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model=args["served_model_name"], temperature=0, max_tokens=max_tokens,
                                              messages=messages)
        assert resp.choices[0].message.content == ref.text and ref.text.strip()
        assert resp.usage.completion_tokens == ref.num_output_tokens
        assert resp.choices[0].finish_reason == ref.finish_reason
        details = resp.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0  # the shipped EAGLE-3 head's drafts are accepted
        # a fresh app: its counters are this one request's
        stats = serve.get_app_handle("rayspec").stats.remote().result(timeout_s=60)
        assert stats["method"] == args["speculative"]["method"]
        assert stats["num_accepted_tokens"] == details.accepted_prediction_tokens
        assert stats["num_draft_tokens"] == details.accepted_prediction_tokens + details.rejected_prediction_tokens
