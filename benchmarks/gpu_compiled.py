"""The compiled step and host syncs on CUDA, for a session that is lent a GPU (no download: random
weights built on the spot).

1. syncs per decode step, counted by CUDA itself (torch.cuda.set_sync_debug_mode: every blocking
   copy or synchronize warns), beside rayspec.device_io's own count: a batch-1 EAGLE-3 tree step and
   batch-8 chain steps (EAGLE-3 head, 2-layer draft model), SmolLM2's shapes, 4 layers, bfloat16;
2. eager against compiled (`EngineConfig.compile`, CUDA graphs) decode speed, tokens per second after
   a warm-up that compiles every shape: SmolLM2's shapes (30 layers) baseline and EAGLE-3 (random
   head), and Llama-3.1-8B's shapes (32 layers, hidden 4096, vocabulary 128256) baseline, at
   concurrency 1 and 8, bfloat16; with the outputs compared token for token.

    python benchmarks/gpu_compiled.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_checks import VOCAB, make_head_dir, make_model_dir  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.device_io import count_host_reads  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

RESULTS: dict = {}
OUT: Path | None = None


def record(section: str, row: dict) -> None:
    RESULTS.setdefault(section, []).append(row)
    print(json.dumps({section: row}), flush=True)
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=1))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(12)]
    return [base * 3 + [rng.randrange(3, vocab) for _ in range(5 + i)] for i in range(n)]


def engine_for(model_dir, loaded, method="none", compile=False, seqs=8, **spec) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=seqs,
                          kv_cache_memory_gb=4.0, compile=compile,
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=spec.pop("k", 4),
                                                        adaptive=False, **spec))
    return LLMEngine(config, model=loaded[0], tokenizer=loaded[1])


def syncs(root: Path) -> None:
    from rayspec.model import loader

    target_dir = make_model_dir(root / "t4", 4, 0)
    loaded = loader.load_model(str(target_dir), device="cuda", dtype="bfloat16")
    head_dir = make_head_dir(root / "h4", target_dir, loaded[0])
    cases = [("eagle3 tree, batch 1", 1, "eagle3", dict(draft_model=str(head_dir), eagle_topk=2, num_steps=4,
                                                          eagle_stop_prob=0.2, k=8)),
             ("eagle3 chain, batch 8", 8, "eagle3", dict(draft_model=str(head_dir), tree_max_batch=1, k=4)),
             ("draft model chain, batch 8", 8, "draft_model", dict(draft_model=str(target_dir), draft_num_layers=2, k=4)),
             ("baseline, batch 8", 8, "none", {})]
    for label, batch, method, spec in cases:
        engine = engine_for(target_dir, loaded, method, **spec)
        per_step, prepare, commit = [], engine._decode_prepare, engine._decode_commit

        def decode(seqs, prepare=prepare, commit=commit):  # a whole decode step: propose -> verify -> commit
            return commit(seqs, prepare(seqs))

        def counted(seqs, decode=decode, per_step=per_step):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught, count_host_reads() as reads:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    done = decode(seqs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            cuda = [w for w in caught if "synchroniz" in str(w.message)]
            per_step.append((len(seqs), len(cuda), reads.count, sorted({str(w.filename).split("/")[-1] + ":" + str(w.lineno) for w in cuda})))
            return done

        engine._decode_prepare = lambda seqs: seqs  # (the whole step runs in the commit spy)
        engine._decode_commit = lambda seqs, _, counted=counted: counted(seqs)
        engine.generate(prompts(batch, VOCAB), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        full = [s for s in per_step if s[0] == batch]
        record("syncs", {"case": label, "steps": len(full), "cuda_syncs_per_step_max": max(s[1] for s in full),
                         "cuda_syncs_per_step_mean": round(sum(s[1] for s in full) / len(full), 2),
                         "to_host_reads_max": max(s[2] for s in full), "where": sorted({w for s in full for w in s[3]})[:12]})


def llama8b_shapes():
    from rayspec.model.families import ModelArgs
    from rayspec.model.native import CausalLM

    args = ModelArgs(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     max_position_embeddings=8192)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    with torch.device("meta"):
        model = CausalLM(args, inv_freq)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "embed" not in name else 1.0)
    model.inv_freq = inv_freq.cuda()
    return model.eval()


def timed(engine, ps, tokens) -> tuple[float, list[list[int]], int]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(ps, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / dt, [o.token_ids for o in outs], sum(o.num_accepted_tokens for o in outs)


def speed(root: Path, which: list[str]) -> None:
    from rayspec.model import loader

    smol_dir = make_model_dir(root / "t30", 30, 1)
    smol = loader.load_model(str(smol_dir), device="cuda", dtype="bfloat16")
    head_dir = make_head_dir(root / "h30", smol_dir, smol[0])
    eagle = dict(draft_model=str(head_dir), eagle_topk=2, num_steps=4, k=8, tree_max_batch=2)
    cases = [("smollm2-shapes baseline c=1", "smol", 1, "none", {}),
             ("llama8b-shapes baseline c=1", "8b", 1, "none", {}),
             ("llama8b-shapes baseline c=8", "8b", 8, "none", {}),
             ("smollm2-shapes eagle3 c=1", "smol", 1, "eagle3", eagle),
             ("smollm2-shapes baseline c=8", "smol", 8, "none", {}),
             ("smollm2-shapes eagle3 c=8", "smol", 8, "eagle3", eagle)]
    big = None
    for label, model, c, method, spec in cases:
        if not any(w in label for w in which):
            continue
        try:
            if model == "8b" and big is None:
                big = (llama8b_shapes(), None)
            loaded, model_dir, vocab = (smol, smol_dir, VOCAB) if model == "smol" else (big, "llama8b-shapes", 128256)
            ps = prompts(c, vocab, seed=c)
            row = {"case": label}
            outs = {}
            for compile in (False, True):
                engine = engine_for(model_dir, loaded, method, compile=compile, seqs=8, **dict(spec))
                t0 = time.perf_counter()
                timed(engine, ps, 16)  # warm-up: every shape compiled (and CUDA graphs captured)
                row[f"warmup_s_{'compiled' if compile else 'eager'}"] = round(time.perf_counter() - t0, 1)
                rates = []
                for _ in range(3):
                    rate, out, acc = timed(engine, ps, 64)
                    rates.append(rate)
                outs[compile] = out
                row[f"tok_s_{'compiled' if compile else 'eager'}"] = round(sorted(rates)[1], 1)
                del engine
            row["compiled_over_eager"] = round(row["tok_s_compiled"] / row["tok_s_eager"], 2)
            row["outputs_equal"] = f"{sum(a == b for a, b in zip(outs[False], outs[True]))}/{len(ps)}"
            record("speed", row)
        except Exception as err:  # noqa: BLE001
            record("speed", {"case": label, "error": repr(err)[:400], "trace": traceback.format_exc()[-1500:]})


def set_fused(model, on: bool, saved: dict) -> None:
    """Turn the fused q/k/v and gate/up matmuls (rayspec.model.linear.fuse_weights) off and on again."""
    from rayspec.model.native import MLP, Attention

    for m in model.modules():
        for attr in ("qkv_fused", "gate_up_fused") if isinstance(m, (Attention, MLP)) else ():
            if hasattr(m, attr):
                if on:
                    setattr(m, attr, saved.get((id(m), attr)))
                else:
                    saved[(id(m), attr)] = getattr(m, attr)
                    setattr(m, attr, None)


def fusion(which: list[str]) -> None:
    """Llama-3.1-8B shapes: eager without and with the fused projections, and compiled (fused) after
    LLMEngine.warm_up, concurrency 1 and 8."""
    model = llama8b_shapes()
    model.pack_for_cpu()  # off the CPU: fuses q/k/v and gate/up (weight views)
    saved: dict = {}
    for c in (1, 8):
        ps = prompts(c, 128256, seed=c)
        row = {"case": f"llama8b-shapes baseline c={c}"}
        outs = {}
        for label, fused, compile in (("eager_unfused", False, False), ("eager_fused", True, False),
                                      ("compiled_fused", True, True)):
            set_fused(model, fused, saved)
            engine = engine_for("llama8b-shapes", (model, None), "none", compile=compile, seqs=8)
            t0 = time.perf_counter()
            row[f"warm_up_{label}"] = [list(x) for x in engine.warm_up()]
            timed(engine, ps, 8)
            row[f"warm_up_s_{label}"] = round(time.perf_counter() - t0, 1)
            rates = []
            for _ in range(3):
                rate, out, _ = timed(engine, ps, 64)
                rates.append(rate)
            row[f"tok_s_{label}"] = round(sorted(rates)[1], 1)
            outs[label] = out
            del engine
        row["fused_over_unfused"] = round(row["tok_s_eager_fused"] / row["tok_s_eager_unfused"], 3)
        row["compiled_over_eager_fused"] = round(row["tok_s_compiled_fused"] / row["tok_s_eager_fused"], 3)
        row["equal_fused_unfused"] = sum(a == b for a, b in zip(outs["eager_fused"], outs["eager_unfused"]))
        record("fusion", row)


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="*", default=["syncs", "smollm2", "llama8b"])
    args = parser.parse_args()
    OUT = Path(args.json) if args.json else None
    RESULTS.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    print(RESULTS, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if "syncs" in args.only:
            try:
                syncs(Path(tmp))
            except Exception as err:  # noqa: BLE001
                record("syncs", {"error": repr(err)[:400], "trace": traceback.format_exc()[-1500:]})
        if "fusion" in args.only:
            try:
                fusion(args.only)
            except Exception as err:  # noqa: BLE001
                record("fusion", {"error": repr(err)[:400], "trace": traceback.format_exc()[-1500:]})
        speed(Path(tmp), [w for w in args.only if w not in ("syncs", "fusion")])
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
