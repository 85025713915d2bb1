"""Engine statistics named like vLLM's: speculative-decoding counters, and what a step did to its
requests (the serving layer turns both into Prometheus metrics: deployments/replicas/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    propose_seconds: float = 0.0  # wall time in the proposer's propose (drafting, or the remote call)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per drafted verification step."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "propose_seconds": round(self.propose_seconds, 4),
        }


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort", "error"
    e2e_latency: float  # arrival to the last output, seconds
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_time_per_output_token: float | None = None  # after the first token; None below two tokens


@dataclass
class IterationStats:
    """What one engine step did to its requests, as the serving loop saw them (vLLM's name).

    The loop fills one per step from the step's outputs and hands it to its metrics sink in one
    call, so metrics cost a call per step plus one observation per request that moved, never one
    per token. Latencies are in seconds, from the loop's clock (a request arrives when it is
    submitted to the loop)."""
    num_prompt_tokens: int = 0  # prompts whose prefill finished this step
    num_generation_tokens: int = 0  # tokens emitted this step
    num_prefix_cache_queries: int = 0  # prompt tokens looked up (those of num_prompt_tokens)
    num_prefix_cache_hits: int = 0  # of them, tokens whose KV came from the prefix cache
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # one per request that got tokens after its first
    queue_times: list[float] = field(default_factory=list)  # arrival to first scheduled
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.num_prompt_tokens or self.num_generation_tokens or self.time_to_first_tokens
                    or self.inter_token_latencies or self.queue_times or self.finished)
