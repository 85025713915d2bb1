"""Train an EAGLE-3 (or EAGLE-1) head by self-distillation: `rayspec train eagle3 ...`.

1. the target answers the prompts (greedy), 2. one target forward per conversation gives the
features and labels (the target's greedy choice), 3. the head learns to predict those labels
with training-time test (TTT, as EAGLE-3): step s feeds the head its own output from step s-1
and attends, like at inference, to true-feature keys up to s-1 positions back plus its own
drafted keys, so the head learns to draft several tokens ahead from its own predictions.

Everything lands in --work-dir (answers, feature shards, checkpoints: resumable at every
stage); the head is written to --output in the published EAGLE layout. This module is the
single-process trainer (stage 3 and its pieces); `pipeline.run` chains the stages and hands
them to `train_ray` (which builds on this module) when there are several workers.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rayspec.eagle.checkpoint import new_eagle_config, read_eagle_head, save_atomic, save_eagle_head
from rayspec.eagle.head import Eagle3Head, EagleHead, attach_target, build_head


@dataclass
class TrainConfig:
    kind: str = "eagle3"
    target: str = "smollm2-135m-instruct"
    prompts: tuple[str, ...] = ()
    work_dir: str = "eagle-work"
    output: str | None = None  # None: a new runs/<kind>-<timestamp> (pipeline.new_output_dir)
    overwrite: bool = False  # write into a non-empty output directory (pipeline.run refuses otherwise)
    max_prompts: int | None = None
    max_new_tokens: int = 192
    draft_vocab_size: int = 4096  # eagle3: most frequent target choices in the data
    intermediate_size: int | None = None  # None: the target's
    ttt_steps: int = 3
    epochs: int = 2
    lr: float = 1e-3
    warmup_steps: int = 50
    batch_tokens: int = 4096
    weight_decay: float = 0.0
    checkpoint_every: int = 100
    answers_only: bool = False  # loss only where the target wrote the next token (not the user)
    seed: int = 0
    num_threads: int | None = None
    init_head: str | None = None  # start from this head (its weights and draft vocabulary), not from scratch
    grad_accum: int = 1  # batches per worker per optimizer step
    num_workers: int = 1  # > 1: data-parallel on that many Ray Train workers (train_ray, via pipeline.run)
    device: str | None = None  # "cpu" or "cuda"; None: CUDA where the process (or Ray cluster) has a GPU, else CPU
    target_dtype: str | None = None  # the target's, for answers and features; None: bfloat16 on CUDA, float32 on CPU


# ---- data ------------------------------------------------------------------------------
def load_examples(shards: list[Path], kind: str) -> list[dict]:
    examples = []
    for path in shards:
        data = torch.load(path, weights_only=True)
        feats = data["aux"] if kind == "eagle3" else data["final"]
        for ids, f, label in zip(data["ids"], feats, data["label"]):
            if len(ids) >= 3:
                examples.append({"ids": ids.long(), "feat": f, "label": label.long()})
    return examples


def make_batches(examples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group conversations of similar length so padding stays small."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(examples[i]["ids"])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(examples: list[dict], idx: list[int], t2d_index: torch.Tensor | None, answers_only: bool = False):
    """-> feats [B, T, F], next_ids [B, T], labels [B, T] (draft ids, -100 = no loss), lengths [B].

    Pair position i: features at i with token i+1; the label is the target's choice after
    token i+1 (what the head must draft next)."""
    rows = [examples[i] for i in idx]
    T = max(len(r["ids"]) for r in rows) - 1
    B = len(rows)
    feats = torch.zeros(B, T, rows[0]["feat"].shape[-1])
    next_ids = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    lengths = torch.zeros(B, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["ids"]) - 1
        feats[b, :n] = r["feat"][:n].float()
        next_ids[b, :n] = r["ids"][1:]
        lab = r["label"][1:]  # target's choice after token i+1
        if t2d_index is not None:
            lab = t2d_index[lab]  # -100 where the draft vocabulary lacks it
        labels[b, :n] = lab
        if answers_only and "prompt_len" in r:  # pair i drafts token i+2: keep it when the target wrote it
            labels[b, : max(0, r["prompt_len"] - 2)] = -100
        lengths[b] = n
    return feats, next_ids, labels, lengths


# ---- TTT forward -----------------------------------------------------------------------
def ttt_mask(T: int, step: int, lengths: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, step*T] bool: step `step` (1-based) query i sees step-1 keys j <= i-step+1 and,
    for each later step t, the key of its own draft chain at i-step+t (all within the row)."""
    dev = lengths.device  # built where the batch is (CUDA when training there)
    i = torch.arange(T, device=dev)[:, None]
    j = torch.arange(T, device=dev)[None, :]
    blocks = [j <= i - step + 1]
    for t in range(2, step + 1):
        blocks.append(j == i - step + t)
    mask = torch.cat(blocks, dim=1)  # [T, step*T]
    key_ok = (j < lengths[:, None]).repeat(1, step)  # [B, step*T]
    mask = mask[None] & key_ok[:, None, :]
    own = torch.eye(T, dtype=torch.bool, device=dev).repeat(1, step)  # [T, step*T]: each query's own key...
    mask |= own[None] & (torch.arange(step * T, device=dev) >= (step - 1) * T)[None, None]  # ...in its step's block
    return mask[:, None]


def attn_ttt(attn, x, cos, sin, store: list, mask):
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    rot = lambda t: torch.cat((-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]), dim=-1)  # noqa: E731
    q = q * cos + rot(q) * sin
    k = k * cos + rot(k) * sin
    store.append((k, v))
    keys = torch.cat([s[0] for s in store], dim=2)
    values = torch.cat([s[1] for s in store], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                         enable_gqa=attn.num_heads != attn.num_kv_heads)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def head_step(head: EagleHead, emb, hidden_in, cos, sin, stores, mask, first: bool):
    if isinstance(head, Eagle3Head):
        layer = head.midlayer
        hid = head.fc(hidden_in) if first else hidden_in
        x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hid)), dim=-1)
        h = hid + attn_ttt(layer.self_attn, x, cos, sin, stores[0], mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))
    x = head.fc(torch.cat((emb, hidden_in), dim=-1))
    for li, layer in enumerate(head.layers):
        normed = x if layer.input_layernorm is None else layer.input_layernorm(x)
        x = x + attn_ttt(layer.self_attn, normed, cos, sin, stores[li], mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def ttt_loss(head: EagleHead, feats, next_ids, labels, lengths, steps: int):
    """Mean over steps (weights 0.8^s) of cross-entropy; returns (loss, per-step accuracy)."""
    B, T, _ = feats.shape
    positions = torch.arange(T, device=feats.device)[None].expand(B, T)
    cos, sin = head.rope(positions, feats.dtype)
    emb = head.embed_tokens(next_ids).detach().to(feats.dtype)  # the target's embedding may be bfloat16
    stores = [[] for _ in range(max(1, len(getattr(head, "layers", [None]))))]
    hidden_in, total, weight_sum, accs = feats, 0.0, 0.0, []
    for s in range(1, steps + 1):
        out = head_step(head, emb, hidden_in, cos, sin, stores, ttt_mask(T, s, lengths), first=s == 1)
        logits = head.draft_logits(out)  # [B, T, V]
        lab = labels.clone()
        lab[:, : s - 1] = -100  # the first s-1 positions have no chain of s-1 drafts before them
        valid = lab != -100
        if valid.any():
            loss = F.cross_entropy(logits[valid], lab[valid])
            total = total + (0.8 ** (s - 1)) * loss
            weight_sum += 0.8 ** (s - 1)
            accs.append((logits[valid].argmax(-1) == lab[valid]).float().mean().item())
        # the next step reads this step's output one position later (as a drafted feature)
        hidden_in = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)
    return total / max(weight_sum, 1e-9), accs


# ---- the target and the head's config ------------------------------------------------
def load_target(cfg: TrainConfig):
    from rayspec.model.loader import load_model

    target, tokenizer = load_model(cfg.target, device=cfg.device, dtype=cfg.target_dtype)  # None: loader defaults
    target.requires_grad_(False)
    return target, tokenizer


def head_config(cfg: TrainConfig, target):
    """-> (head to train further or None, its config): the init head's, else a new one."""
    from rayspec.model.weights.hub import resolve_model_dir

    init = read_eagle_head(cfg.init_head, target, cfg.kind)[0] if cfg.init_head else None
    tcfg = init.config if init is not None else new_eagle_config(
        cfg.kind, resolve_model_dir(cfg.target), target.args.num_layers, target.args.hidden_size,
        draft_vocab_size=cfg.draft_vocab_size, intermediate_size=cfg.intermediate_size)
    return init, tcfg


def choose_draft_tokens(counts: Counter, size: int, vocab_size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[size] target ids, ascending: `keep`, then the most frequent other tokens in `counts`, then the
    lowest unused ids if the data has too few distinct tokens."""
    have = set(keep.tolist()) if keep is not None else set()
    chosen = have | set([t for t, _ in counts.most_common() if t not in have][: size - len(have)])
    chosen |= set(sorted(set(range(vocab_size)) - chosen)[: size - len(chosen)])
    return torch.tensor(sorted(chosen))


def _set_draft_vocab(head: Eagle3Head, target, ids: torch.Tensor, trained: tuple | None = None) -> None:
    """Point an EAGLE-3 head's d2t/t2d at `ids` and start its LM-head rows from the target's, except
    `trained` = (ids, rows) of a trained head, whose rows are kept."""
    with torch.no_grad():
        weight = target.lm_head.weight[ids].to(head.lm_head.weight.dtype)  # [size, H]
        if trained is not None:
            weight[torch.searchsorted(ids, trained[0])] = trained[1]
        head.lm_head.weight.copy_(weight)
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[ids] = True


def grow_draft_vocab(head: Eagle3Head, target, counts: Counter, size: int) -> Eagle3Head:
    """A copy of an EAGLE-3 head whose draft vocabulary has `size` tokens: its own tokens and their
    trained LM-head rows stay; the target's most frequent other choices in `counts` join, their rows
    starting from the target's LM head (as a fresh head's do). Why: tokens outside the draft
    vocabulary can never be drafted, and a vocabulary picked on one kind of text misses many of
    another's (measured: 4096 tokens cover 80% of SmolLM2's mt_bench answers, 96% of humaneval's)."""
    old = torch.nonzero(head.t2d).flatten().cpu()  # [V_old] target ids, ascending
    ids = choose_draft_tokens(counts, size, target.args.vocab_size, keep=old)
    config = replace(head.config, draft_vocab_size=size, hf_config={**head.config.hf_config, "draft_vocab_size": size})
    grown = build_head(config).to(head.lm_head.weight.dtype)
    grown.load_state_dict({k: v for k, v in head.state_dict().items()
                           if not k.startswith(("lm_head.", "d2t", "t2d", "embed_tokens."))}, strict=False)
    _set_draft_vocab(grown, target, ids, trained=(old, head.lm_head.weight))
    return grown


def answer_engine(target, tokenizer, target_name: str):
    """The engine that writes the answers: plain target decoding, 16 sequences batched."""
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=target_name, speculative=SpeculativeConfig(method="none"),
                                  max_num_seqs=16, max_model_len=1024), model=target, tokenizer=tokenizer)


def load_prepared(cfg: TrainConfig) -> list[dict]:
    """The examples prepare_data left in the work dir (what a data-parallel worker reads)."""
    from rayspec.eagle.data import read_answers

    work = Path(cfg.work_dir)
    examples = load_examples(sorted((work / f"features-{cfg.kind}").glob("features-*.pt")), cfg.kind)
    for e, r in zip(examples, read_answers(work / "answers.jsonl")):
        e["prompt_len"] = len(r["prompt_ids"])
    return examples


GradSync = Callable[[list[torch.Tensor], torch.Tensor], None]  # (grads, stats) -> summed over workers, in place


def load_checkpoint(path: Path, device) -> dict:
    """A training checkpoint (head, optimizer and scheduler state: tensors and plain values only),
    read without unpickling anything else: a tampered file cannot run code."""
    return torch.load(path, weights_only=True, map_location=device)


def train_head(cfg: TrainConfig, target, examples: list[dict], rank: int = 0, world: int = 1,
               sync: GradSync | None = None) -> Path | None:
    """Stage 3: train the head; returns where rank 0 wrote it.

    One optimizer step takes world x grad_accum batches: worker `rank` computes the gradients of
    its grad_accum of them and `sync` sums them over the workers (the mean loss of the batches,
    as one process accumulating them all would have). Every worker then takes the same step."""
    work = Path(cfg.work_dir)
    n_tokens = sum(len(e["ids"]) for e in examples)
    if rank == 0:
        print(f"{len(examples)} conversations, {n_tokens} tokens")

    # the head: fresh, or the weights (and draft vocabulary) of an existing head to train further
    device = next(target.parameters()).device  # the head trains where the target sits, in float32
    init, tcfg = head_config(cfg, target)
    torch.manual_seed(cfg.seed)
    head = (init if init is not None else build_head(tcfg)).to(device)
    attach_target(head, target, has_own_embedding=False)
    t2d_index = None
    if cfg.kind == "eagle3":
        counts = Counter()
        for e in examples:
            counts.update(e["label"].tolist())
        if init is not None:
            if cfg.draft_vocab_size > int(head.t2d.sum()):
                head = grow_draft_vocab(head, target, counts, cfg.draft_vocab_size).to(device)
                attach_target(head, target, has_own_embedding=False)
            draft_ids = torch.nonzero(head.t2d).flatten()
        else:
            draft_ids = choose_draft_tokens(counts, tcfg.draft_vocab_size, target.args.vocab_size)
            _set_draft_vocab(head, target, draft_ids)  # the readout starts from the target's own LM head
            with torch.no_grad():
                head.norm.weight.copy_(target.model.norm.weight)
        covered = sum(counts[t] for t in draft_ids.tolist()) / max(1, sum(counts.values()))
        if rank == 0:
            print(f"draft vocabulary {len(draft_ids)} tokens covers {covered:.1%} of the target's choices")
        t2d_index = torch.full((target.args.vocab_size,), -100, dtype=torch.long)
        t2d_index[draft_ids] = torch.arange(len(draft_ids))
    draft_vocab = int(head.t2d.sum()) if cfg.kind == "eagle3" else None  # recorded in checkpoints
    params = [p for n, p in head.named_parameters() if p.requires_grad and not n.startswith(("embed_tokens", "target_lm_head"))]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    flat = [b for _ in range(cfg.epochs) for b in make_batches(examples, cfg.batch_tokens, rng)]
    per_step = world * cfg.grad_accum
    total_steps = len(flat) // per_step  # the last len(flat) % per_step batches are left out
    if total_steps == 0:
        raise ValueError(f"{len(flat)} batches make no step of {per_step} (workers x grad_accum)")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))))
    ckpt_path = work / f"checkpoint-{cfg.kind}.pt"
    step = 0
    if ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path, device)
        if ckpt.get("draft_vocab_size", draft_vocab) != draft_vocab:
            raise RuntimeError(f"{ckpt_path} holds a head with a draft vocabulary of {ckpt['draft_vocab_size']} "
                               f"tokens, this run's has {draft_vocab}; use a new work dir")
        if ckpt.get("batches_per_step", 1) != per_step:
            raise RuntimeError(f"{ckpt_path} was written with {ckpt.get('batches_per_step', 1)} batches per step, "
                               f"this run takes {per_step} (workers x grad_accum); use those or a new work dir")
        head.load_state_dict(ckpt["head"], strict=False)
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed at step {step}/{total_steps}")
    head.train()
    start = time.time()
    history = []
    bar = tqdm(total=total_steps, initial=step, desc=f"train {cfg.kind}", unit="step", disable=rank != 0)
    while step < total_steps:
        opt.zero_grad(set_to_none=True)
        stats = torch.zeros(1 + cfg.ttt_steps)  # summed over this step's batches: loss, accuracy per TTT step
        for a in range(cfg.grad_accum):
            batch = flat[step * per_step + rank * cfg.grad_accum + a]
            feats, next_ids, labels, lengths = (t.to(device) for t in collate(examples, batch, t2d_index,
                                                                              cfg.answers_only))
            loss, accs = ttt_loss(head, feats, next_ids, labels, lengths, cfg.ttt_steps)
            (loss / per_step).backward()
            stats += torch.tensor([loss.item()] + accs + [0.0] * (cfg.ttt_steps - len(accs)))
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if sync is not None:
            sync(grads, stats)
        for p, g in zip(params, grads):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        mean = (stats / per_step).tolist()
        history.append({"step": step, "loss": mean[0], "acc": mean[1:]})
        bar.set_postfix(loss=f"{mean[0]:.3f}", acc="/".join(f"{a:.2f}" for a in mean[1:]))
        bar.update(1)
        if rank == 0 and (step % cfg.checkpoint_every == 0 or step == total_steps):
            save_atomic({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "step": step, "batches_per_step": per_step, "draft_vocab_size": draft_vocab}, ckpt_path)
            with (work / f"history-{cfg.kind}.jsonl").open("a") as f:
                for h in history:
                    f.write(json.dumps(h) + "\n")
            history = []
    bar.close()
    if rank != 0:
        return None
    head.eval()
    out = save_eagle_head(head, cfg.output)
    (Path(cfg.output) / "training.json").write_text(json.dumps(
        {**asdict(cfg), "conversations": len(examples), "tokens": n_tokens,
         "train_seconds_this_run": round(time.time() - start, 1)}, indent=2) + "\n")
    return out
