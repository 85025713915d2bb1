"""The engine's host time per decode step (issue #50 (d)): the step's wall time less the time inside
the forwards, on a tiny model (hidden 64, 2 layers: the forwards are short, so the host dominates).

    python benchmarks/host_step.py --output-json benchmarks/results/host_step_after.json
    python benchmarks/host_step.py --dry-run     # a few steps of tiny cells (what the test runs)

Cells: the EAGLE-3 tree (configs/default.yaml's: 8 nodes, topk 2, depth 4, a prompt-lookup branch of 5;
the stop rule off and a fixed budget, so every step drafts the whole tree) at batch 1 and 32, and the
target alone at batch 32, each at a short (256) and a long (8,192) context of random prompt tokens.
Per cell: the prompts are prefilled, a few decode steps warm up, then per step `LLMEngine.step()`'s
wall time and the time inside the target's and the head's forwards (their modules' forward, write_kv
and read-out calls, timed with perf_counter: on the CPU every op is synchronous) are recorded; the
host time is the difference. Medians over the steps, in ms; the host time per emitted token too.
The cells take turns round by round (--rounds), so that the VM's drift falls on all alike; the
median is over every round's steps. --temperature 1: the requests sampled without a seed (verified by
rejection sampling), greedy by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rayspec.bench.environment import cpu_model  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

TREE = dict(method="eagle3", num_speculative_tokens=8, eagle_topk=2, num_steps=4, eagle_stop_prob=0.0,
            eagle_prompt_lookup=5, adaptive=False)
CONFIGS = {"eagle3-tree": TREE, "target-only": dict(method="none", num_speculative_tokens=0, adaptive=False)}
CELLS = [("eagle3-tree", 1), ("eagle3-tree", 32), ("target-only", 32)]
CONTEXTS = [256, 8192]
MAX_BATCHED = 4096  # prefill tokens per step
TIMED = ("forward", "write_kv", "logits", "draft_logits")  # the modules' compute entry points


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_model_dir(path: Path, max_positions: int) -> Path:
    """The tests' tiny random Llama (tests/conftest.make_tiny_model_dir), its positions raised to
    max_positions, with a fresh EAGLE-3 head beside it (path/head)."""
    from conftest import make_tiny_model_dir

    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head
    from rayspec.model import loader

    model_dir = make_tiny_model_dir(path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (model_dir / "config.json").write_text(json.dumps(config))
    model, _ = loader.load_model(str(model_dir))
    torch.manual_seed(3)
    head = build_head(new_eagle_config("eagle3", model_dir, model.args.num_layers, model.args.hidden_size))
    attach_target(head, model, has_own_embedding=False)
    save_eagle_head(head, path / "head", dtype=torch.float32)
    return model_dir


# vocabulary-wide tensor ops the engine runs outside the forwards (drafting's top-k and scores, the
# verification's choice, sampling): on a GPU device work, on the CPU counted in the host time (--split-ops)
TENSOR_OPS = [(owner, name) for name in ("topk", "argmax", "max", "log_softmax", "softmax", "index_select", "gather",
                                         "multinomial", "cumsum", "sort", "where") for owner in ("torch", "Tensor")]


class ForwardTimer:
    """Seconds spent inside the given modules' compute calls (TIMED), patched on the instances."""

    def __init__(self, modules):
        self.seconds = 0.0
        self._depth = 0  # a timed call inside another (a forward calling its own read-out) counts once
        for module in modules:
            for name in TIMED:
                if hasattr(module, name):
                    setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self._depth -= 1
        return timed


class OpTimer:
    """Seconds in TENSOR_OPS called outside the forwards of the cell being stepped (`current`, a
    ForwardTimer), patched on torch between start() and stop() (--split-ops)."""

    def __init__(self):
        self.seconds, self.current, self._patched = 0.0, None, []

    def start(self) -> None:
        for owner_name, name in TENSOR_OPS:
            owner = torch if owner_name == "torch" else torch.Tensor
            if hasattr(owner, name):
                self._patched.append((owner, name, getattr(owner, name)))
                setattr(owner, name, self._op(getattr(owner, name)))

    def stop(self) -> None:
        for owner, name, fn in self._patched:
            setattr(owner, name, fn)
        self._patched = []

    def _op(self, fn):
        def timed(*args, **kwargs):
            if self.current is None or self.current._depth:
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


OPS = OpTimer()


def max_tokens(batch: int, context: int, steps: int, k: int) -> int:
    """Enough for `steps` decode steps after every prompt is prefilled (the first prompts decode while
    the others prefill, MAX_BATCHED tokens a step)."""
    return (steps + batch * context // MAX_BATCHED + batch + 4) * (k + 1)


def build_engine(model_dir: Path, loaded, config: str, batch: int, context: int, steps: int,
                 **engine_options) -> LLMEngine:
    """An engine whose `batch` requests of `context` tokens can all decode `steps` steps (engine_options:
    EngineConfig's, e.g. defer_draft_reads)."""
    spec = dict(CONFIGS[config])
    if spec["method"] == "eagle3":
        spec.update(draft_model=str(model_dir.parent / "head"), tree_max_batch=max(batch, 2))
    max_len = context + max_tokens(batch, context, steps, spec["num_speculative_tokens"]) + 16
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=max_len, max_num_seqs=batch,
                                    kv_cache_memory_gb=max(0.5, batch * max_len * 2048 / 2**30),
                                    max_num_batched_tokens=MAX_BATCHED, compile=False,
                                    speculative=SpeculativeConfig(**spec), **engine_options),
                       model=loaded[0], tokenizer=loaded[1])
    return engine


def start_decoding(engine: LLMEngine, batch: int, context: int, steps: int, seed: int = 0,
                   temperature: float = 0.0) -> None:
    """Add `batch` prompts of `context` random tokens and step until every one decodes (and can
    decode `steps` steps more)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.args.vocab_size
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens(batch, context, steps, engine.max_k),
                            ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        engine.add_request(prompt, params)
    while engine.num_waiting or not all(s.prefilled for s in engine.running):
        engine.step()


def timed_steps(engine: LLMEngine, timer: ForwardTimer, steps: int) -> list[tuple[float, float, int, float]]:
    """(wall seconds, seconds in forwards, tokens emitted, seconds in tensor ops outside them) per decode step."""
    out = []
    for _ in range(steps):
        before = sum(len(s.token_ids) for s in engine.running)
        timer.seconds, OPS.seconds, OPS.current = 0.0, 0.0, timer
        started = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - started
        emitted = sum(len(s.token_ids) for s in engine.running) - before
        out.append((wall, timer.seconds, emitted, OPS.seconds))
    return out


def run(model_dir: Path, cells, contexts, rounds: int, steps: int, warm: int, temperature: float = 0.0,
        split_ops: bool = False, **engine_options) -> list[dict]:
    from rayspec.model import loader

    loaded = loader.load_model(str(model_dir))
    results = {}
    engines = {}
    total = rounds * steps + warm
    for config, batch in cells:
        for context in contexts:
            engine = build_engine(model_dir, loaded, config, batch, context, total, **engine_options)
            timer = ForwardTimer([engine.model] + engine.proposer.models())
            start_decoding(engine, batch, context, total, temperature=temperature)
            timed_steps(engine, timer, warm)
            engines[(config, batch, context)] = (engine, timer)
            results[(config, batch, context)] = []
    if split_ops:
        OPS.start()
    try:
        for _ in range(rounds):  # the cells take turns
            for key, (engine, timer) in engines.items():
                results[key] += timed_steps(engine, timer, steps)
    finally:
        OPS.stop()
    rows = []
    for (config, batch, context), steps_ in results.items():
        assert engines[(config, batch, context)][0].num_running == batch, "a request finished early"
        wall = [w for w, _, _, _ in steps_]
        host = [w - f for w, f, _, _ in steps_]
        row = dict(config=config, batch=batch, context=context, steps=len(steps_),
                   wall_ms=round(1e3 * statistics.median(wall), 3),
                   forwards_ms=round(1e3 * statistics.median([f for _, f, _, _ in steps_]), 3),
                   host_ms=round(1e3 * statistics.median(host), 3),
                   host_ms_per_token=round(1e3 * statistics.median([h / max(1, n) for h, (_, _, n, _)
                                                                     in zip(host, steps_)]), 4),
                   tokens_per_step=round(statistics.mean([n for _, _, n, _ in steps_]), 2))
        if split_ops:  # the host time's share in vocabulary-wide tensor ops, and the rest
            row["tensor_ops_ms"] = round(1e3 * statistics.median([o for *_, o in steps_]), 3)
            row["host_less_tensor_ops_ms"] = round(1e3 * statistics.median(
                [h - o for h, (*_, o) in zip(host, steps_)]), 3)
        rows.append(row)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per cell per round")
    parser.add_argument("--warm", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the requests' temperature (> 0: unseeded, verified by rejection sampling)")
    parser.add_argument("--split-ops", action="store_true",
                        help="also time the vocabulary-wide tensor ops run outside the forwards (top-k, argmax, "
                             "log-softmax, index_select, ...: device work on a GPU, host time here) and report "
                             "the host time less them")
    parser.add_argument("--defer-draft-reads", choices=("auto", "on", "off"), default="auto",
                        help="EngineConfig.defer_draft_reads (auto: its default, off on the CPU)")
    parser.add_argument("--dry-run", action="store_true", help="tiny cells (batch <= 2, contexts 32, 64), 2 steps")
    parser.add_argument("--output-json", help="write the result here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cells, contexts = CELLS, args.contexts
    if args.dry_run:
        cells, contexts = [(c, min(b, 2)) for c, b in CELLS], [32, 64]
        args.rounds, args.steps, args.warm = 1, 2, 1
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp), max(contexts) + 4096)
        defer = {"auto": None, "on": True, "off": False}[args.defer_draft_reads]
        rows = run(model_dir, cells, contexts, args.rounds, args.steps, args.warm, args.temperature, args.split_ops,
                   defer_draft_reads=defer)
    report = {"what": "engine host time per decode step (step wall - forwards), tiny model, issue #50 (d)",
              "cpu_model": cpu_model()[0], "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(), "commit": git_commit(),
              "command": "python benchmarks/host_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "load_average_at_start": [round(v, 1) for v in os.getloadavg()],
              "defer_draft_reads": args.defer_draft_reads, "temperature": args.temperature, "rounds": args.rounds, "steps": args.steps, "seconds": round(time.time() - started, 1), "rows": rows}
    for r in rows:
        print(f"{r['config']:12s} batch {r['batch']:3d} context {r['context']:5d}: wall {r['wall_ms']:8.2f} ms  "
              f"forwards {r['forwards_ms']:8.2f} ms  host {r['host_ms']:8.2f} ms/step  "
              f"({r['host_ms_per_token']:.3f} ms/token, {r['tokens_per_step']} tokens/step)"
              + (f"  tensor ops {r['tensor_ops_ms']:.2f} ms, the rest {r['host_less_tensor_ops_ms']:.2f} ms"
                 if "tensor_ops_ms" in r else ""))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
