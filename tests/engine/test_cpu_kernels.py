"""The CPU matmul kernel per row count is measured at load time (rayspec.cpu.kernels), not fixed
by a constant measured on one CPU."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rayspec.cpu import kernels as cpu_kernels
from rayspec.cpu.kernels import ROWS, VARIANTS, CpuKernels, choose, pick
from rayspec.model.linear import Linear

needs_onednn = pytest.mark.skipif(not cpu_kernels.onednn_available(), reason="oneDNN is one of the candidates")


def test_pick_takes_the_fastest_per_row_count():
    medians = {"flinear": {n: 1.0 for n in ROWS}, "wxt": {n: 2.0 for n in ROWS},
               "onednn": {n: 0.5 if n >= 9 else 1.5 for n in ROWS}, "onednn_pad4": {n: 3.0 for n in ROWS}}
    assert pick(medians) == {1: "flinear", 2: "flinear", 4: "flinear", 9: "onednn", 32: "onednn"}
    kernels = CpuKernels(pick(medians), "measured", medians)
    assert [kernels.path_for(n) for n in (1, 3, 4, 5, 9, 10, 32, 2048)] == \
        ["flinear", "flinear", "flinear", "onednn", "onednn", "onednn", "onednn", "onednn"]
    assert kernels.onednn and kernels.variant.startswith("mixed:")
    assert not CpuKernels.single("wxt", "x").onednn and CpuKernels.single("wxt", "x").variant == "wxt"


def test_near_equal_kernels_get_the_same_choice_whichever_measured_faster():
    """Two replicas of one machine measured onednn and wxt ~4% apart, in either order: within TIE
    of the fastest, the first in VARIANTS is taken, so both choose alike; past it, the fastest."""
    def medians(wxt, onednn):
        return {"flinear": {n: 2.0 for n in ROWS}, "wxt": {n: wxt for n in ROWS},
                "onednn": {n: onednn for n in ROWS}, "onednn_pad4": {n: 1.5 for n in ROWS}}

    assert pick(medians(1.00, 0.96))[1] == pick(medians(0.96, 1.00))[1] == "wxt"
    assert pick(medians(1.00, 0.90))[1] == "onednn"  # 10% faster: not a tie
    assert pick(medians(1.00, 0.96), tie=0.0)[1] == "onednn"


@needs_onednn
@pytest.mark.parametrize("fast", VARIANTS)
def test_choose_keeps_what_runs_fastest(monkeypatch, fast):
    """Candidates that sleep except the fast one: the measurement finds it at every row count."""
    monkeypatch.setenv(cpu_kernels.ENV, "measure")

    def factory(variant):
        return lambda x: time.sleep(0 if variant == fast else 0.002)

    chosen = choose(factory, 16, torch.float32)
    assert chosen.per_rows == {n: fast for n in ROWS} and chosen.source == "measured"
    assert set(chosen.median_ms) == set(VARIANTS)
    assert fast in chosen.describe()


@needs_onednn
def test_choose_differs_by_row_count(monkeypatch):
    """One kernel fast for few rows, another for many: each row count gets its own."""
    monkeypatch.setenv(cpu_kernels.ENV, "measure")

    def factory(variant):
        def run(x):
            fast = "flinear" if x.shape[0] <= 2 else "onednn_pad4"
            time.sleep(0 if variant == fast else 0.002)
        return run

    chosen = choose(factory, 16, torch.float32)
    assert chosen.per_rows == {1: "flinear", 2: "flinear", 4: "onednn_pad4", 9: "onednn_pad4", 32: "onednn_pad4"}


def test_environment_names_the_kernel(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "wxt")
    assert choose(lambda v: None, 16, torch.float32).per_rows == {n: "wxt" for n in ROWS}
    monkeypatch.setenv(cpu_kernels.ENV, "fastest")
    with pytest.raises(ValueError, match="RAYSPEC_CPU_KERNELS"):
        choose(lambda v: None, 16, torch.float32)


@needs_onednn
def test_every_kernel_computes_the_same_model(tiny_model_dir, monkeypatch):
    """A model loaded under each kernel (and under measurement) gives the same logits for 1, 3 and
    12 rows; its projections use what was chosen (packed copies exactly when oneDNN is among it)."""
    from rayspec.model import loader
    from rayspec.model.batch_layout import additive_mask
    from rayspec.model.kv_cache import ForwardBatch, KVCache

    outputs = {}
    for variant in ["measure", *VARIANTS]:
        monkeypatch.setenv(cpu_kernels.ENV, variant)
        model, _ = loader.load_model(str(tiny_model_dir))
        kernels = model.cpu_kernels
        assert (variant == "measure") == (kernels.source == "measured")
        assert variant == "measure" or kernels.per_rows == {n: variant for n in ROWS}
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all(m.kernels is kernels for m in linears)
        packed = any(m._packed is not None for m in linears) or model.model.layers[0].mlp.gate_up is not None
        assert packed == kernels.onednn
        for rows in (1, 3, 12):
            cache = KVCache(model.args, 1, 16, torch.float32, torch.device("cpu"))
            ids = torch.arange(5, 5 + rows)[None]
            mask = additive_mask((torch.arange(rows)[None, :] <= torch.arange(rows)[:, None])[None, None], torch.float32)
            where = torch.arange(rows)[None]  # block 0's rows
            batch = ForwardBatch(write_index=where, read_index=where, positions=where, kv_len=rows, mask=mask)
            with torch.inference_mode():
                outputs[variant, rows] = model.logits(model(ids, cache, batch))
    for (variant, rows), logits in outputs.items():
        torch.testing.assert_close(logits, outputs["flinear", rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_follows_the_cpu(monkeypatch, caplog, native):
    """`dtype: auto` is bfloat16 where oneDNN runs it natively (AMX / AVX512-BF16), else float32, and
    says which; None stays float32 on every CPU (exact, the same bits everywhere); CUDA: bfloat16."""
    import logging

    from rayspec.model import linear, loader
    monkeypatch.setattr(linear, "cpu_bf16_fast", lambda: native)
    with caplog.at_level(logging.INFO, logger="rayspec.model.loader"):
        assert loader.parse_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert "dtype auto" in caplog.text
    assert loader.parse_dtype(None, torch.device("cpu")) == torch.float32
    assert loader.parse_dtype("auto", torch.device("cuda")) == torch.bfloat16


# A table of the kind `choose` returns on CPUs where the fastest kernel depends on the row count
# ("mixed"): every bucket another kernel, so a decode (1 row), a batch of decodes (2-4 rows), a
# verification (k + 1 = 9 rows) and a prefill each run their own.
MIXED = {1: "flinear", 2: "wxt", 4: "onednn_pad4", 9: "onednn", 32: "flinear"}
MIXED_PROMPTS = ["List the colors: red, green, blue, red, green, blue, red, green,",
                 "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
                 "The capital of France is"]


@needs_onednn
@pytest.mark.slow
def test_mixed_kernels_greedy_verification_equals_single_row_decode(smollm2, monkeypatch):
    """The kernels users get by default are chosen per row count, so verification rows and a
    single-row decode multiply by different kernels (the rest of the suite pins one,
    tests/conftest.py). SmolLM2 under such a table: its greedy output and the logprobs of every
    token (with the top 2) are the same, to 1e-4, whether computed one row at a time (each prompt
    alone: "flinear"), as a batch of 3 decodes ("onednn_pad4"), or in verification rows of 9 (one
    sequence: "onednn") and of 27 (three: "flinear"), chains and trees (an oracle drafts the target's
    own continuation, with a wrong sibling beside each true token in a tree, so every row counts)."""
    from engine_utils import OracleProposer, make_engine, run_to_completion
    from rayspec.model import loader
    from rayspec.sampling.sampler import SamplingParams

    mixed = CpuKernels(dict(MIXED), "test: mixed")
    monkeypatch.setattr(cpu_kernels, "choose", lambda *args, **kwargs: mixed)
    loaded = loader.load_model(smollm2)
    assert loaded[0].cpu_kernels is mixed and mixed.variant.startswith("mixed:")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    target_only = make_engine(smollm2, "none", loaded=loaded)
    reference = [target_only.generate([p], params)[0] for p in MIXED_PROMPTS]  # one row at a time

    def assert_same(outputs, how):
        for prompt, out, ref in zip(MIXED_PROMPTS, outputs, reference):
            assert out.token_ids == ref.token_ids, (how, prompt)
            for got, want in zip(out.logprobs, ref.logprobs):
                assert abs(got.logprob - want.logprob) < 1e-4, (how, prompt, got, want)
                assert [t for t, *_ in got.top] == [t for t, *_ in want.top], (how, prompt)
                assert all(abs(g[-1] - w[-1]) < 1e-4 for g, w in zip(got.top, want.top)), (how, prompt)

    assert_same(target_only.generate(MIXED_PROMPTS, params), "a batch of decodes")
    expected = {tuple(target_only.encode(p)): ref.token_ids for p, ref in zip(MIXED_PROMPTS, reference)}
    wrong = min(set(range(100)) - {t for out in expected.values() for t in out})
    for tree in (False, True):
        engine = make_engine(smollm2, "ngram", k=8, loaded=loaded, eagle_topk=2 if tree else 1, tree_max_batch=8,
                             proposer=OracleProposer(expected, 8, wrong, force_tree=tree))
        assert_same([engine.generate([p], params)[0] for p in MIXED_PROMPTS], ("alone", tree))
        ids = [engine.add_request(p, params) for p in MIXED_PROMPTS]
        done = run_to_completion(engine)
        assert_same([done[i] for i in ids], ("batch", tree))
        assert engine.stats.num_accepted_tokens >= 2 * len(MIXED_PROMPTS) * 32 // 2  # most tokens from verification


def test_a_measurement_on_busy_cores_is_provisional(monkeypatch):
    """Other processes' share of our CPUs while measuring (BusyMeter) past BUSY_SHARE makes the
    choice provisional (`contended`): their threads preempt a multi-threaded kernel's, so a
    one-thread kernel wins there that runs half as fast on free cores."""
    monkeypatch.setenv(cpu_kernels.ENV, "measure")
    for share, contended in ((0.6, True), (0.1, False), (None, False)):
        monkeypatch.setattr(cpu_kernels.BusyMeter, "share", lambda self, share=share: share)
        chosen = choose(lambda v: (lambda x: None), 16, torch.float32, variants=("flinear", "wxt"))
        assert set(chosen.per_rows.values()) <= {"flinear", "wxt"} and chosen.busy == share
        assert chosen.contended == contended and ("provisional" in chosen.describe()) == contended


def test_the_busy_meter_counts_other_processes_only(monkeypatch):
    """Busy time on our CPUs (from /proc/stat) less our own CPU time, over wall time x CPUs."""
    meter = cpu_kernels.BusyMeter()
    meter.cpus = [0, 1]
    clock = {"busy": 100.0, "own": 5.0, "wall": 50.0}
    monkeypatch.setattr(meter, "_busy_s", lambda: clock["busy"])
    monkeypatch.setattr(cpu_kernels.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(cpu_kernels.time, "perf_counter", lambda: clock["wall"])
    meter.start()
    clock.update(busy=101.6, own=5.8, wall=51.0)  # 1.6 s busy in 1 s on 2 CPUs, 0.8 s of it ours
    assert meter.share() == pytest.approx(0.4)
    monkeypatch.setattr(meter, "_busy_s", lambda: None)  # no /proc/stat
    assert meter.share() is None


def test_an_idle_serving_loop_measures_a_provisional_choice_again(tiny_model_dir, monkeypatch):
    """A replica whose kernels were measured on busy cores (replicas loading beside it) measures them
    again once idle (deployments.replicas.engine_loop), and every projection then uses the new choice;
    outputs stay the target's."""
    from deployments.replicas import engine_loop
    from engine_utils import make_engine
    from rayspec.model import loader

    monkeypatch.setenv(cpu_kernels.ENV, "measure")
    loaded = loader.load_model(str(tiny_model_dir))
    model = loaded[0]
    provisional = CpuKernels({n: "flinear" for n in ROWS}, "measured", {}, busy=0.9)
    assert provisional.contended
    model.cpu_kernels = provisional
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernels = provisional
    monkeypatch.setattr(cpu_kernels.BusyMeter, "share", lambda self: 0.0)  # the cores free by now
    monkeypatch.setattr(engine_loop, "KERNEL_CHECK_S", 0.0)
    loop = engine_loop.EngineLoop(lambda: make_engine(tiny_model_dir, "ngram", loaded=loaded))
    try:
        loop.wait_ready(120)
        deadline = time.time() + 60
        while model.cpu_kernels is provisional and time.time() < deadline:
            time.sleep(0.1)
        chosen = model.cpu_kernels
        assert chosen is not provisional and not chosen.contended and chosen.source == "measured"
        assert all(m.kernels is chosen for m in model.modules() if isinstance(m, Linear))
        time.sleep(0.5)
        assert model.cpu_kernels is chosen  # settled: not measured again
    finally:
        loop.shutdown()


def _factory(fast, calls=None):
    def factory(variant):
        if calls is not None:
            calls.append(variant)
        return lambda x: time.sleep(0 if variant == fast else 0.002)
    return factory


def test_a_quiet_choice_is_kept_for_the_machine_and_taken_by_the_next_load(tmp_path, monkeypatch):
    """Replicas measured apart picked different near-equal kernels and served 15% apart: a quiet
    measurement is kept (KernelCache), and the next load of the same key takes it without measuring,
    even where its own measurement would have chosen otherwise; another key measures."""
    monkeypatch.setenv(cpu_kernels.ENV, "measure")
    monkeypatch.setattr(cpu_kernels.BusyMeter, "share", lambda self: 0.0)
    cache, variants = cpu_kernels.KernelCache(tmp_path / "k.json"), ("flinear", "wxt")
    first = choose(_factory("wxt"), 16, torch.float32, variants=variants, cache=cache, cache_key="a")
    assert first.per_rows == {n: "wxt" for n in ROWS} and first.kept_at is None
    calls = []
    second = choose(_factory("flinear", calls), 16, torch.float32, variants=variants, cache=cache, cache_key="a")
    assert calls == [] and second.per_rows == first.per_rows and second.source == "measured"
    assert list(second.per_rows) == list(ROWS) and second.variant == "wxt"
    assert second.kept_at is not None and "kept from a load" in second.describe() and not second.contended
    other = choose(_factory("flinear", calls), 16, torch.float32, variants=variants, cache=cache, cache_key="b")
    assert calls and other.per_rows == {n: "flinear" for n in ROWS}
    # a kept choice outside the candidates (oneDNN where the projections hold no packed copies): measured
    cache.keep("c", CpuKernels.single("onednn", "measured"))
    assert choose(_factory("wxt"), 16, torch.float32, variants=variants, cache=cache,
                  cache_key="c").per_rows == {n: "wxt" for n in ROWS}


def test_a_busy_measurement_is_not_kept_and_the_first_kept_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "measure")
    cache, variants = cpu_kernels.KernelCache(tmp_path / "k.json"), ("flinear", "wxt")
    monkeypatch.setattr(cpu_kernels.BusyMeter, "share", lambda self: 0.6)
    busy = choose(_factory("flinear"), 16, torch.float32, variants=variants, cache=cache, cache_key="a")
    assert busy.contended and cache.get("a") is None
    monkeypatch.setattr(cpu_kernels.BusyMeter, "share", lambda self: 0.0)
    # another process kept its quiet choice while this one measured: this one adopts it
    real_keep = cache.keep
    monkeypatch.setattr(cache, "keep", lambda key, k: (real_keep(key, CpuKernels.single("wxt", "measured")),
                                                        real_keep(key, k))[1])
    adopted = choose(_factory("flinear"), 16, torch.float32, variants=variants, cache=cache, cache_key="a")
    assert adopted.per_rows == {n: "wxt" for n in ROWS} and adopted.kept_at is not None


def test_a_kept_choice_expires_and_a_broken_file_is_ignored(tmp_path):
    now = [1000.0]
    cache = cpu_kernels.KernelCache(tmp_path / "k.json", ttl_s=100, clock=lambda: now[0])
    cache.keep("a", CpuKernels.single("wxt", "measured"))
    assert cache.get("a").per_rows[1] == "wxt"
    now[0] += 101
    assert cache.get("a") is None
    cache.keep("b", CpuKernels.single("flinear", "measured"))  # rewriting drops the stale key
    assert set(json.loads((tmp_path / "k.json").read_text())) == {"b"}
    (tmp_path / "k.json").write_text("{not json")
    assert cache.get("b") is None
    assert cache.keep("b", CpuKernels.single("wxt", "measured")).per_rows[1] == "wxt"


def test_loads_of_one_model_share_the_machines_choice(tiny_model_dir, tmp_path, monkeypatch):
    """Two loads of a model in a process with the cache on: the second takes the first's choice;
    RAYSPEC_CPU_KERNELS_CACHE=off measures every load."""
    from rayspec.model import loader

    monkeypatch.setenv(cpu_kernels.ENV, "measure")
    monkeypatch.setattr(cpu_kernels.BusyMeter, "share", lambda self: 0.0)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "k.json"))
    first = loader.load_model(str(tiny_model_dir))[0].cpu_kernels
    second = loader.load_model(str(tiny_model_dir))[0].cpu_kernels
    assert first.kept_at is None and second.kept_at is not None and second.per_rows == first.per_rows
    assert len(json.loads((tmp_path / "k.json").read_text())) == 1
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, "off")
    assert loader.load_model(str(tiny_model_dir))[0].cpu_kernels.kept_at is None
