"""EAGLE-3 / EAGLE-1 heads: lossless decoding with chain and tree drafts, T>0 distribution,
the published checkpoint layouts, tree attention against a step-by-step reference, and the
self-distillation trainer.

Everything runs on tiny random Llama targets (no tokenizer); the heads that must really be
accepted are trained here for a few seconds on the target's own greedy outputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_model_dir
from engine_utils import (assert_target_logprobs, cached_model, make_engine, run_alone, run_batch, run_joining,
                          run_to_completion)
from rayspec.eagle.checkpoint import load_eagle_head, new_eagle_config, read_state_dict, save_eagle_head
from rayspec.eagle.data import extract_features, read_answers
from rayspec.eagle.head import Eagle1Head, Eagle3Head, attach_target, build_head, default_aux_layers
from rayspec.eagle.train import collate, head_step, load_examples, ttt_loss, ttt_mask
from rayspec.model.batch_layout import TreeQuery
from rayspec.model.runner import make_runner
from rayspec.proposers.base import Draft
from rayspec.sampling.rejection import verify_tree_greedy, verify_tree_parents
from rayspec.sampling.sampler import SamplingParams

VOCAB, LAYERS, HIDDEN = 256, 4, 64  # the tiny target: 4 layers -> EAGLE-3 features of layers (0, 2, 3)
DRAFT_VOCAB = 128  # the trained EAGLE-3 head drafts over the 128 most frequent target choices
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (6, 4, 9, 5)]
TRAIN_PROMPTS = PROMPTS + [[_rng.randrange(VOCAB) for _ in range(6)] for _ in range(44)]
TRAIN_STEPS = 40


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("eagle-target") / "model", seed=3, num_layers=LAYERS,
                               hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return cached_model(str(target_dir))  # (model, None)


@pytest.fixture(scope="module")
def reference(target_dir, target):
    """Target-only greedy decoding, each prompt alone."""
    return run_alone(make_engine(target_dir, "none", loaded=target), PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def train_data(target_dir, target, tmp_path_factory):
    """The target's greedy answers to the training prompts, and their features (rayspec.eagle.data)."""
    work = tmp_path_factory.mktemp("eagle-data")
    engine = make_engine(target_dir, "none", loaded=target, max_num_seqs=16)
    answers = run_batch(engine, TRAIN_PROMPTS, SamplingParams(temperature=0.0, max_tokens=40))
    path = work / "answers.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(i), "prompt_ids": p, "output_ids": a}) + "\n"
                            for i, (p, a) in enumerate(zip(TRAIN_PROMPTS, answers))))
    shards = {}
    for kind in ("eagle3", "eagle"):
        cfg = new_eagle_config(kind, target_dir, LAYERS, HIDDEN, draft_vocab_size=DRAFT_VOCAB)
        (work / kind).mkdir()
        shards[kind] = extract_features(target[0], read_answers(path), work / kind, cfg.aux_layers or (LAYERS - 1,))
    return shards


def _draft_vocab(examples, size: int) -> torch.Tensor:
    """As `rayspec train`: the most frequent target choices, filled up with the lowest other ids."""
    counts = Counter()
    for e in examples:
        counts.update(e["label"].tolist())
    vocab = sorted(t for t, _ in counts.most_common(size))
    vocab += sorted(set(range(VOCAB)) - set(vocab))[: size - len(vocab)]
    return torch.tensor(sorted(vocab))


def _train_head(kind: str, target_dir, model, shards, steps: int = TRAIN_STEPS):
    """A few dozen full-batch TTT steps -> (head, losses, t2d_index)."""
    cfg = new_eagle_config(kind, target_dir, LAYERS, HIDDEN, draft_vocab_size=DRAFT_VOCAB)
    examples = load_examples(shards, kind)
    torch.manual_seed(0)
    head = build_head(cfg)
    attach_target(head, model, has_own_embedding=False)
    t2d_index = None
    if kind == "eagle3":  # a reduced draft vocabulary, d2t / t2d consistent with it
        ids = _draft_vocab(examples, DRAFT_VOCAB)
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[ids] = True
        t2d_index = torch.full((VOCAB,), -100, dtype=torch.long)
        t2d_index[ids] = torch.arange(DRAFT_VOCAB)
        with torch.no_grad():
            head.lm_head.weight.copy_(model.lm_head.weight[ids])
            head.norm.weight.copy_(model.model.norm.weight)
    # not the target's weights the head shares (its embedding; EAGLE-1's LM head is a submodule too)
    params = [p for n, p in head.named_parameters() if not n.startswith(("embed_tokens", "target_lm_head"))]
    opt = torch.optim.AdamW(params, lr=3e-3)
    batch = collate(examples, list(range(len(examples))), t2d_index)
    head.train()
    losses = []
    for _ in range(steps):
        loss, _ = ttt_loss(head, *batch, steps=3)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return head.eval(), losses, t2d_index


@pytest.fixture(scope="module")
def trained(target_dir, target, train_data, tmp_path_factory):
    """kind -> (head directory, training losses): heads that the target really accepts."""
    out = {}
    before = {k: v.clone() for k, v in target[0].state_dict().items()}
    for kind in ("eagle3", "eagle"):
        head, losses, _ = _train_head(kind, target_dir, target[0], train_data[kind])
        path = save_eagle_head(head, tmp_path_factory.mktemp(f"trained-{kind}") / "head", dtype=torch.float32)
        out[kind] = (path, losses)
    for k, v in target[0].state_dict().items():  # training a head leaves the target alone
        assert torch.equal(v, before[k]), k
    return out


@pytest.fixture(scope="module")
def random_heads(target_dir, target, tmp_path_factory):
    """kind -> directory of an untrained head (its drafts are almost all rejected)."""
    out = {}
    for kind in ("eagle3", "eagle"):
        torch.manual_seed(1)
        head = build_head(new_eagle_config(kind, target_dir, LAYERS, HIDDEN))
        attach_target(head, target[0], has_own_embedding=False)
        out[kind] = save_eagle_head(head, tmp_path_factory.mktemp(f"random-{kind}") / "head")  # float16
    return out


def _eagle_engine(target_dir, target, head_dir, kind, k, topk, depth=None, **kw):
    kw.setdefault("tree_max_batch", 8)  # trees at every batch size tested here
    return make_engine(target_dir, kind, k=k, loaded=target, draft_model=str(head_dir), eagle_topk=topk,
                       num_steps=depth, **kw)


def _spy_keep_path(engine) -> list[list[int]]:
    """Record the tree rows the engine keeps (to see that non-contiguous paths were compacted)."""
    kept, original = [], engine.kv.keep_paths

    def keep_paths(paths):
        kept.extend(list(rows) for _, rows in paths)
        return original(paths)

    engine.kv.keep_paths = keep_paths
    return kept


# ---- feature layers --------------------------------------------------------------------------

def test_default_aux_layers():
    # the published choice (EAGLE-3, vLLM) for real depths: inputs of layer 2, L/2 and L-3
    assert default_aux_layers(32) == (2, 16, 29)
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(7) == (2, 3, 4)
    # tiny targets: valid, distinct, sorted layer ids, three of them whenever there are three layers
    for n in range(1, 12):
        ids = default_aux_layers(n)
        assert list(ids) == sorted(set(ids)) and all(0 <= i < n for i in ids), (n, ids)
        assert len(ids) == min(3, n), (n, ids)


def test_eagle3_features_come_from_valid_layers(target_dir, target):
    cfg = new_eagle_config("eagle3", target_dir, LAYERS, HIDDEN)
    assert cfg.aux_layers == (0, 2, 3) and cfg.feature_size == 3 * HIDDEN
    model = target[0]
    runner = make_runner(model, 64, 1, slack=4)
    runner.kv.allocate("s")
    tokens = PROMPTS[0]
    hidden, aux = runner.forward_hidden(["s"], [tokens], aux_layers=cfg.aux_layers)[0]
    assert aux.shape == (1, len(tokens), 3 * HIDDEN)
    # the first feature block is the input of layer 0: the token embeddings
    torch.testing.assert_close(aux[0, :, :HIDDEN], model.model.embed_tokens.weight[tokens])


# ---- greedy: lossless with chain and tree drafts ----------------------------------------------

# (id, kind, head, k, eagle_topk, depth)
GREEDY_CASES = [
    ("eagle3-chain", "eagle3", "trained", 4, 1, None),
    ("eagle3-tree2", "eagle3", "trained", 6, 2, 3),
    ("eagle3-tree3", "eagle3", "trained", 6, 3, 3),
    ("eagle3-random-tree", "eagle3", "random", 6, 2, 3),
    ("eagle1-chain", "eagle", "trained", 4, 1, None),
    ("eagle1-tree2", "eagle", "trained", 6, 2, 3),
    ("eagle1-random-chain", "eagle", "random", 3, 1, None),
]


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_bfloat16_head_stays_exact(target_dir, target, reference, trained, kind):
    """`draft_dtype` sets the head's precision apart from the target's; the output stays the target's."""
    engine = _eagle_engine(target_dir, target, trained[kind][0], kind, 6, 2, 3, draft_dtype="bfloat16")
    head = engine.proposer.head
    assert head.compute_dtype == torch.bfloat16 and engine.proposer.runner.cache.k[0].dtype == torch.bfloat16
    assert next(engine.model.parameters()).dtype == torch.float32
    got = run_batch(engine, PROMPTS, GREEDY)
    assert got == reference
    assert engine.stats.num_accepted_tokens > 0  # the bf16 head still drafts what the target says


@pytest.mark.parametrize("mode", ["alone", "batch", "joining"])
@pytest.mark.parametrize("name,kind,head,k,topk,depth", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_matches_baseline(target_dir, target, reference, trained, random_heads,
                                 name, kind, head, k, topk, depth, mode):
    head_dir = trained[kind][0] if head == "trained" else random_heads[kind]
    engine = _eagle_engine(target_dir, target, head_dir, kind, k, topk, depth)
    kept = _spy_keep_path(engine)
    run = {"alone": run_alone, "batch": run_batch, "joining": run_joining}[mode]
    got = run(engine, PROMPTS, GREEDY)
    for i, (g, ref) in enumerate(zip(got, reference)):
        assert g == ref, f"prompt {i}: {name}/{mode} diverges from target-only decoding"
    assert all(len(r) == GREEDY.max_tokens for r in reference)
    stats = engine.stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft rejected"
    if head == "trained":
        assert stats.num_accepted_tokens > 0, f"{name}: the trained head was never accepted"
    if topk > 1:
        assert kept, "tree drafts were not verified as trees"
        if head == "trained":
            # some accepted path was not the first rows of the tree: keep_path really moved KV
            assert any(rows != list(range(len(rows))) for rows in kept), kept
    assert engine.num_running == engine.num_waiting == 0
    assert engine.kv.num_free_slots == engine.num_slots
    assert engine.proposer.runner.kv.num_free_slots == engine.num_slots  # the head cache is released too


def test_tree_batch_with_sampled_and_undrafted_requests(target_dir, target, reference, trained):
    """Tree drafts (greedy) next to chain drafts (sampled) and rows with no draft at all
    (num_speculative_tokens=0, or one token left) in the same verification forward; the seeded
    sampled request's output equals its solo run."""
    engine = _eagle_engine(target_dir, target, trained["eagle3"][0], "eagle3", 6, 2, 3)
    ids = [engine.add_request(PROMPTS[0], GREEDY),
           engine.add_request(PROMPTS[1], SamplingParams(temperature=0.8, seed=4, max_tokens=20)),
           engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=32, num_speculative_tokens=0))]
    engine.step()
    engine.step()
    ids.append(engine.add_request(PROMPTS[3], GREEDY))  # joins mid-batch
    ids.append(engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2)))
    done = run_to_completion(engine)
    assert done[ids[0]].token_ids == reference[0]
    assert done[ids[2]].token_ids == reference[2] and done[ids[2]].num_draft_tokens == 0
    assert done[ids[3]].token_ids == reference[3]
    assert done[ids[4]].token_ids == reference[0][:2]
    # the seeded sampled request draws coupled (rayspec.sampling.sampler): in the mixed tree batch it
    # emits what it emits alone (issue #53, item 4)
    solo = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.8, seed=4, max_tokens=20))[0]
    assert done[ids[1]].token_ids == solo.token_ids and len(solo.token_ids) == 20
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_tree_logprobs_are_the_targets(target_dir, target, trained, temperature):
    """Tokens accepted from a tree (a path that need not be the tree's first rows) report the target
    logprobs of the row that verified them."""
    # adaptive off: at T = 0.9 the planner stops drafting after the first rejected trees, and this test
    # needs tokens accepted from trees
    engine = _eagle_engine(target_dir, target, trained["eagle3"][0], "eagle3", 6, 2, 3, adaptive=False)
    kept = _spy_keep_path(engine)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=24, logprobs=i) for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    for prompt, out, p in zip(PROMPTS, outs, params):
        assert_target_logprobs(target_dir, prompt, out, p.logprobs)
    assert engine.stats.num_accepted_tokens > 0 and kept


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_stop_prob_stays_exact_and_drafts_less(target_dir, target, reference, trained, topk):
    """eagle_stop_prob ends a draft early where the head is unsure: outputs unchanged, fewer head
    forwards (and, for chains, fewer drafted tokens), and no draft grows past a depth whose
    frontier the head gave < stop_prob."""
    head_dir = trained["eagle3"][0]

    def counting(engine):
        """Head forwards: the catch-up's (forward_hidden) and each depth's (a cycle's TreeSteps.forward)."""
        calls = [0]
        runner = engine.proposer.runner
        original, prepare = runner.forward_hidden, runner.tree_steps

        def forward_hidden(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        def tree_steps(*args, **kwargs):
            steps = prepare(*args, **kwargs)
            if steps is not None:
                step = steps.forward

                def forward(*a, **k):
                    calls[0] += 1
                    return step(*a, **k)

                steps.forward = forward
            return steps

        runner.forward_hidden, runner.tree_steps = forward_hidden, tree_steps
        return calls

    # adaptive off: compares the drafts of a fixed budget with and without the stop (the planner would
    # size each run's budgets from its own acceptance)
    full = _eagle_engine(target_dir, target, head_dir, "eagle3", 6, topk, 4, adaptive=False)
    full_calls = counting(full)
    assert run_batch(full, PROMPTS, GREEDY) == reference
    stop = 0.5
    engine = _eagle_engine(target_dir, target, head_dir, "eagle3", 6, topk, 4, eagle_stop_prob=stop, adaptive=False)
    calls = counting(engine)
    proposer = engine.proposer
    reach = []
    original = proposer._stopped

    def spy(scores):
        stopped = original(scores)
        reach.extend(zip(scores.exp().sum(-1).tolist(), stopped.tolist()))
        return stopped

    proposer._stopped = spy
    got = run_batch(engine, PROMPTS, GREEDY)
    assert got == reference
    assert engine.stats.num_drafts > 0 and engine.stats.num_accepted_tokens > 0
    if topk > 1:  # the rule itself (chains apply it to the scores read back with the draft)
        assert reach and all(stopped == (r < stop) for r, stopped in reach)
        assert any(stopped for _, stopped in reach) and any(not stopped for _, stopped in reach)
    # per draft, fewer head forwards (a catch-up forward plus one per depth grown)
    assert calls[0] / engine.stats.num_drafts < full_calls[0] / full.stats.num_drafts
    if topk == 1:
        assert engine.stats.num_draft_tokens / engine.stats.num_drafts < full.stats.num_draft_tokens / full.stats.num_drafts
    # where reads are not free (CUDA) every row grows to its depth and the nodes past a stop are
    # dropped afterwards: the very same drafts
    device_path = _eagle_engine(target_dir, target, head_dir, "eagle3", 6, topk, 4, eagle_stop_prob=stop, adaptive=False)
    device_path.proposer.early_exit_reads = False
    device_calls = counting(device_path)
    assert run_batch(device_path, PROMPTS, GREEDY) == reference
    assert (device_path.stats.num_drafts, device_path.stats.num_draft_tokens, device_path.stats.num_accepted_tokens) == (
        engine.stats.num_drafts, engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens)
    assert device_calls[0] > calls[0]


@pytest.mark.parametrize("head", ["trained", "random"])
def test_prompt_lookup_branch_stays_exact(target_dir, target, reference, trained, random_heads, head):
    """eagle_prompt_lookup grafts the n-gram continuation onto greedy trees: outputs unchanged,
    the branch is really verified, within the node budget, parents before children."""
    head_dir = trained["eagle3"][0] if head == "trained" else random_heads["eagle3"]
    engine = _eagle_engine(target_dir, target, head_dir, "eagle3", 6, 2, 3, eagle_prompt_lookup=4)
    proposer = engine.proposer
    grafted, drafts = [], []
    original_add, original_propose = proposer._add_lookup_branch, proposer.propose

    def add(req, nodes):
        before = len(nodes)
        original_add(req, nodes)
        sure = [n for n in nodes if n.score == 0.0]
        if sure:
            grafted.append((len(sure), len(nodes) - before))

    def propose(requests):
        out = original_propose(requests)
        drafts.extend((r.num_tokens, d) for r, d in zip(requests, out))
        return out

    proposer._add_lookup_branch, proposer.propose = add, propose
    got = run_batch(engine, PROMPTS, GREEDY)
    assert got == reference
    assert grafted, "the n-gram lookup never matched: the test prompts do not exercise the branch"
    if head == "random":  # a random head rarely agrees with the lookup: new nodes were added
        assert any(new > 0 for _, new in grafted)
    for budget, d in drafts:
        assert len(d.tokens) <= budget
        if d.parents is not None:
            assert all(p < j for j, p in enumerate(d.parents))
    assert engine.stats.num_accepted_tokens > 0


# T > 0: sampled chains and trees keep the target distribution: tests/engine/test_lossless_sampled.py


# ---- published checkpoint layouts ---------------------------------------------------------------

def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _ref_attention(x, sd, prefix, num_heads, num_kv_heads, theta):
    """Causal self-attention as in EAGLE's cnets.py, from raw weights. x: [T, D_in] -> [T, H]."""
    T = x.shape[0]
    q = (x @ sd[prefix + "q_proj.weight"].float().T).view(T, num_heads, -1).transpose(0, 1)
    k = (x @ sd[prefix + "k_proj.weight"].float().T).view(T, num_kv_heads, -1).transpose(0, 1)
    v = (x @ sd[prefix + "v_proj.weight"].float().T).view(T, num_kv_heads, -1).transpose(0, 1)
    hd = q.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.arange(T).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    q = q * emb.cos() + _rotate_half(q) * emb.sin()
    k = k * emb.cos() + _rotate_half(k) * emb.sin()
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)
    return out @ sd[prefix + "o_proj.weight"].float().T


def _ref_mlp(x, sd, prefix):
    w = lambda name: sd[prefix + name].float().T  # noqa: E731
    return (F.silu(x @ w("gate_proj.weight")) * (x @ w("up_proj.weight"))) @ w("down_proj.weight")


def _head_forward(head, tokens, feats):
    """The head's own forward over pairs (feats[i], tokens[i]) through a ModelRunner -> draft logits [T, V']."""
    runner = make_runner(head, 64, 1, slack=4)
    runner.kv.allocate("s")
    out, _ = runner.forward_hidden(["s"], [tokens], features=feats[None])
    return head.draft_logits(out[0])


def _hf_config(**overrides) -> dict:
    """A config.json shaped like the published heads' (LLaMA-3 8B numbers scaled down)."""
    cfg = {"bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": HIDDEN,
           "initializer_range": 0.02, "intermediate_size": 160, "model_type": "llama",
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0,
           "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
           "transformers_version": "4.28.1", "use_cache": True, "vocab_size": VOCAB}
    cfg.update(overrides)
    return cfg


def _rand(*shape, scale=0.1):
    return (torch.randn(*shape) * scale).half()


def _layer_weights(prefix: str, d_in: int, input_norm: bool) -> dict:
    H, I = HIDDEN, 160
    sd = {f"{prefix}self_attn.q_proj.weight": _rand(H, d_in), f"{prefix}self_attn.k_proj.weight": _rand(H // 2, d_in),
          f"{prefix}self_attn.v_proj.weight": _rand(H // 2, d_in), f"{prefix}self_attn.o_proj.weight": _rand(H, H),
          f"{prefix}mlp.gate_proj.weight": _rand(I, H), f"{prefix}mlp.up_proj.weight": _rand(I, H),
          f"{prefix}mlp.down_proj.weight": _rand(H, I),
          f"{prefix}post_attention_layernorm.weight": (1 + _rand(H)).half()}
    if input_norm:
        sd[f"{prefix}input_layernorm.weight"] = (1 + _rand(H)).half()
    return sd


EAGLE3_DRAFT_IDS = torch.tensor(sorted(random.Random(7).sample(range(VOCAB), 32)))


def _write_eagle3_checkpoint(path: Path) -> dict:
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B layout: config.json + pytorch_model.bin (torch.save), no embedding."""
    torch.manual_seed(21)
    H = HIDDEN
    sd = {"fc.weight": _rand(H, 3 * H), **_layer_weights("midlayer.", 2 * H, input_norm=True),
          "midlayer.hidden_norm.weight": (1 + _rand(H)).half(), "norm.weight": (1 + _rand(H)).half(),
          "lm_head.weight": _rand(32, H, scale=1.0),
          "d2t": EAGLE3_DRAFT_IDS - torch.arange(32), "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    sd["t2d"][EAGLE3_DRAFT_IDS] = True
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(_hf_config(architectures=["LlamaForCausalLMEagle3"],
                                                            draft_vocab_size=32, max_position_embeddings=2048)))
    torch.save(sd, path / "pytorch_model.bin")
    return sd


def _write_eagle1_checkpoint(path: Path, fc_bias: bool) -> dict:
    """yuhuili/EAGLE-LLaMA3-Instruct-8B layout: one-layer LlamaForCausalLM config, layer 0 without
    input_layernorm, its own embed_tokens; fc.bias as in the EAGLE-1 code's default (bias=True)."""
    torch.manual_seed(22)
    H = HIDDEN
    sd = {"fc.weight": _rand(H, 2 * H), **_layer_weights("layers.0.", H, input_norm=False),
          "embed_tokens.weight": _rand(VOCAB, H, scale=1.0)}
    if fc_bias:
        sd["fc.bias"] = _rand(H)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(_hf_config(architectures=["LlamaForCausalLM"],
                                                            max_position_embeddings=8192, rope_theta=500000.0,
                                                            rope_scaling=None, pretraining_tp=1)))
    torch.save(sd, path / "pytorch_model.bin")
    return sd


def test_load_published_eagle3_layout(tmp_path, target):
    model = target[0]
    sd = _write_eagle3_checkpoint(tmp_path / "eagle3")
    assert set(read_state_dict(tmp_path / "eagle3")) == set(sd)
    head = load_eagle_head(str(tmp_path / "eagle3"), model, kind="eagle3")
    assert isinstance(head, Eagle3Head) and head.config.draft_vocab_size == 32
    assert head.config.aux_layers == default_aux_layers(LAYERS)  # no eagle_config: the default layers
    # every tensor landed in the module of the same name
    modules = dict(head.named_parameters()) | dict(head.named_buffers())
    for key, value in sd.items():
        assert torch.equal(modules[key], value.to(modules[key].dtype)), key
    assert head.embed_tokens.weight is model.model.embed_tokens.weight  # shared with the target
    assert head.to_target(torch.arange(32)).tolist() == EAGLE3_DRAFT_IDS.tolist()
    # and compute what EAGLE-3 computes (cnets.py), from the raw weights
    torch.manual_seed(0)
    T = 7
    tokens = torch.randint(0, VOCAB, (T,))
    feats = torch.randn(T, 3 * HIDDEN)
    sdf = {k: v.float() for k, v in sd.items() if v.is_floating_point()}
    hidden = feats @ sdf["fc.weight"].T
    emb = model.model.embed_tokens.weight[tokens]
    x = torch.cat((_rms(emb, sdf["midlayer.input_layernorm.weight"]),
                   _rms(hidden, sdf["midlayer.hidden_norm.weight"])), dim=-1)
    h = hidden + _ref_attention(x, sdf, "midlayer.self_attn.", 4, 2, theta=10000.0)
    h = h + _ref_mlp(_rms(h, sdf["midlayer.post_attention_layernorm.weight"]), sdf, "midlayer.mlp.")
    ref = _rms(h, sdf["norm.weight"]) @ sdf["lm_head.weight"].T
    got = _head_forward(head, tokens.tolist(), feats)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fc_bias", [True, False], ids=["fc-bias", "no-fc-bias"])
def test_load_published_eagle1_layout(tmp_path, target, fc_bias):
    model = target[0]
    sd = _write_eagle1_checkpoint(tmp_path / "eagle1", fc_bias)
    head = load_eagle_head(str(tmp_path / "eagle1"), model, kind="eagle")
    assert isinstance(head, Eagle1Head) and head.layers[0].input_layernorm is None
    assert (head.fc.bias is not None) == fc_bias
    modules = dict(head.named_parameters())
    for key, value in sd.items():
        assert torch.equal(modules[key], value.float()), key
    assert head.target_lm_head is model.lm_head  # EAGLE-1 reads out with the target's LM head
    assert not torch.equal(head.embed_tokens.weight, model.model.embed_tokens.weight)  # its own embedding
    # what EAGLE-1 computes (cnets1.py): fc(cat(emb, hidden)), layer 0 without input norm, target LM head
    torch.manual_seed(0)
    T = 6
    tokens = torch.randint(0, VOCAB, (T,))
    feats = torch.randn(T, HIDDEN)
    sdf = {k: v.float() for k, v in sd.items()}
    x = torch.cat((sdf["embed_tokens.weight"][tokens], feats), dim=-1) @ sdf["fc.weight"].T
    if fc_bias:
        x = x + sdf["fc.bias"]
    x = x + _ref_attention(x, sdf, "layers.0.self_attn.", 4, 2, theta=500000.0)
    x = x + _ref_mlp(_rms(x, sdf["layers.0.post_attention_layernorm.weight"]), sdf, "layers.0.mlp.")
    ref = x @ model.lm_head.weight.T
    torch.testing.assert_close(_head_forward(head, tokens.tolist(), feats), ref, atol=1e-4, rtol=1e-4)


def test_wrong_kind_and_broken_checkpoints_fail_clearly(tmp_path, target_dir, target):
    model = target[0]
    _write_eagle3_checkpoint(tmp_path / "eagle3")
    _write_eagle1_checkpoint(tmp_path / "eagle1", fc_bias=True)
    with pytest.raises(ValueError, match="is an eagle3 head, not eagle"):
        load_eagle_head(str(tmp_path / "eagle3"), model, kind="eagle")
    with pytest.raises(ValueError, match="is an eagle head, not eagle3"):
        load_eagle_head(str(tmp_path / "eagle1"), model, kind="eagle3")
    with pytest.raises(ValueError, match="not eagle3"):  # through the engine's proposer registry
        make_engine(target_dir, "eagle3", k=3, loaded=target, draft_model=str(tmp_path / "eagle1"))
    # a key missing, one too many: the check names them
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "eagle3" / "config.json").read_text())
    sd = torch.load(tmp_path / "eagle3" / "pytorch_model.bin", weights_only=True)
    sd["extra.weight"] = sd.pop("midlayer.hidden_norm.weight")
    torch.save(sd, broken / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"not an eagle3 checkpoint \(missing \['midlayer.hidden_norm.weight'\], "
                                         r"unexpected \['extra.weight'\]\)"):
        load_eagle_head(str(broken), model)
    # a reduced draft vocabulary without its d2t mapping
    del sd["d2t"], sd["t2d"]
    torch.save(sd, broken / "pytorch_model.bin")
    with pytest.raises(ValueError, match="d2t"):
        load_eagle_head(str(broken), model)
    # a head for another vocabulary
    other = tmp_path / "other-vocab"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(_hf_config(architectures=["LlamaForCausalLM"], vocab_size=512)))
    (other / "pytorch_model.bin").write_bytes((tmp_path / "eagle1" / "pytorch_model.bin").read_bytes())
    with pytest.raises(ValueError, match="vocab"):
        load_eagle_head(str(other), model)
    with pytest.raises(FileNotFoundError):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text("{}")
        load_eagle_head(str(tmp_path / "empty"), model)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_safetensors_round_trip(tmp_path, target_dir, target, kind, monkeypatch):
    """Saved and loaded, a head computes what it did; loading initializes no weight at random (the
    checkpoint's are assigned; the embedding is the target's, shared)."""
    model = target[0]
    torch.manual_seed(3)
    cfg = new_eagle_config(kind, target_dir, LAYERS, HIDDEN, draft_vocab_size=DRAFT_VOCAB)
    head = build_head(cfg)
    attach_target(head, model, has_own_embedding=False)
    if kind == "eagle3":
        ids = torch.tensor(sorted(random.Random(2).sample(range(VOCAB), DRAFT_VOCAB)))
        head.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[ids] = True
    head.eval()
    tokens = PROMPTS[2]
    feats = torch.randn(len(tokens), cfg.feature_size)
    with torch.no_grad():
        before = _head_forward(head, tokens, feats)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        out = save_eagle_head(head, tmp_path / str(dtype), dtype=dtype)
        assert (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
        saved = read_state_dict(out)
        assert not any(k.startswith(("embed_tokens", "target_lm_head")) for k in saved)
        with monkeypatch.context() as patch:
            for init in ("normal_", "uniform_", "kaiming_uniform_"):  # (on a tensor without storage: free)
                patch.setattr(torch.nn.init, init, lambda t, *a, _init=init, **k: t if t.is_meta else
                              pytest.fail(f"{_init} of a {tuple(t.shape)} tensor while loading"))
            loaded = load_eagle_head(str(out), model, kind=kind)
        assert loaded.embed_tokens.weight is model.model.embed_tokens.weight
        assert loaded.config.aux_layers == cfg.aux_layers and loaded.config.kind == kind
        assert loaded.config.draft_vocab_size == cfg.draft_vocab_size
        if kind == "eagle3":
            assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        else:
            assert loaded.fc.bias is not None  # rayspec's EAGLE-1 heads keep the published fc bias
        after = _head_forward(loaded, tokens, feats)
        torch.testing.assert_close(after, before, atol=tol, rtol=tol)


# ---- tree attention against a step-by-step reference -------------------------------------------

def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _plain_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of `tokens` run as one plain sequence on a fresh cache."""
    runner = make_runner(model, 64, 1, slack=4)
    runner.kv.allocate("ref")
    return runner.forward(["ref"], [tokens], last_only=False)[0]


def test_tree_forward_matches_each_path_run_alone(target):
    model = target[0]
    runner = make_runner(model, 64, 2, slack=16)
    prefixes = {"a": PROMPTS[0] + [11, 12], "b": PROMPTS[2]}
    for s, p in prefixes.items():
        runner.kv.allocate(s)
        runner.forward([s], [p[:-1]], last_only=True)  # the last prefix token stays pending, as in the engine
    # row a: a branching tree under the last prefix token; row b: 2 pending tokens + a smaller tree
    tree_a = Draft([40, 41, 50, 51, 52, 60, 70], None, [-1, -1, 0, 0, 1, 4, 5])
    tree_b = Draft([90, 91, 92, 93], None, [-1, -1, 1, 1])
    pend_a = prefixes["a"][-1:]
    pend_b = [prefixes["b"][-1], 17]
    inputs = {"a": pend_a + tree_a.tokens, "b": pend_b + tree_b.tokens}
    parents = {"a": verify_tree_parents(1, tree_a), "b": verify_tree_parents(2, tree_b)}
    assert parents["b"] == [-1, 0, 1, 1, 3, 3]  # pending chain, then the tree under the last pending token
    # nodes 0..2 in one forward, the rest in a second one that reads those from the cache (as the proposer)
    first = 3
    hidden1, _ = runner.forward_hidden(["a", "b"], [inputs["a"][:first], inputs["b"][:first]],
                                       trees=[TreeQuery(parents["a"][:first]), TreeQuery(parents["b"][:first])])
    hidden2, _ = runner.forward_hidden(["a", "b"], [inputs["a"][first:], inputs["b"][first:]],
                                       trees=[TreeQuery(parents["a"], first), TreeQuery(parents["b"], first)])
    logits = model.logits(torch.cat((hidden1, hidden2), dim=1))
    assert runner.kv.cached_len("a") == len(prefixes["a"]) - 1  # a tree forward does not move the cached length
    for row, s in enumerate("ab"):
        prefix = prefixes[s][:-1]
        for node in range(len(inputs[s])):
            path_tokens = [inputs[s][j] for j in _path(parents[s], node)]
            ref = _plain_logits(model, prefix + path_tokens)[-1]
            torch.testing.assert_close(logits[row, node], ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"row {s} node {node}: {m}")

    # keep an accepted path (a: pending + tree nodes 1 -> 4 -> 5, not the first rows; b: pending +
    # node 0, a prefix of the rows) and continue decoding: same logits as one plain run
    keep = {"a": [0, 1 + 1, 1 + 4, 1 + 5], "b": [0, 1, 2]}
    for s, rows in keep.items():
        with torch.inference_mode():  # as in the engine's step (its in-place KV moves need it)
            runner.kv.keep_paths([(s, rows)])
        assert runner.kv.cached_len(s) == len(prefixes[s]) - 1 + len(rows)
    nxt = {"a": [33, 34, 35], "b": [36, 37]}
    cont = runner.forward(["a", "b"], [nxt["a"], nxt["b"]], last_only=False)
    for row, s in enumerate("ab"):
        accepted = [inputs[s][r] for r in keep[s]]
        ref = _plain_logits(model, prefixes[s][:-1] + accepted + nxt[s])[-len(nxt[s]):]
        torch.testing.assert_close(cont[row, : len(nxt[s])], ref, atol=1e-4, rtol=1e-4)


def test_verify_tree_greedy_hand_made_tree():
    #            (pending) -> 10 [0] -> 20 [2] -> 30 [4]
    #                      -> 11 [1] -> 21 [3] -> 31 [5]
    #                                -> 22 [6]
    draft = Draft([10, 11, 20, 21, 30, 31, 22], None, [-1, -1, 0, 1, 2, 3, 1])
    k = len(draft.tokens)
    # rows: pending tokens first, then one per node; target_argmax[r] = target's choice after row r

    def argmax(num_pending, after_pending, per_node):
        return [99] * (num_pending - 1) + [after_pending] + [per_node.get(j, 98) for j in range(k)]

    # second branch taken, its second child (22) accepted, then the target's own token
    assert verify_tree_greedy(argmax(1, 11, {1: 22, 6: 7}), 1, draft) == ([11, 22, 7], [1, 6])
    # full depth along the second branch; bonus after the leaf
    assert verify_tree_greedy(argmax(1, 11, {1: 21, 3: 31, 5: 8}), 1, draft) == ([11, 21, 31, 8], [1, 3, 5])
    # first branch to depth 3
    assert verify_tree_greedy(argmax(2, 10, {0: 20, 2: 30, 4: 5}), 2, draft) == ([10, 20, 30, 5], [0, 2, 4])
    # nothing matches at the root: just the target's token
    assert verify_tree_greedy(argmax(1, 12, {}), 1, draft) == ([12], [])
    # a match that is not a child of the accepted node does not count (31 hangs under 21, not 20)
    assert verify_tree_greedy(argmax(1, 10, {0: 31}), 1, draft) == ([10, 31], [0])
    assert verify_tree_parents(2, draft) == [-1, 0, 1, 1, 2, 3, 4, 5, 3]
    assert verify_tree_parents(1, Draft([5, 6])) == [-1, 0, 1]  # a chain (parents None)
    assert verify_tree_parents(1, Draft([])) == [-1]


# ---- the trainer ----------------------------------------------------------------------------------

def test_training_lowers_the_loss(trained):
    for kind, (_, losses) in trained.items():
        assert len(losses) == TRAIN_STEPS
        assert losses[-1] < 0.7 * losses[0], (kind, losses[0], losses[-1])


def test_collate_aligns_pairs_and_labels(train_data, target):
    examples = load_examples(train_data["eagle3"], "eagle3")
    assert len(examples) == len(TRAIN_PROMPTS)
    feats, next_ids, labels, lengths = collate(examples, [0, 1], None)
    e = examples[1]
    n = len(e["ids"]) - 1
    assert lengths[1] == n and feats.shape[-1] == 3 * HIDDEN
    assert next_ids[1, :n].tolist() == e["ids"][1:].tolist()  # pair i reads token i+1
    assert labels[1, :n].tolist() == e["label"][1:].tolist()  # and predicts the target's choice after it
    assert (labels[1, n:] == -100).all()
    # the label is the greedy continuation: the answer's next token
    lp, answer = len(TRAIN_PROMPTS[1]), e["ids"][len(TRAIN_PROMPTS[1]):].tolist()
    assert labels[1, lp - 2: lp - 2 + len(answer)].tolist() == answer  # pair lp-2 reads the last prompt token


def test_collate_answers_only_masks_the_prompt(train_data):
    examples = load_examples(train_data["eagle3"], "eagle3")
    lp = len(TRAIN_PROMPTS[1])
    examples[1]["prompt_len"] = lp
    _, _, every, _ = collate(examples, [1], None)
    _, _, answers, _ = collate(examples, [1], None, answers_only=True)
    assert (answers[0, : lp - 2] == -100).all()  # pairs whose next token the user wrote: no loss
    assert torch.equal(answers[0, lp - 2:], every[0, lp - 2:])  # the target's tokens keep theirs


def test_ttt_mask_matches_draft_visibility():
    T, lengths = 6, torch.tensor([6, 4])
    m1 = ttt_mask(T, 1, lengths)
    assert m1.shape == (2, 1, T, T)
    assert torch.equal(m1[0, 0], torch.ones(T, T, dtype=torch.bool).tril())  # step 1: causal
    assert not m1[1, 0, :4, 4:].any()  # real queries never see padding keys
    m3 = ttt_mask(T, 3, lengths)[0, 0]  # step 3, query 4: true keys 0..2, its own chain at steps 2 and 3
    seen = [(s + 1, j) for s in range(3) for j in range(T) if m3[4, s * T + j]]
    assert seen == [(1, 0), (1, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_ttt_steps_equal_inference_drafting(target_dir, target, train_data, kind):
    """Training step s at position i computes what drafting computes at depth s: the head's cache
    holds the true pairs up to i-s+1, then its own drafts (fed their predecessor's output)."""
    head, _, t2d_index = _train_head(kind, target_dir, target[0], train_data[kind], steps=3)
    examples = load_examples(train_data[kind], kind)
    feats, next_ids, labels, lengths = collate(examples, [0], t2d_index)
    T, steps = int(lengths[0]), 3
    feats, next_ids = feats[:, :T], next_ids[:, :T]
    with torch.no_grad():  # the TTT loop of ttt_loss, keeping each step's output
        cos, sin = head.rope(torch.arange(T)[None], feats.dtype)
        emb = head.embed_tokens(next_ids)
        stores = [[] for _ in range(len(getattr(head, "layers", [None])))]
        hidden_in, outs = feats, []
        for s in range(1, steps + 1):
            out = head_step(head, emb, hidden_in, cos, sin, stores, ttt_mask(T, s, lengths[:1]), first=s == 1)
            outs.append(out[0])
            hidden_in = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)
    runner = make_runner(head, 64, 1, slack=8)
    for i in (5, 11, T - 1):
        m = i - steps + 2  # true pairs 0..m-1
        runner.kv.allocate("s")
        h, _ = runner.forward_hidden(["s"], [next_ids[0, :m].tolist()], features=feats[:, :m])
        h = h[:, -1]
        torch.testing.assert_close(h[0], outs[0][m - 1], atol=1e-4, rtol=1e-4)
        for depth in range(2, steps + 1):  # a chain of drafts under the true prefix
            pos = m + depth - 2
            tree = TreeQuery(list(range(-1, depth - 2)), first=depth - 2)
            h, _ = runner.forward_hidden(["s"], [[int(next_ids[0, pos])]], trees=[tree], features=h[:, None])
            h = h[:, 0]
            torch.testing.assert_close(h[0], outs[depth - 1][pos], atol=1e-4, rtol=1e-4,
                                       msg=lambda msg: f"position {pos}, step {depth}: {msg}")
        runner.kv.free("s")


def test_training_writes_to_a_new_directory_by_default(tmp_path, monkeypatch):
    """No --output: a new runs/<kind>-<time> directory, never one that exists; an --output holding files
    (the shipped head, say) is refused unless --overwrite; an empty or missing one is taken."""
    from rayspec.eagle.pipeline import check_output, new_output_dir
    from rayspec.eagle.train import TrainConfig
    from rayspec_cli.local import cmd_train
    from rayspec_cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    first = new_output_dir("eagle3")
    assert first.parent == Path("runs") and first.name.startswith("eagle3-20")
    first.mkdir(parents=True)
    assert new_output_dir("eagle3") != first  # a run started in the same second gets its own
    chosen = check_output(TrainConfig(kind="eagle", prompts=("p.jsonl",)))
    assert Path(chosen.output).parent == Path("runs") and Path(chosen.output).name.startswith("eagle-")
    head = tmp_path / "head"
    assert check_output(TrainConfig(output=str(head))).output == str(head)  # missing: fine
    head.mkdir()
    assert check_output(TrainConfig(output=str(head))).output == str(head)  # empty: fine
    (head / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--overwrite"):
        check_output(TrainConfig(output=str(head)))
    assert check_output(TrainConfig(output=str(head), overwrite=True)).output == str(head)
    args = build_parser().parse_args(["train", "eagle3", "--prompts", "p.jsonl", "--work-dir", "w",
                                      "--output", str(head)])
    assert args.overwrite is False and cmd_train(args) == 2  # refused before loading anything
    assert build_parser().parse_args(["train", "eagle3", "--prompts", "p.jsonl", "--work-dir", "w"]).output is None


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_train_run_end_to_end(tiny_model_dir, tmp_path, kind):
    """`rayspec train` on the 2-layer tiny model (it has a chat template): answers, features, training,
    a head in the published layout that the engine serves losslessly; a second run resumes everything."""
    from rayspec.eagle.pipeline import run
    from rayspec.eagle.train import TrainConfig

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Count from {i} to {i + 5}."]}) + "\n" for i in range(6))
                       + json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    cfg = TrainConfig(kind=kind, target=str(tiny_model_dir), prompts=(str(prompts),), work_dir=str(tmp_path / "work"),
                      output=str(tmp_path / "head"), max_new_tokens=12, draft_vocab_size=512, epochs=2,
                      warmup_steps=2, batch_tokens=256, checkpoint_every=2, num_threads=1)
    out = run(cfg)
    hf = json.loads((out / "config.json").read_text())
    if kind == "eagle3":
        assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["draft_vocab_size"] == 512
        assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # valid layers of a 2-layer target
    else:
        assert hf["architectures"] == ["LlamaForCausalLM"] and hf["num_hidden_layers"] == 1
    work = tmp_path / "work"
    assert len((work / "answers.jsonl").read_text().splitlines()) == 7
    steps = [json.loads(line)["step"] for line in (work / f"history-{kind}.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    first = read_state_dict(out)
    with pytest.raises(FileExistsError, match="--overwrite"):  # a head is there: never replaced by accident
        run(cfg)
    run(dataclasses.replace(cfg, overwrite=True))  # every stage is found done: the same head again
    again = read_state_dict(out)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)

    loaded = cached_model(str(tiny_model_dir))
    prompt = "Count from 3 to 8."
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ref = make_engine(tiny_model_dir, "none", loaded=loaded).generate([prompt], params)[0].token_ids
    engine = make_engine(tiny_model_dir, kind, k=4, loaded=loaded, draft_model=str(out), eagle_topk=2, num_steps=2)
    assert engine.generate([prompt], params)[0].token_ids == ref
    assert engine.stats.num_drafts > 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_train_with_a_bfloat16_target(tiny_model_dir, tmp_path, kind):
    """The CUDA default (bfloat16 target, float32 head), run on the CPU: the head trains on the target's
    bfloat16 embedding (and, for EAGLE-1, its LM head), shards are float16 on the CPU, the head is float32."""
    from rayspec.eagle.pipeline import prepare_data
    from rayspec.eagle.train import TrainConfig, load_target, train_head

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Count from {i} to {i + 5}."]}) + "\n" for i in range(4)))
    cfg = TrainConfig(kind=kind, target=str(tiny_model_dir), prompts=(str(prompts),), work_dir=str(tmp_path / "work"),
                      output=str(tmp_path / "head"), max_new_tokens=10, draft_vocab_size=512, epochs=2,
                      warmup_steps=2, batch_tokens=256, num_threads=1, device="cpu", target_dtype="bfloat16")
    target, tokenizer = load_target(cfg)
    assert next(target.parameters()).dtype == torch.bfloat16
    examples = prepare_data(cfg, target, tokenizer)
    shard = torch.load(next((tmp_path / "work" / f"features-{kind}").glob("features-*.pt")), weights_only=True)
    assert all(t.dtype == torch.float16 and t.device.type == "cpu" for t in shard["aux"] + shard["final"])
    out = train_head(cfg, target, examples)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "work" / f"history-{kind}.jsonl").read_text().splitlines()]
    assert losses and all(math.isfinite(x) for x in losses)
    state = read_state_dict(out)
    assert all(v.device.type == "cpu" for v in state.values())
    assert next(t for k, t in state.items() if k.startswith("fc.")).dtype == torch.float16  # saved as published


def test_train_further_from_a_head_with_more_prompts(tiny_model_dir, tmp_path):
    """--init-head on a work dir that gained prompts: only the new answers get features, training starts
    from the head's weights and keeps its draft vocabulary, and the result serves losslessly."""
    import shutil

    from rayspec.eagle.pipeline import run
    from rayspec.eagle.train import TrainConfig

    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps({"turns": [f"Count from {i} to {i + 5}."]}) + "\n" for i in range(4)))
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"turns": [f"Name {i} colours."]}) + "\n" for i in range(3)))
    common = dict(kind="eagle3", target=str(tiny_model_dir), max_new_tokens=12, draft_vocab_size=512,
                  warmup_steps=2, batch_tokens=256, checkpoint_every=2, num_threads=1)
    base = run(TrainConfig(prompts=(str(first),), work_dir=str(tmp_path / "a"), output=str(tmp_path / "head-a"),
                           epochs=1, **common))
    work_b = tmp_path / "b"
    work_b.mkdir()
    shutil.copy(tmp_path / "a" / "answers.jsonl", work_b / "answers.jsonl")
    shutil.copytree(tmp_path / "a" / "features-eagle3", work_b / "features-eagle3")
    old_shards = {p.name: p.read_bytes() for p in (work_b / "features-eagle3").glob("features-*.pt")}

    out = run(TrainConfig(prompts=(str(first), str(more)), work_dir=str(work_b), output=str(tmp_path / "head-b"),
                          epochs=1, init_head=str(base), **{**common, "draft_vocab_size": 256}))
    assert len((work_b / "answers.jsonl").read_text().splitlines()) == 7
    shards = sorted((work_b / "features-eagle3").glob("features-*.pt"))
    assert len(shards) == len(old_shards) + 1  # the 3 new conversations, in one new shard
    assert all((work_b / "features-eagle3" / n).read_bytes() == b for n, b in old_shards.items())
    assert sum(len(torch.load(s, weights_only=True)["ids"]) for s in shards) == 7
    before, after = read_state_dict(base), read_state_dict(out)
    assert torch.equal(before["d2t"], after["d2t"]) and torch.equal(before["t2d"], after["t2d"])  # vocabulary kept
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 512  # the head's, not the flag's
    assert not torch.equal(before["fc.weight"], after["fc.weight"])  # it trained

    # answers that no longer match the shards row by row are refused, not silently mixed up
    rows = (work_b / "answers.jsonl").read_text().splitlines()
    (work_b / "answers.jsonl").write_text("\n".join(rows[1:] + rows[:1]) + "\n")
    with pytest.raises(RuntimeError, match="row by row"):
        run(TrainConfig(prompts=(str(first), str(more)), work_dir=str(work_b), output=str(tmp_path / "head-c"),
                        epochs=1, init_head=str(base), **common))

    loaded = cached_model(str(tiny_model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ref = make_engine(tiny_model_dir, "none", loaded=loaded).generate(["Name 2 colours."], params)[0].token_ids
    engine = make_engine(tiny_model_dir, "eagle3", k=4, loaded=loaded, draft_model=str(out), eagle_topk=2, num_steps=2)
    assert engine.generate(["Name 2 colours."], params)[0].token_ids == ref


def test_growing_the_draft_vocabulary_keeps_trained_rows(tiny_model_dir, tmp_path):
    """--init-head with a larger --draft-vocab-size: the head's tokens and LM-head rows stay (same
    draft logits for them), the data's most frequent missing tokens join, it trains, and serves losslessly."""
    import shutil

    from rayspec.eagle.checkpoint import read_eagle_head
    from rayspec.eagle.pipeline import run
    from rayspec.eagle.train import TrainConfig, grow_draft_vocab

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Count from {i} to {i + 5}."]}) + "\n" for i in range(4)))
    common = dict(kind="eagle3", target=str(tiny_model_dir), prompts=(str(prompts),), max_new_tokens=12,
                  warmup_steps=2, batch_tokens=256, checkpoint_every=2, num_threads=1, epochs=1)
    base = run(TrainConfig(work_dir=str(tmp_path / "a"), output=str(tmp_path / "head-a"), draft_vocab_size=64, **common))

    loaded = cached_model(str(tiny_model_dir))
    target = loaded[0]
    head, _ = read_eagle_head(str(base), target, "eagle3")
    old_ids = torch.nonzero(head.t2d).flatten()
    frequent = [t for t in range(1000, 1010) if not head.t2d[t]][:5]
    grown = grow_draft_vocab(head, target, Counter({t: 100 - i for i, t in enumerate(frequent)}), 96)
    new_ids = torch.nonzero(grown.t2d).flatten()
    assert len(new_ids) == 96 and grown.config.draft_vocab_size == 96 == grown.config.hf_config["draft_vocab_size"]
    assert set(old_ids.tolist()) <= set(new_ids.tolist()) and set(frequent) <= set(new_ids.tolist())
    assert torch.equal(grown.to_target(torch.arange(96)), new_ids)  # d2t maps draft ids back to these tokens
    hidden = torch.randn(3, head.args.hidden_size)
    old_logits = head.draft_logits(hidden)  # [3, 64]
    new_logits = grown.draft_logits(hidden)  # [3, 96]
    torch.testing.assert_close(new_logits[:, torch.searchsorted(new_ids, old_ids)], old_logits)
    torch.testing.assert_close(grown.fc.weight, head.fc.weight)

    # the same answers and features in a new work dir (the old one's checkpoint is the 64-token head's)
    with pytest.raises(RuntimeError, match="draft vocabulary"):
        run(TrainConfig(work_dir=str(tmp_path / "a"), output=str(tmp_path / "head-x"), draft_vocab_size=96,
                        init_head=str(base), **common))
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "answers.jsonl", tmp_path / "b" / "answers.jsonl")
    shutil.copytree(tmp_path / "a" / "features-eagle3", tmp_path / "b" / "features-eagle3")
    out = run(TrainConfig(work_dir=str(tmp_path / "b"), output=str(tmp_path / "head-b"), draft_vocab_size=96,
                          init_head=str(base), **{**common, "epochs": 2}))
    after = read_state_dict(out)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 96
    assert after["lm_head.weight"].shape[0] == 96 and int(after["t2d"].sum()) == 96
    assert set(old_ids.tolist()) <= set(torch.nonzero(after["t2d"]).flatten().tolist())
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ref = make_engine(tiny_model_dir, "none", loaded=loaded).generate(["Count from 2 to 7."], params)[0].token_ids
    engine = make_engine(tiny_model_dir, "eagle3", k=4, loaded=loaded, draft_model=str(out), eagle_topk=2, num_steps=2)
    assert engine.generate(["Count from 2 to 7."], params)[0].token_ids == ref
    assert engine.stats.num_drafts > 0


def test_engine_refuses_a_local_proposer_that_lost_features(tiny_model_dir):
    """resend_features_from is for a remote proposer to settle with its verifier (RemoteProposer does);
    an in-process proposer asking for it is a bug and must fail loudly, not quietly stop drafting."""
    from rayspec.proposers import Draft, Proposer

    class Forgetful(Proposer):
        name = "forgetful"
        feature_layers = ()

        def propose(self, requests):
            return [Draft([], resend_features_from=0) for _ in requests]

    engine = make_engine(tiny_model_dir, "ngram", k=2, loaded=cached_model(str(tiny_model_dir)), proposer=Forgetful())
    # every request fails with the engine's error (a failing forward fails its requests, not the engine)
    outs = engine.generate(["Count from 1 to 5.", "Name three colours."], SamplingParams(temperature=0, max_tokens=8))
    for out in outs:
        assert out.finish_reason == "error" and "lost the target features" in out.error
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_long_prompt_joins_beside_a_sequence_near_its_end(target_dir, target, random_heads, kind):
    """The head's catch-up forward pads every row to the longest: a long prompt admitted beside a
    sequence deep in its context would write padding past that sequence's cache end (it raised
    CacheFullError and failed the step). It is split into batches that fit; outputs stay exact."""
    max_len = 48
    deep, joiner = PROMPTS[0], [_rng.randrange(VOCAB) for _ in range(30)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_len - len(deep), ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    base = make_engine(target_dir, "none", loaded=target, max_model_len=max_len, max_num_seqs=2)
    want = [base.generate([p], sp)[0].token_ids for p, sp in zip((deep, joiner), params)]
    # adaptive off: a random head's drafts are seldom accepted, so the planner would stop drafting and
    # the head's cache would never get deep enough for the joiner to matter
    engine = make_engine(target_dir, kind, k=2, loaded=target, draft_model=str(random_heads[kind]),
                         max_model_len=max_len, max_num_seqs=2, adaptive=False)
    first = engine.add_request(deep, params[0])
    done: dict = {}
    head_cache = engine.proposer.kv
    # deep enough that the joiner's padded rows would run past the deep sequence's cache end
    while not head_cache.has(first) or head_cache.cached_len(first) + len(joiner) <= head_cache.capacity:
        for out in engine.step():
            assert not out.finished
    second = engine.add_request(joiner, params[1])
    run_to_completion(engine, done)
    assert [done[first].token_ids, done[second].token_ids] == want
    assert engine.stats.num_drafts > 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_catch_up_writes_keys_alone_where_no_row_is_read(target_dir, target, trained, kind, monkeypatch):
    """A one-layer head's catch-up runs only each sequence's last row through the layer; the rows
    before it (a prompt's, a finished sequence's for the prefix cache) have their keys and values
    written alone (ModelRunner.write_kv). The head's drafts, its acceptance and the output are those
    of the catch-up running every row through."""
    from rayspec.eagle.head import EagleHead
    from rayspec.model.runner import ModelRunner as Runner

    prompts = PROMPTS + [PROMPTS[0] + [_rng.randrange(VOCAB) for _ in range(20)]]  # one long prompt
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs, written = {}, []
    original = Runner.write_kv

    def spy(self, seq_ids, token_lists, **kw):
        written.append(sum(len(t) for t in token_lists))
        return original(self, seq_ids, token_lists, **kw)

    monkeypatch.setattr(Runner, "write_kv", spy)
    for alone in (True, False):
        for cls in (EagleHead, Eagle1Head):
            monkeypatch.setattr(cls, "writes_kv_alone", property(lambda self, a=alone: a))
        engine = _eagle_engine(target_dir, target, trained[kind][0], kind, k=4, topk=2, depth=3,
                               enable_prefix_caching=True)
        outs = engine.generate(prompts, params)
        runs[alone] = ([o.token_ids for o in outs], engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens)
        if alone:  # the prompts' rows (but each last one) and the finished sequences', keys alone
            assert sum(written) >= sum(len(p) - 2 for p in prompts), written
        else:
            assert written == []
        written.clear()
    assert runs[True] == runs[False]
    assert runs[True][2] > 0
