"""Engine and speculation configuration: the one definition of each setting, its default and its checks.

Pydantic dataclasses: every construction (a YAML's mapping through deployments.config.AppArgs, a
keyword call, `dataclasses.replace`) is validated the same way, types coerced and bounds checked
(a bad value raises pydantic's ValidationError, a ValueError naming the field), and they stay
plain dataclasses for the core (`dataclasses.fields` / `asdict` / `replace`, pickled to workers).
Ray is not needed: deployments.config embeds these in the serve app's args.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import TYPE_CHECKING, Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from rayspec.engine.drafting import PROBE_SHARE
from rayspec.methods import check_method
from rayspec.model.weights.hub import DEFAULT_MODEL  # (defined there, with the package it comes from)

if TYPE_CHECKING:
    import torch

# unknown keys are errors (a misspelt setting must not pass silently as its default)
_STRICT = ConfigDict(extra="forbid")

Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]


def set_torch_threads(num_threads: int | None) -> None:
    """torch's intra-op threads for an engine or a proposer replica: `engine.num_threads`, unless the
    environment's RAYSPEC_NUM_THREADS (a positive integer) overrides it, for a machine whose cores
    other processes keep busy (the test suite sets 1: there a config's 2 threads stall at OpenMP's
    barriers whenever the other test worker runs). Neither given: torch's (Ray's OMP_NUM_THREADS)."""
    import os

    override = os.environ.get("RAYSPEC_NUM_THREADS", "").strip()
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"RAYSPEC_NUM_THREADS must be a positive integer, not {override!r}")
        num_threads = int(override)
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


def field_names(cls) -> set[str]:
    """The settings a config class takes (deployments' dialects check keys against these)."""
    return {f.name for f in dataclasses.fields(cls)}


@dataclass(config=_STRICT)
class SpeculativeConfig:
    method: str = "ngram"  # a name in rayspec.methods.METHODS
    num_speculative_tokens: NonNegative = 5  # the maximum draft length k (method none: 0)
    # cost-aware drafting (rayspec.engine.drafting): per step and sequence, draft only what pays (k for
    # chains, the node budget for trees, 0 when nothing does). False: always the full budget
    adaptive: bool = True
    # the step costs the planner weighs: None, timed online (host timers, calibrated at warm-up);
    # or fixed coefficients (rayspec.engine.drafting.ModelledCosts: step_s, row_s, row_context_s,
    # propose_s, propose_depth_s, propose_depth_batch_s, propose_catch_up_s), the same plans on every machine
    draft_costs: dict[str, float] | None = None
    # a budget for the probes that first catch up on a context (rayspec.engine.drafting): at most this share
    # of the estimated step time (steps at disable_by_batch_size accrue it too). A draft model's probe
    # catches up on the whole context it skipped, ~a quarter of a prefill for an 8-of-30-layer
    # self-draft: unbudgeted, on text it cannot guess, its probes drafted 96-156 tokens where budgeted
    # 9 (8 prompts x 64 tokens x 3, batch 8). None: probes paced engine-wide only
    probe_share: Annotated[float, Field(gt=0.0, lt=1.0)] | None = PROBE_SHARE
    # ngram (names as vLLM's prompt_lookup_min / prompt_lookup_max)
    prompt_lookup_min: Positive = 2
    prompt_lookup_max: Positive = 5
    # draft_model: the draft LM; eagle3 / eagle: the head (hub id or directory)
    draft_model: str | None = None  # hub id, directory or .gguf; None: the target's own checkpoint
    draft_num_layers: Positive | None = None  # keep only the first N layers of the draft checkpoint
    draft_dtype: str | None = None
    # draft_model: "int8" loads the draft with weight-only int8 linears (rayspec.model.quantize): a quarter
    # of float32's bytes per decoded token; the target's own checkpoint so is a cheap, close draft
    draft_quantization: str | None = None
    # draft_model split over the target's tensor-parallel ranks (vLLM's name): 1 (or None) keeps it
    # whole on rank 0's device; otherwise it must equal EngineConfig.tensor_parallel_size
    draft_tensor_parallel_size: Positive | None = None
    # eagle3 / eagle tree drafting (names as SGLang's): branching per node (1 = a chain) and
    # tree depth (None: num_speculative_tokens); num_speculative_tokens caps the tree's nodes
    eagle_topk: Positive = 1
    num_steps: Positive | None = None
    # tree drafts stop growing deeper once the frontier's summed path probability (the head's
    # own estimate of reaching that depth) is below this: a head step costs more than it returns
    # there. 0: always num_steps deep.
    eagle_stop_prob: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    # EAGLE trees also take the n-gram prompt-lookup continuation (prompt_lookup_min/max)
    # of up to this many tokens as one more branch, verified first; the node budget stays
    # num_speculative_tokens. 0: off. Repetitive text (code, quoting the prompt) gains most.
    eagle_prompt_lookup: NonNegative = 0
    # trees only while at most this many sequences run: a tree multiplies the verified rows,
    # cheap at batch 1, not at batch 8 (there chains with the adaptive k take over)
    tree_max_batch: NonNegative = 2
    # no drafts at all while this many sequences or more run (as vLLM's
    # speculative_disable_by_batch_size): large batches already use the target's compute well
    disable_by_batch_size: Positive | None = None

    def __post_init__(self):
        check_method(self.method)  # (by name: validating a config imports no proposer, nor torch)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if self.draft_quantization is not None:
            from rayspec.model.schemes import check_scheme

            check_scheme(self.draft_quantization)
            if self.method != "draft_model":
                raise ValueError(f"draft_quantization is for method draft_model (a draft LM), not {self.method!r}")
        if self.draft_costs is not None:
            from rayspec.engine.drafting import ModelledCosts

            ModelledCosts(self.draft_costs)  # refuses unknown keys and negative costs
        if self.method == "none":
            self.num_speculative_tokens = 0


@dataclass(config=_STRICT)
class EngineSettings:
    """How the engine runs: a serve config's `engine:` section (EngineConfig adds what it runs)."""

    device: str | None = None  # None: cuda when visible (served: when Ray gave the replica a GPU), else cpu
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    # 4-bit checkpoints (NVFP4, MXFP4; target and draft): "keep" holds their weights 4-bit, dequantized per
    # forward (rayspec.model.fp4_linear: a weight-only kernel on CUDA); "dequantize" at `dtype` when loaded
    # (4x the bytes of 4-bit ones in bfloat16)
    quantized_weights: str = "keep"
    max_model_len: Annotated[int, Field(ge=2)] = 2048
    max_num_seqs: Positive = 16
    kv_cache_memory_gb: Annotated[float, Field(gt=0)] = 2.0  # target + draft KV budget; bounds the concurrent sequences
    # torch intra-op threads on CPU (served: per replica; Ray's num_cpus is a scheduling share, not this)
    num_threads: Positive | None = None
    # requests waiting for a KV slot past which add_request refuses new ones (EngineOverloadedError);
    # None: unbounded (served: what the verifier's max_ongoing_requests leaves past the running ones,
    # after which the replica answers 429). A resumed request (a failover from a lost replica) is always taken.
    max_num_waiting: NonNegative | None = None
    # chunked prefill (vLLM's name): at most this many tokens go through the target in one step,
    # decode and verification rows first, then prompt chunks (a long prompt takes several steps,
    # interleaved with the running requests' decoding). Bounds prefill activations and attention
    # scores to one chunk's worth. None: no chunking (a whole prompt per step).
    max_num_batched_tokens: Positive | None = 2048
    # tensor parallelism (vLLM's name): the target's layers split over this many ranks (processes,
    # one device each); rank 0 runs the engine, the others only forwards (rayspec.model.parallel). Served,
    # the verifier replica reserves one placement group bundle per rank (verifier.placement_group_strategy)
    tensor_parallel_size: Positive = 1
    # the paged KV cache: positions per block; kv_cache_memory_gb is a pool of such blocks
    block_size: Positive = 16
    # automatic prefix caching (vLLM's name): full blocks of verified tokens are kept (LRU) and shared
    # by later requests whose prompts start with the same tokens
    enable_prefix_caching: bool = True
    # the target's decode and verification forwards through torch.compile, shapes padded to buckets
    # (batch and rows to powers of two, keys to multiples of 64); on CUDA captured in CUDA graphs
    # (mode "reduce-overhead"). None: on where it measured faster (rayspec.model.compiled.default_compile)
    compile: bool | None = None
    # in the compiled step, attention reads the paged KV pool in place (FlexAttention over the block
    # tables, rayspec.model.paged_attention) instead of gathering each sequence's keys and masking them
    # densely. Measured faster on an H100 (benchmarks/results/gpu_paged_attention_h100.json); off by
    # default until its outputs are checked on a GPU (see that file's note)
    paged_attention: bool = False
    # batch-invariant decoding (vLLM's and SGLang's batch-invariant mode, for verification): each row of a
    # decode or verification forward computes with the bits a 1-row decode of its token gives, whatever
    # else is batched with it, so greedy speculative output equals target-only output token for token even
    # after a near-tie (CausalLM.set_batch_invariant, rayspec.model.row_attention). None: on where it measured
    # at most 10% of a step (rayspec.model.row_attention.BATCH_INVARIANT_BY_DEFAULT: nowhere yet; on CPU it
    # cost more); needs the native model on one device, and runs the target's step eager
    batch_invariant: bool | None = None
    # an EAGLE cycle's drafts stay on the device until the verification's one read (the target's choices
    # and the drafts together: rayspec.engine.deferred_verify), instead of a read after drafting and another
    # after verifying. None: on where a read waits for the device (CUDA), off on CPU (a read costs nothing
    # there, and the host builds the layout with fewer kernels)
    defer_draft_reads: bool | None = None
    # overlap scheduling (SGLang's overlap scheduler, vLLM's async scheduling) for decode steps that draft
    # nothing (a target-only engine, a batch at disable_by_batch_size, requests with
    # num_speculative_tokens 0): the next step's forward is queued on the device, fed this step's tokens
    # where they are, before the host reads them, so the host's work of a step hides behind the device's
    # next one (rayspec.engine.overlap). None: on where a read waits for the device (CUDA), off on CPU
    # (nothing to hide there: outputs would only come one step later)
    overlap_scheduling: bool | None = None
    # the random streams of sampled requests without a seed of their own (vLLM's engine `seed`): None,
    # from the OS's entropy; an int, a fixed sequence (the i-th such request of the engine's life gets
    # the i-th stream), so a run is reproducible as a whole. Seeded requests draw coupled to their own
    # seed whatever this is (rayspec.sampling.sampler)
    seed: NonNegative | None = None

    def __post_init__(self):
        from rayspec.model.schemes import check_mode

        check_mode(self.quantized_weights)
        if self.paged_attention and self.compile is False:
            raise ValueError("paged_attention is the compiled step's attention: it needs compile true (or unset)")
        if self.batch_invariant and (self.compile or self.paged_attention or self.tensor_parallel_size > 1):
            raise ValueError("batch_invariant runs the eager step on one device: not with compile, paged_attention "
                             "(the compiled step's kernels choose their blocks by the batch) or tensor_parallel_size > 1")


@dataclass(config=_STRICT)
class EngineConfig(EngineSettings):
    """Everything an LLMEngine is built from: the model, its proposer's settings, how it runs."""

    model: str = DEFAULT_MODEL
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        super().__post_init__()
        draft_tp = self.speculative.draft_tensor_parallel_size
        if draft_tp not in (None, 1, self.tensor_parallel_size):
            raise ValueError(f"draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                             f"({self.tensor_parallel_size}), not {draft_tp}")
        if draft_tp not in (None, 1) and self.speculative.method != "draft_model":
            raise ValueError("draft_tensor_parallel_size > 1 applies to method draft_model only")


@dataclasses.dataclass
class ProposerContext:
    """What a proposer may need from the engine it serves."""

    target_model: str
    max_model_len: int
    num_slots: int
    device: torch.device
    dtype: torch.dtype
    target: object = None  # the target CausalLM when the proposer lives in the same process
    # a catch-up forward (a whole prompt, the first time a sequence is drafted) goes in chunks of at
    # most this many tokens, as the target's prefill does (EngineConfig.max_num_batched_tokens)
    max_num_batched_tokens: int | None = None
    # the target's paged KV pool (usable blocks; None: the proposer sizes its own for num_slots whole
    # sequences) and its block size: a proposer's cache is paged alike (rayspec.model.runner.proposer_num_blocks)
    num_blocks: int | None = None
    block_size: int = 16
    # share cached prefix blocks of verified tokens between sequences (the target's setting)
    enable_prefix_caching: bool = False
    # run the proposer's decode-shaped forwards through the compiled step (the target's setting)
    compile: bool = False
    # a draft model's 4-bit weights kept 4-bit or dequantized (the target's EngineSettings.quantized_weights)
    quantized_weights: str = "keep"
