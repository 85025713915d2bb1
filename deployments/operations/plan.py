"""`rayspec plan CONFIG`: the memory each deployment of a serve config needs, per replica and per
GPU, from the models' config.json files alone (no weights are loaded or downloaded).

The sizing is rayspec.memory.plan's (the engine sizes its KV cache with the same function); this
module reads the serve config as deployments.app does (AppArgs), finds the model shapes, and
sets the figures against a GPU size. Ray's fractional `num_gpus` is a scheduling share, not a
memory limit: replicas packed onto one GPU share its memory, so the worst packing is checked too.
A tensor-parallel verifier replica is N processes, one per placement-group bundle (rank 0 is the
replica itself): each is planned and checked against a GPU of its own (its bundle's share).

It also prints what each deployment asks Ray to schedule, against this machine (deployments.operations.resources).

(Over 500 lines: the plan and its two renderings, text and JSON, walk the same AppPlan; the checkpoint
sizes and the GPU fit table are the next split, with the renderings, if it grows.)
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deployments.config import AppArgs, load_app_args
from deployments.dialects import APP_IMPORT_PATHS, app_args_of
from deployments.operations.resources import Machine, ResourcePlan, resource_lines, resource_plan, resources_json
from rayspec.memory.plan import GB, DraftShape, ProcessPlan, engine_plan, proposer_plan
from rayspec.memory.weight_memory import ModelShape, as_shape, causal_lm_weights, generic_weights
from rayspec.model.families import ModelArgs
from rayspec.model.weights import files, hub

_UNITS = {"": GB, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": GB, "gb": GB, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'80GB' / '80G' / '80' -> 80 x 10^9 bytes; '80GiB' -> 80 x 2^30 (also k, M, T and their -iB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 80GB (10^9 bytes) or 80GiB (2^30)")
    return int(float(match.group(1)) * _UNITS[unit])


def read_serve_config(path: str | Path, app: str | None = None) -> list[tuple[str, dict]]:
    """(name, args) of each rayspec application in a serve config (or only the one named `app`)."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text()) or {}
    apps = [a for a in doc.get("applications") or [] if a.get("import_path") in APP_IMPORT_PATHS]
    if app is not None:
        apps = [a for a in apps if a.get("name") == app]
    if not apps:
        raise ValueError(f"{path} has no rayspec application (import_path one of {list(APP_IMPORT_PATHS)})"
                         + (f" named {app!r}" if app else ""))
    return [(a.get("name", "default"), app_args_of(a)) for a in apps]


def cpu_only_configs(configs_dir: str | Path) -> list[Path]:
    """The serve configs in a directory none of whose deployments asks Ray for a GPU, even at their
    autoscaling maximum (no model is read): those `serve run` must start on a machine without one."""
    out = []
    for path in sorted(Path(configs_dir).glob("*.yaml")):
        try:
            apps = read_serve_config(path)
        except ValueError:  # not a serve config of ours (configs/cluster.yaml: a cluster launcher's)
            continue
        if all(resource_plan(load_app_args(args)).gpus(at_max=True) == 0 for _, args in apps):
            out.append(path)
    return out


# ---- model shapes from config files ------------------------------------------------------------

def shape_of(hf_config) -> ModelShape:
    """How the planner counts a model: natively (rayspec.model.native's formula) when ModelArgs accepts its
    config and the formula counts every parameter transformers' own model of it has; otherwise as
    the generic path loads it (rayspec.model.generic: transformers' model, e.g. gpt_oss's experts
    and attention sinks, which the formula knows nothing of), counted from a meta-device build."""
    from rayspec.model.generic import args_from_config

    try:
        args = ModelArgs.from_hf_config(hf_config)
    except ValueError:  # a family rayspec.model.native refuses (UnsupportedArchitectureError is one)
        args = None
    try:
        reference = generic_weights(hf_config, torch.float32).num_params
    except ValueError:  # transformers has no model class for it: only the native formula can count it
        if args is None:
            raise
        return ModelShape(args)
    if args is not None and causal_lm_weights(args, torch.float32).num_params == reference:
        return ModelShape(args)
    return ModelShape(args_from_config(hf_config), generic=hf_config)


def model_shape(spec: str, num_layers: int | None = None, quantized_weights: str = "keep") -> ModelShape:
    """The shape of model `spec` from its config file; num_layers keeps the first layers (as
    loader.load_model and load_generic_model cut a self-draft). quantized_weights (EngineSettings'): a
    4-bit checkpoint's weights counted as held, 4-bit ("keep") or at the engine's dtype ("dequantize")."""
    config = hub.load_model_config(spec)
    if num_layers is not None:
        config = copy.deepcopy(config)
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:num_layers]
    shape = shape_of(config)
    if shape.generic is not None:
        return shape
    if quantized_weights == "dequantize":
        return dataclasses.replace(shape, args=dataclasses.replace(shape.args, mxfp4_experts=False))
    return dataclasses.replace(shape, dense_4bit=dense_4bit_group(hub.model_quantization(spec), shape.args))


def dense_4bit_group(quantization, args: ModelArgs) -> int | None:
    """The group size of a checkpoint's 4-bit decoder projections (16 NVFP4, 32 MXFP4), None where they are
    float: ModelOpt's NVFP4 quantizes them; an MXFP4 mixture of experts (gpt-oss) only its experts."""
    from rayspec.model.formats import MXFP4, NVFP4

    if quantization is None or (quantization.algo == MXFP4 and args.num_experts):
        return None
    return {NVFP4: 16, MXFP4: 32}.get(quantization.algo)


def draft_shape(spec, target_model: str, target: ModelArgs | ModelShape, quantized_weights: str = "keep") -> DraftShape:
    """What the proposer of `spec` (a SpeculativeConfig, as a serve config's `speculative`)
    loads for the target `target_model`: a draft LM's shape (draft_num_layers applied, as
    load_model does), or an EAGLE head's config; where the head is a local safetensors checkpoint
    its tensor names tell whether it has an embedding of its own (else: the target's is shared)."""
    from rayspec.eagle.checkpoint import eagle_config_from_hf
    from rayspec.proposers import PROPOSERS
    from rayspec.proposers.draft_model import DraftModelProposer
    from rayspec.proposers.eagle import EagleProposer

    target = as_shape(target).args
    cls = PROPOSERS[spec.method]
    if issubclass(cls, DraftModelProposer):
        draft = model_shape(spec.draft_model or target_model, spec.draft_num_layers,
                            "dequantize" if spec.draft_quantization else quantized_weights)
        return DraftShape(model=draft.args, model_generic=draft.generic, model_dense_4bit=draft.dense_4bit)
    if issubclass(cls, EagleProposer):
        config_file = hub.model_config_file(spec.draft_model)
        names = files.weight_names(config_file.parent)
        names = None if names is None else {n.removeprefix("model.") for n in names}  # as read_state_dict
        # without tensor names (a hub id, a .bin checkpoint): an fc bias as the published EAGLE-1 heads have
        fc_bias = "fc.bias" in names if names is not None else cls.kind == "eagle"
        head = eagle_config_from_hf(json.loads(config_file.read_text()), target.num_layers, target.hidden_size,
                                    fc_bias=fc_bias)
        return DraftShape(head=head, head_has_embedding=names is not None and "embed_tokens.weight" in names)
    return DraftShape()


# ---- deployments and GPUs ----------------------------------------------------------------------

@dataclass(frozen=True)
class Tenant:
    """Processes of one kind that Ray places on GPUs: `count` of them, each on `share` of a GPU."""

    deployment: "DeploymentPlan"
    label: str  # "" (a whole replica), "rank 0", "ranks 1-3"
    process: ProcessPlan
    count: int
    share: float

    @property
    def name(self) -> str:
        return f"{self.deployment.name} {self.label}".rstrip()


def _share(num_gpus: float | None) -> float:
    """The part of one GPU a process is scheduled on (each uses one device; none given: a whole one)."""
    return num_gpus if num_gpus and num_gpus < 1 else 1.0


@dataclass
class DeploymentPlan:
    name: str
    replicas: int  # at most (autoscaling: max_replicas)
    num_gpus: float | None  # per replica (with tp: per rank), from ray_actor_options
    process: ProcessPlan  # the replica's process (with tp: rank 0)
    follower: ProcessPlan | None = None  # with tp: each of ranks 1..N-1
    bundles: list[dict[str, float]] = field(default_factory=list)  # with tp: the placement group, rank 0's first
    strategy: str | None = None

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.process.device).type == "cuda"

    @property
    def tp_size(self) -> int:
        return self.process.tp_size

    @property
    def share(self) -> float:
        """The part of one GPU the replica's process (rank 0) is scheduled on."""
        return _share(self.bundles[0].get("GPU") if self.bundles else self.num_gpus)

    @property
    def gpus_per_replica(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles) if self.bundles else (self.num_gpus or 0.0)

    def tenants(self) -> list[Tenant]:
        if self.follower is None:
            return [Tenant(self, "", self.process, self.replicas, self.share)]
        # ranks 1..N-1 of one replica have the same shard: one tenant kind per bundle share
        followers: dict[float, int] = {}
        for bundle in self.bundles[1:self.tp_size]:
            share = _share(bundle.get("GPU"))
            followers[share] = followers.get(share, 0) + self.replicas
        label = "ranks 1" + (f"-{self.tp_size - 1}" if self.tp_size > 2 else "")
        return [Tenant(self, "rank 0", self.process, self.replicas, self.share)] + \
            [Tenant(self, label, self.follower, count, share) for share, count in followers.items()]

    def budget(self, gpu_memory: int | None, share: float | None = None) -> int | None:
        if gpu_memory is None or not self.on_gpu:
            return None
        return int((self.share if share is None else share) * gpu_memory)


# ---- the memory plan of an application -------------------------------------------------------------

@dataclass
class AppPlan:
    config: str
    name: str
    args: AppArgs
    target: ModelArgs
    draft: DraftShape
    resources: ResourcePlan
    deployments: list[DeploymentPlan] = field(default_factory=list)
    generic: bool = False  # the target runs on the generic path
    checkpoints: list["CheckpointSize"] = field(default_factory=list)  # the quantized ones
    fit: list["FitRow"] | None = None  # fit_table's rows, when asked for

    def tenants(self) -> list[Tenant]:
        return [t for d in self.deployments if d.on_gpu for t in d.tenants()]

    def worst_gpu(self) -> list[tuple[Tenant, int]]:
        """The processes Ray may pack onto one GPU that need the most memory together: (tenant,
        count) with fractional shares summing to at most 1; a whole-GPU process is alone."""
        gpu = self.tenants()
        best, best_bytes = [], -1
        ranges = [range(min(t.count, int(1 / t.share + 1e-9)) + 1) for t in gpu]
        for counts in itertools.product(*ranges):
            if sum(counts) == 0 or sum(c * t.share for c, t in zip(counts, gpu)) > 1 + 1e-9:
                continue
            need = sum(c * t.process.peak for c, t in zip(counts, gpu))
            if need > best_bytes:
                best, best_bytes = [(t, c) for t, c in zip(gpu, counts) if c], need
        return best

    def fits(self, gpu_memory: int) -> bool:
        worst = self.worst_gpu()
        return all(t.process.peak <= t.share * gpu_memory for t in self.tenants()) and \
            sum(c * t.process.peak for t, c in worst) <= gpu_memory


def plan_app(config: str, name: str, args: dict | AppArgs) -> AppPlan:
    cfg = load_app_args(args)
    engine = cfg.engine_config()
    target = model_shape(cfg.model, quantized_weights=engine.quantized_weights)
    draft = draft_shape(cfg.speculative, cfg.model, target, engine.quantized_weights)
    app = AppPlan(config, name, cfg, target.args, draft, resource_plan(cfg), generic=target.generic is not None)

    def device(deployment) -> str:  # as deployments.config.replica_device: CUDA when Ray gives a GPU
        return cfg.engine.device or ("cuda" if deployment.ray_actor_options.num_gpus else "cpu")

    colocated = cfg.topology == "colocated"
    tp_size = engine.tensor_parallel_size
    verifier = DeploymentPlan(
        "Verifier", cfg.verifier.max_replicas, cfg.verifier.ray_actor_options.num_gpus,
        engine_plan(engine, target, device(cfg.verifier), draft, proposer_in_process=colocated))
    if tp_size > 1:  # as AppArgs.verifier_options: one bundle per rank, the ranks on their own devices
        verifier.follower = engine_plan(engine, target, device(cfg.verifier), draft, proposer_in_process=colocated,
                                        rank=1)
        verifier.bundles = cfg.verifier.rank_bundles(tp_size, default_cpus=1)
        verifier.strategy = cfg.verifier.placement_group_strategy
    app.deployments.append(verifier)
    if not colocated:  # paired: one proposer per verifier replica, in the last bundle of its group
        app.deployments.append(DeploymentPlan(
            "Proposer (paired)" if cfg.paired else "Proposer",
            cfg.verifier.max_replicas if cfg.paired else cfg.proposer.max_replicas,
            cfg.proposer.ray_actor_options.num_gpus,
            proposer_plan(engine, target, device(cfg.proposer), draft, cfg.proposer_num_slots())))
    return app


def plan_config(path: str | Path, app: str | None = None, fit: bool = False) -> list[AppPlan]:
    """Each application's plan; with `fit` (or a quantized checkpoint) its fit_table too."""
    plans = []
    for name, args in read_serve_config(path, app):
        plan = plan_app(str(path), name, args)
        plan.checkpoints = checkpoint_sizes(plan)
        if fit or plan.checkpoints:
            plan.fit = fit_table(str(path), name, args)
        plans.append(plan)
    return plans


# ---- quantized checkpoints: stored and loaded size; where a config fits ------------------------

# the GPU sizes fit_table checks (GB = 10^9 bytes)
FIT_GPUS = (("80 GB (H100, A100 80GB)", 80 * GB), ("128 GB (DGX Spark, unified)", 128 * GB), ("141 GB (H200)", 141 * GB))
FIT_TP_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class CheckpointSize:
    role: str  # "target" or "draft"
    spec: str
    algo: str  # rayspec.model.formats: NVFP4, MXFP4
    source: str  # the file that said so
    stored: int  # bytes of the checkpoint's weights as stored (what a download is, roughly)
    quantized_params: int
    num_params: int
    loaded: int  # bytes of the weights once loaded (dequantized) at `dtype`
    dtype: torch.dtype
    kept_quantized: bool = False  # loaded as stored (a native gpt-oss's MXFP4 experts), not dequantized


def _meta_model(shape: ModelShape):
    """The model the engine builds for `shape`, on the meta device (no memory): rayspec's own, or
    transformers' for the generic path."""
    if shape.generic is not None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(shape.generic))
    from rayspec.model.native import CausalLM

    with torch.device("meta"):
        return CausalLM(shape.args, torch.zeros(shape.args.head_dim // 2), 1.0)


def checkpoint_size(role: str, spec: str, shape: ModelShape, dtype: torch.dtype) -> CheckpointSize | None:
    """Stored and loaded weight bytes of a quantized checkpoint (None: a float one), from config files."""
    from rayspec.model.formats import stored_bytes

    quantization = hub.model_quantization(spec)
    if quantization is None:
        return None
    model = _meta_model(shape)
    stored, quantized = stored_bytes(model, quantization, float_bytes=2)  # the rest: bfloat16, as published
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    args = shape.args
    if shape.generic is None and args.mxfp4_experts:  # held as codes and scales: count the weights they stand for
        quantized = args.num_layers * args.num_experts * 3 * args.hidden_size * args.intermediate_size
        num_params = shape.weights(dtype).num_params
    kept = shape.generic is None and (args.mxfp4_experts or shape.dense_4bit is not None)
    return CheckpointSize(role, spec, quantization.algo, quantization.source, stored, quantized, num_params,
                          shape.weights(dtype).bytes, dtype, kept_quantized=kept)


def checkpoint_sizes(app: AppPlan) -> list[CheckpointSize]:
    cfg = app.args
    dtype = app.deployments[0].process.dtype
    keep = cfg.engine_config().quantized_weights
    out = [checkpoint_size("target", cfg.model, model_shape(cfg.model, quantized_weights=keep), dtype)]
    if app.draft.model is not None:
        spec = cfg.speculative.draft_model or cfg.model
        draft_keep = "dequantize" if cfg.speculative.draft_quantization else keep
        out.append(checkpoint_size("draft", spec, model_shape(spec, cfg.speculative.draft_num_layers, draft_keep), dtype))
    return [c for c in out if c is not None]


@dataclass(frozen=True)
class FitRow:
    tp_size: int
    need: int | None  # bytes on the fullest GPU; None: this size cannot be planned (`why`)
    fits: tuple[bool, ...] = ()  # per FIT_GPUS
    why: str = ""


def fit_table(config: str, name: str, args: dict) -> list[FitRow]:
    """The application as configured, at each of FIT_TP_SIZES (one bundle per rank), against FIT_GPUS."""
    rows = []
    for tp in FIT_TP_SIZES:
        varied = copy.deepcopy(args)
        varied.setdefault("engine", {})["tensor_parallel_size"] = tp
        try:
            plan = plan_app(config, name, varied)
        except ValueError as err:
            rows.append(FitRow(tp, None, why=str(err).splitlines()[0]))
            continue
        need = sum(c * t.process.peak for t, c in plan.worst_gpu())
        rows.append(FitRow(tp, need, tuple(plan.fits(size) for _, size in FIT_GPUS)))
    return rows


def _checkpoint_lines(app: AppPlan) -> list[str]:
    out = []
    for c in app.checkpoints:
        out.append(f"  {c.role} {c.spec}: {c.algo} ({c.source}), {c.quantized_params / 1e9:.2f} B of "
                   f"{c.num_params / 1e9:.2f} B parameters quantized: stored {fmt_bytes(c.stored)}, loaded "
                   f"{fmt_bytes(c.loaded)} in {str(c.dtype).removeprefix('torch.')} "
                   f"({'kept 4-bit' if c.kept_quantized else 'dequantized at load'})")
    return out


def _fit_lines(app: AppPlan) -> list[str]:
    out = ["", "fit, as configured at tensor_parallel_size " + ", ".join(str(tp) for tp in FIT_TP_SIZES)
           + " (the fullest GPU: weights, KV cache, activations, load peak):"]
    for row in app.fit:
        if row.need is None:
            out.append(f"  tp {row.tp_size}: not possible: {row.why}")
            continue
        verdicts = "; ".join(f"{'fits' if ok else 'does not fit'} {gpu}" for (gpu, _), ok in zip(FIT_GPUS, row.fits))
        out.append(f"  tp {row.tp_size}: {fmt_bytes(row.need)} per GPU: {verdicts}")
    return out


# ---- output ------------------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _describe_models(app: AppPlan) -> list[str]:
    t, cfg = app.target, app.args
    lines = [f"  target {cfg.model}: {t.num_layers} layers, hidden {t.hidden_size}, {t.num_heads} heads "
             f"({t.num_kv_heads} KV) x {t.head_dim}, vocab {t.vocab_size:,}"
             + (" (generic path: weights from transformers' model of its config)" if app.generic else "")]
    spec = cfg.speculative
    if app.draft.model is not None:
        lines.append(f"  proposer draft_model: {spec.draft_model or cfg.model}, {app.draft.model.num_layers} layers")
    elif app.draft.head is not None:
        h = app.draft.head
        lines.append(f"  proposer {spec.method}: {spec.draft_model}, {h.args.num_layers} layer(s), "
                     f"draft vocab {h.draft_vocab_size:,}")
    else:
        lines.append(f"  proposer {spec.method}: no model")
    return lines


def _activation_line(process: ProcessPlan) -> str:
    a = process.activations
    parts = [("scores", a.scores), ("MLP", a.mlp), ("logits", a.logits), ("features", a.features),
             ("hidden/qkv/mask", a.hidden + a.qkv + a.mask)]
    terms = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in parts if n)
    return (f"upper bound, {a.tokens:,} tokens x {a.kv_len:,} keys: {terms} "
            f"(with a fused attention kernel: {fmt_bytes(a.without_scores)})")


def _process_rows(p: ProcessPlan, indent: str = "  ") -> list[str]:
    rows = [(item.name, item.bytes, item.detail) for item in p.items] or [("(no model)", 0, "")]
    rows.append(("resident", p.resident, ""))
    if p.activations is not None:
        rows.append(("forward activations", p.activations.total, _activation_line(p)))
    rows.append(("total", p.total, "resident + activations"))
    rows.append(("load peak", p.load_peak, p.load_detail))
    return [f"{indent}{name:<30}{fmt_bytes(n):>11}  {detail}".rstrip() for name, n, detail in rows]


def format_app(app: AppPlan, gpu_memory: int | None, machine: Machine | None = None) -> str:
    cfg = app.args
    out = [f"{app.config}: application {app.name!r}, topology {cfg.topology}"]
    out += _describe_models(app)
    out += _checkpoint_lines(app)
    chunk = cfg.engine.max_num_batched_tokens
    out.append(f"  engine: max_model_len {cfg.engine.max_model_len:,}, max_num_seqs {cfg.engine.max_num_seqs}, "
               f"kv_cache_memory_gb {cfg.engine.kv_cache_memory_gb:g} GiB"
               + (" (over all ranks)" if cfg.engine.tensor_parallel_size > 1 else "")
               + f", max_num_batched_tokens {'None (unchunked)' if chunk is None else f'{chunk:,}'}"
               + (f", tensor_parallel_size {cfg.engine.tensor_parallel_size}"
                  if cfg.engine.tensor_parallel_size > 1 else ""))
    for d in app.deployments:
        p = d.process
        where = (f"num_gpus {d.num_gpus:g}" if d.num_gpus else "no num_gpus") + \
            f": {p.device}, {str(p.dtype).removeprefix('torch.')}"
        out.append("")
        if d.follower is not None:
            kinds = {}  # bundle -> how many, in order
            for b in d.bundles:
                key = ", ".join(f"{k}: {v:g}" for k, v in b.items())
                kinds[key] = kinds.get(key, 0) + 1
            bundles = ", ".join(f"{n} x {{{key}}}" for key, n in kinds.items())
            out.append(f"{d.name}: {d.replicas} replica{'s' if d.replicas > 1 else ''}, tensor_parallel_size "
                       f"{d.tp_size}: {d.gpus_per_replica:g} GPUs per replica (placement group {d.strategy}: "
                       f"{bundles}), {p.device}, {str(p.dtype).removeprefix('torch.')}")
        else:
            out.append(f"{d.name}: {d.replicas} replica{'s' if d.replicas > 1 else ''}, {where}"
                       + ("" if d.on_gpu else " (host memory; no GPU)"))
            if d.num_gpus and d.num_gpus > 1:
                out.append(f"  (num_gpus {d.num_gpus:g}: a replica uses one device; the plan is for one GPU)")
        for tenant in d.tenants():
            q = tenant.process
            indent = "  "
            if d.follower is not None:
                role = "the replica's process: scheduler, sampling" + (", proposer" if q.draft_kv else "") \
                    if q.rank == 0 else "each"
                out.append(f"  {tenant.label} ({role}):")
                indent = "    "
            out += _process_rows(q, indent)
            budget = d.budget(gpu_memory, tenant.share)
            if budget is not None:
                share = f" (its {tenant.share:g} of {fmt_bytes(gpu_memory)})" if tenant.share < 1 else ""
                out.append(f"{indent}per {'GPU' if d.follower is not None else 'replica'}: "
                           f"{_verdict(q.peak, budget)}{share}")
        if p.kv is not None and p.kv.sequences_of(p.kv.capacity) < cfg.engine.max_num_seqs:
            out.append(f"  note: kv_cache_memory_gb {cfg.engine.kv_cache_memory_gb:g} GiB holds "
                       f"{p.kv.sequences_of(p.kv.capacity)} sequences of max_model_len at once, fewer than "
                       f"max_num_seqs {cfg.engine.max_num_seqs} (shorter ones share its {p.kv.num_blocks:,} blocks; "
                       f"the youngest is preempted when they run out)")
    if gpu_memory is not None and any(d.on_gpu for d in app.deployments):
        worst = app.worst_gpu()
        need = sum(c * t.process.peak for t, c in worst)
        packed = " + ".join(f"{c} {t.name} x {t.share:g}" for t, c in worst)
        out.append("")
        out.append(f"per GPU ({fmt_bytes(gpu_memory)}), the fullest packing Ray may make ({packed}): "
                   f"{_verdict(need, gpu_memory)}")
        gpus = sum(d.replicas * d.gpus_per_replica for d in app.deployments)
        out.append(f"verdict: {'fits' if app.fits(gpu_memory) else 'does not fit'} in {fmt_bytes(gpu_memory)} per GPU "
                   f"(GPUs of all replicas: {gpus:g})")
    if app.fit is not None:
        out += _fit_lines(app)
    out += [""] + resource_lines(app.resources, machine or Machine.detected())
    out += measured_step_lines(app.target)
    return "\n".join(out)


# the shapes benchmarks/gpu_roofline.py measures (its SHAPES): (vocab, hidden, intermediate, layers, heads, kv heads)
ROOFLINE_SHAPES = {"llama3.1-8b": (128256, 4096, 14336, 32, 32, 8)}
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def measured_step_lines(target: ModelArgs, results_dir: Path = RESULTS_DIR) -> list[str]:
    """What a GPU measured for a target of these shapes, read where the repository is at hand: end to end
    (benchmarks/results/gpu_engine_*.json: tokens out of LLMEngine, the figure a user gets) first, then
    the forward-only step (gpu_roofline_*.json: the compiled forward + LM head + argmax, no token read
    back, no scheduling or drafting), labelled so: a forward-only tok/s is a bound, not what is served."""
    dims = (target.vocab_size, target.hidden_size, target.intermediate_size, target.num_layers, target.num_heads,
            target.num_kv_heads)
    shape = next((name for name, d in ROOFLINE_SHAPES.items() if d == dims), None)
    out = []
    for path in sorted(results_dir.glob("gpu_engine_*.json")) if shape else []:
        data = _read_json(path)
        runs = [r for r in (data or {}).get("runs", []) if r.get("tok_s") and (data.get("args") or {}).get("shape") == shape]
        # a speculative (oracle) run whose greedy outputs differ from the target's, or whose drafts were not
        # accepted (under half its acceptance target), measured no speculation: the H200's first runs, whose
        # random bfloat16 target left the oracle's recorded continuation within a few tokens
        def unequal(r):
            return any(v.split("/")[0] != v.split("/")[-1] for k, v in r.items()
                       if k.startswith("outputs_equal_vs_") and isinstance(v, str))

        failed = [r for r in runs if r.get("acceptance_target") and (
            unequal(r) or r.get("acceptance_length", 0) < r["acceptance_target"] / 2)]
        runs = [r for r in runs if r not in failed and "eager" not in r["config"]]
        if not runs:
            continue
        gpu = (data.get("summary") or {}).get("gpu") or (data.get("environment") or {}).get("gpu_model") or "a GPU"
        each = "; ".join(f"{r['config']}" + (f" (acceptance length {r['acceptance_length']:.1f})" if r.get("acceptance_target") else "")
                         + f" batch {r['batch']} {r['tok_s']:,.0f} tok/s" for r in runs)
        out.append(f"measured end to end on {gpu} ({shape} shapes, random weights, LLMEngine, "
                   f"benchmarks/results/{path.name}): {each}"
                   + (f" ({len(failed)} speculative run(s) left out: outputs unlike the target's, or under half"
                      " their acceptance target)" if failed else ""))
    for path in sorted(results_dir.glob("gpu_roofline_*.json")) if shape else []:
        data = _read_json(path)
        steps = [r for r in (data or {}).get("decode", []) if r.get("shape") == shape and r.get("compiled")]
        if not steps:
            continue
        gpu = (data.get("summary") or {}).get("gpu") or (data.get("environment") or {}).get("gpu_model") or "a GPU"
        each = ", ".join(f"batch {r['batch']} {r['ms_per_step']:.2f} ms ({r['tok_s']:,.0f} tok/s forward only)" for r in steps)
        roof = (data.get("summary") or {}).get("weights_read_ms")
        out.append(f"measured on {gpu} ({shape} shapes, random weights, {steps[0]['context']:,}-token context, "
                   f"benchmarks/results/{path.name}): compiled decode step, forward only (no token read back, "
                   f"no scheduling or drafting: a bound, not an end-to-end figure): {each}"
                   + (f"; the weights read once in {roof:.2f} ms" if roof else ""))
    return [""] + out if out else []


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _verdict(need: int, budget: int) -> str:
    if need <= budget:
        return f"fits: {fmt_bytes(need)} of {fmt_bytes(budget)}, {fmt_bytes(budget - need)} headroom"
    return f"does not fit: {fmt_bytes(need)} of {fmt_bytes(budget)}, {fmt_bytes(need - budget)} short"


def _process_json(p: ProcessPlan, budget: int | None) -> dict:
    return {
        "rank": p.rank, "device": p.device, "dtype": str(p.dtype).removeprefix("torch."),
        "items": [dataclasses.asdict(item) for item in p.items],
        "kv_cache": None if p.kv is None else {**dataclasses.asdict(p.kv), "tokens": p.kv.tokens, "bytes": p.kv.bytes},
        "proposer_kv_cache": None if p.draft_kv is None else {**dataclasses.asdict(p.draft_kv),
                                                              "bytes": p.draft_kv.bytes},
        "activations": None if p.activations is None else {**dataclasses.asdict(p.activations),
                                                            "total": p.activations.total},
        "resident": p.resident, "total": p.total, "load_peak": p.load_peak, "peak": p.peak,
        "budget": budget, "fits": None if budget is None else p.peak <= budget,
    }


def app_json(app: AppPlan, gpu_memory: int | None, machine: Machine | None = None) -> dict:
    """Per deployment: its replica's process (with tp: rank 0) at the top level, `followers` the
    figures of each of ranks 1..N-1 (None without tp)."""
    deployments = []
    for d in app.deployments:
        tenants = d.tenants()
        entry = {"name": d.name, "replicas": d.replicas, "num_gpus": d.num_gpus, "tensor_parallel_size": d.tp_size,
                 "gpus_per_replica": d.gpus_per_replica, "placement_group_bundles": d.bundles or None,
                 **_process_json(d.process, d.budget(gpu_memory, tenants[0].share))}
        entry["followers"] = None if d.follower is None else \
            _process_json(d.follower, d.budget(gpu_memory, tenants[1].share))
        deployments.append(entry)
    fits = app.fits(gpu_memory) if gpu_memory is not None and any(d.on_gpu for d in app.deployments) else None
    return {"config": app.config, "application": app.name, "topology": app.args.topology, "model": app.args.model,
            "method": app.args.speculative.method, "target": dataclasses.asdict(app.target), "generic": app.generic,
            "gpu_memory": gpu_memory, "deployments": deployments, "fits": fits,
            "resources": resources_json(app.resources, machine or Machine.detected()),
            "checkpoints": [{**dataclasses.asdict(c), "dtype": str(c.dtype).removeprefix("torch.")}
                            for c in app.checkpoints],
            "fit": None if app.fit is None else [
                {"tensor_parallel_size": r.tp_size, "need": r.need, "why": r.why or None,
                 "fits": {gpu: ok for (gpu, _), ok in zip(FIT_GPUS, r.fits)}} for r in app.fit]}
