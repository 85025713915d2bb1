"""Shared fixtures: tiny random Llama models built on the fly, and the real SmolLM2-135M.

Strict mode (`CI` or `RAYSPEC_TEST_STRICT` set; scripts/test sets it): a missing model is an
error, not a skip, and a run with any skipped, xfailed or xpassed test fails. Every test here is of the core or the
serving layer, so a green strict run is a run where all of them ran. Outside strict mode a
developer without the model gets skips, listed with their reasons at the end of the run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from rayspec.model.weights.files import ModelNotFoundError
from rayspec.model.weights.hub import DEFAULT_MODEL, resolve_model_dir

# Every model load in the tests (here and in Ray workers, which inherit the environment) takes the
# same CPU matmul path, so that models loaded in different processes compute the same bits: the
# measured choice (rayspec.cpu.kernels) may differ between loads. tests/engine/test_cpu_kernels.py
# measures.
os.environ.setdefault("RAYSPEC_CPU_KERNELS", "onednn_pad4")  # the path of sessions 8-15
# and no test takes (or leaves) a choice kept by an earlier load on this machine
os.environ.setdefault("RAYSPEC_CPU_KERNELS_CACHE", "off")


# The tiny models' tokenizer: SmolLM2's, cut to its first TINY_VOCAB ids. Every per-row cost that
# scales with the vocabulary (the read-out matmul, softmax, sampling, coupled noise, grammar masks) is
# 6x smaller than at SmolLM2's 49,152, which made a tiny model's sampled step 3x and its greedy step
# 1.7x slower (most of a tiny model's compute); text tokenizes to ~1.2x more tokens.
TINY_VOCAB = 8192


def trimmed_tokenizer_json(source: Path, vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json kept to its ids below `vocab_size`: SmolLM2's ids are its
    special tokens, then the 256 byte symbols, then one id per merge in merge order, so keeping the
    merges whose parts and result stay gives a tokenizer that encodes any text (to more, shorter
    tokens) and decodes it back unchanged."""
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    model = tokenizer["model"]
    vocab = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    if len(vocab) != vocab_size or any(t["id"] >= vocab_size for t in tokenizer.get("added_tokens", ())):
        raise ValueError(f"{source}: ids below {vocab_size} are not a prefix to keep")
    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if m[0] in vocab and m[1] in vocab and "".join(m) in vocab]
    return json.dumps(tokenizer)


def make_tiny_model_dir(path: Path, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                        vocab_size: int | None = None, with_tokenizer: bool = True) -> Path:
    """Write a random Llama checkpoint (config.json + model.safetensors [+ SmolLM2's tokenizer cut
    to its first TINY_VOCAB ids, or to `vocab_size`])."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = None
    if with_tokenizer:
        tokenizer_dir = smollm2_dir()
        vocab_size = vocab_size or TINY_VOCAB
    config = LlamaConfig(vocab_size=vocab_size or 256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits: fewer near-ties, more repetition (n-gram hits)
        model.lm_head.weight.mul_(8.0)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name == "tokenizer.json":
                (path / f.name).write_text(trimmed_tokenizer_json(tokenizer_dir, vocab_size))
            elif f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(f, path / f.name)
    return path


def strict() -> bool:
    return any(os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
               for name in ("CI", "RAYSPEC_TEST_STRICT"))


def smollm2_dir() -> Path:
    try:
        return resolve_model_dir(DEFAULT_MODEL)
    except ModelNotFoundError as err:
        missing = str(err)
    if strict():
        pytest.fail(f"{missing} (a strict test run: run scripts/setup, or `rayspec fetch-model`)", pytrace=False)
    pytest.skip(missing)


# ---- tiers ----------------------------------------------------------------------------------------
# A test's tier is the folder its module is in, tests/<tier>/ (registered as a marker in
# pyproject.toml), and the run goes tier by tier (unit, engine, then cluster before serve, see
# pytest_collection_modifyitems), each module's tests in their own order within a tier:
#   unit     no model engine, or a few steps of a tiny one: seconds in all per module
#   engine   in-process engines and model loads (tiny models, the real SmolLM2-135M, torch.compile)
#   serve    apps on the session's shared Ray cluster (tests/ray_utils.py; fixtures ray_cluster, serve_url)
#   cluster  a Ray cluster of their own (multi-node ray.cluster_utils.Cluster, `ray start`, its own
#            environment) or a process that starts one (`rayspec serve`, the wheel): fixture own_cluster
# The folder must hold what its tier allows, checked at collection: no Ray fixture in unit/ or
# engine/, no own_cluster in serve/; a module right in tests/ (not a helper, which has no tests)
# is refused. `scripts/test --quick` runs unit.
TIERS = ("unit", "engine", "serve", "cluster")
RAY_FIXTURES = {"serve": {"ray_cluster", "serve_url"}, "cluster": {"own_cluster"}}
# Of the modules on the shared cluster, these go first: test_serve_openai checks Prometheus counters,
# which must be its app's alone (tests/serve/test_serve_openai.py, fixture server).
SERVE_FIRST = ("test_serve_openai",)
# The longest engine modules first, longest first (their seconds in CI runs here: ~95 down to ~30), then
# the unit and other engine modules: on two workers (scripts/test runs this tier without xdist's reorder
# by test count, which put test_gpu_roofline's few long tests last, one worker idle for ~20 s) the many
# short modules fill the tail.
ENGINE_FIRST = ("test_deferred_reads", "test_lossless_sampled", "test_gpu_roofline", "test_compiled_step",
                "test_tree_steps", "test_overlap", "test_host_syncs", "test_paged_attention", "test_lossless_grid",
                "test_default_config_greedy", "test_sampling_distribution")
# Likewise the longest cluster and serve modules (CI runs here, 2026-12-04/05: ~180 down to ~30 s), after
# SERVE_FIRST: the run's last modules are short ones, so neither worker ends a long module alone (before,
# the serve tier's alphabetical order ended with test_serve_shipped_configs and test_tensor_parallel, ~180
# and ~120 s)
CLUSTER_FIRST = ("test_serve_node_autoscaling", "test_gpu_bench", "test_wheel", "test_pairing",
                 "test_serve_tensor_parallel", "test_hub_download", "test_serve_disaggregated", "test_eagle_training_ray")
SERVE_LONGEST = ("test_serve_shipped_configs", "test_serve_faults", "test_tensor_parallel", "test_serve_eagle",
                 "test_serve_sampled_default", "test_serve_pool_scaling", "test_serve_autoscaling", "test_step_watchdog",
                 "test_serve_async", "test_gpu_serve_random")


def item_tier(item) -> str:
    """The tier of the folder `item`'s module is in; a pytest.UsageError where the folder is not a tier
    or holds a test its tier does not allow."""
    path = Path(str(item.path)).resolve()
    tier = path.parent.name
    if path.parent.parent != Path(__file__).resolve().parent or tier not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test module belongs in tests/<tier>/, one of {TIERS}")
    names = set(getattr(item, "fixturenames", ()))
    allowed = {"unit": set(), "engine": set(), "serve": RAY_FIXTURES["serve"],
               "cluster": RAY_FIXTURES["serve"] | RAY_FIXTURES["cluster"]}[tier]
    used = names & (RAY_FIXTURES["serve"] | RAY_FIXTURES["cluster"])
    if used - allowed:
        wants = "cluster" if used & RAY_FIXTURES["cluster"] else "serve"
        raise pytest.UsageError(f"{item.nodeid}: in tests/{tier}/ but uses {sorted(used - allowed)}: its tier is "
                                f"{wants} (move it to tests/{wants}/)")
    return tier


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(session, config, items):
    keys = {}
    for index, item in enumerate(items):
        tier = item_tier(item)
        item.add_marker(tier)
        # cluster modules before the serve ones: the shared cluster then starts once, after them, and
        # on two workers (scripts/test) the many short serve modules fill the tail
        order = {"unit": 0, "engine": 0, "cluster": 2, "serve": 3}[tier]
        name = item.module.__name__
        longest = {"unit": ENGINE_FIRST, "engine": ENGINE_FIRST, "cluster": CLUSTER_FIRST,  # (unit: after the long engine ones)
                   "serve": SERVE_FIRST + SERVE_LONGEST}[tier]
        first = longest.index(name) if name in longest else len(longest)
        keys[item] = (order, first, index)
    items.sort(key=keys.__getitem__)


_last_tier: list[str] = []  # [tier, module] of the test this process ran last ("local": unit or engine)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def release_engine_memory() -> None:
    """What the engine tier's modules leave in this process, given back before its Ray tiers start: the
    per-process caches of loaded models and references (the functools caches of tests/engine_utils.py and
    the test modules), then unreachable objects, then the C heap's free pages (glibc keeps them otherwise). On two xdist workers the
    engine tier is followed by the serve and cluster tiers in the same processes (scripts/test): a
    worker held ~6 GB into them, and with both workers' Ray replicas the 24 GiB machine ran short
    (CI run of 2026-12-05 03:00: Ray's memory monitor killed Serve's controller and three replicas,
    two requests got 500s)."""
    import ctypes
    import gc

    tests_dir = str(Path(__file__).resolve().parent)
    for module in list(sys.modules.values()):  # the helpers' and the test modules' functools caches
        if not (getattr(module, "__file__", None) or "").startswith(tests_dir):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                value.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


RAY_TIER_RSS_MIB = 3072  # within the Ray tiers: a module that starts with this process above it releases too


def pytest_runtest_setup(item):
    tier = item.get_closest_marker("serve") or item.get_closest_marker("cluster")
    tier = tier.name if tier else "local"
    module = getattr(getattr(item, "module", None), "__name__", None)
    if _last_tier and tier != "local" and (_last_tier[0] == "local" or (
            module != _last_tier[1] and _rss_mib() > RAY_TIER_RSS_MIB)):  # (serve modules load references too)
        before = _rss_mib()
        release_engine_memory()
        _log_rss(f"released test memory before {item.nodeid}: {before:.0f} -> {_rss_mib():.0f} MiB")
    _last_tier[:] = [tier, module]


def _log_rss(line: str) -> None:
    """A line to $RAYSPEC_TEST_RSS_LOG (unset: nothing), with this process's xdist worker and RSS."""
    path = os.environ.get("RAYSPEC_TEST_RSS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {os.environ.get('PYTEST_XDIST_WORKER', 'main')} "
                    f"{_rss_mib():.0f} MiB {line}\n")


def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or nextitem.module is not item.module:
        _log_rss(f"after {item.module.__name__}")


# Outcomes that fail a strict run: a test that did not run as written (skipped), or whose outcome
# was excused in advance (xfail: failed as expected, or passed against the expectation).
NOT_RUN_AS_WRITTEN = ("skipped", "xfailed", "xpassed")


def _not_run_as_written(reporter) -> list:
    return [r for key in NOT_RUN_AS_WRITTEN for r in (reporter.stats.get(key, []) if reporter is not None else [])]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """In strict mode a skipped, xfailed or xpassed test fails the run (after pytest's own -rs listing)."""
    excused = _not_run_as_written(terminalreporter)
    if strict() and excused:
        terminalreporter.write_sep("=", f"strict run: {len(excused)} test(s) skipped, xfailed or xpassed, which "
                                        "fails the run", red=True)
        for report in excused:
            what = report.longrepr[-1] if isinstance(report.longrepr, tuple) else (report.longrepr or
                                                                                  getattr(report, "wasxfail", ""))
            terminalreporter.write_line(f"{report.outcome.upper()} {report.nodeid}: {what}")


def pytest_sessionfinish(session, exitstatus):
    ray_utils = sys.modules.get("ray_utils")
    if ray_utils is not None:
        ray_utils.release_shared_cluster()
    excused = _not_run_as_written(session.config.pluginmanager.get_plugin("terminalreporter"))
    if strict() and excused and exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """Same vocabulary and tokenizer as tiny_model_dir, different weights."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-draft") / "model", seed=1, num_layers=1)


@pytest.fixture(scope="session")
def smollm2() -> str:
    smollm2_dir()
    return DEFAULT_MODEL


# ---- Ray: one shared cluster (tests/ray_utils.py) -------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster() -> dict:
    """The session's shared local Ray cluster (started on first use): {"metrics_port": ...}."""
    from ray_utils import shared_cluster

    return shared_cluster()


@pytest.fixture(scope="module")
def serve_url(ray_cluster) -> str:
    """Serve on the shared cluster: the HTTP proxy's base URL. Apps a module deployed and left are
    deleted after it, so the next module finds the cluster free."""
    from ray_utils import delete_apps, shared_serve_url

    url = shared_serve_url()
    yield url
    delete_apps()


@pytest.fixture(scope="module")
def own_cluster() -> None:
    """For tests that start a Ray cluster of their own (in this process or another): this worker's
    shared one is stopped first (one cluster per test worker at a time). Its ports must be chosen
    free (ray.init(address="local"), ray.cluster_utils.Cluster), or be its alone (node autoscaling's
    6379): another test worker's cluster may be up beside it; and it is stopped by its own processes,
    never `ray stop`, which stops every Ray process on the machine."""
    from ray_utils import release_shared_cluster

    release_shared_cluster()
