"""The hand-set EAGLE-3 head and prompts shared by tests/serve/test_serve_eagle.py, tests/serve/test_serve_async.py
and tests/engine/test_pre_draft.py (not a test module)."""

from __future__ import annotations

import torch

from rayspec.eagle.checkpoint import new_eagle_config
from rayspec.eagle.head import build_head

PROMPTS = ["one two three four five six seven one two three four five six seven one two",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "1, 2, 3, 4, 5, 6,"]
TARGET_LAYERS = 8  # EAGLE-3 default feature layers of an 8-layer target: inputs of layers 2, 4, 5


def copy_head(target_dir, draft_tokens: list[int]):
    """An EAGLE-3 head set by hand to predict "the next token repeats this one", over a draft
    vocabulary of `draft_tokens` (so d2t maps draft ids to scattered target ids).

    A random head is next to never accepted; this one is on the runs a tiny random model
    produces, so accepted paths (and the features of accepted tokens) are exercised too.
    Attention looks (almost) only at the current position and copies the normed embedding's
    first kv_heads x head_dim dims; fc and the MLP are off; lm_head reads those dims back.
    """
    from safetensors.torch import load_file

    config = new_eagle_config("eagle3", target_dir, TARGET_LAYERS, 64, draft_vocab_size=len(draft_tokens))
    torch.manual_seed(0)
    head = build_head(config)
    a = head.args
    hd, groups = a.head_dim, a.num_kv_heads
    per_group = a.num_heads // groups
    width = groups * hd
    attn = head.midlayer.self_attn
    emb = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.tensor(sorted(draft_tokens))
    with torch.no_grad():
        for w in (head.fc.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                  head.midlayer.mlp.down_proj.weight, head.lm_head.weight):
            w.zero_()
        attn.k_proj.weight[:, :width] = torch.eye(width)
        attn.v_proj.weight[:, :width] = torch.eye(width)
        for h in range(a.num_heads):
            g = h // per_group
            attn.q_proj.weight[h * hd:(h + 1) * hd, g * hd:(g + 1) * hd] = 30.0 * torch.eye(hd)
            attn.o_proj.weight[g * hd:(g + 1) * hd, h * hd:(h + 1) * hd] = torch.eye(hd) / per_group
        normed = torch.nn.functional.rms_norm(emb[ids], (a.hidden_size,))
        head.lm_head.weight[:, :width] = normed[:, :width]
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


def oracle_head(target_dir, num_target_layers: int, hidden: int, sequences: list[list[int]], kind: str = "eagle3"):
    """An EAGLE-3 (or, kind "eagle", EAGLE-1) head set by hand to draft the target's own greedy continuations: a bigram table
    "after token t comes next[t]" read off `sequences` (prompts + their greedy outputs; a token seen
    before several others keeps its most frequent successor), built as copy_head is (attention copies
    the current token's normed embedding) with lm_head rows that map each token's embedding to its
    successor. Where the target's continuation is a function of the last token alone (the loops
    tiny random models settle into) every draft, chain or tree path, is accepted."""
    from collections import Counter

    from safetensors.torch import load_file

    follows: dict[int, Counter] = {}
    for seq in sequences:
        for a, b in zip(seq, seq[1:]):
            follows.setdefault(a, Counter())[b] += 1
    weights = load_file(str(target_dir / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"].float()
    vocab = emb.shape[0]
    if kind == "eagle":
        return _oracle_eagle1(target_dir, num_target_layers, hidden, follows, emb, weights["lm_head.weight"].float())
    config = new_eagle_config(kind, target_dir, num_target_layers, hidden, draft_vocab_size=vocab)
    torch.manual_seed(0)
    head = build_head(config)
    a = head.args
    hd, groups = a.head_dim, a.num_kv_heads
    per_group = a.num_heads // groups
    width = groups * hd
    attn = head.midlayer.self_attn
    normed = torch.nn.functional.rms_norm(emb, (a.hidden_size,))
    with torch.no_grad():
        for w in (head.fc.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                  head.midlayer.mlp.down_proj.weight, head.lm_head.weight):
            w.zero_()
        attn.k_proj.weight[:, :width] = torch.eye(width)
        attn.v_proj.weight[:, :width] = torch.eye(width)
        for h in range(a.num_heads):
            g = h // per_group
            attn.q_proj.weight[h * hd:(h + 1) * hd, g * hd:(g + 1) * hd] = 30.0 * torch.eye(hd)
            attn.o_proj.weight[g * hd:(g + 1) * hd, h * hd:(h + 1) * hd] = torch.eye(hd) / per_group
        for t, counts in follows.items():
            head.lm_head.weight[counts.most_common(1)[0][0], :width] += normed[t, :width]
        head.d2t.zero_()
        head.t2d.fill_(True)
    return head


def _oracle_eagle1(target_dir, num_target_layers, hidden, follows, emb, lm_head):
    """EAGLE-1 form of oracle_head: its logits are the target's LM head applied to its output, so fc
    maps each token's embedding to (a multiple of) its successor's LM-head row (least squares over
    the table: exact while it has at most `hidden` tokens) and the layers pass that through
    (attention and MLP outputs zeroed); the target feature half of fc is zero."""
    config = new_eagle_config("eagle", target_dir, num_target_layers, hidden)
    torch.manual_seed(0)
    head = build_head(config)
    tokens = sorted(follows)
    rows = torch.stack([lm_head[follows[t].most_common(1)[0][0]] for t in tokens])  # [n, H]
    rows = 4.0 * rows / rows.norm(dim=-1, keepdim=True)
    fit = torch.linalg.lstsq(emb[tokens], rows).solution  # [H, H]: emb[t] @ fit ~ rows
    with torch.no_grad():
        head.fc.weight.zero_()
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        head.fc.weight[:, :emb.shape[1]] = fit.T
        for layer in head.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return head
