"""The engine: LLMEngine (llm_engine), continuous batching with speculative decoding, and what it
drives each step: the Scheduler (scheduler), request state and intake (sequence, intake), what
passes between a step's phases (decode_step), the outputs and request errors (outputs), the
cost-aware draft planner (drafting), the statistics (metrics) and the warm-up before the first
request (warm_up). The top of the core: the model, sampling, proposers and memory
layers import nothing of it, the config only drafting's constants (tests/unit/test_imports.py).
`LLMEngine`, `RequestOutput` and the request errors are re-exported here, lazily (importing a
module of this package does not import the engine)."""

_LLM_ENGINE_NAMES = ("LLMEngine", "RequestOutput", "InvalidRequestError", "EngineOverloadedError",
                     "InvalidGrammarError")


def __getattr__(name: str):
    if name in _LLM_ENGINE_NAMES:  # as before engine.py became this package's llm_engine.py
        from rayspec.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
