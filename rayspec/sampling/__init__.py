"""Logits to tokens, lossless under speculation: sampling parameters and draws (sampler), the
acceptance rule of verification (rejection), penalties and logit bias (logits_processing), output
and prompt logprobs (logprobs), grammar constraints (structured) and tool calls (tools,
tool_parsers). No model in it: it imports nothing of the model, memory or engine layers, and of the
proposers only their interface, proposers.base (tests/unit/test_imports.py). `SamplingParams` is
re-exported here, lazily (importing this package imports none of its modules)."""

_SAMPLER_NAMES = ("SamplingParams",)


def __getattr__(name: str):
    if name in _SAMPLER_NAMES:  # as before sampling.py became this package's sampler.py
        from rayspec.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
