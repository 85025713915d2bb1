"""Host-device syncs per engine step: every device-to-host read of a decode step goes through
rayspec.device_io.to_host, and their number is a small constant, whatever the batch size and the
draft length (on CUDA each one drains the GPU's queue).

On CPU nothing syncs, so the audit is done on the code path: a torch function mode watches every
torch call of a decode step and records any read that does not go through to_host (tolist, item,
int(), bool(), numpy, nonzero, a tensor built from a host list for the device, a host list used as
an index), and count_host_reads counts the routed ones. benchmarks/gpu_checks.py counts the real
syncs on CUDA (torch.cuda.set_sync_debug_mode) when a GPU is at hand.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_utils import cached_model, make_engine  # noqa: E402
from rayspec.assets import assets_root  # noqa: E402
from rayspec.device_io import count_host_reads, inside_to_host  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

MAX_READS = 4  # per decode step (the bound); the engine makes 2: the draft, the verdict
READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "nonzero", "cpu"}
PROMPTS = [
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime.",
    "def fibonacci(n):",
    "What is the capital of France? Answer in one sentence.",
    "Translate 'good morning' into Spanish, French and German.",
    "Explain recursion to a child.",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
]


def _host_index(index) -> bool:
    """An index a device tensor cannot take without a host-to-device copy or a data-dependent shape."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)


class SyncAudit(TorchFunctionMode):
    """Records torch calls that read the device from the host, or copy host lists to it, outside to_host."""

    def __init__(self):
        super().__init__()
        self.unrouted: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not inside_to_host():
            name = getattr(func, "__name__", "")
            bad = (name in READS
                   or (name in ("tensor", "as_tensor") and kwargs.get("device") is not None)
                   or (name in ("__getitem__", "__setitem__") and len(args) > 1 and _host_index(args[1])))
            if bad:
                where = traceback.extract_stack(limit=4)[-3]
                self.unrouted.append(f"{name} at {Path(where.filename).name}:{where.lineno}")
        return func(*args, **kwargs)


def audit_decode_steps(engine, prompts, params: SamplingParams, repeat: int = 1) -> list[tuple[int, int, list[str]]]:
    """Run the prompts to completion; (batch size, routed reads, unrouted reads) per decode step.
    repeat: each chat prompt's tokens that many times over (its tail then recurs: an n-gram lookup drafts)."""
    steps, prepare, commit = [], engine._decode_prepare, engine._decode_commit

    def audited(seqs):  # a decode step: propose -> verify (prepare), then commit
        with SyncAudit() as audit, count_host_reads() as reads:
            done = commit(seqs, prepare(seqs))
        steps.append((len(seqs), reads.count, audit.unrouted))
        return done

    engine._decode_prepare = lambda seqs: seqs  # (the whole step runs in the commit spy)
    engine._decode_commit = lambda seqs, _: audited(seqs)
    for p in prompts:
        engine.add_request(engine.encode_chat([{"role": "user", "content": p}]) * repeat, params)
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2):
    return cached_model(smollm2)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
HEAD = str(assets_root() / "heads" / "smollm2-135m-eagle3")


def _check(steps, batch: int) -> list[int]:
    assert steps, "no decode step ran"
    for size, reads, unrouted in steps:
        assert not unrouted, f"device reads outside rayspec.device_io.to_host: {unrouted}"
        assert reads <= MAX_READS, f"{reads} host reads in a decode step of batch {size}"
    full = [reads for size, reads, _ in steps if size == batch]
    assert full, f"no decode step ran the whole batch of {batch}"
    return full


@pytest.mark.parametrize("k,depth", [(8, 4), (12, 6)])
def test_eagle3_tree_step_batch1(smollm2, smollm2_loaded, k, depth):
    """configs/default.yaml's tree (topk 2, stop rule, prompt-lookup branch), batch 1, growing on
    the device (the path every device but the CPU takes): the same reads at depth 4 and 6."""
    # adaptive off: the audit needs tree steps with accepted drafts at every depth asked, and with the
    # planner on the first trees of these prompts were all rejected and it stopped drafting (3 drafts)
    engine = make_engine(smollm2, "eagle3", k=k, loaded=smollm2_loaded, draft_model=HEAD, eagle_topk=2,
                         num_steps=depth, eagle_stop_prob=0.2, eagle_prompt_lookup=5, max_num_seqs=1, adaptive=False)
    engine.proposer.early_exit_reads = False
    reads = _check(audit_decode_steps(engine, PROMPTS[:2], GREEDY), 1)
    assert max(reads) == 2
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("topk,batch", [(2, 1), (1, 8)], ids=["tree", "chains"])
def test_eagle3_recording_paths_adds_no_read(smollm2, smollm2_loaded, topk, batch):
    """With a pre-drafter's recording on (num_candidates: each draft's best path, its head states
    and top candidates, rayspec.proposers.pre_draft), a call still reads the device once."""
    engine = make_engine(smollm2, "eagle3", k=8, loaded=smollm2_loaded, draft_model=HEAD, eagle_topk=topk,
                         num_steps=4, eagle_stop_prob=0.2, max_num_seqs=batch, tree_max_batch=1)
    engine.proposer.early_exit_reads = False
    engine.proposer.num_candidates = 2

    class Kept(dict):  # what was recorded stays after the sequences finish
        def pop(self, key, default=None):
            return self.get(key, default)

    engine.proposer.paths, engine.proposer.candidates = Kept(), Kept()
    reads = _check(audit_decode_steps(engine, PROMPTS[:batch] if batch > 1 else PROMPTS[:1], GREEDY), batch)
    assert max(reads) == 2
    assert engine.proposer.paths and engine.proposer.candidates


def test_eagle3_tree_step_cpu_early_exit(smollm2, smollm2_loaded):
    """On CPU the stop rule reads after each depth (free there): at most one read per depth more."""
    engine = make_engine(smollm2, "eagle3", k=8, loaded=smollm2_loaded, draft_model=HEAD, eagle_topk=2,
                         num_steps=4, eagle_stop_prob=0.2, max_num_seqs=1)
    assert engine.proposer.early_exit_reads
    steps = audit_decode_steps(engine, PROMPTS[:1], GREEDY)
    assert all(not unrouted for _, _, unrouted in steps)
    assert max(reads for _, reads, _ in steps) <= 2 + (4 - 1)


@pytest.mark.parametrize("method,k", [("eagle3", 4), ("eagle3", 8), ("draft_model", 4), ("draft_model", 8),
                                      ("ngram", 4)])
def test_chain_step_batch8(smollm2, smollm2_loaded, method, k):
    """Chains at batch 8 (EAGLE-3 head, a 2-layer SmolLM2 draft, n-gram): the same reads at k 4 and 8."""
    spec = {"eagle3": dict(draft_model=HEAD, eagle_topk=1, eagle_stop_prob=0.2),
            "draft_model": dict(draft_model=smollm2, draft_num_layers=2),
            "ngram": dict()}[method]
    engine = make_engine(smollm2, method, k=k, loaded=smollm2_loaded, max_num_seqs=8, tree_max_batch=1, **spec)
    if method == "eagle3":
        engine.proposer.early_exit_reads = False
    reads = _check(audit_decode_steps(engine, PROMPTS, GREEDY), 8)
    assert max(reads) == (1 if method == "ngram" else 2)


SAMPLED = SamplingParams(temperature=1.0, max_tokens=16)  # unseeded: verified by rejection sampling


SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=16)  # seeded: coupled draws (a top-p on CPU counts its candidates on the host)


@pytest.mark.parametrize("sampled", [None, SAMPLED, SEEDED], ids=["greedy", "t1", "seeded"])
@pytest.mark.parametrize("method,topk,batch", [("eagle3", 2, 1), ("eagle3", 2, 2), ("eagle3", 1, 8), ("draft_model", 1, 8)],
                         ids=["tree", "tree-batch2", "chains-batch8", "draft-model-batch8"])
def test_one_read_per_cycle_with_deferred_drafts(smollm2, smollm2_loaded, method, topk, batch, sampled):
    """defer_draft_reads (on by default off the CPU): an EAGLE cycle reads the device once, the drafts
    with the target's choices (rayspec.engine.deferred_verify), configs/default.yaml's tree shape
    (topk 2, stop rule, prompt-lookup branch) or chains, and a draft model's chains too; the drafts
    still verify (tokens accepted). At temperature 1 without a seed too: the rejection rule is laid
    out from the drafts where they are (rayspec.sampling.rejection.SampledBatch) and its verdicts come
    in the same read.
    Fails with the option off: 2 reads (the draft, then the verdict); sampled, before the rule took
    device drafts: 2 (the drafts with the greedy choices, then the verdicts). (EAGLE-1 heads take the
    same path: test_lossless_grid's "deferred" column.) Seeded (coupled draws, the keys at a tree's
    depths made on the device): 1 read; before, seeded requests were not deferred (2 reads)."""
    spec = (dict(draft_model=HEAD, eagle_topk=topk, num_steps=4, eagle_stop_prob=0.2,
                 eagle_prompt_lookup=5 if topk > 1 else 0) if method == "eagle3"
            else dict(draft_model=smollm2, draft_num_layers=2))
    # adaptive off: a fixed budget, so every cycle counted drafts (the planner, on by default, may leave a
    # cycle with no draft: one read, the verdict's, which says nothing of the drafts)
    engine = make_engine(smollm2, method, k=8, loaded=smollm2_loaded, max_num_seqs=batch, tree_max_batch=2,
                         adaptive=False, engine_seed=17, **spec)
    engine.config.defer_draft_reads = True
    reads = _check(audit_decode_steps(engine, PROMPTS[:max(batch, 2)], sampled or GREEDY), batch)
    assert max(reads) == 1
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method,topk,batch", [("eagle3", 2, 1), ("eagle3", 2, 2), ("eagle3", 1, 8),
                                               ("draft_model", 1, 8), ("ngram", 1, 8)],
                         ids=["tree", "tree-batch2", "chains-batch8", "draft-model-batch8", "ngram-batch8"])
def test_sampled_step_reads_as_a_greedy_one(smollm2, smollm2_loaded, method, topk, batch):
    """At temperature 1 without a seed (what an OpenAI client sends by default) a decode step reads the
    device as often as a greedy one: the draft, then the verdicts of every sequence together
    (rayspec.sampling.rejection.SampledBatch: the rejection rule of sampled chains, with or without
    q, and of token trees runs on the device for the whole batch). Failed before it: one read per
    sampled sequence for its verdict, and a tree walk one per node it visited."""
    spec = {"eagle3": dict(draft_model=HEAD, eagle_topk=topk, num_steps=4, eagle_stop_prob=0.2,
                           eagle_prompt_lookup=5 if topk > 1 else 0),
            "draft_model": dict(draft_model=smollm2, draft_num_layers=2),
            "ngram": dict()}[method]
    # (engine_seed: reproducible streams; unseeded from the OS, an n-gram run once drew text without a match)
    engine = make_engine(smollm2, method, k=8, loaded=smollm2_loaded, max_num_seqs=batch, tree_max_batch=2,
                         adaptive=False, engine_seed=17, **spec)
    if method == "eagle3":
        engine.proposer.early_exit_reads = False
    # (an n-gram's prompts twice over: their first decode step drafts whatever the sampled text; with the chat
    # prompts alone, on an Intel Xeon, 16 tokens drawn at temperature 1 never repeated one and nothing was drafted)
    reads = _check(audit_decode_steps(engine, PROMPTS[:max(batch, 2)], SAMPLED, repeat=2 if method == "ngram" else 1),
                   batch)
    assert max(reads) == (1 if method == "ngram" else 2)
    assert engine.stats.num_draft_tokens > 0


def test_prefill_reads_once_for_every_first_token(smollm2, smollm2_loaded):
    """A prefill forward that finishes 8 prompts (greedy; sampled unseeded, seeded, with top-k/top-p
    and with penalties) reads the device once for all their first tokens (rayspec.sampling.sampler
    .choose_rows), with no read outside to_host; the greedy ones are the argmax of their last rows,
    and each sampled one is the draw its own stream would make alone. Failed before: one read per
    sequence (an int() of its argmax or of its draw)."""
    # (ignore_eos: an unseeded first token that is EOS would finish its request at once; CI saw one)
    engine = make_engine(smollm2, "none", k=0, loaded=smollm2_loaded, max_num_seqs=8, engine_seed=3)
    kinds = [GREEDY, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
             SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, max_tokens=4, ignore_eos=True),
             SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2, max_tokens=4,
                            ignore_eos=True)]
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    shortest = min(len(p) for p in prompts)  # one length: one prefill forward for all 8
    prompts = [p[:shortest - 3] + p[-3:] for p in prompts]
    audits, prefill = [], engine._prefill

    def audited(chunks):
        with SyncAudit() as audit, count_host_reads() as reads:
            touched = prefill(chunks)
        audits.append((len(chunks), reads.count, audit.unrouted))
        return touched

    engine._prefill = audited
    ids = [engine.add_request(p, kinds[i % 4]) for i, p in enumerate(prompts)]
    engine.step()
    assert audits == [(8, 1, [])], audits
    firsts = [engine._requests[i].output_token_ids[0] for i in ids]
    alone = make_engine(smollm2, "none", k=0, loaded=smollm2_loaded, max_num_seqs=1)
    for i in (0, 4, 2, 6):  # greedy and seeded: the same token decoded alone
        out = alone.generate([prompts[i]], SamplingParams(**{**vars(kinds[i % 4]), "max_tokens": 1}))
        assert out[0].token_ids[0] == firsts[i], i


def test_overlapped_step_reads_once_after_queueing_the_next(smollm2, smollm2_loaded, monkeypatch):
    """overlap_scheduling (rayspec.engine.overlap), 8 requests greedy and T = 1: a step that resolves a
    queued step makes one routed read and none outside to_host, and where it queues the next step, that
    step's forward comes before the read (on CUDA: the host's work of a step runs while the device
    computes the next, and the read waits for the step before only: device_io.PendingRead)."""
    from rayspec.device_io import PendingRead

    engine = make_engine(smollm2, "none", k=0, loaded=smollm2_loaded, max_num_seqs=8)
    engine.config.overlap_scheduling = True
    events, steps = [], []
    forward, wait, advance = engine._target_forward, PendingRead.wait, engine.overlap.advance

    def logged_forward(*args, **kwargs):
        events.append("forward")
        return forward(*args, **kwargs)

    def logged_wait(self):
        events.append("read")
        return wait(self)

    def audited():
        events.clear()
        with SyncAudit() as audit, count_host_reads() as reads:
            touched = advance()
        steps.append((reads.count, audit.unrouted, list(events), engine.overlap.in_flight is not None))
        return touched

    engine._target_forward = logged_forward
    monkeypatch.setattr(PendingRead, "wait", logged_wait)
    engine.overlap.advance = audited
    params = [GREEDY, SamplingParams(temperature=1.0, max_tokens=24)] * 4
    engine.generate([engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS], params)
    assert sum(queued for *_, queued in steps) >= 15, steps
    for reads, unrouted, order, queued in steps:
        assert reads == 1 and not unrouted, (reads, unrouted)
        assert order == (["forward", "read"] if queued else ["read"]), order


def test_audit_catches_a_stray_read(smollm2, smollm2_loaded):
    """The audit is not blind: a .tolist() slipped into the verification is reported."""
    engine = make_engine(smollm2, "ngram", k=4, loaded=smollm2_loaded, max_num_seqs=2)
    logits_of = engine.model.logits

    def leaky(hidden):
        out = logits_of(hidden)
        out[:1, :1].tolist()
        return out

    engine.model.logits = leaky
    steps = audit_decode_steps(engine, PROMPTS[:2], GREEDY)
    assert any(any(u.startswith("tolist") for u in unrouted) for _, _, unrouted in steps)


def test_projections_fused_off_the_cpu():
    """Off the CPU q/k/v and gate/up run as one matmul each: their weights become views of one
    tensor (no extra memory, state_dict unchanged) and the outputs stay the parts' own."""
    from rayspec.model.families import ModelArgs
    from rayspec.model.native import MLP, Attention

    args = ModelArgs(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True)
    torch.manual_seed(0)
    mlp, attn = MLP(args), Attention(args)
    x = torch.randn(5, 48)
    want_mlp = mlp(x)
    want_qkv = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    keys = set(mlp.state_dict()) | {f"a.{k}" for k in attn.state_dict()}
    mlp.fuse_for_device()  # what CausalLM.pack_for_cpu does on CUDA
    attn.fuse_for_device()
    weight, bias, sizes = attn.qkv_fused
    assert sizes == [48, 24, 24] and bias is not None
    base = weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == base for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert set(mlp.state_dict()) | {f"a.{k}" for k in attn.state_dict()} == keys
    torch.testing.assert_close(mlp(x), want_mlp)
    fused = torch.nn.functional.linear(x, weight, bias).split(sizes, dim=-1)
    for got, want in zip(fused, want_qkv):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # an in-place update of a part is seen by the fused weight (a view)
        attn.k_proj.weight.add_(1.0)
    torch.testing.assert_close(weight[48:72], attn.k_proj.weight)
