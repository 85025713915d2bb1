"""The one proposer interface. The engine asks; a proposer answers with draft tokens.

A proposer may keep per-sequence state (a draft model's KV cache); it finds out what was
accepted by comparing the tokens it is given with those it saw last time, so the contract
stays two plain dataclasses that also travel between Ray actors.

`Proposer` declares everything the engine, the scheduler and the serving loop use of a proposer
(no caller asks a proposer for an attribute it may not have); `PreDraftable` adds what
asynchronous drafting (rayspec.proposers.pre_draft) drives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ProposeRequest:
    seq_id: str
    token_ids: list[int]  # prompt + output so far (the last one has no KV in the target yet)
    num_tokens: int  # draft at most this many
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # EAGLE: target hidden features [m, F] of the positions features_start.. committed since the
    # last call (the engine sends them only to proposers with `feature_layers`)
    features: torch.Tensor | None = None
    features_start: int = 0
    # a token tree of up to num_tokens nodes is welcome (else a chain of num_tokens)
    tree: bool = False
    # the request's cache_salt: a proposer's own prefix cache shares blocks only among sequences of
    # one salt, as the target's does (else a tenant could time another's prompts through the draft)
    cache_salt: str | None = None
    # a sampled request without a seed: its stream's seed when the engine has one (EngineConfig.seed),
    # from which a proposer seeds its own draws for it (None: from the OS's entropy)
    stream_seed: int | None = None
    # a probe (rayspec.engine.drafting) of a proposer with a probe_window: catch up on at most this many
    # tokens, the context's last ones, before drafting (None: the whole context it has not seen)
    max_catch_up: int | None = None
    # the engine verifies this draft on the device and reads it with its verdict (one read a cycle):
    # answer with Draft.deferred where the proposer can (rayspec.proposers.deferred), else as usual
    defer_read: bool = False


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), vocab] probabilities the tokens were sampled from; None for a point mass
    # (deterministic proposers, and every proposer at temperature 0)
    probs: torch.Tensor | None = None
    # a token tree: parents[j] is the index of token j's parent, -1 for a child of the last
    # committed token (parents come before children). None: a chain.
    parents: list[int] | None = None
    # EAGLE: the proposer holds no continuous features for this sequence (it never saw it, or lost
    # it: another replica, a restart, an evicted slot); send them again from this position
    resend_features_from: int | None = None
    # asynchronous drafting (rayspec.proposers.pre_draft): True when the draft came from the
    # speculation cache (pre-drafted while the target verified), False when drafted on the call
    pre_drafted: bool | None = None
    # still on the device (ProposeRequest.defer_read): tokens/probs/parents come after the engine's read
    # (rayspec.proposers.deferred.DeferredRow; never sent between processes)
    deferred: object | None = None

    @property
    def is_chain(self) -> bool:
        return self.parents is None or self.parents == list(range(-1, len(self.tokens) - 1))


class Proposer(ABC):
    name: str = ""
    in_process: bool = True  # its state (a draft model's KV cache) lives in the engine's process and budget

    @classmethod
    def create(cls, config, context) -> "Proposer":
        """Build from a SpeculativeConfig and a ProposerContext (see rayspec.config)."""
        return cls()

    @abstractmethod
    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        """Draft for every request in one batched call."""

    # None: no target features needed; () the final hidden state; (i, j, ...) the inputs of those layers
    feature_layers: tuple[int, ...] | None = None
    # a proposer that catches up on a context with a model of its own (a draft model) may draft a
    # probe from the context's last probe_window tokens only (ProposeRequest.max_catch_up): a probe
    # asks whether drafts pay again, and on text no draft guesses its catch-up was most of its cost.
    # None: probes catch up whole
    probe_window: int | None = None

    def cached_prefix(self, seq_id: str, token_ids: list[int], cache_salt: str | None = None) -> int | None:
        """A proposer drafting from target features (feature_layers) whose own cache can start a new
        sequence on a cached prefix: take that place now and return how many of token_ids' positions
        it covers (the target's cached prefix may then reach that far, not further: the head needs
        the features of every position past its own). None: it cannot (the target computes every
        prompt token for it). `cache_salt` (the request's): its own cache is looked up, and
        registered, among that salt's sequences only, as the target's is."""
        return None

    def draftable(self, seq_id: str, token_ids: list[int], k: int) -> int:
        """The most tokens (<= k) a draft for this sequence can hold now, known before drafting:
        an n-gram lookup finds its match, or none (0). The planner gives a sequence no budget past
        it (a budget it cannot fill buys nothing, and in a closed batch an empty draft leaves its
        sequence where it was). Default k: a model drafts whatever it is asked."""
        return k

    def catch_up_tokens(self, seq_id: str, num_tokens: int, window: int | None = None) -> int:
        """Tokens of a sequence now `num_tokens` long that a draft for it would first run through
        the proposer's own model: its context past what the proposer holds (a draft model that
        skipped steps, or never saw the sequence, prefills them), at most `window` (a probe's
        max_catch_up). The planner weighs them (rayspec.engine.drafting). Default 0: no per-sequence model
        state (n-gram), or a catch-up too cheap to count."""
        return 0

    def trim_prefix(self, seq_id: str, num_tokens: int) -> None:
        """The target's cached prefix of seq_id came out shorter: keep num_tokens of it (after
        cached_prefix)."""

    def commit_finished(self, requests: list[ProposeRequest]) -> None:
        """Sequences finishing now (released right after), each with the target features it has not
        been sent yet (all of a prompt's where the request ends at its prefill): a proposer drafting
        from features (feature_layers) whose cache serves later prompts (cached_prefix) caches those
        positions for them, drafting nothing. Default: nothing to do."""

    def release(self, seq_id: str) -> None:
        """Forget a finished or aborted sequence."""

    def close(self) -> None:
        """The engine is going away (a replica shutting down; may be called from another thread
        than the engine's): stop background work and end any wait on another process."""

    def flush(self) -> None:
        """The engine is idle: send what was deferred (a remote proposer's batched releases)."""

    def set_compile(self, on: bool) -> None:
        """Follow the target's compiled-step choice for the proposer's own static forwards (warm-up
        turns the compiled step off where it is slower). Default: no model of its own."""

    def models(self) -> list[torch.nn.Module]:
        """The torch modules the proposer runs in this process (a draft model, an EAGLE head): the
        serving loop re-measures their CPU kernels while idle. Default: none."""
        return []

    def kv_usage(self) -> dict[str, float] | None:
        """The proposer's own KV pool, for stats: num_slots, num_free_slots, kv_cache_usage (0..1).
        None: it has none in this process."""
        return None

    def stats(self) -> dict[str, float]:
        """Counters of the proposer's own (a remote proposer's calls and their seconds) for the
        serving loop's snapshot, under their snapshot names. Default: none."""
        return {}


class PreDraftable(Proposer):
    """A proposer asynchronous drafting can drive (rayspec.proposers.pre_draft): between calls it
    drafts hypotheses of the next verdicts. It keeps each draft position's top `num_candidates`
    tokens and their probabilities in `candidates`, and stops between forwards when `should_stop`
    (set by the pre-drafter) says so."""

    # True: hypotheses are drafted from the proposer's own states (an EAGLE head's `paths`, with the
    # true features handed over later through `accept_features`); False: from tokens alone
    drafts_from_states: bool = False

    def __init__(self):
        self.num_candidates = 0
        self.candidates: dict[str, list[tuple[list[int], list[float]]]] = {}
        self.should_stop: Callable[[], bool] | None = None
