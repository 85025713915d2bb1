"""The suite's shape (tests/conftest.py): a test's tier is its folder, and a folder holds only what
its tier allows; a strict run fails on skips, xfails and xpasses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest

TESTS = Path(conftest.__file__).resolve().parent


def fake_item(folder: str, *fixtures: str) -> SimpleNamespace:
    path = TESTS / folder / "test_x.py" if folder else TESTS / "test_x.py"
    return SimpleNamespace(path=path, nodeid=f"{path.name}::test_y", fixturenames=list(fixtures))


@pytest.mark.parametrize("folder", conftest.TIERS)
def test_the_tier_is_the_folder(folder):
    assert conftest.item_tier(fake_item(folder, "tmp_path")) == folder


@pytest.mark.parametrize("folder, fixtures, ok", [
    ("unit", ("serve_url",), False), ("engine", ("ray_cluster",), False), ("engine", ("own_cluster",), False),
    ("serve", ("own_cluster",), False), ("serve", ("serve_url", "ray_cluster"), True),
    ("cluster", ("own_cluster", "serve_url"), True)])
def test_a_folder_refuses_the_fixtures_of_a_higher_tier(folder, fixtures, ok):
    if ok:
        assert conftest.item_tier(fake_item(folder, *fixtures)) == folder
    else:
        with pytest.raises(pytest.UsageError, match="its tier is"):
            conftest.item_tier(fake_item(folder, *fixtures))


@pytest.mark.parametrize("folder", ["", "helpers"])
def test_a_module_outside_a_tier_folder_is_refused(folder):
    with pytest.raises(pytest.UsageError, match="belongs in tests/<tier>/"):
        conftest.item_tier(fake_item(folder))


def test_every_test_module_is_in_a_tier_folder():
    assert not sorted(p.name for p in TESTS.glob("test_*.py"))
    assert {p.parent.name for p in TESTS.rglob("test_*.py") if "data" not in p.parts} == set(conftest.TIERS)


def test_skips_and_xfails_are_not_run_as_written():
    reports = {key: [SimpleNamespace(nodeid=key)] for key in ("passed", "skipped", "xfailed", "xpassed", "failed")}
    excused = conftest._not_run_as_written(SimpleNamespace(stats=reports))
    assert sorted(r.nodeid for r in excused) == ["skipped", "xfailed", "xpassed"]
    assert conftest._not_run_as_written(SimpleNamespace(stats={"passed": reports["passed"]})) == []


def test_engine_memory_is_released_before_the_ray_tiers(monkeypatch):
    """A worker's first serve or cluster test drops the test modules' functools caches (the engine tier's
    loaded models and references) at the tier change; local tests keep them; within the Ray tiers a new
    module drops them again only where the process holds more than RAY_TIER_RSS_MIB."""
    import functools

    calls = []

    @functools.lru_cache(maxsize=None)
    def loaded(key):
        calls.append(key)
        return bytearray(1 << 20)

    monkeypatch.setattr(conftest, "_probe_cache", loaded, raising=False)  # a module global of tests/conftest.py
    monkeypatch.setattr(conftest, "_last_tier", [])
    monkeypatch.setattr(conftest, "_log_rss", lambda line: None)

    def item(tier, module="test_x"):
        return SimpleNamespace(get_closest_marker=lambda name: SimpleNamespace(name=name) if name == tier else None,
                               nodeid=f"tests/{tier}/{module}.py::test_y", module=SimpleNamespace(__name__=module))

    loaded("model")
    conftest.pytest_runtest_setup(item("engine"))
    conftest.pytest_runtest_setup(item("unit"))
    assert loaded.cache_info().currsize == 1  # still local: kept
    conftest.pytest_runtest_setup(item("serve"))
    assert loaded.cache_info().currsize == 0  # released at the change
    loaded("model")
    conftest.pytest_runtest_setup(item("cluster"))
    assert loaded.cache_info().currsize == 1 and calls == ["model", "model"]  # not again within the Ray tiers
    monkeypatch.setattr(conftest, "RAY_TIER_RSS_MIB", 1 << 30)
    conftest.pytest_runtest_setup(item("serve", "test_other"))  # a new module, this process below the bound: kept
    assert loaded.cache_info().currsize == 1
    monkeypatch.setattr(conftest, "RAY_TIER_RSS_MIB", 0)  # above it: released
    conftest.pytest_runtest_setup(item("serve", "test_other"))  # (the same module: not at every test)
    assert loaded.cache_info().currsize == 1
    conftest.pytest_runtest_setup(item("serve", "test_third"))
    assert loaded.cache_info().currsize == 0
