"""Application arguments (the `args:` block of a serve config), validated with pydantic.

`speculative` and `engine` are rayspec.config's own SpeculativeConfig and EngineSettings (their
defaults and checks are defined there, once); this module adds what serving needs around them.

Deployment options (replicas, autoscaling, resources) are computed here from the config and
applied with `.options(...)` in deployments.app; the decorators carry no resources.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from deployments.operations.autoscaling import proposer_autoscaling_config
from deployments.vllm_names import translate_vllm_args
from rayspec.assets import assets_root
from rayspec.config import DEFAULT_MODEL, EngineConfig, EngineSettings, SpeculativeConfig, field_names

REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_local_path(spec: str | None) -> str | None:
    """A relative model/head path that exists from the working directory or, failing that, from the
    repo root (an installed wheel's copy of configs/ and heads/: rayspec.assets) -> an absolute path
    (replicas may run elsewhere); anything else (hub ids, the default model's name, absolute paths,
    paths that do not exist) is returned as it is."""
    from rayspec.model.weights.hub import DEFAULT_MODEL

    if not spec or spec in (DEFAULT_MODEL, "default"):
        return spec
    path = Path(spec).expanduser()
    if path.is_absolute():
        return spec
    for base in (Path.cwd(), assets_root()):
        if (base / path).exists():
            return str((base / path).resolve())
    return spec


def feeds_target_features(method: str) -> bool:
    """EAGLE-style proposers: they draft from target hidden states handed over every step."""
    from rayspec.methods import FEATURE_METHODS

    return method in FEATURE_METHODS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RayActorOptions(BaseModel):
    """The usual ray_actor_options; other Ray keys (runtime_env, accelerator_type, ...) pass through."""

    model_config = ConfigDict(extra="allow")
    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    memory: float | None = Field(None, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v not in (None, {})}


class DeploymentArgs(_Strict):
    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=-1)  # per caller; -1: unbounded (Serve's default)
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)
    health_check_period_s: float | None = None
    graceful_shutdown_timeout_s: float | None = None
    # how often a stopping replica checks that its requests are done (Serve's default 2 s, which is
    # also the least a replica takes to stop: an app's delete waits for it)
    graceful_shutdown_wait_loop_s: float | None = Field(None, gt=0)
    # Serve's placement group options (a tensor-parallel verifier: one bundle per rank). Bundles
    # default to the replica's num_cpus / num_gpus per rank; the replica itself takes the first.
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"

    @model_validator(mode="after")
    def _replicas_xor_autoscaling(self):
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        if self.autoscaling_config is not None:
            lo = self.autoscaling_config.get("min_replicas", 1)
            hi = self.autoscaling_config.get("max_replicas", lo)
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError("autoscaling_config needs 0 <= min_replicas <= max_replicas, max_replicas >= 1")
        return self

    @property
    def max_replicas(self) -> int:
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config.get("max_replicas", self.autoscaling_config.get("min_replicas", 1)))
        return self.num_replicas or 1

    def options(self, *, name: str, default_cpus: float, default_max_ongoing: int, default_max_queued: int = -1,
                retry_after_s: float | None = None, extra_ongoing: int = 0) -> dict[str, Any]:
        """Keyword arguments for Deployment.options(...). Past max_queued_requests (per caller) Serve
        refuses at once: a BackPressureError to a handle, an HTTP 429 with Retry-After from the proxy."""
        opts: dict[str, Any] = {"name": name}
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            opts["num_replicas"] = self.num_replicas or 1
        opts["max_ongoing_requests"] = (self.max_ongoing_requests or default_max_ongoing) + extra_ongoing
        opts["max_queued_requests"] = self.max_queued_requests if self.max_queued_requests is not None \
            else default_max_queued
        if retry_after_s is not None:
            opts["backpressure_config"] = {"status_code": 429, "retry_after_s": retry_after_s}
        for key in ("health_check_period_s", "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s"):
            if getattr(self, key) is not None:
                opts[key] = getattr(self, key)
        actor = self.ray_actor_options.to_dict()
        actor.setdefault("num_cpus", default_cpus)
        opts["ray_actor_options"] = actor
        return opts

    def bundle(self, default_cpus: float) -> dict[str, float]:
        """One placement group bundle holding what one replica of this deployment asks for."""
        actor = self.ray_actor_options.to_dict()
        bundle = {"CPU": float(actor.get("num_cpus", default_cpus))}
        if actor.get("num_gpus"):
            bundle["GPU"] = float(actor["num_gpus"])
        # custom resources (the node-type convention: target_node) in the bundle, so it lands on a
        # node of that type and the replica actor fits its bundle 0
        bundle.update({k: float(v) for k, v in actor.get("resources", {}).items()})
        return bundle

    def rank_bundles(self, size: int, default_cpus: float) -> list[dict[str, float]]:
        """The placement group bundles of a replica with `size` tensor-parallel ranks."""
        if self.placement_group_bundles is not None:
            if len(self.placement_group_bundles) < size:
                raise ValueError(f"placement_group_bundles has {len(self.placement_group_bundles)} bundles; "
                                 f"tensor_parallel_size {size} needs one per rank")
            return [dict(b) for b in self.placement_group_bundles]
        return [self.bundle(default_cpus) for _ in range(size)]


class PrefixRoutingArgs(_Strict):
    """Prefix-aware routing across verifier replicas (deployments/replicas/prefix_router.py): a request goes
    to the replica sent the longest prefix of its prompt before, unless that one is much busier."""

    enabled: bool | None = None  # None: on where the verifier may run more than one replica
    # how many more ongoing requests than the least busy replica the prefix's replica may hold and
    # still get the request; None: half of engine.max_num_seqs (at least 1)
    imbalance_threshold: int | None = Field(None, ge=0)
    # below this share of the prompt matched, no replica is preferred (power of two choices)
    min_match_ratio: float = Field(0.1, ge=0, le=1)
    block_size: int = Field(64, ge=1)  # prompt units (characters, or ids of a token prompt) per hashed block
    max_entries: int = Field(200_000, ge=1)  # (block, replica) entries the router keeps, LRU evicted


INGRESS_NAME, VERIFIER_NAME, PROPOSER_NAME = "OpenAIIngress", "Verifier", "Proposer"
PREFIX_ROUTER = "deployments.replicas.prefix_router.PrefixAwareRouter"
REPIN_INTERVAL_S = 60.0  # a verifier's re-pin period when the proposer pool autoscales
ASYNC_METHODS = ("draft_model", "eagle3", "eagle")  # proposers that can pre-draft (rayspec.proposers.pre_draft)
INGRESS_RESERVE = 32  # Serve's max_ongoing_requests for the ingress: its admission gate + this


class AppArgs(_Strict):
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # the `model` clients send; default: `model`
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    topology: Literal["colocated", "disaggregated"] = "colocated"
    ingress: DeploymentArgs = Field(default_factory=DeploymentArgs)
    verifier: DeploymentArgs = Field(default_factory=DeploymentArgs)
    proposer: DeploymentArgs = Field(default_factory=DeploymentArgs)
    prefix_routing: PrefixRoutingArgs = Field(default_factory=PrefixRoutingArgs)
    # disaggregated: where proposers run. "pool": a Proposer deployment of its own, which verifier
    # replicas pin replicas of (scaled and placed by its own options). "paired": no Proposer
    # deployment; each verifier replica reserves one more placement group bundle (the proposer's
    # ray_actor_options) and runs its own proposer actor there (deployments/replicas/pairing.py), placed by
    # verifier.placement_group_strategy: STRICT_PACK the replica's node (another GPU), STRICT_SPREAD
    # another node.
    proposer_placement: Literal["pool", "paired"] = "pool"
    # disaggregated: how long a verifier step waits on its proposer call before stepping without
    # drafts (then it leaves the proposer alone for 1 s, doubling to 60 s while calls keep failing)
    proposer_call_timeout_s: float = Field(30.0, gt=0)
    # disaggregated: per-step calls over a direct socket to the pinned proposer replica ("direct",
    # deployments.transport.direct_channel; falls back to Serve when it cannot connect) or through Serve handles
    proposer_transport: Literal["direct", "serve"] = "direct"
    # the direct channel refuses frames longer than this (both ways; a call that would be longer goes
    # through Serve): checked from the length prefix, before anything is allocated
    proposer_channel_max_frame_mib: int = Field(256, ge=1, le=1 << 16)
    # disaggregated: a verifier replica pins itself to one proposer replica (its draft state lives
    # there) and pins again, letting Serve's router choose, this often: so verifiers spread over a
    # proposer pool that grew. A re-pin that lands elsewhere costs one resend of the sequences'
    # features (EAGLE). None: every REPIN_INTERVAL_S when the proposer pool autoscales, else never.
    proposer_repin_interval_s: float | None = Field(None, gt=0)
    # disaggregated: asynchronous drafting. After each answer the proposer pre-drafts the next
    # step for this many likeliest verdicts per sequence while the target verifies, and answers
    # from that speculation cache when the verdict matches (rayspec.proposers.pre_draft). 0: off.
    # draft_model, eagle3 and eagle (an EAGLE head pre-drafts from its own states in place of the
    # target's features of the hypothesised accepted tokens).
    proposer_async_hypotheses: int = Field(0, ge=0, le=64)
    # ... and when: 'measured' pre-drafts only while the verifier's measured cycle is shorter for it
    # (pre-drafting shares cores or a device with verification; rayspec.proposers.pre_draft);
    # 'always' pre-drafts every round and every hypothesis (a proposer on a device of its own).
    proposer_async_pacing: Literal["measured", "always"] = "measured"
    # clients must send `Authorization: Bearer <api_key>` on every route but /health; None: the
    # RAYSPEC_API_KEY environment variable, else no key. Goes to the ingress only, never into logs.
    api_key: SecretStr | None = None
    # without a key, requests from anywhere but this machine (a peer address outside loopback) are
    # refused (403): binding beyond loopback with no key serves nobody else unless this says so
    allow_unauthenticated: bool = False
    # admission control: what a refused request's 429 (or 503 while no verifier is up) tells the
    # client to wait, in its Retry-After header. The bounds themselves are each deployment's
    # max_ongoing_requests / max_queued_requests and engine.max_num_waiting (deployments/README.md).
    retry_after_s: float = Field(1.0, ge=0)
    # a request body longer than this is a 413, refused before it is parsed (deployments.frontend.admission)
    max_request_body_bytes: int = Field(16 << 20, ge=1 << 10)
    # ... and one not whole within this many seconds a 408 (a slow body holds a place in the gate)
    body_timeout_s: float = Field(30.0, gt=0)
    # /tokenize and /detokenize in flight per ingress replica, a lane beside generation's (past it: 429)
    max_ongoing_tokenizer: int = Field(4, ge=1)
    # requests (generation and tokenizer together) one client may have in flight per ingress replica;
    # past it that client gets 429s while others still get in. None: no per-client bound (one client
    # may fill the gate: right for a server of one user or one batch job). A client is its address,
    # or the value of `client_header` (behind a trusted proxy: "x-forwarded-for", or a tenant header)
    max_ongoing_per_client: int | None = Field(None, ge=1)
    client_header: str | None = None
    # admission by work (deployments.replicas.work_budget): tokens of work (prompt + max_tokens per
    # choice, prompts scored with logprobs and echoed weighted more) one verifier replica lets in at
    # once; past it a request gets a 429 at once, a request larger than all of it a 400. None: engine
    # max_num_seqs x max_model_len (a full batch of the longest sequences)
    work_budget_tokens: int | None = Field(None, ge=1)
    # a header naming the request's tenant, set by a trusted proxy (e.g. "x-tenant-id"): requests of
    # different tenants never share cached prefixes (each tenant's salts its prefix cache; without the
    # header a request is tenant ""). None: one cache for all (a request's own cache_salt still splits it)
    tenant_header: str | None = None
    # tool_choice "auto": the format tool calls are read out of the model's text in (rayspec.sampling.tool_parsers);
    # None: found from the markers in the model's chat template
    tool_call_parser: Literal["llama3_json", "hermes", "mistral"] | None = None
    # a verifier replica with requests queued or running whose engine has finished no step for this
    # long (a CUDA/NCCL call or a grammar step that hangs) fails Serve's health check, so Serve
    # replaces it and its requests fail over as from a dead replica. Above the longest step expected
    # (a shape compiled when first seen). None: no watchdog
    step_watchdog_s: float | None = Field(120.0, gt=0)
    # each request's deadline, from when the ingress takes it (over failovers too): past it the request
    # ends with a 504 (OpenAI error JSON, code request_timeout) and is aborted in the engine. None: none
    request_timeout_s: float | None = Field(600.0, gt=0)
    # a request not started (first output after its prefill) within this many seconds of the ingress
    # taking it, waiting in Serve's queue for a verifier place or in the engine's for a batch place,
    # is refused: 429 with Retry-After (code server_overloaded), its place and work freed. None: it waits
    queue_timeout_s: float | None = Field(60.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _vllm_dialect(cls, data: Any) -> Any:
        """vLLM's names onto ours: `speculative_config`, engine keys at the top level (deployments/vllm_names.py)."""
        return translate_vllm_args(data, app_fields=set(cls.model_fields), engine_fields=field_names(EngineSettings),
                                   spec_fields=field_names(SpeculativeConfig))

    @field_validator("api_key")
    @classmethod
    def _non_empty_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("api_key must not be empty (leave it out for no key)")
        return key

    @field_validator("model")
    @classmethod
    def _local_model(cls, spec: str) -> str:
        return resolve_local_path(spec)

    @field_validator("speculative")
    @classmethod
    def _served_proposer(cls, spec: SpeculativeConfig) -> SpeculativeConfig:
        if feeds_target_features(spec.method) and not spec.draft_model:
            raise ValueError(f"method {spec.method!r} needs the EAGLE head's location in draft_model")
        local = resolve_local_path(spec.draft_model)
        return spec if local == spec.draft_model else dataclasses.replace(spec, draft_model=local)

    @model_validator(mode="after")
    def _topology(self):
        if self.topology == "disaggregated" and (self.speculative.draft_tensor_parallel_size or 1) > 1:
            raise ValueError("draft_tensor_parallel_size > 1 splits the draft over the verifier's ranks: "
                             "topology must be colocated (a disaggregated proposer runs the draft whole)")
        if self.proposer_async_hypotheses and (self.topology != "disaggregated"
                                               or self.speculative.method not in ASYNC_METHODS):
            raise ValueError("proposer_async_hypotheses needs topology 'disaggregated' and a method among "
                             f"{ASYNC_METHODS}")
        if self.proposer_async_pacing != "measured" and not self.proposer_async_hypotheses:
            raise ValueError("proposer_async_pacing paces pre-drafting: it needs proposer_async_hypotheses > 0")
        if self.topology == "disaggregated" and self.speculative.method == "none":
            raise ValueError("topology 'disaggregated' needs a speculative method; method 'none' has no proposer")
        if self.paired:
            if self.topology != "disaggregated":
                raise ValueError("proposer_placement 'paired' needs topology 'disaggregated' (colocated: the "
                                 "proposer already runs inside the verifier replica)")
            options = self.proposer.model_dump()  # (the proposer deployment's options)
            pool = [key for key in ("num_replicas", "autoscaling_config", "max_ongoing_requests",
                                    "max_queued_requests", "placement_group_bundles") if options[key] is not None]
            if pool or self.proposer_repin_interval_s is not None:
                raise ValueError(f"proposer_placement 'paired' runs one proposer per verifier replica: "
                                 f"{pool or ['proposer_repin_interval_s']} apply to a proposer pool only "
                                 "(the verifier's options scale and place the pairs)")
        return self

    @property
    def paired(self) -> bool:
        return self.proposer_placement == "paired"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        engine = dataclasses.asdict(self.engine)
        if engine["max_num_waiting"] is None:  # all a verifier replica takes in beyond its running ones
            engine["max_num_waiting"] = max(0, self.verifier_max_ongoing - self.engine.max_num_seqs)
        # a copy of the speculative settings: the engine's may be changed without changing these
        return EngineConfig(model=self.model, speculative=dataclasses.replace(self.speculative), **engine)

    # ---- deployment options -------------------------------------------------------------
    @property
    def work_budget(self) -> int | None:
        """A verifier replica's work budget in tokens (deployments.replicas.work_budget); None: not known
        before the model is (its max_model_len from the model's config)."""
        from deployments.replicas.work_budget import default_work_budget

        if self.work_budget_tokens or not self.engine.max_model_len:
            return self.work_budget_tokens
        return default_work_budget(self.engine.max_num_seqs, self.engine.max_model_len)

    @property
    def verifier_max_ongoing(self) -> int:
        # requests past the KV slots wait inside the engine (continuous batching), so accept more
        return self.verifier.max_ongoing_requests or 4 * self.engine.max_num_seqs

    @property
    def ingress_max_ongoing(self) -> int:
        """HTTP generation requests one ingress replica holds at once (its admission gate; past it: 429)."""
        return self.ingress.max_ongoing_requests or max(64, self.verifier_max_ongoing * self.verifier.max_replicas)

    def ingress_options(self) -> dict[str, Any]:
        # Serve lets INGRESS_RESERVE more in than the gate: health probes, /v1/models and the gate's own
        # 429s (OpenAI JSON) get through while generation fills the gate; past that the proxy queues
        # up to max_queued_requests, then answers 429 itself (plain text, with Retry-After)
        return self.ingress.options(name=INGRESS_NAME, default_cpus=0.5, default_max_ongoing=self.ingress_max_ongoing,
                                    extra_ongoing=INGRESS_RESERVE,
                                    # the proxy's queue also holds requests being routed: a burst arrives
                                    # there at once, so it is sized for bursts, not for waiting
                                    default_max_queued=max(256, 4 * self.ingress_max_ongoing),
                                    retry_after_s=self.retry_after_s)

    def verifier_options(self) -> dict[str, Any]:
        # each ingress replica queues at most max_queued_requests for busy verifiers; past that a
        # BackPressureError, which the ingress answers with a 429
        opts = self.verifier.options(name=VERIFIER_NAME, default_cpus=1, default_max_ongoing=self.verifier_max_ongoing,
                                     # also holds requests being routed, and one HTTP request fans out to
                                     # prompts x n of them: sized for bursts, not for waiting
                                     default_max_queued=max(256, 4 * self.verifier_max_ongoing),
                                     retry_after_s=self.retry_after_s)
        if self.prefix_routing_enabled:
            opts["request_router_config"] = self.request_router_config()
        size = self.engine.tensor_parallel_size
        if size > 1 or self.verifier.placement_group_bundles is not None or self.paired:
            bundles = self.verifier.rank_bundles(size, default_cpus=1)
            if self.paired:  # the replica's own proposer, after the ranks' bundles: always the last
                bundles.append(self.proposer.bundle(default_cpus=1))
            opts["placement_group_bundles"] = bundles
            opts["placement_group_strategy"] = self.verifier.placement_group_strategy
        return opts

    @property
    def prefix_routing_enabled(self) -> bool:
        enabled = self.prefix_routing.enabled
        return self.verifier.max_replicas > 1 if enabled is None else enabled

    def request_router_config(self) -> dict[str, Any]:
        """The verifier's Serve request_router_config with prefix routing (PrefixAwareRouter's kwargs)."""
        routing = self.prefix_routing
        threshold = routing.imbalance_threshold
        return {"request_router_class": PREFIX_ROUTER, "request_router_kwargs": {
            "imbalance_threshold": max(1, self.engine.max_num_seqs // 2) if threshold is None else threshold,
            "min_match_ratio": routing.min_match_ratio, "block_size": routing.block_size,
            "max_entries": routing.max_entries}}

    def proposer_options(self) -> dict[str, Any]:
        # every verifier replica has at most one propose call in flight (plus one release flush)
        opts = self.proposer.options(name=PROPOSER_NAME, default_cpus=1,
                                     default_max_ongoing=2 * self.verifier.max_replicas + 2)
        if "autoscaling_config" in opts:  # its own signal: busy drafting, not ongoing calls
            opts["autoscaling_config"] = proposer_autoscaling_config(opts["autoscaling_config"])
        return opts

    @property
    def repin_interval_s(self) -> float | None:
        """How often a verifier re-pins to a proposer replica (RemoteProposer); see proposer_repin_interval_s."""
        if self.proposer_repin_interval_s is not None:
            return self.proposer_repin_interval_s
        return REPIN_INTERVAL_S if self.proposer.autoscaling_config is not None else None

    def proposer_num_slots(self) -> int:
        """Draft-model KV slots in one proposer replica: every verifier replica's sequences may land
        there (paired: its own verifier's only)."""
        return self.engine.max_num_seqs * (1 if self.paired else self.verifier.max_replicas)


def replica_device(configured: str | None) -> str:
    """The device a replica uses: the configured one, else CUDA only when Ray assigned this replica a GPU."""
    if configured:
        return configured
    import ray
    import torch

    has_gpu = True  # outside Ray: whatever torch sees
    if ray.is_initialized():  # (asking a process outside Ray would start a Ray instance, or join a running one)
        try:
            has_gpu = bool(ray.get_gpu_ids())
        except Exception:  # noqa: BLE001 - not a Ray worker
            pass
    return "cuda" if has_gpu and torch.cuda.is_available() else "cpu"


API_KEY_ENV = "RAYSPEC_API_KEY"


def resolve_api_key(configured: SecretStr | str | None) -> SecretStr | None:
    """The key the ingress asks for: the configured one, else $RAYSPEC_API_KEY, else None (open)."""
    if configured is None:
        configured = os.environ.get(API_KEY_ENV, "").strip() or None
    if configured is None or isinstance(configured, SecretStr):
        return configured
    return SecretStr(configured)


def load_app_args(args: dict | AppArgs | None) -> AppArgs:
    if isinstance(args, AppArgs):
        return args
    return AppArgs.model_validate(args or {})
