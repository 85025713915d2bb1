"""A request's sampling parameters (SamplingParams) and their bounds: plain data, no torch (a Serve
ingress builds and checks them without importing it). The draws are rayspec.sampling.sampler's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rayspec.sampling.structured import StructuredOutput

# torch.Generator.manual_seed takes [-2**63, 2**64 - 1] (negatives wrap onto large positives); the
# proposers seed their own streams with small offsets (seed + 1, seed + 0x5EED), so a request's
# seed is kept to the non-negative int64 range, where every one of those is accepted and distinct
MAX_SEED = 2**63 - 1
MIN_TEMPERATURE = 1e-5  # below it a request is greedy (vLLM's _SAMPLING_EPS)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    max_tokens: int | None = 16  # None: until max_model_len
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # no EOS or stop token id before this many output tokens
    seed: int | None = None
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # per-request cap on the draft length (0: off)
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: each output token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (scoring, `echo`)
    # the target distribution asked for (rayspec.sampling.logits_processing): OpenAI's penalties count output
    # tokens; the repetition penalty (HF semantics) prompt and output tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    structured: StructuredOutput | None = None  # a grammar the output must follow (rayspec.sampling.structured)
    # vLLM's: prefix caching shares cached prompt blocks only among requests with the same salt
    # (one per tenant), so no one learns from cached_tokens or timing what another tenant sent
    cache_salt: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not self.temperature >= 0:  # (NaN too)
            raise ValueError("temperature must be >= 0")
        if self.temperature < MIN_TEMPERATURE:  # as vLLM: logits / 1e-300 overflow; this close to 0 is greedy
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (disabled) or positive")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 20:
                raise ValueError(f"{name} must be between 0 and 20")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be between -2 and 2")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            # 5e-324 passed `> 0` and divided logits into inf (a fuzzed request's 500)
            raise ValueError(f"repetition_penalty must be between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}")
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be between 0 and {MAX_SEED} (2**63 - 1), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
